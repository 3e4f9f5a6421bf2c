"""A bounded memory of ids: the newest ``size`` kept, the oldest forgotten first. For readers
that must recognise what a redelivery sends again (an id forgotten only loses the skip)."""

from __future__ import annotations

from collections import OrderedDict


class RecentIds:
    def __init__(self, size: int) -> None:
        self.size = size
        self._ids: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, id_: object) -> bool:
        return id_ in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, id_: str) -> None:
        self._ids[id_] = None
        self._ids.move_to_end(id_)
        if len(self._ids) > self.size:
            self._ids.popitem(last=False)

    def seen(self, id_: str) -> bool:
        """Whether ``id_`` was kept already; kept from now on either way."""
        known = id_ in self._ids
        self.add(id_)
        return known
