"""Tar archives as byte streams, never whole in memory: the members of a stream read as its
chunks arrive (:class:`TarScanner`), a one-member archive written around a stream of bytes
(:func:`one_member`), and the rules an uploaded archive's members must keep (:func:`check`
for each member alone, :class:`ArchiveRules` for the links the members before it made).

Headers are parsed with the standard library's ``tarfile.TarInfo.frombuf``; pax extended
headers and GNU long names are applied to the member they precede. A pax or long-name header
larger than MAX_META is refused (a stream cannot make the reader buffer without bound).
"""

from __future__ import annotations

import posixpath
import tarfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Final, Literal

BLOCK: Final = tarfile.BLOCKSIZE
END: Final = bytes(2 * BLOCK)  # the end-of-archive marker: two zero blocks
MAX_META: Final = 1024 * 1024  # the most bytes a pax or long-name header may hold
MAX_LINK_PATHS: Final = 250_000  # the most paths an archive's symlinks may reach (each is kept)
_META_TYPES: Final = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME,
                      tarfile.GNUTYPE_LONGLINK, tarfile.SOLARIS_XHDTYPE)  # fmt: skip

MemberType = Literal["file", "dir", "symlink", "hardlink", "other"]


class TarError(ValueError):
    """The stream is not a valid tar archive, or a member breaks the upload rules."""


@dataclass(frozen=True, slots=True)
class Member:
    name: str
    type: MemberType
    size: int  # bytes of data that follow (regular files)
    linkname: str
    mode: int
    mtime: float


@dataclass(frozen=True, slots=True)
class Data:
    """A piece of the current member's data."""

    data: bytes


def _kind(info: tarfile.TarInfo) -> MemberType:
    if info.isreg():
        return "file"
    if info.isdir():
        return "dir"
    if info.issym():
        return "symlink"
    if info.islnk():
        return "hardlink"
    return "other"


def _pax(data: bytes) -> dict[str, str]:
    """The records of a pax header (``"<len> <key>=<value>\\n"`` each)."""
    records: dict[str, str] = {}
    at = 0
    while at < len(data) and data[at:at + 1] != b"\0":  # fmt: skip
        length_text, space, _ = data[at:at + 24].partition(b" ")  # fmt: skip
        if not space or not length_text.isdigit() or int(length_text) <= 0:
            raise TarError("tar: a malformed pax header")
        record = data[at:at + int(length_text)]  # fmt: skip
        key, eq, value = record[len(length_text) + 1 : -1].partition(b"=")
        if not eq:
            raise TarError("tar: a malformed pax record")
        records[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        at += int(length_text)
    return records


class TarScanner:
    """The members of a tar stream and their data, as the chunks arrive: ``feed`` returns the
    events the chunk completes (a :class:`Member`, then its data in :class:`Data` pieces);
    ``ended`` tells whether the end-of-archive marker (or a clean end at a header) was seen."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._left = 0  # data bytes of the current member still to come
        self._pad = 0  # padding after them
        self._meta: tuple[bytes, int] | None = None  # a pax/long-name header's type and size
        self._pending: dict[str, str] = {}  # pax / long-name values for the next member
        self._global: dict[str, str] = {}
        self.ended = False
        self.members = 0

    def feed(self, chunk: bytes) -> list[Member | Data]:
        events: list[Member | Data] = []
        if self.ended:
            return events
        self._buffer += chunk
        while not self.ended:
            if self._left and self._meta is None:
                take = min(self._left, len(self._buffer))
                if not take:
                    break
                events.append(Data(bytes(self._buffer[:take])))
                del self._buffer[:take]
                self._left -= take
                continue
            if self._meta is not None:
                if len(self._buffer) < self._left + self._pad:
                    break
                self._apply_meta(bytes(self._buffer[: self._left]))
                del self._buffer[: self._left + self._pad]
                self._left = self._pad = 0
                continue
            if self._pad:
                take = min(self._pad, len(self._buffer))
                if not take:
                    break
                del self._buffer[:take]
                self._pad -= take
                continue
            if len(self._buffer) < BLOCK:
                break
            block = bytes(self._buffer[:BLOCK])
            del self._buffer[:BLOCK]
            member = self._header(block)
            if member is not None:
                events.append(member)
        return events

    def _header(self, block: bytes) -> Member | None:
        if block == bytes(BLOCK):
            self.ended = True
            return None
        try:
            info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
        except tarfile.HeaderError as exc:
            raise TarError(f"tar: a bad header block ({exc})") from None
        if info.type in _META_TYPES:
            if info.size > MAX_META:
                raise TarError(f"tar: a pax or long-name header above {MAX_META} bytes")
            self._meta = (info.type, info.size)
            self._left, self._pad = info.size, -info.size % BLOCK
            return None
        values = {**self._global, **self._pending}
        self._pending = {}
        size = int(values["size"]) if "size" in values else info.size
        has_data = info.isreg() or info.type not in tarfile.SUPPORTED_TYPES
        data_size = size if has_data else 0
        self._left, self._pad = data_size, -data_size % BLOCK
        self.members += 1
        return Member(
            name=values.get("path", info.name),
            type=_kind(info),
            size=data_size,
            linkname=values.get("linkpath", info.linkname),
            mode=info.mode,
            mtime=float(values.get("mtime", info.mtime)),
        )

    def _apply_meta(self, data: bytes) -> None:
        assert self._meta is not None
        kind, _ = self._meta
        self._meta = None
        if kind == tarfile.GNUTYPE_LONGNAME:
            self._pending["path"] = data.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        elif kind == tarfile.GNUTYPE_LONGLINK:
            self._pending["linkpath"] = data.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        elif kind == tarfile.XGLTYPE:
            self._global.update(_pax(data))
        else:
            self._pending.update(_pax(data))


def one_member(
    name: str, size: int, chunks: AsyncIterator[bytes], *, mode: int = 0o644
) -> AsyncIterator[bytes]:
    """A tar archive of one regular file ``name`` whose ``size`` bytes are ``chunks``: the
    header, the bytes as they come, the padding and the end marker. Fewer or more bytes than
    ``size`` raise TarError (the archive would be wrong)."""

    async def archive() -> AsyncIterator[bytes]:
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = size, mode, time.time()
        yield info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
        sent = 0
        async for chunk in chunks:
            sent += len(chunk)
            if sent > size:
                raise TarError(f"the body is longer than its Content-Length ({size})")
            yield chunk
        if sent != size:
            raise TarError(f"the body ended after {sent} of its {size} bytes")
        yield bytes(-size % BLOCK) + END

    return archive()


def _parts(path: str) -> list[str]:
    return [part for part in path.split("/") if part not in ("", ".")]


def check(member: Member) -> None:
    """The rules an uploaded archive's members keep (TarError naming the member otherwise):
    relative names without ``..``; regular files, directories and symlinks, and hard links to
    another member of the archive; no devices or FIFOs; a symlink's target relative, and
    staying inside the directory the archive is extracted into, by name (:class:`ArchiveRules`
    adds the rules of the links the members before it made)."""
    name = member.name
    shown = repr(name)
    if name.startswith("/") or ".." in name.split("/"):
        raise TarError(f"tar member {shown}: absolute, or with a '..' component")
    if member.type == "other":
        raise TarError(f"tar member {shown}: not a file, directory or link (device, FIFO, ...)")
    if member.type in ("symlink", "hardlink"):
        if not _parts(name):
            raise TarError(f"tar member {shown}: a link in place of the directory itself")
        target = member.linkname
        if target.startswith("/"):
            raise TarError(f"tar member {shown}: a link to an absolute path ({target!r})")
        base = posixpath.dirname(name) if member.type == "symlink" else ""
        resolved = posixpath.normpath(posixpath.join(base, target))
        if resolved == ".." or resolved.startswith("../"):
            raise TarError(f"tar member {shown}: a link out of the directory ({target!r})")


class ArchiveRules:
    """The rules of one archive's members in order (:func:`check`, and those of the links the
    members before made). Its extractor (Podman's archive API, ``tar -x`` in a Pod) follows a
    symlink already extracted, so names alone do not tell where a member lands: ``a -> .`` then
    ``a/b -> ..`` (each inside by name) put ``a/b/x`` beside the directory, not in it.

    So no member's path, no hard link's target and no symlink's target may pass through a
    symlink of the archive (one may be a target's last component: it is followed, and its own
    target is checked against its own directory); and no symlink may be made where an earlier
    symlink's target passes, which would send that one somewhere else. Then every target is
    resolved through real directories only, and its name tells where it leads. A symlink
    already in the sandbox's directory is not known here (the sandbox's own).

    Paths are kept as a tree of numbered nodes (0 the directory extracted into): only those a
    symlink's name or target walks, at most ``max_paths`` of them."""

    def __init__(self, max_paths: int = MAX_LINK_PATHS) -> None:
        self._max_paths = max_paths
        self._nodes: dict[tuple[int, str], int] = {}  # (parent, name): the child's node
        self._links: set[int] = set()  # the symlink members so far
        self._passed: dict[int, str] = {}  # a directory a symlink's target passes: that link

    def check(self, member: Member) -> None:
        check(member)
        shown, link = repr(member.name), member.type == "symlink"
        parts, target = _parts(member.name), _parts(member.linkname)
        if link and len(self._nodes) + len(parts) + len(target) > self._max_paths:
            raise TarError(f"tar member {shown}: the archive's symlinks reach more than "
                           f"{self._max_paths} paths")  # fmt: skip
        at: list[tuple[int | None, str]] = [(0, "")]
        through = self._walk(parts, at, make=link)
        if through is not None:
            raise TarError(f"tar member {shown}: its path passes through {through!r}, a "
                           "symlink of the archive")  # fmt: skip
        if member.type == "hardlink":
            through = self._walk(target, [(0, "")])
            if through is not None:
                raise TarError(f"tar member {shown}: a hard link through {through!r}, a "
                               f"symlink of the archive ({member.linkname!r})")  # fmt: skip
        node = at[-1][0]
        if not link or node is None:
            return
        earlier = self._passed.get(node)
        if earlier is not None:
            raise TarError(f"tar member {shown}: a symlink where the target of the symlink "
                           f"{earlier!r} passes (it would lead that one elsewhere)")  # fmt: skip
        self._links.add(node)
        at.pop()  # a symlink's target starts from its directory
        through = self._walk(target, at, make=True, passer=member.name)
        if through is not None:
            raise TarError(f"tar member {shown}: a link through {through!r}, a symlink of "
                           f"the archive ({member.linkname!r})")  # fmt: skip

    def _walk(
        self,
        steps: list[str],
        at: list[tuple[int | None, str]],
        *,
        make: bool = False,
        passer: str | None = None,
    ) -> str | None:
        """Walk ``steps`` from ``at`` (the nodes and names from the top, changed in place;
        None for a path no symlink walked); the first symlink of the archive passed through
        (the last step is not), or None. ``make``: the nodes are made; ``passer``: the
        directories passed are marked as passed by that link."""
        for index, step in enumerate(steps):
            if step == "..":
                if len(at) > 1:  # '..' out of the top: check() refused it
                    at.pop()
                continue
            parent = at[-1][0]
            node = None if parent is None else self._nodes.get((parent, step))
            if node is None and parent is not None and make:
                node = self._nodes[parent, step] = len(self._nodes) + 1
            at.append((node, step))
            if index == len(steps) - 1 or node is None:
                continue
            if node in self._links:
                return "/".join(name for _, name in at[1:])
            if passer is not None:
                self._passed.setdefault(node, passer)
        return None


def checked(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``chunks`` passed on unchanged, each member checked (:class:`ArchiveRules`) before the
    chunk that holds its header goes on; the stream must end with a whole archive."""

    async def passed() -> AsyncIterator[bytes]:
        scanner = TarScanner()
        rules = ArchiveRules()
        async for chunk in chunks:
            for event in scanner.feed(chunk):
                if isinstance(event, Member):
                    rules.check(event)
            yield chunk
        if not scanner.ended:
            raise TarError("tar: the archive ended before its end marker")

    return passed()
