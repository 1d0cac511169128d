"""`packrl report RUN_DIR`: one self-contained HTML page about a run's lengths, stages and rewards.

Reads what `packrl train` leaves in RUN_DIR: ``metrics.jsonl`` (required; docs/metrics.md),
``config.yaml`` (budgets drawn on the plots), ``budgets.txt`` and ``rollouts/step_N.jsonl``
(response dumps, ``train.dump_rollouts``). Everything else is optional: a section whose data
is missing shows a note that says what to turn on instead of a plot.

The page works offline: the plotly.js bundle (about 4.8 MB) is inlined once and every figure
is a `<div class="packrl-plot">` drawn by it. Each section is `<section id="section-NAME">`,
each plot `<div id="plot-NAME">`. A small hook records JavaScript errors (``error``,
``unhandledrejection``, ``console.error``) into the hidden `<pre id="packrl-js-errors">`, so
a headless browser's DOM dump shows whether the page drew cleanly.
"""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from packrl.diagnostics import report_figures as figs

_STEP_FILE = re.compile(r"^step_(\d+)\.jsonl$")
_TABLE_ROWS = 10
"""Rows in each response table; the page stays small for runs with thousands of responses."""
_TEXT_CHARS = 400
"""Characters of a prompt or response shown before the rest folds into a <details>."""


@dataclass
class RunData:
    """What the report reads from RUN_DIR.

    Attributes:
        run_dir: the run folder.
        metrics: ``metrics.jsonl``, one dict per step, in file order.
        config: ``config.yaml`` as nested dicts ({} when absent or unreadable).
        rollouts: step -> rows of ``rollouts/step_N.jsonl`` ({} when the run has no dumps).
        skipped_lines: unparseable lines left out (``file: count``), e.g. a line cut by a kill.
    """

    run_dir: Path
    metrics: list[dict[str, Any]]
    config: dict[str, Any]
    rollouts: dict[int, list[dict[str, Any]]]
    skipped_lines: dict[str, int] = field(default_factory=dict)

    def config_value(self, dotted: str) -> Any:
        """``config.yaml`` value at ``dotted`` (``train.max_tokens_per_microbatch``), or None."""
        node: Any = self.config
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        return node


def _read_jsonl(path: Path, skipped: dict[str, int]) -> list[dict[str, Any]]:
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        else:
            skipped[path.name] = skipped.get(path.name, 0) + 1
    return rows


def load_run(run_dir: str | Path) -> RunData:
    """Read RUN_DIR (see the module docstring).

    Raises:
        ValueError: RUN_DIR is not a folder, or holds no ``metrics.jsonl`` or no step in it.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"RUN_DIR {str(run_dir)!r} is not a folder; give the train.out_dir of a `packrl train` run")
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise ValueError(f"{str(run_dir)!r} has no metrics.jsonl, so it is not a packrl run (or no step finished yet); "
                         "give the train.out_dir of a `packrl train` run that completed at least one step")
    skipped: dict[str, int] = {}
    metrics = [m | {"step": int(step)} for m in _read_jsonl(metrics_path, skipped)
               if (step := figs.as_number(m.get("step"))) is not None]
    if not metrics:
        raise ValueError(f"{str(metrics_path)!r} holds no step record (0 lines with a 'step' key); "
                         "report on a run that completed at least one step")
    config: dict[str, Any] = {}
    if (run_dir / "config.yaml").is_file():
        try:
            loaded = yaml.safe_load((run_dir / "config.yaml").read_text())
            config = loaded if isinstance(loaded, dict) else {}
        except yaml.YAMLError:
            skipped["config.yaml"] = 1
    rollouts: dict[int, list[dict[str, Any]]] = {}
    if (run_dir / "rollouts").is_dir():
        for path in (run_dir / "rollouts").iterdir():
            match = _STEP_FILE.match(path.name)
            if match and path.is_file():
                rollouts[int(match[1])] = _read_jsonl(path, skipped)
    return RunData(run_dir, metrics, config, dict(sorted(rollouts.items())), skipped)


@dataclass(frozen=True)
class Section:
    """One section of the page: a figure, or a note saying why there is none."""

    name: str
    title: str
    caption: str
    figure: Any = None
    note: str = ""
    body_html: str = ""


def _budget(run: RunData, key: str) -> int | None:
    value = figs.as_number(run.config_value(key))
    return int(value) if value else None


def _number(row: dict[str, Any], key: str) -> float:
    """``row[key]`` as a float; 0.0 when missing or not a finite number."""
    return figs.as_number(row.get(key)) or 0.0


def _length_section(run: RunData) -> Section:
    """Response-length percentiles from the rollout dumps, else min/mean/max from metrics.jsonl."""
    budget = _budget(run, "rollout.max_response_tokens")
    per_step = {s: [n for r in rows if (n := figs.as_number(r.get("response_tokens"))) is not None]
                for s, rows in run.rollouts.items()}
    title = "Response length over steps"
    figure = figs.add_step_budget(figs.length_from_rollouts(per_step, budget), run.metrics)
    if figure is not None:
        return Section("length", title, "Response tokens per step from rollouts/step_N.jsonl: p10-p90 band, "
                       "median (p50) and longest; the dashed line is rollout.max_response_tokens (under a length "
                       "curriculum the largest stage; the stepped line is each step's budget).", figure)
    caption = ("Response tokens per step from metrics.jsonl (response_length/min|mean|max); set "
               "train.dump_rollouts=true for percentile bands.")
    figure = figs.add_step_budget(figs.length_from_metrics(run.metrics, budget), run.metrics)
    return _plain_section("length", title, caption, figure, "no response_length/* metrics in metrics.jsonl")


def _plain_section(name: str, title: str, caption: str, figure: Any, missing: str) -> Section:
    return Section(name, title, caption, figure, note="" if figure is not None else missing)


def build_sections(run: RunData) -> list[Section]:
    """Every section of the page, in reading order: lengths, finish reasons, turns, staleness, padding,
    reward, time, buckets, tables."""
    mbt = _budget(run, "train.max_tokens_per_microbatch")
    fill = (f"micro-batch fill is seqlen/microbatch_tokens_max over train.max_tokens_per_microbatch={mbt:,}" if mbt
            else "micro-batch fill needs train.max_tokens_per_microbatch from config.yaml, which is missing")
    return [
        _length_section(run),
        _plain_section("finish", "Clip ratio and finish reasons",
                       "Share of responses per finish reason (response/finish_reason/*, stacked) and the clip ratio "
                       "(response_length/clip_ratio: cut at a budget, finish reason length or context).",
                       figs.finish_reasons(run.metrics), "no response/finish_reason/* or clip-ratio metrics in metrics.jsonl"),
        _plain_section("turns", "Turns and tool calls",
                       "Multi-turn rollouts: assistant turns per trajectory (num_turns/mean, /max), tool calls, malformed "
                       "calls and tool errors per trajectory (multi_turn/*), the share of trajectories that called a tool, and "
                       "the turns the rolling window dropped per trajectory (multi_turn/dropped_turns).",
                       figs.turns(run.metrics), "no num_turns/* metrics in metrics.jsonl (a single-turn run)"),
        _plain_section("staleness", "Staleness and the tail cut",
                       "Partial rollouts (trainer.rollout_mode=colocate_async or separate_async): updates between a trained "
                       "token's version and the step (async/staleness_token_*), the share of trained responses holding tokens "
                       "of an earlier version, groups carried to the next step, at rollout.max_staleness, and dropped.",
                       figs.staleness(run.metrics), "no async/* metrics in metrics.jsonl (trainer.rollout_mode=sync)"),
        _plain_section("length_control", "Length control",
                       "How long correct and wrong responses are (length/correct/*, length/wrong/*: tokens the policy "
                       "generated), tokens per correct answer, forced end-of-thinking tokens (seqlen/forced_tokens) and "
                       "responses each filter took out of the loss (filter/<name>/dropped, e.g. GFPO's).",
                       figs.length_control(run.metrics), "no length/* metrics in metrics.jsonl (a reward without a notion "
                       "of correct)"),
        _plain_section("targets", "Target-length adherence",
                       "|len - N| / N of the responses to prompts that ask for N tokens (data.length_target), over all "
                       "targets and per target range (length/target_error/*).",
                       figs.target_error(run.metrics), "no length/target_error/* metrics (no data.length_target)"),
        _plain_section("padding", "Pad fraction and micro-batch fill",
                       f"Pad positions / all positions of the update passes (seqlen/pad_fraction, 0 with packing); {fill}.",
                       figs.padding(run.metrics, mbt), "no seqlen/pad_fraction or seqlen/microbatch_tokens_max in metrics.jsonl"),
        _plain_section("reward", "Reward and validation accuracy",
                       "Mean task score (critic/score/mean), mean reward after shaping (critic/rewards/mean) and "
                       "validation accuracy (val/accuracy, every train.val_every steps).",
                       figs.reward(run.metrics), "no critic/score/mean, critic/rewards/mean or val/accuracy in metrics.jsonl"),
        _plain_section("timing", "Stage time per step",
                       "Wall seconds per stage (timing_s/*), stacked; the black line is the whole step.",
                       figs.stage_time(run.metrics), "no timing_s/* metrics in metrics.jsonl"),
        _plain_section("throughput", "Throughput",
                       "Prompt + response tokens per second per device (perf/throughput).",
                       figs.throughput(run.metrics), "no perf/throughput in metrics.jsonl"),
        _plain_section("buckets", "Metrics by response length",
                       "Means over the responses whose length falls in each bucket [lo, hi) of "
                       "rollout.max_response_tokens (bucket/<metric>/<lo>-<hi>).",
                       figs.buckets(run.metrics), "no bucket/* metrics in metrics.jsonl (written by runs that "
                       "record length-bucketed metrics)"),
        _responses_section(run),
    ]


_COLUMNS = ("step", "index", "prompt_tokens", "response_tokens", "finish_reason", "score", "reward", "advantage")


def _folded_text(text: Any) -> str:
    text = str(text if text is not None else "")
    if len(text) <= _TEXT_CHARS:
        return f'<pre class="packrl-text">{html.escape(text)}</pre>'
    return (f'<details><summary><pre class="packrl-text">{html.escape(text[:_TEXT_CHARS])}…</pre></summary>'
            f'<pre class="packrl-text">{html.escape(text)}</pre></details>')


def _cell(row: dict[str, Any], key: str) -> str:
    value = row.get(key, "")
    if isinstance(value, float):
        return f"{value:.4g}"
    return html.escape(str(value))


def response_table(table_id: str, rows: list[dict[str, Any]]) -> str:
    """An HTML table of rollout-dump rows: counts, finish reason, score, then prompt and response text."""
    head = "".join(f"<th>{c.replace('_', ' ')}</th>" for c in (*_COLUMNS, "prompt", "response"))
    body = []
    for row in rows:
        cells = "".join(f"<td>{_cell(row, c)}</td>" for c in _COLUMNS)
        body.append(f"<tr>{cells}<td>{_folded_text(row.get('prompt'))}</td><td>{_folded_text(row.get('response'))}</td></tr>")
    return f'<table class="packrl-table" id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def _responses_section(run: RunData) -> Section:
    """Tables of the longest responses of the run and of the latest truncated ones (rollout dumps)."""
    title = "Longest and truncated responses"
    rows = [r for step_rows in run.rollouts.values() for r in step_rows]
    if not rows:
        return Section("responses", title, "", note="no rollout dumps (RUN_DIR/rollouts/step_N.jsonl); "
                       "set train.dump_rollouts=true to list the longest and the truncated responses")
    longest = sorted(rows, key=lambda r: _number(r, "response_tokens"), reverse=True)[:_TABLE_ROWS]
    truncated = [r for r in rows if r.get("truncated") or r.get("finish_reason") in ("length", "context")]
    latest_first = sorted(truncated, key=lambda r: (-_number(r, "step"), -_number(r, "response_tokens")))[:_TABLE_ROWS]
    parts = [f"<h3>Longest {len(longest)} of {len(rows):,} responses</h3>", response_table("table-longest", longest),
             f"<h3>Truncated responses ({len(truncated):,} of {len(rows):,}; latest {len(latest_first)} shown)</h3>"]
    if latest_first:
        parts.append(response_table("table-truncated", latest_first))
    else:
        parts.append('<p class="packrl-note" id="note-truncated">no response was truncated: every finish reason '
                     "is eos, stop or abort (none hit rollout.max_response_tokens or the model context)</p>")
    caption = f"From {len(run.rollouts)} rollout dump(s) under rollouts/; text longer than {_TEXT_CHARS} characters folds."
    return Section("responses", title, caption, body_html="".join(parts))


_ERROR_HOOK = """(function () {
  var box = document.getElementById("packrl-js-errors");
  function record(text) {
    box.textContent += text + "\\n";
    box.setAttribute("data-count", String(Number(box.getAttribute("data-count")) + 1));
  }
  window.addEventListener("error", function (e) {
    record("error: " + e.message + " at " + (e.filename || "?") + ":" + (e.lineno || "?"));
  });
  window.addEventListener("unhandledrejection", function (e) { record("unhandled rejection: " + e.reason); });
  var consoleError = console.error;
  console.error = function () {
    record("console.error: " + Array.prototype.join.call(arguments, " "));
    consoleError.apply(console, arguments);
  };
})();"""

_CSS = """body{font-family:system-ui,sans-serif;margin:0 auto;max-width:1300px;padding:0 16px 40px;color:#222}
h1{margin-bottom:4px} .packrl-meta{color:#555;margin:0 0 16px} section{margin:28px 0}
.packrl-caption{color:#555;margin:4px 0 8px} .packrl-note{background:#fff6e0;border-left:4px solid #e0a800;padding:8px 12px}
.packrl-plot{min-height:200px} .packrl-table{border-collapse:collapse;font-size:13px;width:100%}
.packrl-table th,.packrl-table td{border:1px solid #ddd;padding:4px 6px;vertical-align:top;text-align:left}
.packrl-table th{background:#f3f3f3}
.packrl-text{white-space:pre-wrap;word-break:break-word;margin:0;max-width:520px;font-size:12px}
nav a{margin-right:12px} details summary{cursor:pointer}"""


def _plot_html(section: Section) -> str:
    body = section.figure.to_html(
        full_html=False, include_plotlyjs=False, include_mathjax=False, div_id=f"plotly-{section.name}",
        config={"displaylogo": False, "responsive": True},
    )
    return f'<div class="packrl-plot" id="plot-{section.name}">{body}</div>'


def _section_html(section: Section) -> str:
    parts = [f'<section class="packrl-section" id="section-{section.name}"><h2>{html.escape(section.title)}</h2>']
    if section.caption:
        parts.append(f'<p class="packrl-caption">{html.escape(section.caption)}</p>')
    if section.figure is not None:
        parts.append(_plot_html(section))
    if section.note:
        parts.append(f'<p class="packrl-note" id="note-{section.name}">{html.escape(section.note)}</p>')
    parts.append(section.body_html + "</section>")
    return "".join(parts)


def _header_html(run: RunData) -> str:
    steps = [int(m["step"]) for m in run.metrics]
    facts = [f"{len(steps)} step(s), {min(steps)}-{max(steps)}"]
    for key in ("model.path", "rollout.max_response_tokens", "rollout.max_response_tokens_schedule", "train.max_tokens_per_microbatch",
                "algorithm.adv_estimator"):
        value = run.config_value(key)
        if value is not None:
            facts.append(f"{key}={value}")
    if run.skipped_lines:
        facts.append("unreadable lines left out: " + ", ".join(f"{k}: {v}" for k, v in run.skipped_lines.items()))
    budgets = run.run_dir / "budgets.txt"
    budgets_html = ""
    if budgets.is_file():
        text = html.escape(budgets.read_text())
        budgets_html = f"<details><summary>Token budgets (budgets.txt)</summary><pre>{text}</pre></details>"
    return (f"<h1>packrl report: {html.escape(run.run_dir.name)}</h1>"
            f'<p class="packrl-meta">{html.escape(" · ".join(facts))}</p>{budgets_html}')


def render_html(run: RunData) -> str:
    """The whole page as one string, plotly.js inlined (no network access needed to view it)."""
    from plotly.offline import get_plotlyjs

    sections = build_sections(run)
    nav = "".join(f'<a href="#section-{s.name}">{html.escape(s.title)}</a>' for s in sections)
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>packrl report: {html.escape(run.run_dir.name)}</title><style>{_CSS}</style></head><body>",
        '<pre id="packrl-js-errors" hidden data-count="0"></pre>',
        f"<script>{_ERROR_HOOK}</script>",
        f'<script type="text/javascript">{get_plotlyjs()}</script>',
        _header_html(run), f"<nav>{nav}</nav>",
        *(_section_html(s) for s in sections),
        "</body></html>",
    ])


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the report of RUN_DIR to ``out`` (default ``RUN_DIR/report.html``) and return its path.

    Raises:
        ValueError: RUN_DIR is not a run (see `load_run`), or ``out`` is a directory.
        OSError: ``out`` cannot be written (its parent folders are created).
    """
    run = load_run(run_dir)
    path = Path(out) if out is not None else run.run_dir / "report.html"
    if path.is_dir():
        raise ValueError(f"--out {path} is a directory; pass a file path such as {path / 'report.html'}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(render_html(run), encoding="utf-8")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
