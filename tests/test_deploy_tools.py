"""The pure parts of the image build (services/localstack/image.py), of kube play's adaptation
of the rendered chart (services/localstack/kube_play.py), the values of the chart on the local
cluster's real node (kube_chart.py), and where the migrations are found
when sandstream runs from its wheel (the image) rather than a checkout. The artifacts themselves
run in tests/test_helm_chart.py and, with `make deploy-test`, test_deploy_kube_play.py,
test_deploy_kube_chart.py and test_deploy_compose.py."""

from __future__ import annotations

import base64
import json
import tomllib
import uuid
import zipfile
from pathlib import Path

import asyncpg
import pytest
from packaging.requirements import Requirement

from services.common import migrations
from services.common.settings import PROJECT_ROOT, Settings
from services.localstack import image, kube_chart, kube_node, kube_play
from services.localstack import kubernetes as kube_cluster

PYPROJECT = """
[project]
name = "x"
dependencies = ["b==2", "a==1"]

[project.optional-dependencies]
dev = ["pytest==9"]
"""


def test_requirements_pin_every_dependency_wheel_but_sandstreams_own() -> None:
    wheels = [
        "sandstream-0.1.0-py3-none-any.whl",
        "pyarrow-26.0.1-cp311-cp311-manylinux_2_28_x86_64.whl",
        "aiokafka-0.14.0-1build-cp311-cp311-manylinux2014_x86_64.whl",
    ]
    assert image.requirements(wheels, own=wheels[0]) == "aiokafka==0.14.0\npyarrow==26.0.1\n"
    with pytest.raises(image.ImageError, match="not a wheel"):
        image.requirement_of("pyarrow.tar.gz")


def test_the_base_is_named_by_its_recipe_and_leaves_docs_and_locales_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cmd = image.mmdebstrap_command([Path("/etc/apt/sources.list")], Path("/tmp/r.tar"))
    assert cmd[-3:] == ["bookworm", "/tmp/r.tar", "/etc/apt/sources.list"]
    for pattern in ("/usr/share/doc/*", "/usr/share/man/*", "/usr/share/locale/*"):
        assert f"--dpkgopt=path-exclude={pattern}" in cmd
    assert any("var/lib/apt/lists" in part for part in cmd)
    before = image.base_reference()
    assert before == image.base_reference()  # where it reads and writes is not in the name
    monkeypatch.setattr(image, "BASE_PACKAGES", (*image.BASE_PACKAGES, "curl"))
    assert image.base_reference() != before


def test_the_dependencies_key_follows_the_runtime_dependencies_only() -> None:
    key = image.dependencies_key(PYPROJECT)
    assert image.dependencies_key(PYPROJECT.replace("pytest==9", "pytest==10")) == key
    assert image.dependencies_key(PYPROJECT.replace("a==1", "a==1.1")) != key
    # A dependency moved into an extra leaves the image: the cached wheels are not reused.
    moved = PYPROJECT.replace('"b==2", ', "").replace("dev = [", 'parquet = ["b==2"]\ndev = [')
    assert image.dependencies_key(moved) != key
    assert image.dependencies_key(moved.replace("b==2", "b==3")) == image.dependencies_key(moved)


def test_pyarrow_comes_with_the_parquet_extra_and_stays_out_of_the_image() -> None:
    project = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]
    runtime = [Requirement(r).name for r in project["dependencies"]]
    extras = project["optional-dependencies"]
    assert "pyarrow" not in runtime  # the image installs the runtime dependencies only
    assert [Requirement(r).name for r in extras["parquet"]] == ["pyarrow"]
    assert "sandstream[parquet]" in extras["dev"]  # the tests exercise the Parquet export


def test_kube_play_leaves_ports_out_keeps_init_containers_and_restarts_on_failure() -> None:
    mounts = [{"name": "run", "mountPath": "/run"}, {"name": "sock", "mountPath": "/s"}]
    pod = {
        "containers": [{"ports": [1], "volumeMounts": mounts}],
        "initContainers": [{"volumeMounts": mounts[:1]}],
        "volumes": [{"name": "run", "emptyDir": {}}, {"name": "sock", "hostPath": {}}],
    }
    deployment = {
        "kind": "Deployment",
        "metadata": {"name": "d"},
        "spec": {"replicas": 2, "template": {"spec": pod}},
    }
    played = kube_play.for_podman(deployment)
    spec = played["spec"]["template"]["spec"]
    assert "ports" not in spec["containers"][0]
    assert played["metadata"]["annotations"][kube_play.INIT_TYPE] == "always"
    assert spec["restartPolicy"] == "OnFailure"  # kube play gives it to the init steps too
    # an emptyDir named after its pod (kube play would share one "run" among all pods)
    assert [v["name"] for v in spec["volumes"]] == ["d-run", "sock"]
    assert [m["name"] for m in spec["containers"][0]["volumeMounts"]] == ["d-run", "sock"]
    assert spec["initContainers"][0]["volumeMounts"][0]["name"] == "d-run"
    assert pod["containers"][0]["ports"] == [1]  # a copy
    assert kube_play.pod_names([deployment, {"kind": "Pod", "metadata": {"name": "p"}}]) == [
        "d-pod-0", "d-pod-1", "p",
    ]  # fmt: skip


def test_kube_play_secrets_are_json_of_base64_values() -> None:
    decoded = {
        k: base64.b64decode(v).decode()
        for k, v in json.loads(kube_play.podman_secret({"api": '{"api": 1}'})).items()
    }
    assert decoded == {"api": '{"api": 1}'}


def test_the_second_processor_release_has_only_a_processor_on_its_own_port(
    settings: Settings,
) -> None:
    deployment = kube_play.LocalDeployment(settings, release="r")
    values = kube_play.merged(
        kube_play.chart_values(deployment, "0.1.0"),
        kube_play.second_processor_values(deployment),
    )
    enabled = [r for r in kube_play.PLAYED_ROLES if values[r].get("enabled", True)]
    assert enabled == ["processor"]
    assert values["processor"]["healthPort"] == deployment.ports.second_processor
    assert values["prepare"] == {"enabled": False}
    assert values["kafka"]["credentialsSecret"] == "r-kafka"  # the first release's secrets
    template = {"metadata": {"labels": {}}, "spec": {"containers": []}}
    job = {"metadata": {"name": "j"}, "spec": {"template": template}}
    assert kube_play.job_as_pod(job)["kind"] == "Pod"


def test_the_chart_on_the_real_node_uses_the_kubernetes_driver_there_and_the_kubeconfigs_server(
    settings: Settings, tmp_path: Path
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(kube_cluster.render_kubeconfig("https://127.0.0.1:16543", b"ca", "token"))
    deployment = kube_chart.ClusterDeployment(
        kube_play.LocalDeployment(settings, release="r"), "ns", kubeconfig
    )
    values = kube_chart.chart_values(deployment, "0.1.0")
    assert values["driver"] == "kubernetes"
    assert values["kubernetesDriver"]["apiServer"] == {"host": "127.0.0.1", "port": 16543}
    assert values["hostNetwork"] is True  # Kafka and PostgreSQL on the host's loopback
    assert values["image"]["pullPolicy"] == "Never"  # imported into containerd, never pulled
    # the roles and the sandboxes alike on the tainted real node
    assert values["nodeSelector"] == {kube_node.TAINT_KEY: "true"}
    assert [t["key"] for t in values["tolerations"]] == [kube_node.TAINT_KEY]
    assert values["settings"] == {
        "KUBE_NODE_SELECTOR": kube_node.NODE_LABEL, "KUBE_TOLERATIONS": kube_node.TAINT,
    }  # fmt: skip


def test_migrations_come_from_the_checkout_else_the_installed_wheel(tmp_path: Path) -> None:
    checkout, installed = tmp_path / "checkout", tmp_path / "installed"
    with pytest.raises(migrations.MigrationError, match="no migrations found"):
        migrations.default_directory(checkout, installed)
    installed.mkdir()
    assert migrations.default_directory(checkout, installed) == installed
    checkout.mkdir()
    assert migrations.default_directory(checkout, installed) == checkout


async def test_without_a_checkout_the_installed_migrations_are_applied(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    installed = tmp_path / "share" / "sandstream" / "migrations"
    installed.mkdir(parents=True)
    (installed / "0001_t.sql").write_text("CREATE TABLE t (x int);")
    monkeypatch.setattr(migrations, "MIGRATIONS_DIR", tmp_path / "no-checkout")
    monkeypatch.setattr(migrations, "INSTALLED_MIGRATIONS", installed)
    schema = f"mig_{uuid.uuid4().hex[:10]}"
    try:
        assert await migrations.apply_migrations(settings.pg_dsn, schema=schema) == ["0001_t.sql"]
    finally:
        conn = await asyncpg.connect(settings.pg_dsn)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        finally:
            await conn.close()


def test_sandstreams_wheel_holds_no_module_left_in_build_by_an_earlier_build(
    tmp_path: Path,
) -> None:
    """setuptools packs whatever the checkout's build/lib holds: a module removed since an
    earlier build (as projections/lifecycle.py became a package) rode along into the image."""
    stale = PROJECT_ROOT / "build" / "lib" / "projections" / "removed_since_left_over.py"
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_text("GONE = True\n")
    wheel = image._build_wheel(tmp_path)
    names = zipfile.ZipFile(tmp_path / wheel).namelist()
    assert "projections/lifecycle/__init__.py" in names
    assert not [n for n in names if "removed_since_left_over" in n]
