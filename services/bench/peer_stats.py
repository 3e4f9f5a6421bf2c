"""The peer benchmark's pure parts: what "Ready" and "gone" mean for each system, latency
summaries, the apiserver's request counter, and the table (services/bench/peer.py runs it)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# ------------------------------------------------------------------------------ readiness


def pod_ready(pod: Mapping[str, Any]) -> bool:
    """A Pod Running, its Ready condition true and an IP given: what every system's Ready must
    include (agent-sandbox's Sandbox Ready asks the same of its Pod)."""
    status = pod.get("status") or {}
    if status.get("phase") != "Running" or not (status.get("podIP") or status.get("podIPs")):
        return False
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )


def sandbox_ready(sandbox: Mapping[str, Any]) -> bool:
    """An agent-sandbox Sandbox whose Ready condition is true (its controller sets it once the
    Pod is Running and Ready with an IP, and its Service exists)."""
    conditions = (sandbox.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def row_phase(row: Mapping[str, Any]) -> str | None:
    """The phase of a sandstream row as the watch sends it."""
    phase = row.get("phase")
    return phase if isinstance(phase, str) else None


def sse_events(buffer: str) -> tuple[list[tuple[str, str]], str]:
    """The complete server-sent events in ``buffer`` as (event, data), and the rest (an event
    not complete yet). Comments and ids are skipped; data lines are joined by newlines."""
    events = []
    *complete, rest = buffer.split("\n\n")
    for block in complete:
        name, data = "message", []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
        if data:
            events.append((name, "\n".join(data)))
    return events, rest


# ------------------------------------------------------------------------------ latency


@dataclass(frozen=True, slots=True)
class Summary:
    """Latency figures of one phase, in seconds (NaN where nothing was measured)."""

    count: int
    expected: int
    p50: float
    p90: float
    p99: float
    max: float

    @property
    def complete(self) -> bool:
        return self.count == self.expected


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """The q-quantile (0 < q <= 1) by the nearest rank: a value that was measured."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


def summarize(latencies: Iterable[float], expected: int) -> Summary:
    values = sorted(latencies)
    return Summary(
        len(values),
        expected,
        quantile(values, 0.50),
        quantile(values, 0.90),
        quantile(values, 0.99),
        values[-1] if values else math.nan,
    )


def latencies(started: Mapping[str, float], done: Mapping[str, float]) -> list[float]:
    """Per item: from its request to its event (items without the event are left out)."""
    return [done[name] - at for name, at in started.items() if name in done]


def span(started: Mapping[str, float], done: Mapping[str, float]) -> float:
    """From the first request to the last event, if every item got one (NaN otherwise)."""
    if not started or any(name not in done for name in started):
        return math.nan
    return max(done[name] for name in started) - min(started.values())


def median(values: Iterable[float]) -> float:
    known = [v for v in values if not math.isnan(v)]
    return statistics.median(known) if known else math.nan


# ------------------------------------------------------------------------------ apiserver


def request_counts(
    metrics_text: str,
    metric: str = "apiserver_request_total",
    by: tuple[str, str] = ("verb", "resource"),
) -> dict[tuple[str, str], float]:
    """``metric`` from a /metrics text (the apiserver's ``apiserver_request_total`` unless
    told), summed by the two labels ``by`` over its other labels (code, scope, ...)."""
    counts: dict[tuple[str, str], float] = {}
    prefix = metric + "{"
    for line in metrics_text.splitlines():
        if not line.startswith(prefix):
            continue
        labels_text, _, value = line[len(prefix) :].rpartition("} ")
        labels = _labels(labels_text)
        key = (labels.get(by[0], ""), labels.get(by[1], ""))
        counts[key] = counts.get(key, 0.0) + float(value.split()[0])
    return counts


def _labels(text: str) -> dict[str, str]:
    """Prometheus labels ``a="x",b="y"`` (values without escaped quotes: the apiserver's)."""
    labels = {}
    for part in text.split('",'):
        name, _, value = part.partition('="')
        labels[name.strip(",")] = value.rstrip('"')
    return labels


def counts_delta(
    before: Mapping[tuple[str, str], float], after: Mapping[tuple[str, str], float]
) -> dict[tuple[str, str], float]:
    """The requests made in between, by (verb, resource); those with none left out."""
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    return {k: v for k, v in delta.items() if v > 0}


def top_requests(delta: Mapping[tuple[str, str], float], items: int, n: int = 4) -> str:
    """The ``n`` largest (verb, resource) counts per item, e.g. ``patch sandboxes 3.1``."""
    ranked = sorted(delta.items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{verb} {resource} {count / items:.1f}" for (verb, resource), count in ranked)


# ------------------------------------------------------------------------------ table


@dataclass(frozen=True, slots=True)
class BurstFigures:
    """One system's burst: request → Ready, all Ready, delete → all gone, per-sandbox costs."""

    ready: Summary
    all_ready: float  # s from the first create to the last Ready
    all_gone: float  # s from the first delete to the last object gone
    requests: float  # apiserver requests per sandbox (creates and deletes)
    cpu: Mapping[str, float]  # party -> CPU seconds per sandbox (create and delete)


def ratio(a: float, b: float) -> str:
    if math.isnan(a) or math.isnan(b) or b == 0:
        return "n/a"
    return f"{a / b:.2f}"


def _s(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.2f}"


def _ms(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value * 1000:.1f}"


def burst_table(figures: Mapping[str, BurstFigures], ours: str, peer: str, floor: str) -> str:
    """The systems side by side (columns in ``figures``' order) and two ratio columns: ours
    to the peer's and ours to the floor's."""
    names = list(figures)
    rows: list[tuple[str, list[float], str]] = [
        ("request → Ready p50 (s)", [f.ready.p50 for f in figures.values()], "s"),
        ("request → Ready p90 (s)", [f.ready.p90 for f in figures.values()], "s"),
        ("request → Ready p99 (s)", [f.ready.p99 for f in figures.values()], "s"),
        ("request → Ready max (s)", [f.ready.max for f in figures.values()], "s"),
        ("all Ready (s)", [f.all_ready for f in figures.values()], "s"),
        ("delete → all gone (s)", [f.all_gone for f in figures.values()], "s"),
        ("apiserver requests / sandbox", [f.requests for f in figures.values()], "n"),
    ]
    parties = sorted({p for f in figures.values() for p in f.cpu})
    for party in parties:
        rows.append(
            (f"CPU ms / sandbox: {party}", [f.cpu.get(party, math.nan) for f in figures.values()],
             "ms")
        )  # fmt: skip
    header = ["", *names, f"{ours}/{peer}", f"{ours}/{floor}"]
    lines = [header]
    for label, values, unit in rows:
        by_name = dict(zip(names, values, strict=True))
        shown = [_ms(v) if unit == "ms" else _s(v) for v in values]
        lines.append(
            [label, *shown, ratio(by_name[ours], by_name[peer]),
             ratio(by_name[ours], by_name[floor])]
        )  # fmt: skip
    return render_rows(lines)


def render_rows(rows: Sequence[Sequence[str]]) -> str:
    """Rows as aligned columns: the first left-aligned, the rest right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)
