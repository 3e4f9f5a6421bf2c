"""The installation key and the vault: created once with mode 0600, refused when readable by
others or malformed, supplied from the environment instead; AES-GCM bound to provider and key;
fingerprints salted."""

from __future__ import annotations

import base64
import os
import stat
from pathlib import Path
from uuid import UUID

import pytest
from pydantic import SecretStr

from drivers.protocol import LaunchSpec
from events.common import SandboxSpec
from services.common.credentials import CredentialKeyError, Vault, create_key_file, load_key
from services.common.settings import Settings


def settings_with(path: Path, key: str | None = None) -> Settings:
    update = {"credentials_key_file": path, "credentials_key": SecretStr(key) if key else None}
    return Settings().model_copy(update=update)


def test_the_key_file_is_created_once_private_and_loaded(tmp_path: Path) -> None:
    path = tmp_path / "state" / "credentials.key"
    assert create_key_file(path) is True
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    first = path.read_text()
    assert create_key_file(path) is False and path.read_text() == first  # left alone
    assert len(load_key(settings_with(path))) == 32


def test_a_key_file_readable_by_others_missing_or_malformed_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "credentials.key"
    with pytest.raises(CredentialKeyError, match="no credentials key"):
        load_key(settings_with(path))
    create_key_file(path)
    os.chmod(path, 0o644)
    with pytest.raises(CredentialKeyError, match="readable by others"):
        load_key(settings_with(path))
    os.chmod(path, 0o600)
    path.write_text(base64.b64encode(b"short").decode())
    with pytest.raises(CredentialKeyError, match="expected 32"):
        load_key(settings_with(path))


def test_the_environment_supplies_the_key_instead_of_the_file(tmp_path: Path) -> None:
    key = base64.b64encode(bytes(range(32))).decode()
    settings = settings_with(tmp_path / "absent.key", key)
    assert load_key(settings) == bytes(range(32))
    assert "SANDSTREAM_CREDENTIALS_KEY" not in settings.as_env()
    with pytest.raises(CredentialKeyError, match="not base64"):
        load_key(settings_with(tmp_path / "absent.key", "not base64!"))


def test_values_are_bound_to_provider_and_key_and_fingerprints_to_the_salt() -> None:
    vault = Vault(bytes(32), b"salt-one")
    sealed = vault.seal("p", "API_KEY", "value")
    assert b"value" not in sealed.ciphertext
    assert vault.open("p", "API_KEY", sealed) == "value"
    with pytest.raises(CredentialKeyError):
        vault.open("q", "API_KEY", sealed)  # moved to another provider's row
    with pytest.raises(CredentialKeyError):
        Vault(bytes(range(32)), b"salt-one").open("p", "API_KEY", sealed)  # another key
    fp = vault.fingerprint("p", "API_KEY", "value")
    assert fp.startswith("hmac-sha256:") and "value" not in fp
    assert fp == vault.fingerprint("p", "API_KEY", "value")
    assert fp != Vault(bytes(32), b"salt-two").fingerprint("p", "API_KEY", "value")
    assert "salt-one" not in repr(vault) and str(bytes(32)) not in repr(vault)


def test_a_launch_spec_never_shows_its_values() -> None:
    spec = LaunchSpec("k", UUID(int=1), 1, "rid-1", SandboxSpec(image="i"), {"K": "sekrit-value"})
    assert "sekrit-value" not in repr(spec) and "sekrit-value" not in str(spec)
