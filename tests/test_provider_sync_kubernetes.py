"""The provider-sync controller with Kubernetes Secrets as its source: a real kube-apiserver
(`make k8s`), real Kafka and PostgreSQL, the processor and executor with the fake driver.

Secrets selected by label become providers (a baseline: nothing restarts); a changed Secret is
one rotation that restarts its attached sandbox once; a restarted controller re-sends nothing;
Secrets outside the selector, or naming a provider twice, are left alone.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
from pathlib import Path
from typing import Any

import apikit
import pytest
from apikit import create_body, unique
from harness import eventually
from kube_support import admin_client, namespace
from pydantic import SecretStr
from typer.testing import CliRunner

from drivers.fake import FakeDriver
from drivers.kubernetes import KubeConfig
from services.cli.main import app
from services.common.settings import Settings
from services.provider_sync.controller import ProviderSync, sync_source
from services.provider_sync.kube_secrets import KubeSecretSource
from services.provider_sync.sources import PROVIDER_ANNOTATION, read_secrets

KEY = SecretStr(base64.b64encode(secrets.token_bytes(32)).decode())


def secret(name: str, values: dict[str, str], labels: dict[str, str], **annotations: str) -> Any:
    return {
        "metadata": {"name": name, "labels": labels, "annotations": annotations},
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in values.items()},
    }


async def test_secrets_by_label_become_providers_and_a_changed_one_rotates_once(
    settings: Settings,
) -> None:
    selector = {"sandstream.test/sync": unique("sel")}
    label = ",".join(f"{k}={v}" for k, v in selector.items())
    p, q, sandbox = unique("ks-p"), unique("ks-q"), unique("ks-sb")
    async with admin_client(settings) as admin, namespace(admin, "sync") as ns:
        core = admin.core
        # p by its Secret's name, q by the annotation; one outside the selector.
        await core.create_namespaced_secret(ns, secret(p, {"API_KEY": "p-one"}, selector))
        await core.create_namespaced_secret(
            ns, secret("q-secret", {"TOKEN": "q-one"}, selector, **{PROVIDER_ANNOTATION: q})
        )
        await core.create_namespaced_secret(ns, secret(unique("other"), {"X": "1"}, {}))

        def controller(**kw: Any) -> ProviderSync:
            source = KubeSecretSource(KubeConfig(namespace=ns, kubeconfig=admin.kubeconfig), label)
            return ProviderSync(api.app.state.providers, source, **kw)

        async with apikit.running_api(
            FakeDriver(), settings_update={"credentials_key": KEY}
        ) as api, api.client() as c:  # fmt: skip
            sync = controller()
            first = await sync.reconcile()
            await sync.source.close()
            assert first is not None and first.sandboxes == []
            assert {a.change.provider for a in first.applied} == {p, q}
            assert all(a.created and not a.change.rotated for a in first.applied)
            listed = (await c.get("/v1/providers")).json()["items"]
            assert {i["name"] for i in listed} >= {p, q}

            body = create_body(sandbox)
            body["providers"] = [p, q]
            r = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
            assert r.status_code == 201, r.text
            await api.wait_phase(sandbox, "Ready")

            # One Secret changes: one rotation, one restart.
            changed = secret(p, {"API_KEY": "p-two"}, selector)
            await core.replace_namespaced_secret(p, ns, changed)
            sync = controller()
            receipt = await sync.reconcile()
            await sync.source.close()
            assert receipt is not None
            assert [(a.change.provider, a.change.of("rotated")) for a in receipt.applied] == [
                (p, ["API_KEY"])
            ]
            (line,) = receipt.sandboxes
            assert (line.sandbox, line.action, line.providers) == (sandbox, "restart", (p,))
            await eventually(
                lambda: c.get(f"/v1/sandboxes/{sandbox}"),
                lambda resp: (resp.json()["phase"], resp.json()["generation"]) == ("Ready", 2),
                what=f"{sandbox} restarted once",
            )

            # A restarted controller finds nothing changed and sends nothing.
            sync = controller()
            assert await sync.reconcile() is None
            await sync.source.close()
            history = (await c.get(f"/v1/sandboxes/{sandbox}/history")).json()["items"]
            assert len([h for h in history if "AgentRestarted" in h["events"]]) == 1
            assert (await c.get(f"/v1/providers/{p}")).json()["revision"] == 2

            # A second Secret naming p makes it ambiguous: skipped, nothing sent.
            await core.create_namespaced_secret(
                ns, secret("p-again", {"API_KEY": "p-three"}, selector, **{PROVIDER_ANNOTATION: p})
            )
            sync = controller()
            assert await sync.reconcile() is None
            await sync.source.close()
            assert (await c.get(f"/v1/providers/{p}")).json()["revision"] == 2


async def test_the_loop_follows_a_changed_secret(settings: Settings) -> None:
    selector = {"sandstream.test/sync": unique("sel")}
    label = ",".join(f"{k}={v}" for k, v in selector.items())
    p = unique("ks-loop")
    async with admin_client(settings) as admin, namespace(admin, "sync") as ns:
        await admin.core.create_namespaced_secret(ns, secret(p, {"API_KEY": "one"}, selector))
        async with apikit.running_api(
            FakeDriver(), settings_update={"credentials_key": KEY}
        ) as api, api.client() as c:  # fmt: skip
            source = KubeSecretSource(KubeConfig(namespace=ns, kubeconfig=admin.kubeconfig), label)
            loop = ProviderSync(api.app.state.providers, source, restart=False, interval=0.1)
            stop = asyncio.Event()
            task = asyncio.create_task(loop.run(stop))
            try:
                await eventually(lambda: c.get(f"/v1/providers/{p}"),
                                 lambda r: r.status_code == 200, what=f"{p} created")  # fmt: skip
                changed = secret(p, {"API_KEY": "two"}, selector)
                await admin.core.replace_namespaced_secret(p, ns, changed)
                await eventually(
                    lambda: c.get(f"/v1/providers/{p}"),
                    lambda r: r.json()["revision"] == 2,
                    what=f"{p} rotated",
                )
            finally:
                stop.set()
                await asyncio.wait_for(task, 10)


def test_a_secret_maps_to_a_provider_by_annotation_or_name_and_skips_bad_names() -> None:
    found = read_secrets(
        [
            secret("a", {"API_KEY": "1", "bad-key": "2", "SANDSTREAM_X": "3"}, {}),
            secret("b", {"T": "4"}, {}, **{PROVIDER_ANNOTATION: "Named_B"}),
            secret("c", {"T": "5"}, {}, **{PROVIDER_ANNOTATION: "not a name!"}),
            secret("d", {"T": "6"}, {}, **{PROVIDER_ANNOTATION: "dup"}),
            secret("e", {"T": "7"}, {}, **{PROVIDER_ANNOTATION: "dup"}),
        ]
    )
    assert found == {"a": {"API_KEY": "1"}, "Named_B": {"T": "4"}}
    # A value that is not UTF-8 text: the key is there, its value unreadable (kept as stored).
    binary = secret("f", {}, {})
    binary["data"] = {"T": base64.b64encode(b"\xff\xfe").decode(), "U": "not base64!"}
    assert read_secrets([binary]) == {"f": {"T": None, "U": None}}


def test_provider_sync_takes_exactly_one_source() -> None:
    for argv in (["provider-sync"], ["provider-sync", "--dir", ".", "--kube-selector", "a=b"]):
        result = CliRunner().invoke(app, argv)
        assert result.exit_code != 0
        assert "one of --dir and --kube-selector" in result.output + str(result.exception)


def test_up_takes_the_source_from_the_settings(settings: Settings, tmp_path: Path) -> None:
    assert sync_source(settings.model_copy(update={"provider_sync_dir": None})) is None
    kube = sync_source(
        settings.model_copy(
            update={"provider_sync_dir": None, "provider_sync_kube_selector": "app=agents"}
        )
    )
    assert isinstance(kube, KubeSecretSource)
    assert (kube.selector, kube.cfg.namespace) == ("app=agents", settings.kube_namespace)
    both = settings.model_copy(
        update={"provider_sync_dir": tmp_path, "provider_sync_kube_selector": "app=agents"}
    )
    with pytest.raises(ValueError, match="not both"):
        sync_source(both)
