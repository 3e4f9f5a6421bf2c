"""The console in a real browser: Debian's Chromium, driven through Playwright (never a browser
it downloads), against a real `sandstream up` (Kafka, PostgreSQL, the Podman driver), one
browser for the module. Every wait is on a DOM condition with a deadline; "live" means the page
was not reloaded (a mark set on its window survives).

The two screenshots in docs/img/ are taken here: console-fleet.png and console-sandbox.png, into
docs/img/ under `make screenshots` (SANDSTREAM_SCREENSHOTS=docs), else into a scratch folder, so
a test run leaves the checkout as it was.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Final

import factories as f
import httpx
import pytest
import pytest_asyncio
from apikit import unique
from harness import eventually
from playwright.async_api import Browser, Page, async_playwright
from upkit import Up, running_up

from services.common.settings import PROJECT_ROOT, load_settings
from services.common.tokens import READ, add_token

CHROMIUM: Final = "/usr/bin/chromium"  # Debian's (compose/bootstrap.sh installs it)
# As root, on a closed network: no sandbox, and none of the background connections that are
# refused many at a time here.
FLAGS: Final = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync"]  # fmt: skip
DOCS_SHOTS: Final = PROJECT_ROOT / "docs" / "img"
IMAGE: Final = load_settings().sandbox_image
LIVE: Final = "html[data-live='open']"  # the page's script says its live feed is open
LIVE_WAIT: Final = 15_000  # ms for a page's live feed to open
PHASE_WAIT: Final = 60_000  # ms for a sandbox to reach a phase on Podman


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the screenshots go: docs/img/ when asked for, a scratch folder otherwise."""
    if os.environ.get("SANDSTREAM_SCREENSHOTS") == "docs":
        return DOCS_SHOTS
    return tmp_path_factory.mktemp("shots")


def taken(path: Path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def up(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Up]:
    async with running_up(tmp_path_factory.mktemp("run")) as running:
        yield running


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def browser() -> AsyncIterator[Browser]:
    assert shutil.which(CHROMIUM), "Debian's chromium is missing: compose/bootstrap.sh installs it"
    async with async_playwright() as playwright:
        # Playwright gives it a fresh --user-data-dir of its own.
        launched = await playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            yield launched
        finally:
            await launched.close()


async def signed_in(browser: Browser, up: Up, token: str, **options: object) -> Page:
    context = await browser.new_context(viewport={"width": 1280, "height": 900}, **options)
    page = await context.new_page()
    await page.goto(f"{up.url}/ui/")
    assert page.url.startswith(f"{up.url}/ui/login"), page.url
    await page.get_by_label("API token").fill(token)
    await page.get_by_role("button", name="Sign in").click()
    await page.wait_for_url(f"{up.url}/ui/")
    return page


async def live_page(page: Page, url: str) -> None:
    """Open ``url`` and wait until its live feed is open; mark the window (a reload clears it)."""
    await page.goto(url)
    await page.locator(LIVE).wait_for(state="attached", timeout=LIVE_WAIT)
    await page.evaluate("window.notReloaded = true")


async def not_reloaded(page: Page) -> bool:
    return bool(await page.evaluate("window.notReloaded === true"))


async def api_call(up: Up, method: str, path: str, **kwargs: object) -> httpx.Response:
    headers = {"Authorization": f"Bearer {up.admin_token()}"}
    params = {"wait": 60} if method != "GET" else {}
    async with httpx.AsyncClient(base_url=up.url, headers=headers, timeout=90) as client:
        r = await client.request(method, path, params=params, **kwargs)  # type: ignore[arg-type]
    assert r.status_code in (200, 201), r.text
    return r


async def create(up: Up, prefix: str, **labels: str) -> str:
    name = up.name(prefix)
    body = {"name": name, "spec": {"image": IMAGE, "command": ["sleep", "3600"], "labels": labels}}
    await api_call(up, "POST", "/v1/sandboxes", json=body)
    return name


async def wait_phase(page: Page, phase: str) -> None:
    await page.locator(f'#row .phase-badge[data-phase="{phase}"]').wait_for(timeout=PHASE_WAIT)


async def ready(up: Up, name: str, generation: int) -> None:
    """Wait (through the API) until the sandbox is Ready at ``generation``."""

    async def row() -> dict[str, object]:
        return dict((await api_call(up, "GET", f"/v1/sandboxes/{name}")).json())

    wanted = ("Ready", generation)
    await eventually(
        row,
        lambda r: (r["phase"], r["generation"]) == wanted,
        timeout=PHASE_WAIT / 1000,
        what=f"{name} Ready at generation {generation}",
    )


async def test_the_fleet_page_shows_a_new_sandbox_within_a_second_without_a_reload(
    up: Up, browser: Browser, shots: Path
) -> None:
    page = await signed_in(browser, up, up.admin_token())
    await live_page(page, f"{up.url}/ui/")
    # Created through the API; its answer comes once the processor decided it (the row is
    # written): from then on the page has a second.
    name = await create(up, "fleet", team="research")
    row = page.locator(f'#sandboxes tr[data-name="{name}"]')
    await row.wait_for(state="attached", timeout=1_000)
    assert await not_reloaded(page)
    await row.locator('[data-phase="Ready"]').wait_for(timeout=PHASE_WAIT)
    # The counts follow within the next update: the page's parts are read side by side, so
    # one update can carry the row Ready and counts read a moment before it.
    ready = page.locator('#counts li[data-phase="Ready"] .n', has_text=re.compile(r"^[1-9]"))
    await ready.wait_for(timeout=PHASE_WAIT)
    # Held (through the API): the attention list names it, live too.
    await api_call(up, "POST", f"/v1/sandboxes/{name}:hold", json={"reason": "a post-mortem"})
    held = page.locator(f'#attention tr.why-held a[href="/ui/sandboxes/{name}"]')
    await held.wait_for(timeout=10_000)
    assert await not_reloaded(page)
    await page.reload()  # the chart is drawn when the page loads
    await page.screenshot(path=shots / "console-fleet.png", full_page=True)
    taken(shots / "console-fleet.png")
    await page.context.close()


async def test_the_sandbox_page_shows_a_late_ignored_observation_with_its_reason(
    up: Up, browser: Browser, shots: Path
) -> None:
    name = await create(up, "late", team="research")
    await ready(up, name, 1)
    await api_call(up, "POST", f"/v1/sandboxes/{name}:restart")
    await ready(up, name, 2)
    page = await signed_in(browser, up, up.admin_token())
    await live_page(page, f"{up.url}/ui/sandboxes/{name}")
    # The first generation's exit, reported late: after the restart made generation 2.
    late = f.exited(name, generation=1, exit_code=137, actor="late-watcher",
                    occurred_at=datetime.now(UTC) - timedelta(seconds=30))  # fmt: skip
    await up.stack.observe(late)
    entry = page.locator("#inputs tr.ignored", has_text="late-watcher")
    await entry.wait_for(timeout=10_000)
    assert await not_reloaded(page)
    assert await entry.locator(".disposition").inner_text() == "ignored"
    assert await entry.locator(".reason").inner_text() == (
        "stale: RuntimeSnapshot(exited_error) of generation 1, current generation is 2"
    )
    await page.screenshot(path=shots / "console-sandbox.png", full_page=True)
    taken(shots / "console-sandbox.png")
    await page.context.close()


async def test_a_stop_from_the_page_reaches_stopped(up: Up, browser: Browser) -> None:
    name = await create(up, "stop")
    # The page's form carries the version it was loaded at (a stale one is refused): load it
    # once the sandbox is Ready, as a user who sees Ready and then stops it would.
    await ready(up, name, 1)
    page = await signed_in(browser, up, up.admin_token())
    await page.goto(f"{up.url}/ui/sandboxes/{name}")
    await wait_phase(page, "Ready")
    async with page.expect_navigation(timeout=PHASE_WAIT) as navigation:
        await page.get_by_role("button", name="Stop", exact=True).focus()
        await page.keyboard.press("Enter")  # from the keyboard
    answer = await navigation.value
    assert answer is not None and answer.status == 200
    assert re.fullmatch(rf".*/ui/sandboxes/{name}\?command=.+", page.url), page.url
    notice = page.get_by_role("status").filter(has_text="Stop accepted")
    assert await notice.count() == 1
    await page.locator(LIVE).wait_for(state="attached", timeout=LIVE_WAIT)
    await wait_phase(page, "Stopped")  # live: the page is not reloaded for it
    await page.context.close()


async def test_a_stale_pages_action_is_refused_with_the_version_message(
    up: Up, browser: Browser
) -> None:
    name = await create(up, "stale")
    page = await signed_in(browser, up, up.admin_token())
    await page.goto(f"{up.url}/ui/sandboxes/{name}")
    await wait_phase(page, "Ready")
    await live_page(page, f"{up.url}/ui/sandboxes/{name}")
    shown = int(await page.locator("#row .version").inner_text())
    # Someone else changes the sandbox meanwhile: the page says so, its forms keep their version.
    await api_call(up, "POST", f"/v1/sandboxes/{name}:extend", json={"ttl_seconds": 7200})
    await page.locator("#stale").wait_for(timeout=10_000)
    unnamed = await page.locator("input:not([type=hidden]), button, a").evaluate_all(
        "els => els.filter(e => !(e.labels && e.labels.length) && !e.getAttribute('aria-label')"
        " && !e.textContent.trim()).map(e => e.outerHTML)"
    )
    assert unnamed == []  # every control of the page has a name (a label or its text)
    async with page.expect_navigation(timeout=PHASE_WAIT) as navigation:
        await page.get_by_role("button", name="Stop", exact=True).click()
    answer = await navigation.value
    assert answer is not None and answer.status == 409
    alert = await page.get_by_role("alert").inner_text()
    assert alert.startswith("Stop refused: this page was out of date.")
    assert f"expected version {shown} but sandbox '{name}' is at version {shown + 1}" in alert
    assert await page.locator("#row .phase-badge").inner_text() == "Ready"
    await page.context.close()


async def test_a_read_only_token_sees_no_action_buttons(up: Up, browser: Browser) -> None:
    name = await create(up, "viewer")
    token = add_token(up.run_dir / "tokens.json", unique("viewer"), (READ,))
    page = await signed_in(browser, up, token)
    await page.goto(f"{up.url}/ui/sandboxes/{name}")
    assert await page.locator("#row .phase-badge").count() == 1  # it reads the row
    assert await page.locator("#inputs tr").count() >= 1  # and the timeline
    for verb in ("Stop", "Start", "Restart", "Hold", "Delete…"):
        assert await page.get_by_role("button", name=verb, exact=True).count() == 0, verb
        assert await page.get_by_role("link", name=verb, exact=True).count() == 0, verb
    await page.context.close()


async def test_the_pages_read_without_javascript(up: Up, browser: Browser) -> None:
    name = await create(up, "nojs")
    page = await signed_in(browser, up, up.admin_token(), java_script_enabled=False)
    assert await page.locator(f'#sandboxes tr[data-name="{name}"]').count() == 1
    await page.goto(f"{up.url}/ui/sandboxes/{name}")
    inputs = page.locator("#inputs tr td:nth-child(2)")
    assert await inputs.filter(has_text=re.compile("^Create$")).count() == 1
    assert await page.locator("#live-status").inner_text() == "Not live (no script)"
    await page.context.close()
