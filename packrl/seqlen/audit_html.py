"""`packrl audit --html FILE`: one self-contained page (no script, no external URL, works offline).

The histograms are drawn with matplotlib and inlined as SVG (text kept as text), the tables
are plain HTML. A 7,473-row GSM8K report renders to about 30 kB.
"""

from __future__ import annotations

import html
import io
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from packrl.seqlen.audit_report import AuditReport, LengthStats, PolicyOutcome

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
    """The report as a complete HTML document (a string), with the prompt-token histogram.

    Raises:
        ValueError: matplotlib is not installed (with the install command).
    """
    c = report.config
    e = html.escape
    parts = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>packrl audit</title><style>{_CSS}</style></head><body>",
        f"<h1>packrl audit: {report.num_rows:,} rows</h1>",
        "<p>" + ", ".join(f"<code>{e(s.source)}</code> ({s.num_rows:,})" for s in report.sources) + "</p>",
        f"<p>model <code>{e(report.model)}</code>, data.max_prompt_tokens={c['data.max_prompt_tokens']:,}, "
        f"data.overlong_prompt={e(str(c['data.overlong_prompt']))}, rollout.max_response_tokens={c['rollout.max_response_tokens']:,}</p>",
        "<h2>Prompt tokens</h2>", _stats_table([("prompt tokens", report.prompt_tokens)]),
        _histogram_svg(report.prompt_tokens, "prompt tokens", budget=("data.max_prompt_tokens", c["data.max_prompt_tokens"])),
    ]
    if report.answer_tokens is not None:
        parts += ["<h2>Reference answer tokens (response-length proxy)</h2>", _stats_table([("answer tokens", report.answer_tokens)]),
                  _histogram_svg(report.answer_tokens, "answer tokens",
                                 budget=("rollout.max_response_tokens", c["rollout.max_response_tokens"]))]
    parts += [f"<h2>Over data.max_prompt_tokens={c['data.max_prompt_tokens']:,}: {report.num_overlong:,} rows</h2>",
              _policy_table(report.policies, c["data.overlong_prompt"])]
    parts += [f"<h2>Bad rows: {report.num_bad_rows:,}</h2>", _bad_rows(report)]
    if report.multimodal is not None:
        m = report.multimodal
        parts += [f"<h2>Multimodal rows: {m.num_rows:,} ({m.num_images:,} images)</h2><p>{e(m.training)}</p>",
                  _stats_table([("image tokens", m.image_tokens), ("text tokens", m.text_tokens), ("total tokens", m.total_tokens)]),
                  _policy_table(m.policies, c["data.overlong_prompt"])]
    s = report.suggested
    parts += ["<h2>Suggested budgets</h2>",
              f"<p><code>data.max_prompt_tokens={s.max_prompt_tokens}</code> "
              f"<code>train.max_tokens_per_microbatch={s.max_tokens_per_microbatch}</code><br>{e(s.rule)}</p>",
              "<h2>Would stop packrl train</h2>",
              "<ul>" + "".join(f"<li class='problem'>{e(p)}</li>" for p in report.problems) + "</ul>" if report.problems else "<p>nothing</p>",
              f"<p>audited in {report.wall_s:.2f} s ({report.rows_per_s:,.0f} rows/s){', from the cache' if report.cached else ''}</p>",
              "</body></html>"]
    return "\n".join(parts)


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


def _histogram_svg(stats: LengthStats, label: str, *, budget: tuple[str, int]) -> str:
    """The histogram as an inline ``<svg>`` element (matplotlib, no pyplot state)."""
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ValueError("--html needs matplotlib, which is not installed: pip install matplotlib") from err
    edges, counts = stats.histogram.bin_edges, stats.histogram.counts
    if not counts:
        return "<p>(no rows)</p>"
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "packrl-audit"}):
        fig = Figure(figsize=(8, 3))
        ax = fig.add_subplot()
        ax.bar(edges[:-1], counts, width=[b - a for a, b in zip(edges, edges[1:])], align="edge", color="#4878a8", edgecolor="white")
        key, value = budget
        if value <= edges[-1] * 1.5:  # a far-away budget would squash the bars
            ax.axvline(value, color="#c03030", linestyle="--", label=f"{key}={value:,}")
            ax.legend(loc="upper right")
        ax.set_xlabel(label)
        ax.set_ylabel("rows")
        ax.set_title(f"{label}: histogram")
        fig.tight_layout()
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None})
    svg = buf.getvalue()
    svg = svg[svg.index("<svg"):]  # drop the XML prolog and doctype: the element is inlined
    return re.sub(r"<metadata>.*?</metadata>", "", svg, count=1, flags=re.DOTALL)  # RDF credits, not drawing
