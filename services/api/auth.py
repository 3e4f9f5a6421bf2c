"""Bearer tokens with scopes for the HTTP API.

The tokens file (``settings.tokens_file``, JSON, mode 0600) stores, per token, only its name,
its scopes and the sha256 of its value::

    {"tokens": [{"name": "admin", "sha256": "<hex>", "scopes": ["sandbox:read", ...],
                 "created_at": "2026-01-01T00:00:00+00:00"}]}

A token may also carry ``"max_stop_timeout_seconds": N``: the longest grace period its
creates may ask for (default: ``settings.api_max_stop_timeout_seconds``).

The plaintext exists once: ``ensure_tokens`` (called by ``sandstream up``) writes the admin
token to ``settings.admin_token_file`` (mode 0600) when it creates the tokens file, and
``add_token`` returns a new token's value to its caller. A request's token is hashed and
compared with every stored hash with ``hmac.compare_digest``.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import stat
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from services.common.settings import Settings

READ: Final = "sandbox:read"
WRITE: Final = "sandbox:write"
AUDIT: Final = "audit:read"  # the audit routes: whole histories, exports, chain checks
# Providers: reading shows names, key names and fingerprints (never values); writing sets
# values, deletes providers, and is needed (with sandbox:write) to attach or detach one.
PROVIDER_READ: Final = "provider:read"
PROVIDER_WRITE: Final = "provider:write"
SCOPES: Final = (READ, WRITE, AUDIT, PROVIDER_READ, PROVIDER_WRITE)
TOKEN_PREFIX: Final = "sst_"


class TokenFileError(RuntimeError):
    """The tokens file is missing, unreadable, malformed or too open."""


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request acts for: the token's name (the ``actor`` of its commands) and scopes."""

    name: str
    scopes: frozenset[str]
    max_stop_timeout: int | None = None  # this token's cap on stop_timeout_seconds, if any


@dataclass(frozen=True, slots=True)
class StoredToken:
    name: str
    sha256: str
    scopes: frozenset[str]
    created_at: str | None = None
    max_stop_timeout: int | None = None


def hash_token(value: str) -> str:
    return hashlib.sha256(value.encode("utf-8")).hexdigest()


def new_token_value() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


class TokenStore:
    """The known tokens; ``from_file`` stores re-read the file when it changes."""

    def __init__(self, tokens: list[StoredToken], path: Path | None = None) -> None:
        self._tokens = list(tokens)
        self._path = path
        self._stamp = _stamp(path) if path is not None else None

    @classmethod
    def from_file(cls, path: Path) -> TokenStore:
        return cls(read_tokens(path), path)

    @classmethod
    def of(cls, **tokens: tuple[str, ...]) -> TokenStore:
        """An in-memory store from ``name=(value, scope, ...)`` (tests, embedding)."""
        return cls(
            [
                StoredToken(name, hash_token(value), frozenset(scopes))
                for name, (value, *scopes) in tokens.items()
            ]
        )

    def _refresh(self) -> None:
        if self._path is None:
            return
        stamp = _stamp(self._path)
        if stamp != self._stamp:
            # Keep serving the tokens we had if the file is being rewritten or broken.
            with contextlib.suppress(TokenFileError):
                self._tokens = read_tokens(self._path)
                self._stamp = stamp

    def authenticate(self, value: str) -> Principal | None:
        self._refresh()
        digest = hash_token(value)
        found: StoredToken | None = None
        for token in self._tokens:  # no early exit: the time taken does not depend on a match
            if hmac.compare_digest(digest, token.sha256) and found is None:
                found = token
        if found is None:
            return None
        return Principal(found.name, found.scopes, found.max_stop_timeout)


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def check_private(path: Path) -> None:
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise TokenFileError(
            f"{path} is accessible by other users (mode {mode:04o}); run: chmod 600 {path}"
        )


def read_tokens(path: Path) -> list[StoredToken]:
    try:
        check_private(path)
        raw = json.loads(path.read_text(encoding="utf-8"))
        tokens = []
        for entry in raw["tokens"]:
            scopes = frozenset(entry["scopes"])
            unknown = scopes - set(SCOPES)
            if unknown:
                raise TokenFileError(
                    f"{path}: token {entry['name']!r} has unknown scopes {unknown}"
                )
            digest = str(entry["sha256"]).lower()
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise TokenFileError(f"{path}: token {entry['name']!r} has a malformed sha256")
            cap = entry.get("max_stop_timeout_seconds")
            if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 0):
                raise TokenFileError(
                    f"{path}: token {entry['name']!r}: max_stop_timeout_seconds must be a "
                    "non-negative integer"
                )
            tokens.append(
                StoredToken(str(entry["name"]), digest, scopes, entry.get("created_at"), cap)
            )
        return tokens
    except FileNotFoundError:
        raise TokenFileError(
            f"tokens file {path} does not exist (`sandstream up` creates it)"
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TokenFileError(f"cannot read tokens file {path}: {exc}") from exc


def _write_private(path: Path, text: str, *, exclusive: bool) -> None:
    """Write ``text`` to ``path`` with mode 0600 from the start (never briefly world-readable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if exclusive:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text)
    os.replace(tmp, path)


def _entry(name: str, value: str, scopes: tuple[str, ...]) -> dict[str, Any]:
    return {
        "name": name,
        "sha256": hash_token(value),
        "scopes": sorted(scopes),
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


@dataclass(frozen=True, slots=True)
class TokenSetup:
    tokens_file: Path
    admin_token_file: Path
    created: bool  # False: the tokens file existed and was left as it is


def ensure_tokens(settings: Settings) -> TokenSetup:
    """Create the tokens file with an admin token if it is missing; check it otherwise."""
    path, admin = settings.tokens_file, settings.admin_token_file
    if path.exists():
        read_tokens(path)  # fail early (and loudly) on a broken or too open file
        return TokenSetup(path, admin, created=False)
    value = new_token_value()
    # The plaintext first: a crash in between leaves a token nobody can use, never a file
    # that accepts a token nobody has.
    admin.unlink(missing_ok=True)
    _write_private(admin, value + "\n", exclusive=True)
    document = {"tokens": [_entry("admin", value, SCOPES)]}
    try:
        _write_private(path, json.dumps(document, indent=2) + "\n", exclusive=True)
    except FileExistsError:  # another `up` won the race: its token stands
        admin.unlink(missing_ok=True)
        return TokenSetup(path, admin, created=False)
    return TokenSetup(path, admin, created=True)


def add_token(path: Path, name: str, scopes: tuple[str, ...]) -> str:
    """Add a token to the tokens file and return its value (shown once, never stored)."""
    unknown = set(scopes) - set(SCOPES)
    if unknown or not scopes:
        raise ValueError(f"scopes must be some of {', '.join(SCOPES)}")
    document = {"tokens": []} if not path.exists() else json.loads(path.read_text("utf-8"))
    if path.exists():
        check_private(path)
    if any(t["name"] == name for t in document["tokens"]):
        raise ValueError(f"a token named {name!r} exists already")
    value = new_token_value()
    document["tokens"].append(_entry(name, value, scopes))
    _write_private(path, json.dumps(document, indent=2) + "\n", exclusive=False)
    return value


def read_token_value(path: Path) -> str:
    """A token's plaintext from a token file (the CLI's credentials)."""
    value = path.read_text(encoding="utf-8").strip()
    if not value:
        raise TokenFileError(f"token file {path} is empty")
    return value
