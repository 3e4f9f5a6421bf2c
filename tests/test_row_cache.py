"""The processor's cache of the rows it wrote (pure)."""

from __future__ import annotations

import factories as f

from events.common import Cause
from projections.lifecycle import Sandbox, decide
from services.processor.row_cache import RowCache


def row(key: str) -> Sandbox:
    cause = Cause(topic="c", partition=0, offset=0, message_type="CreateSandbox")
    state = decide(None, f.create(key, command_id=f"c-{key}"), cause).state
    assert state is not None
    return state


AT = {("c", 0): 5, ("o", 0): 3, ("c", 1): 7, ("o", 1): 0}


def test_rows_are_found_by_partition_and_key_with_absence_remembered() -> None:
    cache = RowCache(capacity=10)
    cache.remember([(0, "a", row("a")), (1, "b", None)], AT)
    assert cache.lookup([(0, "a"), (1, "b"), (0, "b"), (1, "z")]) == {"a": row("a"), "b": None}
    assert len(cache) == 2


def test_a_partition_whose_offsets_moved_is_forgotten_the_others_kept() -> None:
    cache = RowCache(capacity=10)
    cache.remember([(0, "a", row("a")), (1, "b", row("b"))], AT)
    assert cache.check(AT) == set()
    assert cache.check({**AT, ("o", 1): 1}) == {1}
    assert cache.lookup([(0, "a"), (1, "b")]) == {"a": row("a")}
    # Forgotten until written again, even if the offsets come back to what they were.
    assert cache.check(AT) == set()
    assert cache.lookup([(1, "b")]) == {}


def test_never_cached_partitions_are_not_reported() -> None:
    cache = RowCache(capacity=10)
    assert cache.check(AT) == set()


def test_capacity_evicts_the_oldest_rows_and_zero_keeps_none() -> None:
    cache = RowCache(capacity=2)
    cache.remember([(0, "a", None), (0, "b", None)], AT)
    cache.remember([(0, "a", None)], AT)  # a is now newer than b
    cache.remember([(0, "c", None)], AT)
    assert set(cache.lookup([(0, k) for k in "abc"])) == {"a", "c"}
    assert len(cache) == 2
    none = RowCache(capacity=0)
    none.remember([(0, "a", None)], AT)
    assert none.lookup([(0, "a")]) == {} and len(none) == 0


def test_clear_forgets_everything() -> None:
    cache = RowCache(capacity=10)
    cache.remember([(0, "a", None)], AT)
    cache.clear()
    assert cache.lookup([(0, "a")]) == {} and len(cache) == 0
    assert cache.check(AT) == set()
