"""The processor's collector thresholds: the young threshold is raised, never lowered, and the
older generations keep their ratios."""

from __future__ import annotations

import gc
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
