"""Plotly figures of `packrl report`, one function per section.

Each function takes the run's per-step metrics (``metrics.jsonl``, one dict per step; see
docs/metrics.md) and returns a ``plotly.graph_objects.Figure``, or None when the run holds
none of the metrics the figure needs, so the page shows a note instead. The x axis is always
the training step. Values that are missing at a step or are not finite numbers are left out
of that step (validation, for one, runs only every ``train.val_every`` steps).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

Metrics = Sequence[dict[str, Any]]

FINISH_REASONS: tuple[str, ...] = ("eos", "stop", "length", "context", "abort")
"""Finish reasons in the order they stack (see DESIGN.md, glossary)."""

_STAGE_ORDER: tuple[str, ...] = ("gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor")
_BUCKET = re.compile(r"^bucket/(?P<metric>[^/]+)/(?P<lo>\d+)-(?P<hi>\d+)$")
_HEIGHT_PX = 380


def as_number(value: Any) -> float | None:
    """A finite float, or None for anything else (metrics.jsonl writes nan/inf as strings)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def series(metrics: Metrics, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` over the steps where it is a finite number."""
    steps, values = [], []
    for record in metrics:
        number = as_number(record.get(key))
        if number is not None and "step" in record:
            steps.append(int(record["step"]))
            values.append(number)
    return steps, values


def keys_with_prefix(metrics: Metrics, prefix: str) -> list[str]:
    """Metric names starting with ``prefix``, in first-seen order."""
    seen: dict[str, None] = {}
    for record in metrics:
        for key in record:
            if key.startswith(prefix):
                seen.setdefault(key, None)
    return list(seen)


def _layout(fig: go.Figure, *, y_title: str, height: int = _HEIGHT_PX, y_from_zero: bool = True, **extra: Any) -> go.Figure:
    fig.update_layout(
        template="plotly_white", height=height, margin={"l": 60, "r": 20, "t": 30, "b": 45},
        legend={"orientation": "h", "y": -0.18}, hovermode="x unified", **extra,
    )
    fig.update_xaxes(title_text="step", dtick=1 if _few_steps(fig) else None)
    fig.update_yaxes(title_text=y_title, rangemode="tozero" if y_from_zero else "normal")
    return fig


def _few_steps(fig: go.Figure) -> bool:
    xs = {x for trace in fig.data for x in (trace.x or ())}
    return 0 < len(xs) <= 20


def length_from_rollouts(per_step: dict[int, list[float]], budget: int | None) -> go.Figure | None:
    """Response tokens per step from the rollout dumps: a p10-p90 band, the median and the max.

    Args:
        per_step: step -> response tokens of each of its responses (``response_tokens``).
        budget: ``rollout.max_response_tokens`` drawn as a dashed line; None to leave it out.
    """
    steps = sorted(s for s, lengths in per_step.items() if lengths)
    if not steps:
        return None
    pct = np.array([np.percentile(per_step[s], [10, 50, 90]) for s in steps])  # [steps, 3]
    top = [max(per_step[s]) for s in steps]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=steps, y=pct[:, 0], name="p10", mode="lines", line={"width": 0.5, "color": "#7aa6d8"}))
    fig.add_trace(go.Scatter(x=steps, y=pct[:, 2], name="p90 (band p10-p90)", mode="lines", fill="tonexty",
                             fillcolor="rgba(31,119,180,0.2)", line={"width": 0.5, "color": "#7aa6d8"}))
    fig.add_trace(go.Scatter(x=steps, y=pct[:, 1], name="p50", mode="lines+markers", line={"color": "#1f77b4"}))
    fig.add_trace(go.Scatter(x=steps, y=top, name="max", mode="lines+markers", line={"color": "#d62728", "dash": "dot"}))
    _add_budget(fig, budget, "rollout.max_response_tokens")
    return _layout(fig, y_title="response tokens")


def length_from_metrics(metrics: Metrics, budget: int | None) -> go.Figure | None:
    """Response tokens per step from ``response_length/min|mean|max`` (no rollout dumps)."""
    fig = go.Figure()
    styles = {"min": {"color": "#7aa6d8"}, "mean": {"color": "#1f77b4"}, "max": {"color": "#d62728", "dash": "dot"}}
    for name, style in styles.items():
        steps, values = series(metrics, f"response_length/{name}")
        if steps:
            fig.add_trace(go.Scatter(x=steps, y=values, name=name, mode="lines+markers", line=style))
    if not fig.data:
        return None
    _add_budget(fig, budget, "rollout.max_response_tokens")
    return _layout(fig, y_title="response tokens")


def add_step_budget(fig: go.Figure | None, metrics: Metrics) -> go.Figure | None:
    """``fig`` with each step's response budget (``rollout/max_response_tokens``, tokens) as a
    stepped line when it changes over the run (a length curriculum); ``fig`` as it is otherwise."""
    steps, values = series(metrics, "rollout/max_response_tokens")
    if fig is not None and len(set(values)) > 1:
        fig.add_trace(go.Scatter(x=steps, y=values, name="budget of the step (length curriculum)", mode="lines",
                                 line={"color": "#555", "width": 1, "shape": "hv"}))
    return fig


def _add_budget(fig: go.Figure, budget: int | float | None, key: str) -> None:
    if budget:
        fig.add_hline(y=budget, line={"color": "#555", "dash": "dash", "width": 1},
                      annotation_text=f"{key}={budget:,}", annotation_position="top left")


def finish_reasons(metrics: Metrics) -> go.Figure | None:
    """Finish-reason mix (stacked fractions, ``response/finish_reason/*``) and the clip ratio
    (``response_length/clip_ratio``: share cut at a budget) per step."""
    fig = go.Figure()
    for reason in FINISH_REASONS:
        steps, values = series(metrics, f"response/finish_reason/{reason}")
        if steps and any(values):
            fig.add_trace(go.Bar(x=steps, y=values, name=reason))
    steps, values = series(metrics, "response_length/clip_ratio")
    if steps:
        fig.add_trace(go.Scatter(x=steps, y=values, name="clip ratio", mode="lines+markers", line={"color": "black"}))
    if not fig.data:
        return None
    return _layout(fig, y_title="fraction of responses", barmode="stack", yaxis={"range": [0, 1.05]})


TURN_SERIES = (("num_turns/mean", "turns (mean)"), ("num_turns/max", "turns (max)"),
                ("multi_turn/tool_calls", "tool calls"), ("multi_turn/malformed_calls", "malformed calls"),
                ("multi_turn/tool_errors", "tool errors"), ("multi_turn/tool_use_rate", "tool-use rate (fraction)"),
               ("multi_turn/dropped_turns", "turns dropped by the rolling window"))


ASYNC_SERIES = (("async/staleness_token_mean", "token staleness (mean, updates)"),
                ("async/staleness_token_max", "token staleness (max, updates)"),
                ("async/partial_ratio", "responses holding older tokens (fraction)"),
                ("async/carried_groups", "groups carried to the next step"),
                ("async/must_finish_groups", "groups at the staleness bound"),
                ("async/dropped_groups", "groups dropped (stale)"))


def staleness(metrics: Metrics) -> go.Figure | None:
    """Partial rollouts per step (``async/*``): staleness of the trained tokens, the share of
    responses carried across steps, the groups carried, at the bound and dropped; None for a
    ``sync`` run."""
    return _lines(metrics, ASYNC_SERIES, y_title="per step")


def _lines(metrics: Metrics, named: tuple[tuple[str, str], ...], *, y_title: str) -> go.Figure | None:
    fig = go.Figure()
    for key, name in named:
        steps, values = series(metrics, key)
        if steps:
            fig.add_trace(go.Scatter(x=steps, y=values, name=name, mode="lines+markers"))
    return _layout(fig, y_title=y_title) if fig.data else None


LENGTH_SERIES = (
    ("length/correct/mean", "correct responses, mean tokens"), ("length/correct/p95", "correct, p95"),
    ("length/wrong/mean", "wrong responses, mean tokens"), ("length/tokens_per_correct", "tokens per correct answer"),
    ("val/length/correct/mean", "validation: correct, mean tokens"), ("seqlen/forced_tokens", "forced end-of-thinking tokens"),
)


def length_control(metrics: Metrics) -> go.Figure | None:
    """Length control per step (``length/*``): how long correct and wrong responses are, tokens per
    correct answer, forced tokens and the responses each filter took out of the loss
    (``filter/<name>/dropped``, where a filter took any); None when no such metric was logged."""
    dropped = tuple((key, f"responses taken out by the {key.split('/')[1]} filter")
                    for key in keys_with_prefix(metrics, "filter/") if key.endswith("/dropped") and any(series(metrics, key)[1]))
    return _lines(metrics, LENGTH_SERIES + dropped, y_title="tokens / count")


def target_error(metrics: Metrics) -> go.Figure | None:
    """``|len - N| / N`` per step, over all targets and per target range (``length/target_error/*``);
    None without targets."""
    named = tuple((key, key.removeprefix("length/target_error/")) for key in keys_with_prefix(metrics, "length/target_error/"))
    return _lines(metrics, named, y_title="|len - N| / N") if named else None


def turns(metrics: Metrics) -> go.Figure | None:
    """Multi-turn rollouts per step: turns per trajectory (mean, max), tool calls, malformed calls
    and tool errors per trajectory, the share of trajectories that called a tool, and the turns the
    rolling window dropped per trajectory; None for a single-turn run."""
    return _lines(metrics, TURN_SERIES, y_title="per trajectory")


def padding(metrics: Metrics, max_tokens_per_microbatch: int | None) -> go.Figure | None:
    """Pad fraction of the update passes (``seqlen/pad_fraction``) and micro-batch fill, the
    largest micro-batch's real tokens (``seqlen/microbatch_tokens_max``) over
    ``train.max_tokens_per_microbatch``; without that budget the fill is left out."""
    fig = go.Figure()
    steps, values = series(metrics, "seqlen/pad_fraction")
    if steps:
        fig.add_trace(go.Scatter(x=steps, y=values, name="pad fraction", mode="lines+markers"))
    steps, values = series(metrics, "seqlen/microbatch_tokens_max")
    if steps and max_tokens_per_microbatch:
        fill = [v / max_tokens_per_microbatch for v in values]
        fig.add_trace(go.Scatter(x=steps, y=fill, name=f"largest micro-batch / {max_tokens_per_microbatch:,} tokens",
                                 mode="lines+markers", customdata=values,
                                 hovertemplate="%{y:.3f} (%{customdata:,} tokens)"))
    if not fig.data:
        return None
    return _layout(fig, y_title="fraction", yaxis={"range": [0, 1.05]})


def reward(metrics: Metrics) -> go.Figure | None:
    """Mean score (``critic/score/mean``), mean reward (``critic/rewards/mean``, score plus
    shaping) and validation accuracy (``val/accuracy``) per step."""
    fig = go.Figure()
    for key, name, mode in (("critic/score/mean", "score (mean)", "lines+markers"),
                            ("critic/rewards/mean", "reward (mean)", "lines"),
                            ("val/accuracy", "val accuracy", "lines+markers")):
        steps, values = series(metrics, key)
        if steps:
            line = {"dash": "dot"} if key == "critic/rewards/mean" else {}
            fig.add_trace(go.Scatter(x=steps, y=values, name=name, mode=mode, line=line,
                                     marker={"size": 10, "symbol": "diamond"} if key.startswith("val/") else None))
    if not fig.data:
        return None
    return _layout(fig, y_title="score / accuracy")


def stage_time(metrics: Metrics) -> go.Figure | None:
    """Wall time per stage (``timing_s/<stage>``) stacked per step, with the whole step
    (``timing_s/step``) as a line; the gap between them is untimed loop work."""
    stages = [k.removeprefix("timing_s/") for k in keys_with_prefix(metrics, "timing_s/")]
    ordered = [s for s in _STAGE_ORDER if s in stages] + sorted(s for s in stages if s not in _STAGE_ORDER and s != "step")
    fig = go.Figure()
    for stage in ordered:
        steps, values = series(metrics, f"timing_s/{stage}")
        if steps:
            fig.add_trace(go.Bar(x=steps, y=values, name=stage))
    steps, values = series(metrics, "timing_s/step")
    if steps:
        fig.add_trace(go.Scatter(x=steps, y=values, name="step (total)", mode="lines+markers", line={"color": "black"}))
    if not fig.data:
        return None
    return _layout(fig, y_title="seconds", barmode="stack")


def throughput(metrics: Metrics) -> go.Figure | None:
    """Tokens per second per device (``perf/throughput``) per step."""
    steps, values = series(metrics, "perf/throughput")
    if not steps:
        return None
    fig = go.Figure(go.Scatter(x=steps, y=values, name="throughput", mode="lines+markers"))
    return _layout(fig, y_title="tokens / s / device")


def buckets(metrics: Metrics) -> go.Figure | None:
    """Length-bucketed means (``bucket/<metric>/<lo>-<hi>``): one panel per metric, one line
    per response-length bucket [lo, hi) tokens, so trouble that grows with length shows."""
    found: dict[str, dict[tuple[int, int], str]] = {}
    for key in keys_with_prefix(metrics, "bucket/"):
        match = _BUCKET.match(key)
        if match:
            found.setdefault(match["metric"], {})[(int(match["lo"]), int(match["hi"]))] = key
    if not found:
        return None
    names = list(found)
    fig = make_subplots(rows=len(names), cols=1, shared_xaxes=True, subplot_titles=names,
                        vertical_spacing=min(0.15, 0.35 / len(names)))
    colors = ["#440154", "#31688e", "#35b779", "#fde725", "#e15759", "#79706e"]
    all_bounds = sorted({b for per in found.values() for b in per})
    for row, name in enumerate(names, start=1):
        for bounds in sorted(found[name]):
            steps, values = series(metrics, found[name][bounds])
            color = colors[all_bounds.index(bounds) % len(colors)]
            fig.add_trace(go.Scatter(x=steps, y=values, name=f"{bounds[0]}-{bounds[1]} tokens", mode="lines+markers",
                                     line={"color": color}, legendgroup=str(bounds), showlegend=row == 1), row=row, col=1)
    _layout(fig, y_title="", height=160 + 220 * len(names), y_from_zero=False)  # small differences between buckets matter
    fig.update_xaxes(title_text=None)
    fig.update_xaxes(title_text="step", row=len(names), col=1)
    return fig
