"""Check each history chain link by link and name the first broken link of each."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from projections.chain import ChainId, chain_of, link
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


@dataclass(slots=True)
class ChainReport:
    checked: int = 0
    chains: int = 0
    unchained: int = 0  # entries written before the chain existed (leading, no hashes)
    broken: list[BrokenLink] = field(default_factory=list)

    @property
    def intact(self) -> bool:
        return not self.broken


@dataclass(slots=True)
class _Walk:
    head: bytes | None = None
    started: bool = False  # a hashed entry was seen
    broken: bool = False


async def check_chains(conn: Connection, key: str | None = None) -> ChainReport:
    """Walk every chain (or one sandbox's) in order; recompute each link from the content."""
    report = ChainReport()
    walks: dict[ChainId, _Walk] = {}
    async for chunk in stream(conn, Filter(key=key)):
        for entry in chunk:
            report.checked += 1
            chain = chain_of(entry.key, entry.partition)
            walk = walks.setdefault(chain, _Walk())
            if walk.broken:
                continue  # the first broken link of a chain is the one that matters
            problem = _problem(walk, entry)
            if problem == "unchained":
                report.unchained += 1
            elif problem is not None:
                walk.broken = True
                report.broken.append(BrokenLink(chain, entry, problem))
            else:
                walk.started = True
                walk.head = entry.entry_hash
    report.chains = len(walks)
    return report


def _problem(walk: _Walk, entry: Entry) -> str | None:
    if entry.entry_hash is None:
        if not walk.started:
            return "unchained"
        return "the entry carries no hash after chained entries (hash removed)"
    if entry.prev_hash != walk.head:
        return (
            "its previous-hash does not match the entry before it in the chain "
            "(an entry before it was removed, inserted or reordered, or this one was moved)"
        )
    if link(entry.prev_hash, entry.content()) != entry.entry_hash:
        return "its content does not match its hash (the entry was altered)"
    return None
