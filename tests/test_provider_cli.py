"""`sandstream provider ...` and `sandstream sandbox attach|detach`, run in-process against the
real API (Kafka, PostgreSQL, the processor and executor with the fake driver).

Values go in by ``--from-file`` and ``--from-env`` only; what comes out (tables, JSON) holds key
names and fingerprints, never a value; an update prints its receipt as a table.
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
from pathlib import Path

import apikit
from apikit import ADMIN, create_body, unique
from pydantic import SecretStr
from typer.testing import CliRunner, Result

from drivers.fake import FakeDriver
from services.cli.main import app


def said(result: Result) -> str:
    """What the command printed, and the error it failed with (``main`` prints that)."""
    return result.output + (str(result.exception) if result.exception else "")


KEY = SecretStr(base64.b64encode(secrets.token_bytes(32)).decode())


async def test_provider_commands_take_values_from_files_and_env_and_never_print_them(
    tmp_path: Path,
) -> None:
    name, sandbox = unique("cli-p"), unique("cli-sb")
    first, second = f"v1-{secrets.token_hex(6)}", f"v2-{secrets.token_hex(6)}"
    values = tmp_path / "values.env"
    values.write_text(f"# a comment\nAPI_KEY={second}\n")
    async with apikit.running_api(FakeDriver(), settings_update={"credentials_key": KEY}) as api:

        async def cli(*args: str, env: dict[str, str] | None = None) -> Result:
            argv = ["--url", api.url, "--token", ADMIN, *args]
            return await asyncio.to_thread(CliRunner().invoke, app, argv, env=env)

        created = await cli("provider", "create", name, "--type", "api-key",
                            "--from-env", "API_KEY", env={"API_KEY": first})  # fmt: skip
        assert created.exit_code == 0, created.output
        assert "API_KEY" in created.output and "hmac-sha256:" in created.output

        async with api.client() as c:
            body = create_body(sandbox)
            r = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
            assert r.status_code == 201, r.text
        await api.wait_phase(sandbox, "Ready")
        attached = await cli("sandbox", "attach", sandbox, name)
        assert attached.exit_code == 0, attached.output
        missing = await cli("sandbox", "attach", sandbox, "no-such-provider")
        assert missing.exit_code == 1 and "not found" in said(missing)

        updated = await cli("provider", "update", name, "--from-file", str(values))
        assert updated.exit_code == 0, updated.output
        assert f"provider {name} revision 2: rotated API_KEY" in updated.output
        assert sandbox in updated.output and "restart" in updated.output
        await api.wait_phase(sandbox, "Ready")

        listed = await cli("provider", "list", "-o", "json")
        assert [p["name"] for p in json.loads(listed.output)] == [name]
        got = await cli("provider", "get", name, "-o", "json")
        assert json.loads(got.output)["revision"] == 2

        kept = await cli("sandbox", "detach", sandbox, name, "--no-restart")
        assert kept.exit_code == 0 and "no-restart" in kept.output, kept.output
        async with api.client() as c:
            assert (await c.get(f"/v1/sandboxes/{sandbox}")).json()["generation"] == 2
        assert (await cli("sandbox", "attach", sandbox, name)).exit_code == 0

        refused = await cli("provider", "delete", name)
        assert refused.exit_code == 1 and "attached" in said(refused)
        forced = await cli("provider", "delete", name, "--force")
        assert forced.exit_code == 0 and sandbox in forced.output

        for result in (created, attached, updated, listed, got, kept, refused, forced):
            assert first not in said(result) and second not in said(result)


def test_a_values_file_that_is_not_utf8_is_refused_in_words_without_its_bytes(
    tmp_path: Path,
) -> None:
    """Found by a hostile pass: such a file ended in a Python traceback. Now it is a plain
    refusal (exit 1) naming the file and the offset, not the bytes, before any request."""
    values = tmp_path / "values.env"
    values.write_bytes(b"API_KEY=s3cr3t-\xff\xfe\n")
    argv = ["--url", "http://127.0.0.1:9", "--token", ADMIN,
            "provider", "create", "p", "--from-file", str(values)]  # fmt: skip
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 1, said(result)
    assert f"cannot read {values}: not UTF-8 text (at byte 15)" in said(result)
    assert "s3cr3t" not in said(result) and "Traceback" not in said(result)
