"""The fleet page's chart of live sandboxes per phase over the last hours: stacked bars, one per
bucket of ``readmodel.phase_trend``, drawn as inline SVG on the server (no script, no fetch)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Final

from events.common import LIVE_PHASES
from services.api.readmodel import Trend
from services.audit.page import COLOURS

WIDTH, HEIGHT = 720, 180  # the drawing, in SVG units
LEFT, BOTTOM, TOP = 40, 22, 8  # room for the axes' labels
TICKS: Final = 4  # time labels under the bars, besides the first


@dataclass(frozen=True, slots=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    colour: str
    title: str  # a tooltip: the bucket's end, the phase, the count


@dataclass(frozen=True, slots=True)
class Label:
    x: float
    y: float
    text: str


@dataclass(frozen=True, slots=True)
class Chart:
    width: int
    height: int
    bars: list[Bar]
    x_labels: list[Label]
    y_labels: list[Label]
    summary: str  # the chart in words, for whoever cannot see it
    rows: list[tuple[datetime, dict[str, int]]]  # the data, for the table beside it


def draw(trend: Trend) -> Chart:
    buckets = len(trend.counts)
    top = max((sum(c.values()) for c in trend.counts), default=0)
    scale = max(top, 1)
    plot_w, plot_h = WIDTH - LEFT, HEIGHT - BOTTOM - TOP
    slot = plot_w / buckets
    bars: list[Bar] = []
    for i, counts in enumerate(trend.counts):
        base = float(HEIGHT - BOTTOM)
        end = trend.end_of(i).strftime("%H:%M")
        for phase in LIVE_PHASES:
            n = counts.get(phase, 0)
            if n == 0:
                continue
            h = n / scale * plot_h
            base -= h
            bars.append(Bar(LEFT + i * slot + 0.5, base, max(slot - 1, 1), h,
                            COLOURS[phase.value], f"{end}: {phase.value} {n}"))  # fmt: skip
    x_labels = [
        Label(LEFT + i * slot, HEIGHT - 6, trend.end_of(i).strftime("%H:%M"))
        for i in range(0, buckets, max(buckets // TICKS, 1))
    ]
    y_labels = [Label(LEFT - 6, HEIGHT - BOTTOM, "0")]
    if top:
        y_labels.append(Label(LEFT - 6, TOP + 10, str(top)))
    now = trend.now
    live = ", ".join(f"{p.value} {now[p]}" for p in LIVE_PHASES if now.get(p)) or "none"
    hours = trend.step * buckets
    summary = (
        f"Live sandboxes per phase over the last {hours.total_seconds() / 3600:g} h, "
        f"at most {top} at once; now: {live}."
    )
    rows = [
        (trend.end_of(i), {p.value: c[p] for p in LIVE_PHASES if c.get(p)})
        for i, c in enumerate(trend.counts)
    ]
    return Chart(WIDTH, HEIGHT, bars, x_labels, y_labels, summary, rows)
