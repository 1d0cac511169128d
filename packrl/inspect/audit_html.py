"""`packrl audit --html FILE`: one self-contained page (no external URL, works offline).

The histograms are plotly figures, as on the run report (`packrl report`): one plotting library
for every page packrl writes. plotly.js is inlined once (about 4.8 MB, the size of any page that
carries it); the tables are plain HTML.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from packrl.inspect.audit_report import AuditReport, LengthStats, MultimodalStats, PolicyOutcome

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 60em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
tr.chosen { background: #eef5ff; }
.problem { color: #a00; }
code { background: #f4f4f4; padding: 0 0.2em; }
"""


def render_html(report: AuditReport) -> str:
    """The report as a complete HTML document (a string), with the length histograms."""
    from plotly.offline import get_plotlyjs

    c = report.config
    e = html.escape
    parts = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>packrl audit</title><style>{_CSS}</style>",
        f'<script type="text/javascript">{get_plotlyjs()}</script></head><body>',
        f"<h1>packrl audit: {report.num_rows:,} rows</h1>",
        "<p>" + ", ".join(f"<code>{e(s.source)}</code> ({s.num_rows:,})" for s in report.sources) + "</p>",
        f"<p>model <code>{e(report.model)}</code>, data.max_prompt_tokens={c['data.max_prompt_tokens']:,}, "
        f"data.overlong_prompt={e(str(c['data.overlong_prompt']))}, rollout.max_response_tokens={c['rollout.max_response_tokens']:,}</p>",
        "<h2>Prompt tokens</h2>", _stats_table([("prompt tokens", report.prompt_tokens)]),
        _histogram(report.prompt_tokens, "prompt tokens", budget=("data.max_prompt_tokens", c["data.max_prompt_tokens"])),
    ]
    if report.answer_tokens is not None:
        parts += ["<h2>Reference answer tokens (response-length proxy)</h2>", _stats_table([("answer tokens", report.answer_tokens)]),
                  _histogram(report.answer_tokens, "answer tokens",
                                 budget=("rollout.max_response_tokens", c["rollout.max_response_tokens"]))]
    parts += [f"<h2>Over data.max_prompt_tokens={c['data.max_prompt_tokens']:,}: {report.num_overlong:,} rows</h2>",
              _policy_table(report.policies, c["data.overlong_prompt"])]
    parts += [f"<h2>Bad rows: {report.num_bad_rows:,}</h2>", _bad_rows(report)]
    if report.multimodal is not None:
        parts += _multimodal(report.multimodal, c["data.overlong_prompt"])
    s = report.suggested
    parts += ["<h2>Suggested budgets</h2>",
              f"<p><code>data.max_prompt_tokens={s.max_prompt_tokens}</code> "
              f"<code>train.max_tokens_per_microbatch={s.max_tokens_per_microbatch}</code><br>{e(s.rule)}</p>",
              "<h2>Would stop packrl train</h2>",
              ("<ul>" + "".join(f"<li class='problem'>{e(p)}</li>" for p in report.problems) + "</ul>"
               if report.problems else "<p>nothing</p>"),
              f"<p>audited in {report.wall_s:.2f} s ({report.rows_per_s:,.0f} rows/s){', from the cache' if report.cached else ''}</p>",
              "</body></html>"]
    return "\n".join(parts)


def _multimodal(m: MultimodalStats, configured: str) -> list[str]:
    """The rows-with-images section: what training does with them, tokens per row and per fitted
    image size (with a processor), the policies over these rows, and the rows a policy changed."""
    e = html.escape
    parts = [f"<h2>Multimodal rows: {m.num_rows:,} ({m.num_images:,} images)</h2><p>{e(m.training)}</p>"]
    if m.geometry is not None:
        parts += [f"<p>per row under data.overlong_prompt={e(m.policy)} (vision tokens: placeholders and markers)</p>",
                  _stats_table([("vision tokens", m.vision_tokens), ("text tokens", m.text_tokens),
                                ("prompt tokens", m.total_tokens)])]
        head = "<tr><th>fitted size</th><th>tokens</th><th>encoder patches</th><th>images</th></tr>"
        body = "".join(f"<tr><td>{s.width}x{s.height}</td><td>{s.vision_tokens:,}</td><td>{s.encoder_patches:,}</td>"
                       f"<td>{s.num_images:,}</td></tr>" for s in m.image_sizes)
        parts.append(f"<table>{head}{body}</table>")
    parts.append(_policy_table(m.policies, configured))
    if m.changed:
        rows = "".join(f"<tr><td>{r.row}</td><td>{r.status}</td><td>{e(r.reason)}</td></tr>" for r in m.changed)
        parts.append(f"<table><tr><th>row</th><th>status</th><th>reason</th></tr>{rows}</table>")
    return parts


def _stats_table(rows: list[tuple[str, LengthStats]]) -> str:
    names = ("num_rows", "p50", "p90", "p95", "p99", "max", "mean")
    head = "<tr><th></th>" + "".join(f"<th>{n}</th>" for n in names) + "</tr>"
    body = "".join(
        f"<tr><td>{html.escape(title)}</td>" + "".join(f"<td>{_num(getattr(s, n))}</td>" for n in names) + "</tr>"
        for title, s in rows
    )
    return f"<table>{head}{body}</table>"


def _num(value: object) -> str:
    return "-" if value is None else f"{value:,}"


def _policy_table(policies: tuple[PolicyOutcome, ...], configured: str) -> str:
    names = ("num_kept", "num_truncated", "num_filtered", "num_rejected", "num_tokens_removed")
    head = "<tr><th>policy</th>" + "".join(f"<th>{n.removeprefix('num_')}</th>" for n in names) + "<th>rows (first 20)</th></tr>"
    body = ""
    for p in policies:
        chosen = " class='chosen'" if p.policy == configured else ""
        note = " (stops training)" if p.stops_training else ""
        cells = "".join(f"<td>{getattr(p, n):,}</td>" for n in names)
        body += f"<tr{chosen}><td>{p.policy}{note}</td>{cells}<td>{', '.join(map(str, p.rows))}</td></tr>"
    return f"<table>{head}{body}</table>"


def _bad_rows(report: AuditReport, shown: int = 100) -> str:
    if not report.bad_rows:
        return "<p>none</p>"
    body = "".join(
        f"<tr><td>{b.row}</td><td>{html.escape(b.source)}</td><td>{b.source_row}</td><td>{html.escape(b.reason)}</td></tr>"
        for b in report.bad_rows[:shown]
    )
    more = f"<p>... and {report.num_bad_rows - shown:,} more</p>" if report.num_bad_rows > shown else ""
    return f"<table><tr><th>row</th><th>source</th><th>source row</th><th>reason</th></tr>{body}</table>{more}"


def _histogram(stats: LengthStats, label: str, *, budget: tuple[str, int]) -> str:
    """The histogram as a plotly figure's ``<div>`` (plotly.js is on the page once), titled
    ``<label>: histogram``, with the budget as a dashed line when it lies near the bars."""
    import plotly.graph_objects as go

    edges, counts = stats.histogram.bin_edges, stats.histogram.counts
    if not counts:
        return "<p>(no rows)</p>"
    widths = [b - a for a, b in zip(edges, edges[1:])]
    fig = go.Figure(go.Bar(x=[a + w / 2 for a, w in zip(edges, widths)], y=list(counts), width=widths, name="rows",
                           marker={"color": "#4878a8", "line": {"color": "white", "width": 1}},
                           hovertemplate=f"{label} %{{x}}: %{{y}} rows<extra></extra>"))
    key, value = budget
    if value <= edges[-1] * 1.5:  # a far-away budget would squash the bars
        fig.add_vline(x=value, line={"color": "#c03030", "dash": "dash"}, annotation_text=f"{key}={value:,}")
    fig.update_layout(title=f"{label}: histogram", xaxis_title=label, yaxis_title="rows", height=320, bargap=0,
                      margin={"l": 50, "r": 20, "t": 50, "b": 45}, template="plotly_white")
    div_id = "histogram-" + label.replace(" ", "-")
    return fig.to_html(full_html=False, include_plotlyjs=False, include_mathjax=False, div_id=div_id,
                       config={"displaylogo": False, "responsive": True})
