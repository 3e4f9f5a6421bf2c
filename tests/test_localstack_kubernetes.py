"""The local Kubernetes cluster's own tools: the pure parts of its build and command lines, and
the tests' refusal to run without a cluster. (The cluster itself is exercised by every test in
test_driver_kubernetes.py and test_pipeline_kubernetes.py.)"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from kube_support import OWN_APISERVER, START_HINT, admin_client, stop_orphaned_apiservers

from services.common.settings import Settings
from services.localstack import kube_build as kb
from services.localstack.kubernetes import (
    CLIENT_QPS,
    COMPONENTS,
    _spawn,
    component_command,
    live_pid,
    paths,
    render_kubeconfig,
    running,
    scheduler_config,
    up,
)

KUBERNETES_GO_MOD = """module k8s.io/kubernetes

go 1.25.0

require (
\tgithub.com/spf13/cobra v1.9.1
\tk8s.io/api v0.0.0
\tk8s.io/apimachinery v0.0.0
\tk8s.io/utils v0.0.0-20250604170112-4c0f3b243397
)

require (
\tk8s.io/kms v0.0.0 // indirect
)

replace k8s.io/api => ./staging/src/k8s.io/api
"""


def test_the_wrapper_replaces_exactly_the_staging_modules() -> None:
    assert kb.staging_version("v1.37.2") == "v0.37.2"
    with pytest.raises(ValueError, match="Kubernetes release"):
        kb.staging_version("1.37")
    # Pseudo-versioned modules (k8s.io/utils) are not staging modules: they keep their version.
    modules = kb.staging_modules(KUBERNETES_GO_MOD)
    assert modules == ["k8s.io/api", "k8s.io/apimachinery"]
    text = kb.wrapper_go_mod(
        "local/kubernetesbuild",
        {"k8s.io/kubernetes": "v1.37.2"},
        ["k8s.io/kubernetes/cmd/kube-apiserver"],
        {m: "v0.37.2" for m in modules},
    )
    assert "require k8s.io/kubernetes v1.37.2\n" in text
    assert "\tk8s.io/kubernetes/cmd/kube-apiserver\n" in text
    assert "\tk8s.io/api => k8s.io/api v0.37.2\n" in text and "k8s.io/utils" not in text


def test_go_versions_and_version_stamps() -> None:
    assert kb.go_version("go1.26.8\n") == (1, 26) and kb.go_version("devel") is None
    old = kb.go_version("go1.19.8")
    assert old is not None and old < kb.MIN_GO
    flags = kb.kube_ldflags("v1.37.2")
    assert "-X k8s.io/component-base/version.gitVersion=v1.37.2" in flags
    assert "-X k8s.io/client-go/pkg/version.gitMinor=37" in flags


def test_everything_lives_outside_the_clone_and_on_its_own_ports(tmp_path: Path) -> None:
    settings = Settings(state_dir=tmp_path / "state", kube_home=tmp_path / "cache")
    bins = kb.binaries(settings)
    assert all(tmp_path / "cache" in p.parents for p in bins.all)
    assert Settings().kube_home_path.parts[-2:] == ("sandstream", "kubernetes")
    ports = set()
    for name in COMPONENTS:
        command = component_command(name, settings, bins)
        assert Path(command[0]).is_relative_to(tmp_path / "cache")
        ports |= {int(a.rsplit(":", 1)[1]) for a in command if "127.0.0.1:" in a}
        ports |= {int(a.split("=")[1]) for a in command if a.startswith("--secure-port=")}
    assert ports == {0, 16379, 16380, 16443, 16247}  # 0: controller manager, scheduler serve none
    assert not ports & {19092, 19093, 5432, 8787, 8788}  # Kafka, PostgreSQL, API, OpenShell


def test_the_kubeconfig_names_the_server_its_ca_and_the_token() -> None:
    text = render_kubeconfig("https://127.0.0.1:16443", b"PEM", "tok")
    assert "server: https://127.0.0.1:16443" in text
    assert "certificate-authority-data: UEVN" in text and "token: tok" in text


async def test_without_a_cluster_the_kubernetes_tests_fail_and_say_how_to_start_one(
    tmp_path: Path,
) -> None:
    settings = Settings(state_dir=tmp_path, kube_config=tmp_path / "no-such-kubeconfig")
    with pytest.raises(pytest.fail.Exception, match="make k8s"):
        async with admin_client(settings):
            pass


def test_up_leaves_a_running_cluster_alone(settings: Settings) -> None:
    """The tests' cluster is running (or this fails like every Kubernetes test): a second `up`
    returns its kubeconfig and restarts nothing."""
    p = paths(settings)
    if not running(settings):
        pytest.fail(f"no local Kubernetes cluster: {START_HINT}")
    before = {name: p.pid(name).read_text() for name in COMPONENTS}
    assert up(settings) == p.kubeconfig
    assert {name: p.pid(name).read_text() for name in COMPONENTS} == before


def test_an_own_apiserver_of_a_test_run_that_is_gone_is_stopped_and_no_other(
    tmp_path: Path,
) -> None:
    """A test run killed before it could stop its own apiserver leaves it running; the next
    run's stops it (by the owner's pid in its name), never one whose run is still on."""
    settings = Settings(state_dir=tmp_path)
    paths(settings).home.mkdir(parents=True)
    gone = subprocess.Popen(["true"])
    gone.wait()
    orphan, kept = f"{OWN_APISERVER}-{gone.pid}-1", f"{OWN_APISERVER}-{os.getpid()}-2"
    stand_in = [str(shutil.which("sleep")), "600"]
    procs = [_spawn(name, settings, stand_in) for name in (orphan, kept)]
    try:
        assert live_pid(settings, orphan) == procs[0].pid
        stop_orphaned_apiservers(settings)
        assert live_pid(settings, orphan) is None
        assert live_pid(settings, kept) == procs[1].pid
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_the_controllers_talk_to_the_apiserver_at_raised_client_limits(tmp_path: Path) -> None:
    """Stock limits (20 and 50 requests a second) made deleting 300 Pods take 14 s instead of
    3: a burst would be measured against the cluster's own throttles."""
    settings = Settings(state_dir=tmp_path, kube_home=tmp_path / "cache")
    bins = kb.binaries(settings)
    manager = component_command("kube-controller-manager", settings, bins)
    assert f"--kube-api-qps={CLIENT_QPS}" in manager and f"--kube-api-burst={CLIENT_QPS}" in manager
    scheduler = component_command("kube-scheduler", settings, bins)
    config = paths(settings).scheduler_config
    assert f"--config={config}" in scheduler
    text = scheduler_config(paths(settings).kubeconfig)
    assert f"kubeconfig: {paths(settings).kubeconfig}\n" in text
    assert f"  qps: {CLIENT_QPS}\n  burst: {CLIENT_QPS}\n" in text
    assert "leaderElect: false" in text and CLIENT_QPS >= 500
