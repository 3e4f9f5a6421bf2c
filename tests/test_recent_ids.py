"""``RecentIds``: the newest ids kept, the oldest forgotten first; one seen again counts as
new again."""

from __future__ import annotations

from events.recent import RecentIds


def test_the_oldest_id_is_forgotten_first_and_a_repeat_is_recognised() -> None:
    ids = RecentIds(3)
    assert [ids.seen(i) for i in ("a", "b", "c", "a")] == [False, False, False, True]
    ids.add("d")  # "a" was seen again: "b" is now the oldest
    assert ("b" in ids, "a" in ids, "c" in ids, len(ids)) == (False, True, True, 3)
