"""The operator's console over HTTP on the real stack (fake driver), without a browser: signing in
(the cookie and what it may not do), scopes, CSRF and the same-site check, the actions through
the API's handlers with the page's version, the fleet table's filters and pages, the attention
list, the audit chain's part, and the chart's counts from the history. The browser tests
(tests/test_console_browser.py) drive the same pages live in Chromium against `sandstream up`."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta

import apikit
import httpx
import pytest_asyncio
from apikit import ADMIN, INSPECTOR, KEEPER, READER, Api, create_body, unique
from harness import eventually, isolated_env

from drivers.fake import FakeDriver
from events.common import Phase
from services.api.console.session import COOKIE
from services.api.readmodel import phase_trend
from services.api.readmodel.trend import Move, series
from services.common.settings import PROJECT_ROOT

SECRET_ENV = "env-value-that-must-not-show"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def api() -> AsyncIterator[Api]:
    async with apikit.running_api(FakeDriver()) as running:
        yield running


@asynccontextmanager
async def session(api: Api, token: str) -> AsyncIterator[httpx.AsyncClient]:
    """A client signed in to the console with ``token`` (its cookie only: no bearer header)."""
    async with api.client(None, follow_redirects=False) as client:
        r = await client.post("/ui/login", data={"token": token, "next": "/ui/"})
        assert r.status_code == 303, r.text
        yield client


async def create_ready(api: Api, name: str, **spec: object) -> None:
    async with api.client() as c:
        r = await c.post("/v1/sandboxes", params={"wait": 30}, json=create_body(name, **spec))
        assert r.status_code == 201, r.text
    await api.wait_phase(name, "Ready")


def form_of(page: str, action: str) -> dict[str, str]:
    """The hidden fields of the form posting to ``action`` on ``page``."""
    found = re.search(rf'<form[^>]*action="{re.escape(action)}"[^>]*>(.*?)</form>', page, re.S)
    assert found, f"no form for {action}"
    return dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)"', found.group(1)))


def notice(page: str) -> str:
    found = re.search(r'<div class="notice \w+" role="\w+">\s*<p>(.*?)</p>', page, re.S)
    assert found, "no notice on the page"
    return found.group(1).replace("&#39;", "'")


async def test_signing_in_keeps_the_token_in_an_httponly_strict_cookie_of_ui_only(api: Api) -> None:
    async with api.client(None, follow_redirects=False) as c:
        r = await c.get("/ui/sandboxes/x?before=3")
        assert (r.status_code, r.headers["location"]) == (
            303, "/ui/login?next=/ui/sandboxes/x%3Fbefore%3D3",
        )  # fmt: skip
        bad = await c.post("/ui/login", data={"token": "sst_nope", "next": "/ui/"})
        assert bad.status_code == 401 and "invalid bearer token" in bad.text
        assert "set-cookie" not in bad.headers
        lacking = await c.post("/ui/login", data={"token": KEEPER})
        assert lacking.status_code == 403 and "lacks the scope sandbox:read" in lacking.text
        elsewhere = await c.post("/ui/login", data={"token": READER, "next": "//evil.example/"})
        assert (elsewhere.status_code, elsewhere.headers["location"]) == (303, "/ui/")
        cookie = elsewhere.headers["set-cookie"]
        assert cookie.startswith(f"{COOKIE}={READER};")
        attributes = {a.strip().lower() for a in cookie.split(";")[1:]}
        assert {"httponly", "path=/ui", "samesite=strict"} <= attributes
        page = await c.get("/ui/")
        assert page.status_code == 200 and "Signed in as <strong>reader</strong>" in page.text
        for header in ("content-security-policy", "x-frame-options"):
            assert header in page.headers
        assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
        # Signing out needs the form's CSRF token; signing in from another site is refused.
        assert (await c.post("/ui/logout", data={"csrf": "x"})).status_code == 403
        out = await c.post("/ui/logout", data=form_of(page.text, "/ui/logout"))
        assert out.status_code == 303 and f'{COOKIE}=""' in out.headers["set-cookie"]
        assert (await c.get("/ui/")).status_code == 303
        foreign = await c.post("/ui/login", data={"token": READER},
                               headers={"Sec-Fetch-Site": "cross-site"})  # fmt: skip
        assert foreign.status_code == 403 and "set-cookie" not in foreign.headers


async def test_the_cookie_authenticates_nothing_of_the_json_api(api: Api) -> None:
    name = unique("jar")
    await create_ready(api, name)
    async with session(api, ADMIN) as client:
        assert (await client.get(f"/ui/sandboxes/{name}")).status_code == 200
        published = await api.commands_published()
        assert (await client.get("/v1/sandboxes")).status_code == 401
        stop = await client.post(f"/v1/sandboxes/{name}:stop")
        assert stop.status_code == 401
    assert await api.commands_published() == published


async def test_a_read_only_session_sees_no_action_and_cannot_act(api: Api) -> None:
    name = unique("ro")
    await create_ready(api, name, env={"API_KEY": SECRET_ENV})
    async with session(api, READER) as client:
        page = (await client.get(f"/ui/sandboxes/{name}")).text
        assert "<form" in page  # sign out is a form; no action is
        assert f'action="/ui/sandboxes/{name}/' not in page and "Delete…" not in page
        # The page shows the environment's names, never their values, nor the token.
        assert "API_KEY" in page and SECRET_ENV not in page and READER not in page
        csrf = form_of(page, "/ui/logout")["csrf"]
        published = await api.commands_published()
        r = await client.post(f"/ui/sandboxes/{name}/stop",
                              data={"csrf": csrf, "expected_version": "2"})  # fmt: skip
        assert r.status_code == 403 and "lacks the scope sandbox:write" in r.text
    assert await api.commands_published() == published


async def test_an_action_needs_the_sessions_csrf_token_and_a_same_site_request(api: Api) -> None:
    name = unique("csrf")
    await create_ready(api, name)
    async with session(api, ADMIN) as client:
        page = (await client.get(f"/ui/sandboxes/{name}")).text
        form = form_of(page, f"/ui/sandboxes/{name}/stop")
        assert ADMIN not in page  # the CSRF token is an HMAC of the token, not the token
        published = await api.commands_published()
        for data, headers in (
            ({**form, "csrf": ""}, {}),
            ({**form, "csrf": "0" * 64}, {}),
            (form, {"Sec-Fetch-Site": "cross-site"}),
            (form, {"Sec-Fetch-Site": "same-site"}),
        ):
            r = await client.post(f"/ui/sandboxes/{name}/stop", data=data, headers=headers)
            assert r.status_code == 403, (data, headers, r.text)
        assert await api.commands_published() == published
        r = await client.post(f"/ui/sandboxes/{name}/stop", data=form,
                              headers={"Sec-Fetch-Site": "same-origin"})  # fmt: skip
        assert r.status_code == 303
    await api.wait_phase(name, "Stopped")


async def test_actions_are_the_apis_commands_with_the_pages_version(api: Api) -> None:
    name = unique("act")
    await create_ready(api, name)
    async with session(api, ADMIN) as client:
        page = (await client.get(f"/ui/sandboxes/{name}")).text
        stale_restart = form_of(page, f"/ui/sandboxes/{name}/restart")
        hold = form_of(page, f"/ui/sandboxes/{name}/hold")
        r = await client.post(f"/ui/sandboxes/{name}/hold", data={**hold, "reason": "forensics"})
        assert r.status_code == 303 and r.headers["location"].endswith(
            f"?command={hold['command_id']}"
        )
        after = await client.get(r.headers["location"])
        assert notice(after.text).startswith("Hold accepted:")
        assert "held by admin" in after.text and "forensics" in after.text

        # The restart form still carries the version before the hold: refused, in words.
        stale = await client.post(f"/ui/sandboxes/{name}/restart", data=stale_restart)
        assert stale.status_code == 409
        version = int(stale_restart["expected_version"])
        words = notice(stale.text)
        assert words.startswith("Restart refused: this page was out of date.")
        assert (
            f"expected version {version} but sandbox '{name}' is at version {version + 1}" in words
        )
        # A double submission of the same form is the same command: the same answer, once.
        again = await client.post(f"/ui/sandboxes/{name}/restart", data=stale_restart)
        assert again.status_code == 409 and notice(again.text) == words

        empty = await client.post(f"/ui/sandboxes/{name}/hold", data={**hold, "reason": ""})
        assert empty.status_code == 422 and "reason" in empty.text

    async with api.client() as c:
        items = (await c.get(f"/v1/sandboxes/{name}/history")).json()["items"]
    commands = [(h["message_type"], h["message"]["actor"], h["message"].get("expected_version"),
                 h["disposition"]) for h in items if h["command_id"]]  # fmt: skip
    assert commands[1:] == [
        ("HoldSandbox", "admin", version, "applied"),
        ("RestartSandbox", "admin", version, "rejected"),
    ]


async def test_delete_is_sent_only_once_confirmed(api: Api) -> None:
    name = unique("del")
    await create_ready(api, name)
    async with session(api, ADMIN) as client:
        page = (await client.get(f"/ui/sandboxes/{name}")).text
        link = re.search(rf'href="(/ui/sandboxes/{name}/delete\?version=\d+)"', page)
        assert link, "no delete link"
        confirm = (await client.get(link.group(1))).text
        form = form_of(confirm, f"/ui/sandboxes/{name}/delete")
        assert form["confirm"] == name
        published = await api.commands_published()
        unconfirmed = {k: v for k, v in form.items() if k != "confirm"}
        r = await client.post(f"/ui/sandboxes/{name}/delete", data=unconfirmed)
        assert r.status_code == 422 and "not confirmed" in r.text
        assert await api.commands_published() == published
        r = await client.post(f"/ui/sandboxes/{name}/delete", data=form)
        assert r.status_code == 303
        await api.wait_phase(name, "Deleted")
        tombstone = await client.get(f"/ui/sandboxes/{name}")
        assert tombstone.status_code == 200 and "a tombstone" in tombstone.text
        assert "Delete…" not in tombstone.text


async def test_the_fleet_table_filters_and_pages_and_says_what_is_wrong(api: Api) -> None:
    batch = unique("batch")
    names = sorted(unique("flt") for _ in range(3))
    for name in names:
        await create_ready(api, name, labels={"batch": batch})
    async with session(api, READER) as client:

        async def listed(**params: object) -> tuple[list[str], str]:
            r = await client.get("/ui/", params=params)
            shown = re.findall(r'<tr data-name="([^"]+)">', r.text)
            return shown, r.text

        assert (await listed(label=f"batch={batch}"))[0] == names
        first, page = await listed(label=f"batch={batch}", limit=2)
        assert first == names[:2]
        following = re.search(r'href="/ui/\?([^"]+)" rel="next"', page)
        assert following, "no next page link"
        second, _ = await listed(
            **dict(httpx.QueryParams(following.group(1).replace("&amp;", "&")))
        )
        assert second == names[2:]
        assert (await listed(label=f"batch={batch}", phase="Stopped"))[0] == []
        bad = await client.get("/ui/", params={"phase": "Sleeping"})
        assert bad.status_code == 422 and "unknown phase &#39;Sleeping&#39;" in bad.text
        wrong = await client.get("/ui/", params={"label": "=x"})
        assert "expected key=value or key" in wrong.text


async def test_the_attention_list_names_held_sandboxes_and_why(api: Api) -> None:
    name = unique("att")
    await create_ready(api, name)
    async with api.client() as c:
        r = await c.post(f"/v1/sandboxes/{name}:hold", params={"wait": 30},
                         json={"reason": "ticket 99"})  # fmt: skip
        assert r.status_code == 200, r.text
    async with session(api, READER) as client:
        page = (await client.get("/ui/")).text
    row = re.search(
        rf'<tr class="why-held">\s*<td><a href="/ui/sandboxes/{name}">.*?</tr>', page, re.S
    )
    assert row and "held by admin: ticket 99" in row.group(0)


async def test_the_audit_chain_shows_for_audit_read_only(api: Api) -> None:
    name = unique("chain")
    await create_ready(api, name)
    async with session(api, INSPECTOR) as inspector:
        page = (await inspector.get(f"/ui/sandboxes/{name}")).text
        assert re.search(r"Intact: \d+ entries of this sandbox's history checked", page)
    async with session(api, READER) as reader:
        page = (await reader.get(f"/ui/sandboxes/{name}")).text
        assert "Intact" not in page and "needs the <code>audit:read</code> scope" in page


async def test_a_commands_page_shows_its_outcome_and_unknown_ones_are_404(api: Api) -> None:
    name = unique("cmd")
    await create_ready(api, name)
    async with session(api, READER) as client:
        page = (await client.get(f"/ui/sandboxes/{name}")).text
        link = re.search(r'href="(/ui/commands/[^"]+)">outcome', page)
        assert link, "no link to the create's outcome"
        outcome = await client.get(link.group(1).replace("&amp;", "&"))
        assert outcome.status_code == 200 and "CreateSandbox" in outcome.text
        assert "accepted" in outcome.text
        missing = await client.get("/ui/commands/never-sent")
        assert missing.status_code == 404 and "is not known" in missing.text


async def test_a_revoked_session_is_sent_to_sign_in_and_big_forms_are_refused(api: Api) -> None:
    async with api.client(None, follow_redirects=False) as c:
        c.cookies.set(COOKIE, "sst_unknown", path="/ui")
        r = await c.get("/ui/")
        assert r.status_code == 303 and r.headers["location"].endswith("&ended=1")
        again = await c.get(r.headers["location"])
        assert "no longer valid (revoked, expired or unknown)" in again.text
        # The sign-in page takes no words from its address (no text injected into it).
        assert "phish" not in (await c.get("/ui/login?message=phish&next=phish")).text
        limit = api.env.settings.api_max_body_bytes
        form = {"content-type": "application/x-www-form-urlencoded"}
        big = await c.post("/ui/login", content=b"token=" + b"x" * limit, headers=form)
        assert big.status_code == 413


# -- the stylesheet's contrast -------------------------------------------------------------------

# Every (text, background) pair of the stylesheet's palette that the pages use.
TEXT_ON = [("ink", "page"), ("ink", "bar"), ("ink", "head"), ("ink", "hover"), ("ink", "warn-bg"),
           ("muted", "page"), ("muted", "bar"), ("muted", "head"), ("link", "page"),
           ("link", "bar"), ("link", "warn-bg"), ("link", "bad-bg"), ("link", "good-bg"),
           ("bad", "page"), ("bad", "bad-bg"), ("bad", "hover"), ("good", "page"),
           ("good", "bar"), ("good", "good-bg")]  # fmt: skip


def contrast(a: str, b: str) -> float:
    """WCAG 2's contrast ratio of two #rrggbb colours."""

    def luminance(colour: str) -> float:
        rgb = [int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5)]
        lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]

    high, low = sorted((luminance(a), luminance(b)), reverse=True)
    return (high + 0.05) / (low + 0.05)


def test_the_stylesheets_text_colours_have_aa_contrast_on_their_backgrounds() -> None:
    css = (PROJECT_ROOT / "services/api/console/static/console.css").read_text()
    palette = dict(re.findall(r"--([\w-]+): (#[0-9a-f]{6})", css))
    low = [(t, b, round(contrast(palette[t], palette[b]), 2)) for t, b in TEXT_ON
           if contrast(palette[t], palette[b]) < 4.5]  # fmt: skip
    assert low == []
    assert contrast("#777777", "#ffffff") < 4.5  # (the check can fail: a grey too light)


# -- the chart's counts ---------------------------------------------------------------------------


def test_the_series_undoes_each_buckets_moves_from_the_counts_now() -> None:
    ready, stopped = Phase.READY, Phase.STOPPED
    moves = [
        Move(0, None, "Provisioning", 2),  # created in the first bucket
        Move(0, "Provisioning", "Ready", 2),
        Move(2, "Ready", "Stopping", 1),  # one stopped in the third
        Move(2, "Stopping", "Stopped", 1),
        Move(3, "Ready", "Deleted", 1),  # the other deleted in the last
    ]
    counts = series({stopped: 1}, moves, 4)
    assert [(c[ready], c[stopped]) for c in counts] == [(2, 0), (2, 0), (1, 1), (0, 1)]
    assert all(c[Phase.PROVISIONING] == 0 for c in counts)  # created and moved on in one bucket


async def test_the_chart_counts_phases_per_bucket_from_the_history() -> None:
    """History entries put at known times before now: the counts at each bucket's end."""
    async with isolated_env(partitions=1) as env:
        rows = [("a", "Ready"), ("b", "Stopped")]  # the rows now
        for key, phase in rows:
            await env.pool.execute(
                "INSERT INTO sandboxes (key, sandbox_id, phase, generation, version, spec, "
                "providers, identity, created_at, updated_at, partition, change_seq) VALUES "
                "($1, gen_random_uuid(), $2, 1, 1, '{\"image\": \"x\"}', '{}', 'i', now(), now(), "
                "0, 1)",
                key,
                phase,
            )
        # (key, phase after, minutes ago): a before the window and after; b within it only.
        entries = [("a", "Provisioning", 200), ("a", "Ready", 199), ("b", "Provisioning", 50),
                   ("b", "Ready", 49), ("b", "Ready", 30), ("b", "Stopping", 10),
                   ("b", "Stopped", 9)]  # fmt: skip
        for offset, (key, phase, ago) in enumerate(entries):
            await env.pool.execute(
                'INSERT INTO history (key, topic, partition, "offset", disposition, reason, '
                "event_types, phase, recorded_at) VALUES ($1, 'c', 0, $2, 'applied', '', '{}', "
                "$3, now() - $4::interval)",
                key,
                offset,
                phase,
                timedelta(minutes=ago),
            )
        trend = await phase_trend(env.pool, 1)
    counts = trend.counts
    assert len(counts) == 60 and trend.step == timedelta(minutes=1)
    at = {ago: counts[59 - ago] for ago in (55, 45, 20, 5, 0)}  # buckets ending that long ago
    assert [(c[Phase.READY], c[Phase.STOPPING], c[Phase.STOPPED]) for c in at.values()] == [
        (1, 0, 0), (2, 0, 0), (2, 0, 0), (1, 0, 1), (1, 0, 1),
    ]  # fmt: skip
    assert counts[-1][Phase.PROVISIONING] == 0 and counts[8][Phase.PROVISIONING] == 0


async def test_suspend_and_resume_are_console_actions(api: Api) -> None:
    name = unique("susp")
    await create_ready(api, name)
    async with session(api, ADMIN) as client:
        page = (await client.get(f"/ui/sandboxes/{name}")).text
        suspend = form_of(page, f"/ui/sandboxes/{name}/suspend")
        r = await client.post(f"/ui/sandboxes/{name}/suspend", data=suspend)
        assert r.status_code == 303, r.text
        assert notice((await client.get(r.headers["location"])).text).startswith(
            "Suspend accepted:"
        )
    async with api.client() as c:

        async def phase() -> str:
            return str((await c.get(f"/v1/sandboxes/{name}")).json()["phase"])

        await eventually(phase, lambda p: p == "Suspended", what="suspended")
    async with session(api, ADMIN) as client:
        page = (await client.get(f"/ui/sandboxes/{name}")).text
        resume = form_of(page, f"/ui/sandboxes/{name}/resume")
        r = await client.post(f"/ui/sandboxes/{name}/resume", data=resume)
        assert r.status_code == 303, r.text
        assert notice((await client.get(r.headers["location"])).text).startswith("Resume accepted:")


async def test_the_templates_page_lists_them_and_a_sandbox_page_names_its_revision(
    api: Api,
) -> None:
    template, name = unique("tpl"), unique("from-tpl")
    spec = {"image": "registry.example/agent:7", "env": {"TOKEN": SECRET_ENV}}
    async with api.client() as c:
        r = await c.post("/v1/templates", json={"name": template, "spec": spec,
                                                "description": "research agents"})  # fmt: skip
        assert r.status_code == 201, r.text
        r = await c.post("/v1/sandboxes", params={"wait": 30},
                         json={"name": name, "template": {"name": template}})  # fmt: skip
        assert r.status_code == 201, r.text
    async with session(api, READER) as browser:
        page = (await browser.get("/ui/templates")).text
        row = re.search(rf'<tr id="template-{template}">(.*?)</tr>', page, re.S)
        assert row, page
        assert "registry.example/agent:7" in row.group(1) and "research agents" in row.group(1)
        assert "TOKEN" in row.group(1) and SECRET_ENV not in page  # names only
        assert '<a href="/ui/templates">Templates</a>' in page
        page = (await browser.get(f"/ui/sandboxes/{name}")).text
        assert f'<a href="/ui/templates#template-{template}">{template}</a> revision 1' in page


async def test_the_pools_page_shows_each_pool_and_its_claims(api: Api) -> None:
    template, pool = unique("tpl"), unique("pool")
    async with api.client() as c:
        r = await c.post("/v1/templates", json={"name": template, "spec": {"image": "i:1"}})
        assert r.status_code == 201, r.text
        r = await c.post("/v1/pools", json={"name": pool, "template": template, "size": 2,
                                            "strategy": "OnReplenish"})  # fmt: skip
        assert r.status_code == 201, r.text
        r = await c.post("/v1/sandboxes", params={"wait": 30},
                         json={"name": unique("cold"), "template": {"name": template}})  # fmt: skip
        assert r.status_code == 201 and r.json()["claim"]["warm"] is False, r.text
    async with session(api, READER) as browser:
        page = (await browser.get("/ui/pools")).text
        assert '<a href="/ui/pools">Pools</a>' in page
        row = re.search(rf'<tr id="pool-{pool}">(.*?)</tr>', page, re.S)
        assert row, page
        cells = re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", row.group(1), re.S)
        assert cells[0] == pool and f'href="/ui/templates#template-{template}"' in cells[1]
        assert (cells[2], cells[3], cells[9], cells[10]) == ("2", "OnReplenish", "1", "0%")
