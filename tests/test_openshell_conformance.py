"""OpenShell's own conformance suite and CLI against `sandstream up` (real Kafka, PostgreSQL,
Podman; an isolated environment of their own).

The tools are OpenShell's builds, not part of this repository: ``OPENSHELL_CONFORMANCE`` and
``OPENSHELL_CLI`` name them (``.ci/run`` sets both when the shared tools folder has them). A
variable that is set but names no executable fails the test. An unset one fails it under CI
(``CI`` set to ``true`` or ``1``, as CI services and ``.ci/run`` set it: a CI run must not pass
without the suite having run) and skips it elsewhere, saying which variable is missing.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import tlskit

from services.common.settings import Settings
from services.openshell.conformance import (
    CLI_ENV,
    RUNNER_ENV,
    GatewayTls,
    cli_session,
    run_suite,
    running_up,
)

RUNS = 2  # twice in a row against one `up`: names, rows and containers of run 1 do not linger


def under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def openshell_tool(env_name: str) -> Path:
    if not os.environ.get(env_name):
        missing = f"{env_name} is not set: OpenShell's tool is not available here"
        if under_ci():
            pytest.fail(f"{missing}; under CI it must be (.ci/run sets it from the shared tools)")
        pytest.skip(missing)
    path = Path(os.environ[env_name])
    assert path.is_file() and os.access(path, os.X_OK), f"{env_name}={path}: not an executable"
    return path


async def test_openshell_conformance_suite_passes_twice_in_a_row(
    settings: Settings, tmp_path: Path
) -> None:
    runner = openshell_tool(RUNNER_ENV)
    async with running_up(settings, tmp_path) as up:
        codes = []
        for _ in range(RUNS):
            codes.append(await asyncio.to_thread(run_suite, runner, up.endpoint))
    assert codes == [0] * RUNS, f"exit codes {codes}; see the runner's output above"


async def test_openshell_conformance_suite_passes_over_tls(
    settings: Settings, tmp_path: Path
) -> None:
    """With the API's certificate the gateway speaks TLS (server authentication only): the
    runner, which insists on a client certificate for https, passes with a CA to verify the
    gateway and a pair of its own that the gateway never asks for."""
    runner = openshell_tool(RUNNER_ENV)
    (tmp_path / "client").mkdir()
    gateway = tlskit.issue_for_localhost(tmp_path)
    client = tlskit.issue_for_localhost(tmp_path / "client")
    tls = GatewayTls(gateway.ca, gateway.cert, gateway.key, client.cert, client.key)
    async with running_up(settings, tmp_path, tls) as up:
        assert up.endpoint.startswith("https://")
        code = await asyncio.to_thread(run_suite, runner, up.endpoint, tls=tls)
    assert code == 0, f"exit code {code}; see the runner's output above"


async def test_openshell_cli_session(settings: Settings, tmp_path: Path) -> None:
    cli = openshell_tool(CLI_ENV)
    async with running_up(settings, tmp_path) as up:
        steps = await asyncio.to_thread(
            lambda: list(cli_session(cli, up.endpoint, tmp_path / "home"))
        )
    failed = [(args, code, output) for args, code, output in steps if code != 0]
    assert not failed, failed
    outputs = {" ".join(args[:2]): output for args, _, output in steps}
    assert len(steps) == 9
    assert "Connected" in outputs["status"]
    assert "Ready" in outputs["sandbox get"]
    assert "cli-exec-ok" in outputs["sandbox exec"]


def outcome_of_unset_tool() -> BaseException | None:
    """What ``openshell_tool`` raises for an unset variable (a skip would skip this test)."""
    try:
        openshell_tool(RUNNER_ENV)
    except BaseException as exc:  # pytest's skip and fail are BaseExceptions
        return exc
    return None


@pytest.mark.parametrize("ci", ["true", "1"])
def test_an_unset_tool_fails_under_ci(monkeypatch: pytest.MonkeyPatch, ci: str) -> None:
    monkeypatch.delenv(RUNNER_ENV, raising=False)
    monkeypatch.setenv("CI", ci)
    outcome = outcome_of_unset_tool()
    assert isinstance(outcome, pytest.fail.Exception), repr(outcome)
    assert f"{RUNNER_ENV} is not set" in str(outcome) and "under CI" in str(outcome)


def test_an_unset_tool_skips_outside_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RUNNER_ENV, raising=False)
    monkeypatch.delenv("CI", raising=False)
    outcome = outcome_of_unset_tool()
    assert isinstance(outcome, pytest.skip.Exception), repr(outcome)
    assert f"{RUNNER_ENV} is not set" in str(outcome)
