"""The cyclic garbage collector's thresholds for the processor's process.

A poll of thousands of records allocates several container objects per record (messages,
events, rows, history entries), and CPython's default first threshold (700 allocations) ran
a young collection every few records and a full one, walking every live object (the row
cache, the loaded modules), every few hundred: 54-58 µs of CPU per input, a third of the
processor's, in docs/benchmarks.md. Almost everything a poll allocates is freed by reference
counting; the collector is only needed for cycles, which are rare on this path, so it runs a
seventieth as often. The garbage this can hold back is bounded by the threshold (tens of
thousands of objects), not by the input.
"""

from __future__ import annotations

import gc
from typing import Final

YOUNG_THRESHOLD: Final = 50_000  # container allocations between young collections (default 700)


def collect_less_often() -> None:
    """Raise the first threshold (the older generations keep their default ratios)."""
    young, middle, old = gc.get_threshold()
    if young < YOUNG_THRESHOLD:
        gc.set_threshold(YOUNG_THRESHOLD, middle, old)
