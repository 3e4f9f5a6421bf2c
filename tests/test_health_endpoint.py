"""A role process's health endpoint shows probes only ready or not; its readiness detail and
metrics are for a token with the ops:read scope (as the HTTP API's /readyz and /metrics)."""

from __future__ import annotations

from pathlib import Path

import httpx

from services.common.health import Readiness, start_health
from services.common.settings import Settings
from services.common.tokens import ensure_tokens, read_token_value

SECRET_DETAIL = "PostgreSQL unreachable: ConnectionRefusedError(111, 'connect to 10.1.2.3')"


async def _not_ready() -> Readiness:
    return Readiness(False, SECRET_DETAIL, {"partitions": [0, 1]})


async def test_a_role_health_endpoint_hides_detail_and_metrics_without_the_ops_scope(
    tmp_path: Path,
) -> None:
    settings = Settings().model_copy(update={"run_dir": tmp_path})
    admin = read_token_value(ensure_tokens(settings).admin_token_file)
    health = await start_health("processor", _not_ready, "127.0.0.1", 0, None, settings.tokens_file)
    try:
        async with httpx.AsyncClient(base_url=health.url, timeout=5) as anonymous:
            assert (await anonymous.get("/healthz")).status_code == 200
            bare = await anonymous.get("/readyz")
            assert bare.status_code == 503
            assert bare.json() == {"status": "not ready", "role": "processor"}
            assert "10.1.2.3" not in bare.text
            assert (await anonymous.get("/metrics")).status_code == 401
            forged = await anonymous.get("/readyz", headers={"authorization": "Bearer sst_x"})
            assert forged.status_code == 401 and "10.1.2.3" not in forged.text
        operator = {"authorization": f"Bearer {admin}"}
        async with httpx.AsyncClient(base_url=health.url, headers=operator, timeout=5) as ops:
            detailed = (await ops.get("/readyz")).json()
            assert (detailed["reason"], detailed["partitions"]) == (SECRET_DETAIL, [0, 1])
            metrics = await ops.get("/metrics")
            assert metrics.status_code == 200 and "python_info" in metrics.text
        two = [("authorization", f"Bearer {admin}"), ("authorization", f"Bearer {admin}")]
        async with httpx.AsyncClient(base_url=health.url, timeout=5) as twice:
            for path in ("/readyz", "/metrics"):  # one token per request, as at the API
                refused = await twice.get(path, headers=two)
                assert refused.status_code == 401 and SECRET_DETAIL not in refused.text
    finally:
        await health.stop()


async def test_without_a_tokens_file_the_metrics_are_refused(tmp_path: Path) -> None:
    health = await start_health("watcher", _not_ready, "127.0.0.1", 0, None, tmp_path / "none")
    try:
        async with httpx.AsyncClient(base_url=health.url, timeout=5) as client:
            assert (await client.get("/metrics")).status_code == 403
            assert (await client.get("/readyz")).json() == {
                "status": "not ready",
                "role": "watcher",
            }
    finally:
        await health.stop()
