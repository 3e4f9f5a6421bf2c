"""The processor's collector thresholds: the young threshold is raised, never lowered, and the
older generations keep their ratios."""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Iterator

import pytest

from services.processor.gc_thresholds import YOUNG_THRESHOLD, collect_less_often


@pytest.fixture
def thresholds() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


@pytest.mark.usefixtures("thresholds")
def test_the_young_threshold_is_raised_and_the_older_ratios_kept() -> None:
    gc.set_threshold(700, 7, 9)
    collect_less_often()
    assert gc.get_threshold() == (YOUNG_THRESHOLD, 7, 9)


@pytest.mark.usefixtures("thresholds")
def test_a_higher_young_threshold_is_left_alone() -> None:
    gc.set_threshold(YOUNG_THRESHOLD * 2, 10, 10)
    collect_less_often()
    assert gc.get_threshold() == (YOUNG_THRESHOLD * 2, 10, 10)


CYCLE_CHECK = """
import gc, weakref
from services.processor.gc_thresholds import YOUNG_THRESHOLD, collect_less_often
collect_less_often()
class Node:
    pass
cycle = Node(); cycle.self = cycle
alive = weakref.ref(cycle)
del cycle
kept = [[] for _ in range(3 * YOUNG_THRESHOLD)]  # allocations only: no explicit collect
assert alive() is None, "a cycle outlived a young collection"
print("ok")
"""


def test_cyclic_garbage_is_still_freed_by_allocations_alone() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CYCLE_CHECK], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.stdout.strip() == "ok", done.stderr
