"""The CRIU build's pure parts and where the Podman service finds the binary
(services/localstack/criu_build.py; checkpoints with it: tests/test_suspend_memory.py)."""

from __future__ import annotations

import os
from pathlib import Path

from services.common.settings import Settings
from services.localstack.criu_build import (
    CRIU_SUITE,
    apt_options,
    criu_dir,
    criu_path,
    sources_list,
    upstream_version,
)
from services.localstack.podman_service import podman_env


def test_the_upstream_tarball_name_comes_from_the_debian_version() -> None:
    assert upstream_version("4.1.1-1") == "4.1.1"
    assert upstream_version("1:4.2-3+deb13u1") == "4.2"


def test_apt_reads_only_our_sources_and_writes_only_under_our_directory(tmp_path: Path) -> None:
    options = apt_options(tmp_path)
    values = dict(o.split("=", 1) for o in options if o != "-o")
    assert values["Dir::Etc::SourceList"] == str(tmp_path / "sources.list")
    assert values["Dir::Etc::SourceParts"] == "/dev/null"  # not the machine's sources.list.d
    assert values["Dir::State::Lists"].startswith(str(tmp_path))
    assert values["Dir::Cache"].startswith(str(tmp_path))
    line = sources_list()
    assert line.startswith("deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg]")
    assert line.split()[-2:] == [CRIU_SUITE, "main"]


def test_the_podman_service_finds_the_built_criu_first_on_its_path(tmp_path: Path) -> None:
    settings = Settings(state_dir=tmp_path / "state", kube_home=tmp_path / "cache")
    assert str(criu_dir(settings)) not in podman_env(settings)["PATH"].split(os.pathsep)
    criu_path(settings).parent.mkdir(parents=True)
    criu_path(settings).write_text("")
    assert podman_env(settings)["PATH"].split(os.pathsep)[0] == str(criu_dir(settings))
