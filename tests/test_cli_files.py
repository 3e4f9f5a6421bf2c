"""`sandstream sandbox cp` and `sandstream sandbox files ...` against an API over the real
Podman service (the CLI in-process through typer's runner, as tests/test_provider_cli.py)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from files_support import FILES, Sandbox, files_api
from typer.testing import CliRunner, Result

from services.cli.main import app


@pytest.fixture(scope="module")
async def box() -> AsyncIterator[Sandbox]:
    async with files_api() as sandbox:
        yield sandbox


async def cli(box: Sandbox, *args: str) -> Result:
    argv = ["--url", box.api.url, "--token", FILES, *args]
    return await asyncio.to_thread(CliRunner().invoke, app, argv)


def said(result: Result) -> str:
    """What the command printed, and the error it failed with (``main`` prints that)."""
    return result.output + (str(result.exception) if result.exception else "")


def tree(root: Path) -> dict[str, bytes | str | None]:
    """A local tree: a file's bytes, a symlink's target, None for a directory."""
    found: dict[str, bytes | str | None] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            found[rel] = os.readlink(path)
        elif path.is_dir():
            found[rel] = None
        else:
            found[rel] = path.read_bytes()
    return found


async def test_cp_copies_a_directory_in_and_out_whole(box: Sandbox, tmp_path: Path) -> None:
    source = tmp_path / "project"
    (source / "src" / "pkg").mkdir(parents=True)
    (source / "src" / "pkg" / "mod.py").write_text("print('hi')\n")
    (source / "data.bin").write_bytes(os.urandom(3 * 1024 * 1024))
    (source / "latest").symlink_to("data.bin")
    r = await cli(box, "sandbox", "cp", str(source), f"{box.name}:/workspace/proj")
    assert r.exit_code == 0, r.output
    # An existing directory as the destination receives the source under its own name.
    r = await cli(box, "sandbox", "cp", str(source), f"{box.name}:/workspace/proj")
    assert r.exit_code == 0, r.output
    r = await cli(box, "sandbox", "files", "ls", box.name, "proj", "-o", "json")
    assert r.exit_code == 0, r.output
    names = {e["name"] for e in json.loads(r.output)["entries"]}
    assert names == {"src", "data.bin", "latest", "project"}

    back = tmp_path / "back"
    r = await cli(box, "sandbox", "cp", f"{box.name}:proj", str(back))
    assert r.exit_code == 0, r.output
    assert {k: v for k, v in tree(back).items() if not k.startswith("project")} == tree(source)
    (tmp_path / "into").mkdir()
    r = await cli(box, "sandbox", "cp", f"{box.name}:proj/src", str(tmp_path / "into"))
    assert r.exit_code == 0, r.output
    assert (tmp_path / "into" / "src" / "pkg" / "mod.py").read_text() == "print('hi')\n"


async def test_cp_copies_a_file_in_and_out(box: Sandbox, tmp_path: Path) -> None:
    local = tmp_path / "notes.txt"
    local.write_bytes(b"line\n" * 100_000)
    r = await cli(box, "sandbox", "cp", str(local), f"{box.name}:/workspace/sandbox-docs")
    assert r.exit_code == 0, said(r)  # a path naming "sandbox" is still a path
    r = await cli(box, "sandbox", "cp", str(local), f"{box.name}:/workspace/docs/notes.txt")
    assert r.exit_code == 0, r.output
    r = await cli(box, "sandbox", "cp", str(local), f"{box.name}:docs")  # into the directory
    assert r.exit_code == 0, r.output
    copy = tmp_path / "copy.txt"
    r = await cli(box, "sandbox", "cp", f"{box.name}:docs/notes.txt", str(copy))
    assert r.exit_code == 0, r.output
    assert copy.read_bytes() == local.read_bytes()
    assert [p for p in os.listdir(tmp_path) if p.endswith(".part")] == []


async def test_cp_needs_exactly_one_sandbox_side_and_says_what_is_missing(
    box: Sandbox, tmp_path: Path
) -> None:
    r = await cli(box, "sandbox", "cp", str(tmp_path), str(tmp_path / "x"))
    assert r.exit_code == 1 and "exactly one side" in said(r)
    r = await cli(box, "sandbox", "cp", f"{box.name}:/nowhere", str(tmp_path / "x"))
    assert r.exit_code == 1 and "no such file or directory" in said(r)
    r = await cli(box, "sandbox", "cp", str(tmp_path / "absent"), f"{box.name}:/workspace")
    assert r.exit_code == 1 and "no such file or directory" in said(r)
    r = await cli(box, "sandbox", "cp", str(tmp_path), "no-such-box:/workspace")
    assert r.exit_code == 1 and "sandbox 'no-such-box' not found" in said(r)
    r = await cli(box, "sandbox", "cp", str(tmp_path), f"{box.name}:/etc/x")
    assert r.exit_code == 1 and "read-only file system" in said(r).lower()


async def test_files_mkdir_stat_mv_rm(box: Sandbox) -> None:
    r = await cli(box, "sandbox", "files", "mkdir", box.name, "work/a")
    assert r.exit_code == 0 and "/workspace/work/a" in r.output, r.output
    r = await cli(box, "sandbox", "files", "mv", box.name, "work/a", "work/b")
    assert r.exit_code == 0, r.output
    r = await cli(box, "sandbox", "files", "stat", box.name, "work/b")
    assert r.exit_code == 0 and "drwx" in r.output and "/workspace/work/b" in r.output, r.output
    r = await cli(box, "sandbox", "files", "rm", box.name, "work")
    assert r.exit_code == 1 and "not empty" in said(r).lower(), said(r)
    r = await cli(box, "sandbox", "files", "rm", box.name, "-r", "work")
    assert r.exit_code == 0, r.output
    r = await cli(box, "sandbox", "files", "ls", box.name, "work")
    assert r.exit_code == 1 and "no such file or directory" in said(r).lower(), r.output
