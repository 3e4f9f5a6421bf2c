"""OpenShell's official Python SDK, one virtualenv per released version, made once and cached.

``openshell`` 0.0.116 (the stable line downstream projects pin) and 0.1.5 (the current line)
share a package name, so each gets its own virtualenv under ``<cache_dir>/openshell-sdk/``
with the exact versions below (pip from PyPI; about 10 s each on a cold machine). The tests
drive each SDK's own client in a subprocess of its virtualenv; ``python -m
services.openshell.sdk`` makes them ahead of time. A virtualenv is built under a temporary
name and renamed into place, so concurrent test runs never see a half-made one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Final

from services.common.settings import load_settings

# What `pip install openshell==<version>` resolved to when these were pinned (Dec 2026).
REQUIREMENTS: Final[dict[str, tuple[str, ...]]] = {
    "0.0.116": (
        "openshell==0.0.116", "grpcio==1.85.3", "protobuf==7.36.2", "httpx==0.29.0",
        "cloudpickle==3.1.3",
    ),
    "0.1.5": (
        "openshell==0.1.5", "grpcio==1.85.3", "protobuf==7.36.2", "httpx==0.29.0",
        "cloudpickle==3.1.3", "googleapis-common-protos==1.76.0",
    ),
}  # fmt: skip
VERSIONS: Final = tuple(REQUIREMENTS)
INSTALL_TIMEOUT: Final = 600.0


def sdk_dir(cache_dir: Path, version: str) -> Path:
    return cache_dir / "openshell-sdk" / version


def sdk_python(cache_dir: Path, version: str) -> Path:
    """The Python of the SDK's virtualenv, made first if it is missing."""
    target = sdk_dir(cache_dir, version)
    python = target / "bin" / "python"
    if python.exists():
        return python
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=target.parent))
    try:
        subprocess.run([sys.executable, "-m", "venv", str(scratch)], check=True)
        pip = [str(scratch / "bin" / "python"), "-m", "pip", "install", "-q", "--no-input"]
        subprocess.run([*pip, *REQUIREMENTS[version]], check=True, timeout=INSTALL_TIMEOUT)
        try:
            os.rename(scratch, target)  # atomic; fails if another run made it meanwhile
        except OSError:
            if not python.exists():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return python


def main() -> None:
    cache = load_settings().cache_dir
    for version in VERSIONS:
        print(f"openshell {version}: {sdk_python(cache, version)}")


if __name__ == "__main__":
    main()
