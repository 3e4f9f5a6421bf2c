"""compose/docker-compose.yml and its TLS override as podman-compose reads them (`podman-compose
config`: anchors, merges and variables resolved by the tool itself): which role gets which
secret, and what TLS adds. The files run for real in tests/test_deploy_compose.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from services.common.settings import PROJECT_ROOT

COMPOSE = PROJECT_ROOT / "compose"
SECRETS = {
    "SANDSTREAM_PG_PASSWORD": "pg-password",
    "SANDSTREAM_CREDENTIALS_KEY": "the-credentials-key",
    **{f"SANDSTREAM_KAFKA_{r}": f"kafka-{r.lower()}"
       for r in ("ADMIN", "API", "PROCESSOR", "EXECUTOR", "WATCHER", "SCHEDULER")},
}  # fmt: skip
# Where provider values are encrypted or decrypted, and prepare (else it makes a key file).
KEYED = {"prepare", "api", "openshell", "executor"}


def config(*files: str, **variables: str) -> dict[str, Any]:
    runner = str(Path(sys.executable).with_name("podman-compose"))
    args = [runner, *(a for f in files for a in ("--file", str(COMPOSE / f))), "config"]
    env = {"PATH": "/usr/bin:/bin", **SECRETS, **variables}
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    loaded: dict[str, Any] = yaml.safe_load(result.stdout)
    return loaded


def test_only_the_roles_that_need_it_get_the_credentials_key() -> None:
    services = config("docker-compose.yml")["services"]
    assert set(services) == KEYED | {"processor", "watcher", "scheduler"}
    for name, service in services.items():
        env = service["environment"]
        assert ("SANDSTREAM_CREDENTIALS_KEY" in env) == (name in KEYED), name
        if name in KEYED:
            assert env["SANDSTREAM_CREDENTIALS_KEY"] == "the-credentials-key"
        assert "SANDSTREAM_API_TLS_CERTFILE" not in env  # plain http without the override


def test_the_tls_override_serves_both_apis_with_the_certificate_from_secrets(
    tmp_path: Path,
) -> None:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    files = {"SANDSTREAM_TLS_CERT_FILE": str(cert), "SANDSTREAM_TLS_KEY_FILE": str(key)}
    merged = config("docker-compose.yml", "docker-compose.tls.yml",
                    SANDSTREAM_API_FORWARDED_ALLOW_IPS="10.1.2.0/24", **files)  # fmt: skip
    assert merged["secrets"] == {
        "sandstream_tls_cert": {"file": str(cert)}, "sandstream_tls_key": {"file": str(key)},
    }  # fmt: skip
    for name in ("api", "openshell"):
        service = merged["services"][name]
        env = service["environment"]
        assert env["SANDSTREAM_API_TLS_CERTFILE"] == "/run/secrets/tls.crt"
        assert env["SANDSTREAM_API_TLS_KEYFILE"] == "/run/secrets/tls.key"
        assert {s["target"] for s in service["secrets"]} == {"tls.crt", "tls.key"}
        assert env["SANDSTREAM_CREDENTIALS_KEY"] == "the-credentials-key"  # kept by the merge
    assert merged["services"]["openshell"]["environment"]["SANDSTREAM_OPENSHELL_TLS"] == "true"
    api = merged["services"]["api"]["environment"]
    assert api["SANDSTREAM_API_FORWARDED_ALLOW_IPS"] == "10.1.2.0/24"
    for name in ("processor", "executor", "watcher", "scheduler", "prepare"):
        assert "secrets" not in merged["services"][name]

    plain_grpc = config("docker-compose.yml", "docker-compose.tls.yml",
                        SANDSTREAM_OPENSHELL_TLS="false", **files)  # fmt: skip
    assert plain_grpc["services"]["openshell"]["environment"]["SANDSTREAM_OPENSHELL_TLS"] == (
        "false"
    )
