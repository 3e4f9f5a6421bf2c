"""Check each history chain link by link and name the first broken link of each; with the
log's checkpoints (``anchors``), also that each chain still holds the newest head the log
vouches for."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from projections.chain import ChainId, chain_label, chain_of, link
from services.audit.anchors import Anchor, Anchors
from services.audit.entries import Entry, Filter, stream

if TYPE_CHECKING:
    from projections.store import Connection


@dataclass(frozen=True, slots=True)
class BrokenLink:
    chain: ChainId
    entry: Entry
    problem: str

    def describe(self) -> str:
        e = self.entry
        who = self.chain[0] if self.chain[0] is not None else f"(unkeyed, partition {e.partition})"
        return (
            f"{who}: history entry {e.id} ({e.topic}[{e.partition}]@{e.offset}, "
            f"{e.message_type or 'dead letter'}): {self.problem}"
        )


@dataclass(frozen=True, slots=True)
class CutChain:
    """A chain that does not hold the head a checkpoint on the log names for it."""

    chain: ChainId  # as the checkpoint names it (``chain_label``)
    partition: int  # the input partition whose checkpoint it is
    anchor: Anchor
    newest: Entry | None  # the chain's newest entry in the history, if it has any

    def describe(self) -> str:
        who = (
            self.chain[0] if self.chain[0] is not None else f"(unkeyed, partition {self.partition})"
        )
        e = self.newest
        now = (
            f"its newest entry is history entry {e.id} ({e.topic}[{e.partition}]@{e.offset})"
            if e is not None
            else "the history holds no entry of it"
        )
        return (
            f"{who}: the checkpoint {self.anchor.at} on the log names {self.anchor.head.hex()} "
            f"as this chain's head, which no entry of it holds ({now}): its newest entries were "
            "removed, or its hashes rewritten"
        )


@dataclass(slots=True)
class ChainReport:
    checked: int = 0
    chains: int = 0
    unchained: int = 0  # entries written before the chain existed (leading, no hashes)
    broken: list[BrokenLink] = field(default_factory=list)
    anchored: int | None = None  # chains checked against the log's checkpoints (None: not read)
    cut: list[CutChain] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)  # checkpoint records that did not parse

    @property
    def intact(self) -> bool:
        return not self.broken and not self.cut and not self.unreadable


@dataclass(slots=True)
class _Walk:
    label: ChainId  # the chain as the checkpoints name it
    head: bytes | None = None
    started: bool = False  # a hashed entry was seen
    broken: bool = False
    newest: Entry | None = None


async def chain_start(conn: Connection) -> int:
    """The first history id written with hashes (migration 0070); 0 if the record of it is
    gone, so that every entry must then carry them."""
    first = await conn.fetchval("SELECT first_id FROM history_chain_start")
    return int(first) if first is not None else 0


async def check_chains(
    conn: Connection, key: str | None = None, anchors: Anchors | None = None
) -> ChainReport:
    """Walk every chain (or one sandbox's) in order; recompute each link from the content.
    With ``anchors`` (read from the log before this is called), every head they name must be
    an entry of its chain."""
    report = ChainReport()
    first_id = await chain_start(conn)
    walks: dict[ChainId, _Walk] = {}
    wanted = _wanted(anchors, key)
    async for chunk in stream(conn, Filter(key=key)):
        for entry in chunk:
            report.checked += 1
            chain = chain_of(entry.key, entry.partition)
            walk = walks.get(chain)
            if walk is None:
                walk = walks[chain] = _Walk(chain_label(chain))
            walk.newest = entry
            if walk.broken:
                continue  # the first broken link of a chain is the one that matters
            problem = _problem(walk, entry, first_id)
            if problem == "unchained":
                report.unchained += 1
            elif problem is not None:
                walk.broken = True
                report.broken.append(BrokenLink(chain, entry, problem))
            else:
                walk.started = True
                walk.head = entry.entry_hash
                heads = wanted.get(walk.label)
                if heads and entry.entry_hash is not None:
                    heads.pop(entry.entry_hash, None)
    report.chains = len(walks)
    if anchors is not None:
        report.anchored = len(wanted)
        report.unreadable = list(anchors.unreadable)
        by_label = {w.label: w for w in walks.values()}
        for label, heads in wanted.items():
            walk = by_label.get(label)
            if walk is not None and walk.broken:
                continue  # named already, at its first broken link
            for partition, anchor in heads.values():
                newest = walk.newest if walk is not None else None
                report.cut.append(CutChain(label, partition, anchor, newest))
    return report


def _wanted(
    anchors: Anchors | None, key: str | None
) -> dict[ChainId, dict[bytes, tuple[int, Anchor]]]:
    """The heads to find, by chain label: hash -> (input partition, its anchor)."""
    if anchors is None:
        return {}
    only = chain_label((key, None)) if key is not None else None
    return {
        label: {a.head: (p, a) for p, a in per.items()}
        for label, per in anchors.heads.items()
        if only is None or label == only
    }


def _problem(walk: _Walk, entry: Entry, first_id: int) -> str | None:
    if entry.entry_hash is None:
        if walk.started:
            return "the entry carries no hash after chained entries (hash removed)"
        if entry.id >= first_id:
            return (
                f"the entry carries no hash, yet it was written after the chain began "
                f"(history id {first_id} on): its hash was removed"
            )
        return "unchained"
    if entry.prev_hash != walk.head:
        return (
            "its previous-hash does not match the entry before it in the chain "
            "(an entry before it was removed, inserted or reordered, or this one was moved)"
        )
    if link(entry.prev_hash, entry.content()) != entry.entry_hash:
        return "its content does not match its hash (the entry was altered)"
    return None
