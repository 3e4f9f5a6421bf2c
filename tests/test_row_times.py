"""A row's ``updated_at`` never goes back: a deciding input stamped by a clock behind the
control plane's (a driver's, a late observation) leaves it where it was, and the rebuild from
the log agrees."""

from __future__ import annotations

import factories as f

from events.common import Phase


def test_an_input_older_than_the_rows_last_change_does_not_move_updated_at_back() -> None:
    h = f.Harness()
    h.send(f.create(occurred_at=f.at(10)))
    h.send(f.running(occurred_at=f.at(4)))  # the driver's clock is 6 s behind
    row = h.row()
    assert row.phase == Phase.READY
    assert row.created_at == f.at(10)
    assert row.updated_at == f.at(10)
    assert h.rebuilt()[f.KEY].updated_at == h.row().updated_at


def test_a_newer_input_moves_updated_at_to_its_time() -> None:
    h = f.Harness()
    h.send(f.create(occurred_at=f.at(10)))
    h.send(f.running(occurred_at=f.at(15)))
    assert (h.row().phase, h.row().updated_at) == (Phase.READY, f.at(15))
