"""Docs that are generated from the code must match it."""

from __future__ import annotations

from projections.table_doc import DOC, embedded, render


def test_state_machine_doc_shows_the_tables_in_the_code() -> None:
    assert embedded(DOC.read_text()) == render(), (
        "docs/state-machine.md is stale: run `python -m projections.table_doc --write`"
    )
