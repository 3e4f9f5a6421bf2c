"""The streaming tar reader and writer (drivers/tar_stream.py) against the standard library's
tarfile: the same members and bytes however the stream is cut into chunks."""

from __future__ import annotations

import asyncio
import io
import itertools
import tarfile
from collections.abc import AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drivers.tar_stream import (
    MAX_META,
    ArchiveRules,
    Data,
    Member,
    TarError,
    TarScanner,
    check,
    checked,
    one_member,
)

NAMES = st.text(st.characters(min_codepoint=33, max_codepoint=0x2FF, exclude_characters="/\\"),
                min_size=1, max_size=120)  # fmt: skip


def archive_of(files: list[tuple[str, bytes]], form: int) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=form) as archive:
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return out.getvalue()


def scan(data: bytes, cuts: list[int]) -> tuple[list[tuple[str, bytes]], bool]:
    scanner = TarScanner()
    found: list[tuple[str, bytearray]] = []
    edges = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    for start, end in itertools.pairwise(edges):
        for event in scanner.feed(data[start:end]):
            if isinstance(event, Member):
                found.append((event.name, bytearray()))
            else:
                found[-1][1].extend(event.data)
    return [(n, bytes(d)) for n, d in found], scanner.ended


@settings(max_examples=200, deadline=None)
@given(
    files=st.lists(st.tuples(NAMES, st.binary(max_size=3000)), min_size=1, max_size=5),
    form=st.sampled_from([tarfile.PAX_FORMAT, tarfile.GNU_FORMAT]),
    cuts=st.lists(st.integers(min_value=0, max_value=1 << 20), max_size=20),
)
def test_members_and_bytes_are_those_tarfile_wrote_however_the_stream_is_cut(
    files: list[tuple[str, bytes]], form: int, cuts: list[int]
) -> None:
    got, ended = scan(archive_of(files, form), cuts)
    assert got == files
    assert ended


def test_a_pax_header_above_the_bound_is_refused() -> None:
    info = tarfile.TarInfo("x")
    info.type = tarfile.XHDTYPE
    info.size = MAX_META + 1
    with pytest.raises(TarError, match="pax or long-name header"):
        TarScanner().feed(info.tobuf(tarfile.USTAR_FORMAT))


def test_a_bad_header_block_is_refused() -> None:
    with pytest.raises(TarError, match="bad header"):
        TarScanner().feed(b"x" * 512)


async def chunks_of(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


async def collect(stream: AsyncIterator[bytes]) -> bytes:
    return b"".join([chunk async for chunk in stream])


def test_one_member_is_a_tar_of_the_bytes_and_refuses_a_wrong_length() -> None:
    data = asyncio.run(collect(one_member("f.bin", 5, chunks_of(b"ab", b"cde"))))
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        member = archive.getmember("f.bin")
        extracted = archive.extractfile(member)
        assert extracted is not None and extracted.read() == b"abcde"
    with pytest.raises(TarError, match="ended after 2 of its 5"):
        asyncio.run(collect(one_member("f", 5, chunks_of(b"ab"))))
    with pytest.raises(TarError, match="longer than"):
        asyncio.run(collect(one_member("f", 1, chunks_of(b"ab"))))


@pytest.mark.parametrize(
    ("name", "kind", "link", "ok"),
    [
        ("a/b.txt", "file", "", True),
        ("a/./b", "file", "", True),
        ("../b", "file", "", False),
        ("a/../../b", "file", "", False),
        ("/abs", "file", "", False),
        ("a/l", "symlink", "../b", True),  # a/../b is b: inside
        ("a/l", "symlink", "../../b", False),
        ("l", "symlink", "/etc", False),
        ("h", "hardlink", "a/b.txt", True),
        ("a/h", "hardlink", "../x", False),  # hard links are relative to the archive's root
        ("dev", "other", "", False),
    ],
)
def test_the_upload_rules(name: str, kind: str, link: str, ok: bool) -> None:
    member = Member(name, kind, 0, link, 0o644, 0.0)  # type: ignore[arg-type]
    if ok:
        check(member)
    else:
        with pytest.raises(TarError, match=repr(name)):
            check(member)


LINK_ESCAPES = [
    # a symlink used as a directory by a later member (Podman follows it)
    ([("a", "symlink", "."), ("a/b", "symlink", ".."), ("a/b/x", "file", "")], "'a/b'"),
    (
        [("d/up", "symlink", ".."), ("d/up/up2", "symlink", ".."), ("d/up/up2/x", "file", "")],
        "'d/up/up2'",
    ),
    ([("sub/", "dir", ""), ("a", "symlink", "sub"), ("a/x", "file", "")], "'a/x'"),
    # a symlink's target through another symlink of the archive: ./../x
    ([("a", "symlink", "."), ("l", "symlink", "a/../x")], "'l'"),
    # a symlink made where an earlier target passes: l would become ./../y
    ([("l", "symlink", "x/../y"), ("x", "symlink", ".")], "'x'"),
    # a hard link through a symlink of the archive: to ../secret
    ([("a", "symlink", "."), ("h", "hardlink", "a/../secret")], "'h'"),
    ([("d/a", "symlink", ".."), ("h", "hardlink", "d/a/x")], "'h'"),
    ([("l", "symlink", "l/..")], "'l'"),
    ([(".", "symlink", "sub")], "'.'"),
]


def rules_over(members: list[tuple[str, str, str]]) -> None:
    rules = ArchiveRules()
    for name, kind, link in members:
        rules.check(Member(name, kind, 0, link, 0o644, 0.0))  # type: ignore[arg-type]


@pytest.mark.parametrize(("members", "named"), LINK_ESCAPES)
def test_no_member_passes_through_a_symlink_of_the_archive(
    members: list[tuple[str, str, str]], named: str
) -> None:
    """Each member is inside by name; extracted in order, each archive leads out of the
    directory (Podman's archive API and tar -x follow a symlink already extracted)."""
    with pytest.raises(TarError, match=named):
        rules_over(members)


def test_symlinks_that_only_end_at_a_symlink_or_pass_real_directories_are_kept() -> None:
    rules_over([
        ("d/", "dir", ""), ("d/f", "file", ""),
        ("bin/python3", "symlink", "../d/f"),
        ("bin/python", "symlink", "python3"),  # a chain: its last component is a link
        ("lib64", "symlink", "d"), ("lib64x", "symlink", "./d/../lib64"),
        ("node_modules/.pnpm/a@1/node_modules/a/index.js", "file", ""),
        ("node_modules/a", "symlink", ".pnpm/a@1/node_modules/a"),
        ("node_modules/.pnpm/a@1/node_modules/b", "symlink", "../../b@2/node_modules/b"),
        ("h", "hardlink", "d/f"), ("h2", "hardlink", "bin/python"),  # a link to the link
        ("bin/python", "symlink", "python3"),  # the same link again
        ("x/y", "file", ""), ("x", "symlink", "d"),  # replaces the directory x
    ])  # fmt: skip


def test_the_paths_symlinks_reach_are_bounded() -> None:
    rules = ArchiveRules(max_paths=10)
    rules.check(Member("a/b/c", "symlink", 0, "../d/e", 0o777, 0.0))
    with pytest.raises(TarError, match="'z/y': the archive's symlinks reach more than 10"):
        rules.check(Member("z/y", "symlink", 0, "../q/r/s", 0o777, 0.0))


def test_checked_refuses_a_member_through_a_symlink_of_the_archive() -> None:
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for name, target in (("a", "."), ("a/b", "..")):
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            archive.addfile(info)
        archive.addfile(tarfile.TarInfo("a/b/escaped"), io.BytesIO(b""))
    with pytest.raises(TarError, match="'a/b': its path passes through 'a'"):
        asyncio.run(collect(checked(chunks_of(data.getvalue()))))


def test_checked_passes_a_good_archive_unchanged_and_refuses_one_cut_short() -> None:
    data = archive_of([("a", b"1" * 700), ("b", b"2")], tarfile.PAX_FORMAT)
    assert asyncio.run(collect(checked(chunks_of(data[:100], data[100:])))) == data
    with pytest.raises(TarError, match="before its end marker"):
        asyncio.run(collect(checked(chunks_of(data[:1024]))))


def test_data_events_carry_no_padding() -> None:
    data = archive_of([("a", b"xyz")], tarfile.USTAR_FORMAT)
    events = TarScanner().feed(data)
    assert [e.data for e in events if isinstance(e, Data)] == [b"xyz"]
