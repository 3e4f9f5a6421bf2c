"""Credential values at rest: the installation key, AES-GCM, salted fingerprints.

The key (32 bytes) is read from SANDSTREAM_CREDENTIALS_KEY (base64) or from the key file that
``sandstream up`` creates once (mode 0600). It never enters PostgreSQL, Kafka or a log. Values
are encrypted with the provider and key name as associated data, so a ciphertext copied to
another row does not decrypt. Fingerprints are HMAC-SHA256 under the installation's salt
(persisted in PostgreSQL): equal values compare equal, and nothing about a value can be
learned from its fingerprint without the salt.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from services.common.secret_files import create_secret_file
from services.common.settings import Settings

KEY_BYTES = 32
NONCE_BYTES = 12


class CredentialKeyError(RuntimeError):
    """The credentials key is missing, malformed, or its file is readable by others."""


def create_key_file(path: Path) -> bool:
    """Write a new random key to ``path`` (mode 0600) unless it exists; True if written."""
    return create_secret_file(path, base64.b64encode(secrets.token_bytes(KEY_BYTES)).decode())


def _decode(text: str, where: str) -> bytes:
    try:
        key = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise CredentialKeyError(f"{where}: not base64") from exc
    if len(key) != KEY_BYTES:
        raise CredentialKeyError(f"{where}: {len(key)} bytes, expected {KEY_BYTES}")
    return key


def load_key(settings: Settings) -> bytes:
    """The installation key: from the environment if set there, else from the key file."""
    if settings.credentials_key is not None:
        return _decode(settings.credentials_key.get_secret_value(), "SANDSTREAM_CREDENTIALS_KEY")
    path = settings.credentials_key_path
    try:
        mode = path.stat().st_mode
    except FileNotFoundError as exc:
        raise CredentialKeyError(
            f"{path}: no credentials key (`sandstream up` creates it; or set "
            "SANDSTREAM_CREDENTIALS_KEY)"
        ) from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise CredentialKeyError(f"{path}: readable by others (chmod 600 it)")
    return _decode(path.read_text(), str(path))


@dataclass(frozen=True, slots=True)
class Sealed:
    nonce: bytes
    ciphertext: bytes


@dataclass(frozen=True)
class Vault:
    """Encrypts and fingerprints values with the installation key and salt."""

    key: bytes
    salt: bytes

    def fingerprint(self, provider: str, name: str, value: str) -> str:
        message = b"\0".join((provider.encode(), name.encode(), value.encode()))
        return "hmac-sha256:" + hmac.new(self.salt, message, hashlib.sha256).hexdigest()

    def seal(self, provider: str, name: str, value: str) -> Sealed:
        nonce = secrets.token_bytes(NONCE_BYTES)
        data = AESGCM(self.key).encrypt(nonce, value.encode(), _aad(provider, name))
        return Sealed(nonce, data)

    def open(self, provider: str, name: str, sealed: Sealed) -> str:
        try:
            data = AESGCM(self.key).decrypt(sealed.nonce, sealed.ciphertext, _aad(provider, name))
        except InvalidTag as exc:
            raise CredentialKeyError(
                f"credential {name!r} of provider {provider!r} does not decrypt with this "
                "installation's key"
            ) from exc
        return data.decode()

    def __repr__(self) -> str:
        return "Vault(<key>, <salt>)"


def _aad(provider: str, name: str) -> bytes:
    return provider.encode() + b"\0" + name.encode()
