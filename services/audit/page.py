"""``explain --html``: one self-contained page (inline CSS and SVG, no scripts, nothing
fetched) with a timeline of the phases over time and the causal chain as a table."""

from __future__ import annotations

from datetime import datetime, timedelta
from html import escape

from services.audit.reach import Reach
from services.audit.timeline import Explanation, Step, describe_decision, describe_input

COLOURS = {
    "Provisioning": "#8ecae6", "Starting": "#219ebc", "Ready": "#2a9d8f", "Stopping": "#e9c46a",
    "Stopped": "#b5b5b5", "Suspending": "#cdb4db", "Suspended": "#9d8bb0",
    "Completed": "#6a994e", "Error": "#e63946", "Deleting": "#f4a261", "Deleted": "#444444",
}  # fmt: skip
WIDTH, LEFT, RIGHT = 1100, 20, 20

_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px; color: #1d1d1d; }
h1 { font-size: 20px; margin: 0 0 4px; } .sub { color: #555; margin-bottom: 16px; }
.reach { padding: 6px 10px; background: #f3f3f3; border-left: 4px solid #999; margin: 8px 0; }
.reach.cut { border-color: #e63946; }
table { border-collapse: collapse; width: 100%; margin-top: 16px; }
td, th { border-bottom: 1px solid #ddd; padding: 4px 8px; vertical-align: top; text-align: left; }
th { background: #fafafa; } td.time { white-space: nowrap; font-family: monospace; }
.ignored td, .duplicate td { color: #777; } .rejected td { color: #b00020; }
.call { color: #1d4e89; font-size: 13px; } .differs { color: #b00020; font-weight: 600; }
.legend span { display: inline-block; margin-right: 12px; font-size: 12px; }
.legend i { display: inline-block; width: 12px; height: 12px; margin-right: 4px;
            vertical-align: -1px; }
"""


def render(explanation: Explanation, reach: Reach | None, generated: datetime) -> str:
    steps = explanation.steps
    state = explanation.state
    head = (
        f"{escape(state.phase.value)}, generation {state.generation}, version {state.version}, "
        f"incarnation {state.sandbox_id}"
        if state
        else "no row"
    )
    reach_html = ""
    if reach is not None:
        cls = "reach" if reach.complete else "reach cut"
        reach_html = f'<div class="{cls}">{escape(reach.statement())}</div>'
    rows = "".join(_row(i, s, explanation) for i, s in enumerate(steps))
    legend = "".join(f'<span><i style="background:{c}"></i>{p}</span>' for p, c in COLOURS.items())
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>sandstream: explain {escape(explanation.key)}</title><style>{_CSS}</style></head>
<body>
<h1>{escape(explanation.key)}: {head}</h1>
<div class="sub">{len(steps)} inputs of the current incarnation, decided again with today's
rules from the history's verbatim copies of the log records. Generated
{escape(generated.isoformat(timespec="seconds"))}.</div>
{reach_html}
{timeline_svg(steps)}
<div class="legend">{legend}</div>
<table><thead><tr><th>time (UTC)</th><th>input</th><th>decision</th><th>log position</th></tr>
</thead><tbody>{rows}</tbody></table>
</body></html>
"""


def _row(i: int, step: Step, explanation: Explanation) -> str:
    e = step.entry
    when = e.occurred_at.strftime("%H:%M:%S.%f")[:-3] if e.occurred_at else "?"
    calls = "".join(
        f'<div class="call">&rArr; executor: {escape(c.operation)} generation {c.generation}: '
        + (
            ", ".join(escape(_result(r)) for r in c.results)
            if c.results
            else "no result recorded yet"
        )
        + "</div>"
        for c in explanation.calls.get(i, [])
    )
    decision = escape(describe_decision(step))
    if not step.agrees:
        decision = f'<span class="differs">{decision}</span>'
    return (
        f'<tr class="{escape(step.disposition)}"><td class="time">{when}</td>'
        f"<td>{escape(describe_input(e))}</td><td>{decision}{calls}</td>"
        f'<td class="time">{escape(e.topic)}[{e.partition}]@{e.offset}</td></tr>'
    )


def _result(step: Step) -> str:
    body = step.entry.body
    reason = f" ({body['reason']})" if body.get("reason") else ""
    return f"{body.get('outcome')}{reason} at {step.entry.topic}@{step.entry.offset}"


def timeline_svg(steps: list[Step]) -> str:
    """Phase bands over time (one band per phase the row held) and a tick per input."""
    times = [s.entry.occurred_at for s in steps if s.entry.occurred_at is not None]
    if not times:
        return ""
    start, end = min(times), max(times)
    span = max((end - start).total_seconds(), 1e-3)
    end = end + timedelta(seconds=span * 0.05)  # room for the last phase
    span = (end - start).total_seconds()

    def x(t: datetime) -> float:
        return LEFT + (t - start).total_seconds() / span * (WIDTH - LEFT - RIGHT)

    bands: list[str] = []
    ticks: list[str] = []
    current: tuple[str, datetime] | None = None
    for s in steps:
        t = s.entry.occurred_at
        if t is None:
            continue
        phase = s.state.phase.value if s.state else None
        if phase is not None and (current is None or current[0] != phase):
            if current is not None:
                bands.append(_band(current[0], x(current[1]), x(t)))
            current = (phase, t)
        y = 18 if s.entry.message is not None and "command_id" in s.entry.body else 92
        colour = "#222" if s.disposition == "applied" else "#aaa"
        title = escape(f"{describe_input(s.entry)} -> {s.disposition}")
        ticks.append(
            f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{y}" y2="{y + 12}" stroke="{colour}" '
            f'stroke-width="2"><title>{title}</title></line>'
        )
    if current is not None:
        bands.append(_band(current[0], x(current[1]), x(end)))
    labels = (
        f'<text x="{LEFT}" y="12" font-size="11">commands</text>'
        f'<text x="{LEFT}" y="118" font-size="11">observations</text>'
        f'<text x="{LEFT}" y="138" font-size="11">'
        f"{escape(start.isoformat(timespec='milliseconds'))}</text>"
        f'<text x="{WIDTH - RIGHT}" y="138" font-size="11" text-anchor="end">'
        f"{escape(end.isoformat(timespec='milliseconds'))}</text>"
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="145" '
        f'role="img" aria-label="phases over time">{"".join(bands)}{"".join(ticks)}{labels}</svg>'
    )


def _band(phase: str, x0: float, x1: float) -> str:
    width = max(x1 - x0, 1.0)
    colour = COLOURS.get(phase, "#999")
    text = (
        f'<text x="{x0 + 4:.1f}" y="64" font-size="12" fill="#fff">{escape(phase)}</text>'
        if width > 60
        else ""
    )
    return (
        f'<rect x="{x0:.1f}" y="34" width="{width:.1f}" height="52" fill="{colour}">'
        f"<title>{escape(phase)}</title></rect>{text}"
    )
