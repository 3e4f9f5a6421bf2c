"""Bearer tokens with scopes: the HTTP API's, the OpenShell gRPC API's and any role's
operational endpoints (``authorize_header`` is the one check they all make).

The tokens file (``settings.tokens_file``, JSON, mode 0600) stores, per token, only its name,
its scopes and the sha256 of its value::

    {"tokens": [{"name": "admin", "sha256": "<hex>", "scopes": ["sandbox:read", ...],
                 "created_at": "2026-01-01T00:00:00+00:00",
                 "expires_at": "2026-02-01T00:00:00+00:00", "revoked_at": null}]}

A token may also carry ``"max_stop_timeout_seconds": N``: the longest grace period its
creates may ask for (default: ``settings.api_max_stop_timeout_seconds``). ``expires_at`` and
``revoked_at`` (optional) end a token; a running store re-reads the file when it changes, so
``sandstream token revoke`` takes effect at the next request, without a restart; while the
file is not valid it refuses every token (it fails closed). Edits replace the file atomically.

The plaintext exists once: ``ensure_tokens`` (called by ``sandstream up``) writes the admin
token to ``settings.admin_token_file`` (mode 0600) when it creates the tokens file, and
``add_token`` returns a new token's value to its caller. A request's token is hashed and
compared with every stored hash with ``hmac.compare_digest``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import stat
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final, TypeVar

from services.common import secret_files
from services.common.settings import Settings

READ: Final = "sandbox:read"
WRITE: Final = "sandbox:write"
# Exec (OpenShell's ExecSandbox) runs a command inside the agent's sandbox, which sees all the
# agent sees: its attached providers' values included. So it is a scope of its own, never
# implied by sandbox:write (a tokens file made before it existed gives it to no token).
EXEC: Final = "sandbox:exec"
# Files inside a sandbox: reading shows what the agent's files hold (its secrets included:
# /run/secrets/sandstream/ holds its providers' values); writing changes what the agent runs.
# Neither is implied by sandbox:read/write (a tokens file made before them gives them to none).
FILES_READ: Final = "files:read"
FILES_WRITE: Final = "files:write"
AUDIT: Final = "audit:read"  # the audit routes: whole histories, exports, chain checks
# Providers: reading shows names, key names and fingerprints (never values); writing sets
# values, deletes providers, and is needed (with sandbox:write) to attach or detach one.
PROVIDER_READ: Final = "provider:read"
PROVIDER_WRITE: Final = "provider:write"
# Operations: /metrics and the checks of /readyz (addresses, lag, errors of the parts).
OPS: Final = "ops:read"
SCOPES: Final = (
    READ, WRITE, EXEC, FILES_READ, FILES_WRITE, AUDIT, PROVIDER_READ, PROVIDER_WRITE, OPS
)  # fmt: skip
TOKEN_PREFIX: Final = "sst_"

log = logging.getLogger("sandstream.tokens")
T = TypeVar("T")


class TokenFileError(RuntimeError):
    """The tokens file is missing, unreadable, malformed or too open."""


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request acts for: the token's name (the ``actor`` of its commands) and scopes."""

    name: str
    scopes: frozenset[str]
    max_stop_timeout: int | None = None  # this token's cap on stop_timeout_seconds, if any


def stop_timeout_refusal(principal: Principal, default_cap: int, asked: int | None) -> str | None:
    """Why ``principal`` may not create a sandbox with a grace period of ``asked`` seconds (its
    own cap, else ``default_cap``: settings.api_max_stop_timeout_seconds), or None. Every door
    asks it of the spec a create resolved to, a template's included; the HTTP API also of a
    template it writes and of a warm pool's template (the controller creates the members)."""
    cap = default_cap if principal.max_stop_timeout is None else principal.max_stop_timeout
    if asked is None or asked <= cap:
        return None
    return f"at most {cap} seconds for token {principal.name!r} (asked for {asked})"


@dataclass(frozen=True, slots=True)
class Denied:
    """Why a request is refused: 401 (no valid token) or 403 (a valid one without the scope)."""

    status: int
    message: str


@dataclass(frozen=True, slots=True)
class StoredToken:
    name: str
    sha256: str
    scopes: frozenset[str]
    created_at: str | None = None
    max_stop_timeout: int | None = None
    expires_at: datetime | None = None
    revoked_at: datetime | None = None

    def ended(self, now: datetime) -> str | None:
        """Why this token no longer authenticates, or None while it does."""
        if self.revoked_at is not None:
            return f"token {self.name!r} was revoked at {_shown(self.revoked_at)}"
        if self.expires_at is not None and now >= self.expires_at:
            return f"token {self.name!r} expired at {_shown(self.expires_at)}"
        return None


def hash_token(value: str) -> str:
    return hashlib.sha256(value.encode("utf-8")).hexdigest()


def new_token_value() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


# The answer to every token while the tokens file is not valid: what is wrong with the file
# (its path, its mode, the parser's message) goes to the log, not to whoever sent a token.
TOKENS_UNAVAILABLE: Final = (
    "no token can be checked now: the server's tokens file is not valid (its log says why); "
    "every token is refused until it is"
)


class TokenStore:
    """The known tokens; ``from_file`` stores re-read the file when it changes.

    A ``from_file`` store fails closed: while the file is missing, unreadable, readable by
    others or not a valid tokens document, it refuses every token (``problem`` says why) and
    logs that once per change of the file; it accepts them again once the file is valid.
    """

    def __init__(self, tokens: list[StoredToken], path: Path | None = None) -> None:
        self._tokens = list(tokens)
        self._path = path
        self._stamp = _stamp(path) if path is not None else None
        self._problem: str | None = None

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

    @property
    def problem(self) -> str | None:
        """Why every token is refused now (what is wrong with the tokens file), or None."""
        self._refresh()
        return self._problem

    def _refresh(self) -> None:
        if self._path is None:
            return
        stamp = _stamp(self._path)  # before the read: a change during it is read again
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            tokens = read_tokens(self._path)
        except TokenFileError as exc:
            self._tokens, self._problem = [], str(exc)
            log.error("refusing every token: %s", exc)
            return
        if self._problem is not None:
            log.warning("tokens file %s is valid again: accepting its tokens", self._path)
        self._tokens, self._problem = tokens, None

    def lookup(self, value: str) -> StoredToken | None:
        """The stored token with this value (revoked or expired ones included)."""
        self._refresh()
        digest = hash_token(value)
        found: StoredToken | None = None
        for token in self._tokens:  # no early exit: the time taken does not depend on a match
            if hmac.compare_digest(digest, token.sha256) and found is None:
                found = token
        return found

    def authorize(self, value: str, scope: str, now: datetime | None = None) -> Principal | Denied:
        """The principal of a token value if it is live and holds ``scope``; else why not."""
        found = self.lookup(value)
        if self._problem is not None:
            return Denied(401, TOKENS_UNAVAILABLE)
        if found is None:
            return Denied(401, "invalid bearer token")
        ended = found.ended(now or datetime.now(UTC))
        if ended is not None:
            return Denied(401, ended)
        if scope not in found.scopes:
            return Denied(403, f"token {found.name!r} lacks the scope {scope}")
        return Principal(found.name, found.scopes, found.max_stop_timeout)


@dataclass(frozen=True, slots=True)
class Grant:
    """A check made when a long stream opened, kept to be made again: a watch asks ``lapsed``
    at every wake, so a token revoked, expired or stripped of the scope (or a tokens file no
    longer valid) ends the stream at its next wake rather than when it closes. ``value`` None:
    a call that sent no token and was let in without one (nothing to revoke)."""

    tokens: TokenStore
    value: str | None
    scope: str

    def lapsed(self) -> Denied | None:
        """Why the stream's token no longer holds its scope, or None while it does."""
        if self.value is None:
            return None
        checked = self.tokens.authorize(self.value, self.scope)
        return checked if isinstance(checked, Denied) else None


RECHECK: Final = 1.0  # seconds at most between two checks of an open stream's token


async def while_granted(
    items: AsyncIterator[T], grant: Grant, every: float
) -> AsyncGenerator[T | Denied, None]:
    """``items`` for as long as ``grant`` holds: it is checked before each item and every
    ``every`` seconds while none comes; once it lapses, why (a Denied) is the last item.
    However it ends, ``items`` is left and closed before this closes (an exec's command is
    ended, a download's runtime stream let go), not left to the garbage collector."""
    source = aiter(items)
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(source))
            done, _ = await asyncio.wait({pending}, timeout=every)
            if (lapsed := grant.lapsed()) is not None:
                yield lapsed
                return
            if not done:
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield item
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        closing = getattr(source, "aclose", None)
        if closing is not None:
            await closing()


def grant_of(tokens: TokenStore, headers: Sequence[str], scope: str) -> Grant:
    """The grant of a request that ``authorize_header`` let in (its one bearer token)."""
    header = the_header(headers)
    value = bearer_of(header) if isinstance(header, str) else None
    return Grant(tokens, value or "", scope)  # "" never holds: fail closed


MISSING_TOKEN: Final = "missing bearer token (Authorization: Bearer <token>)"


# Sent twice, one reader might take the first and another the last: which was meant is no guess.
TWO_TOKENS: Final = "more than one Authorization header (or authorization metadata entry)"


def bearer_of(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value, if it is one."""
    scheme, _, value = (header or "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def the_header(headers: Sequence[str]) -> str | Denied | None:
    """A request's one Authorization header (every value it sent, in order); None without one,
    Denied 401 with several."""
    if len(headers) > 1:
        return Denied(401, TWO_TOKENS)
    return headers[0] if headers else None


def authorize_header(tokens: TokenStore, headers: Sequence[str], scope: str) -> Principal | Denied:
    """The check every HTTP endpoint behind a scope makes, given its Authorization headers."""
    header = the_header(headers)
    if isinstance(header, Denied):
        return header
    value = bearer_of(header)
    if value is None:
        return Denied(401, MISSING_TOKEN)
    return tokens.authorize(value, scope)


def sees_operations(tokens: TokenStore | None, headers: Sequence[str]) -> bool | Denied:
    """Whether a caller may see operational detail (the checks behind a readiness answer):
    False without a token or without the ops:read scope; a token that is sent must be valid
    (Denied 401 otherwise). Probes without a token still get ready or not."""
    header = the_header(headers)
    if isinstance(header, Denied):
        return header
    value = bearer_of(header)
    if value is None or tokens is None:
        return False if value is None else Denied(401, "no tokens file: no token is valid")
    checked = tokens.authorize(value, OPS)
    if isinstance(checked, Denied):
        return checked if checked.status == 401 else False
    return True


def _stamp(path: Path) -> tuple[int, int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    # The inode too: a rewrite (os.replace) of the same size within the clock's resolution.
    return st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size


def _shown(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat(timespec="seconds")


def _moment(entry: dict[str, Any], key: str, path: Path) -> datetime | None:
    raw = entry.get(key)
    if raw is None:
        return None
    moment = datetime.fromisoformat(str(raw))
    if moment.tzinfo is None:
        raise TokenFileError(f"{path}: token {entry['name']!r}: {key} needs a UTC offset")
    return moment


def check_private(path: Path) -> None:
    try:
        secret_files.check_private(path)
    except ValueError as exc:
        raise TokenFileError(str(exc)) from None


def read_tokens(path: Path) -> list[StoredToken]:
    try:
        if not stat.S_ISREG(path.stat().st_mode):  # a FIFO would block the reader forever
            raise TokenFileError(f"tokens file {path} is not a regular file")
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
                StoredToken(
                    str(entry["name"]),
                    digest,
                    scopes,
                    entry.get("created_at"),
                    cap,
                    _moment(entry, "expires_at", path),
                    _moment(entry, "revoked_at", path),
                )
            )
        return tokens
    except FileNotFoundError:
        raise TokenFileError(
            f"tokens file {path} does not exist (`sandstream up` creates it)"
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TokenFileError(f"cannot read tokens file {path}: {exc}") from exc


def _entry(
    name: str, value: str, scopes: tuple[str, ...], expires_at: datetime | None = None
) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": name,
        "sha256": hash_token(value),
        "scopes": sorted(scopes),
        "created_at": _shown(datetime.now(UTC)),
    }
    if expires_at is not None:
        entry["expires_at"] = _shown(expires_at)
    return entry


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
    if not secret_files.create_secret_file(admin, value):
        raise FileExistsError(f"{admin} appeared while it was being created")
    document = {"tokens": [_entry("admin", value, SCOPES)]}
    if not secret_files.create_secret_file(path, json.dumps(document, indent=2)):
        admin.unlink(missing_ok=True)  # another `up` won the race: its token stands
        return TokenSetup(path, admin, created=False)
    return TokenSetup(path, admin, created=True)


@contextlib.contextmanager
def _editing(path: Path) -> Iterator[dict[str, Any]]:
    """The tokens file's document, written back (atomically, mode 0600) when the block ends;
    edits are serialised by a lock file beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = os.open(path.with_name(f".{path.name}.lock"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            check_private(path)
            read_tokens(path)  # refuse to edit a file the API could not read
            document: dict[str, Any] = json.loads(path.read_text("utf-8"))
        else:
            document = {"tokens": []}
        yield document
        secret_files.replace_secret_file(path, json.dumps(document, indent=2) + "\n")
    finally:
        os.close(lock)


def _live(entry: dict[str, Any], now: datetime) -> bool:
    expires = entry.get("expires_at")
    return entry.get("revoked_at") is None and (
        expires is None or datetime.fromisoformat(expires) > now
    )


def add_token(
    path: Path, name: str, scopes: tuple[str, ...], expires_at: datetime | None = None
) -> str:
    """Add a token to the tokens file and return its value (shown once, never stored).

    A name may be reused once every earlier token of that name is revoked or expired: it is
    the ``actor`` of the commands, so two live tokens never share it."""
    unknown = set(scopes) - set(SCOPES)
    if unknown or not scopes:
        raise ValueError(f"scopes must be some of {', '.join(SCOPES)}")
    now = datetime.now(UTC)
    if expires_at is not None and expires_at <= now:
        raise ValueError(f"expiry {_shown(expires_at)} is not in the future")
    with _editing(path) as document:
        if any(t["name"] == name and _live(t, now) for t in document["tokens"]):
            raise ValueError(f"a token named {name!r} exists already (revoke it first)")
        value = new_token_value()
        document["tokens"].append(_entry(name, value, scopes, expires_at))
    return value


def revoke_token(path: Path, name: str) -> int:
    """Mark every unrevoked token of this name revoked; how many were. ValueError if none."""
    now = _shown(datetime.now(UTC))
    with _editing(path) as document:
        found = [t for t in document["tokens"] if t["name"] == name and not t.get("revoked_at")]
        if not found:
            raise ValueError(f"no unrevoked token named {name!r} in {path}")
        for entry in found:
            entry["revoked_at"] = now
    return len(found)


_DURATION = re.compile(r"^(\d+)([smhdw])$")
_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_expiry(text: str, now: datetime | None = None) -> datetime:
    """``30d``/``12h``/``90m``/``3600s``/``2w`` from now, a date (its first instant, UTC) or
    an ISO 8601 time (UTC when it has no offset)."""
    now = now or datetime.now(UTC)
    text = text.strip()
    if match := _DURATION.match(text):
        return now + timedelta(seconds=int(match[1]) * _UNITS[match[2]])
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"--expires {text!r}: expected a duration (30d, 12h, 90m, 3600s, 2w), a date "
            "(2027-01-31) or a time (2027-01-31T12:00:00+00:00)"
        ) from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def read_token_value(path: Path) -> str:
    """A token's plaintext from a token file (the CLI's credentials)."""
    value = path.read_text(encoding="utf-8").strip()
    if not value:
        raise TokenFileError(f"token file {path} is empty")
    return value
