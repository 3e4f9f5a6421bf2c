"""The processor's garbage collector settings: applied, and cyclic garbage is still freed."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import gc, weakref
from services.processor.collector import THRESHOLDS, tune_collector
tune_collector()
assert gc.get_threshold() == THRESHOLDS, gc.get_threshold()
assert gc.get_freeze_count() > 1000, gc.get_freeze_count()  # the imported modules' objects
class Node:
    pass
cycle = Node(); cycle.self = cycle
alive = weakref.ref(cycle)
del cycle
kept = [[] for _ in range(3 * THRESHOLDS[0])]  # allocations only: no explicit collect
assert alive() is None, "a cycle outlived a young collection"
print("ok")
"""


def test_tuned_collector_is_applied_and_still_frees_cycles() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.stdout.strip() == "ok", done.stderr
