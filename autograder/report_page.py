"""The class report as one self-contained HTML page (autograder/report.py computes its numbers).

Plotly's JavaScript is inlined once, so the file opens offline and needs no server. Every piece
of student text (names, failure messages, notes) goes into HTML tables, escaped; the plots hold
only numbers and the instructor's own names (grade ids, exercise names).
"""

from __future__ import annotations

import html

import plotly.graph_objects as go
import plotly.io as pio

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.92em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
code { font-size: 0.95em; } .muted { color: #777; }
"""


def _table(header: list[str], rows: list[list], numeric: set[int] = frozenset()) -> str:
    if not rows:
        return '<p class="muted">none</p>'
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>"
        + "".join(f"<td{' class=n' if i in numeric else ''}>{html.escape(_show(v))}</td>" for i, v in enumerate(row))
        + "</tr>"
        for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _show(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _percent(rate) -> str:
    return "–" if rate is None else f"{100 * rate:.0f}%"


class _Figures:
    """Plotly figures as <div>s; the first carries plotly.js, inlined."""

    def __init__(self):
        self.first = True

    def __call__(self, fig: go.Figure, height: int = 320) -> str:
        fig.update_layout(height=height, margin=dict(l=50, r=20, t=40, b=50), template="plotly_white")
        div = pio.to_html(fig, full_html=False, include_plotlyjs=self.first, config={"displaylogo": False})
        self.first = False
        return div


def render(report: dict) -> str:
    """The page for build()'s numbers."""
    figure = _Figures()
    parts = [
        f"<h1>{html.escape(report['assignment'])}: the class at a glance</h1>",
        f"<p>{report['students']} students; mean score {_show(report['score_mean'])}, median "
        f"{_show(report['score_median'])} of {_show(report['max_score'])}.</p>",
    ]

    scores = list(report["scores"].values())
    fig = go.Figure(
        go.Histogram(
            x=scores,
            xbins=dict(start=0, end=(report["max_score"] or 1) + 0.5, size=0.5) if report["max_score"] else None,
        )
    )
    fig.update_layout(title="Score distribution", xaxis_title="score (net of late penalty)", yaxis_title="students")
    parts += [
        "<h2>Scores and statuses</h2>",
        figure(fig),
        _table(["status", "submissions"], [[s, n] for s, n in report["statuses"].items()], {1}),
    ]

    cells = [c for c in report["cells"] if c["graded"]]
    if cells:
        fig = go.Figure(go.Bar(x=[c["grade_id"] for c in cells], y=[100 * c["pass_rate"] for c in cells]))
        fig.update_layout(title="Full marks per graded cell", yaxis_title="% of submissions", yaxis_range=[0, 100])
        parts += ["<h2>Test cells</h2>", figure(fig, 360)]
    by_id = {c["grade_id"]: c for c in report["cells"]}
    rows = []
    for gid in report["failed_most"]:
        c = by_id[gid]
        top = c["messages"][0] if c["messages"] else None
        rows.append(
            [
                gid,
                c["graded"] - c["full_marks"],
                c["graded"],
                _percent(c["pass_rate"]),
                f"{top['count']}× {top['message']}" if top else "(no failure note: the notebook did not run)",
                "; ".join(f"{m['count']}× {m['message']}" for m in c["messages"][1:]),
            ]
        )
    parts += [
        "<h3>Failed most, with the most common first failure message</h3>",
        _table(["cell", "failed", "graded", "full marks", "most common message", "next"], rows, {1, 2}),
    ]

    hints = report["hints"]
    if hints:
        fig = go.Figure(go.Bar(x=list(hints), y=[h["students"] for h in hints.values()], name="students"))
        fig.update_layout(title="Hints opened per exercise", yaxis_title="students who opened one or more")
        parts += ["<h2>Hints</h2>", figure(fig)]
    parts.append(
        _table(
            ["exercise", "students", "rungs opened"], [[e, h["students"], h["rungs"]] for e, h in hints.items()], {1, 2}
        )
    )

    predictions = report["predictions"]
    if predictions:
        parts.append("<h2>Predictions</h2>")
        ratios = [
            (p["grade_id"], a / p["truth"])
            for p in predictions
            if p["truth"]
            for a in p["answers"].values()
            if isinstance(a, (int, float)) and a / p["truth"] > 0
        ]
        if ratios:
            fig = go.Figure(
                go.Box(x=[r for _, r in ratios], y=[g for g, _ in ratios], orientation="h", boxpoints="all", jitter=0.4)
            )
            fig.update_layout(title="Answer ÷ the right answer (1 = exact; log scale)", xaxis_type="log")
            parts.append(figure(fig, 120 + 40 * len(predictions)))
        parts.append(
            _table(
                ["cell", "right answer", "graded correct", "answered", "median answer ÷ right"],
                [
                    [
                        p["grade_id"],
                        p["truth"],
                        _percent(p["pass_rate"]),
                        sum(isinstance(a, (int, float)) for a in p["answers"].values()) if p["answers"] else "–",
                        p["median_ratio"],
                    ]
                    for p in predictions
                ],
                {1, 3, 4},
            )
        )

    parts.append("<h2>Late, similarity, integrity</h2>")
    parts.append(_table(["student", "late penalty"], [[s, p] for s, p in report["late"].items()], {1}))
    parts.append(_table(["student", "similarity"], [[s, "; ".join(n)] for s, n in report["similarity"].items()]))
    parts.append(_table(["student", "integrity"], [[s, "; ".join(n)] for s, n in report["integrity"].items()]))
    if report["hours_after_due"]:
        fig = go.Figure(go.Histogram(x=list(report["hours_after_due"].values())))
        fig.update_layout(
            title=f"When work was submitted (due {report['due']})",
            xaxis_title="hours after the due date (negative: before)",
            yaxis_title="submissions",
        )
        parts += ["<h2>Timing</h2>", figure(fig)]
    body = "\n".join(parts)
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(report['assignment'])} report"
        f"</title><style>{STYLE}</style></head><body>{body}</body></html>"
    )
