"""Build ``helm`` (v4) from the Go module proxy, cached beside the local cluster's binaries.

    python -m services.localstack.helm_build        # build if missing, print the binary's path

The chart's tests (tests/test_helm_chart.py) lint and render deploy/helm/sandstream with it. It
is built like kube-apiserver (services/localstack/kube_build.py): a wrapper module that
requires ``helm.sh/helm/v4`` at ``HELM_VERSION`` and lists ``cmd/helm`` as a tool, built with
the same Go caches in ``settings.kube_home_path``. A binary present there is never rebuilt.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

from services.common.settings import Settings, load_settings
from services.localstack.kube_build import BuildError, _go_build, _wrapper, check_go

HELM_VERSION = "v4.3.2"
HELM_MODULE = "helm.sh/helm/v4"
HELM_PACKAGE = f"{HELM_MODULE}/cmd/helm"
MIN_GO = (1, 26)  # helm v4.3's go.mod


def helm_path(settings: Settings, version: str = HELM_VERSION) -> Path:
    return settings.kube_home_path / "bin" / f"helm-{version}" / "helm"


def helm_ldflags(version: str) -> str:
    """Helm's own release flags: `helm version` then names the release, not `v4.3`."""
    return f"-s -w -X {HELM_MODULE}/internal/version.version={version}"


def build_helm(settings: Settings, say: Callable[[str], None]) -> Path:
    """The helm binary, built first if missing (a few minutes of two cores; seconds warm)."""
    target = helm_path(settings)
    if target.exists():
        return target
    check_go(MIN_GO, f"helm {HELM_VERSION}")
    started = time.monotonic()
    say(f"building helm {HELM_VERSION} into {target.parent}")
    src = _wrapper(settings, "helm", HELM_VERSION, {HELM_MODULE: HELM_VERSION}, [HELM_PACKAGE])
    _go_build(settings, src, [HELM_PACKAGE], target, [helm_ldflags(HELM_VERSION)], say)
    say(f"helm built in {time.monotonic() - started:.0f}s")
    return target


def main() -> int:
    try:
        path = build_helm(load_settings(), lambda m: print(f"helm: {m}", file=sys.stderr))
    except BuildError as exc:
        print(f"helm: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
