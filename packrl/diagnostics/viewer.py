"""Terminal viewer for rollout dumps (`packrl view RUN_DIR`).

Reads ``RUN_DIR/rollouts/step_N.jsonl`` (one JSON object per response, written when
``train.dump_rollouts=true``) and shows three panes: the steps with their summaries, the samples
of the highlighted step, and the prompt and response text of the highlighted sample.

The first half of this module is plain Python (reading, summarising, sorting, filtering) and is
tested without a terminal; the second half is the Textual app that draws it. Every dump is read
once, at start-up, because the step list needs each step's means: 100 steps of 512 responses
with ~1 KB of text each (68 MB) load in about 0.5 s on one CPU core, after which sorting and
filtering a step take under 1 ms (redrawing its table dominates). A line that is not a JSON
object with the fields the viewer shows is skipped and counted, never fatal: a run killed
mid-write leaves a partial line.

Example (three responses of one step):

    =====  ===============  =============  ======
    index  response_tokens  finish_reason  reward
    =====  ===============  =============  ======
    0      12               eos            1.0
    1      64               length         0.0
    2      30               stop           0.5
    =====  ===============  =============  ======

    sort_samples(samples, "length")  -> indices 1, 2, 0 (longest first)
    sort_samples(samples, "reward")  -> indices 0, 2, 1 (highest first)
    filter_samples(samples, "eos")   -> index 0
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rich.text import Text
from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import DataTable, Footer, Header, Static

SortKey = Literal["original", "length", "reward"]
"""Sample order: batch order, response tokens, or reward."""

FINISH_FILTERS: tuple[str | None, ...] = (None, "eos", "stop", "length", "context")
"""The finish-reason filter cycle (`f`); None shows every sample."""

TRUNCATED_REASONS: frozenset[str] = frozenset({"length", "context"})
"""Finish reasons that mean the response was cut by a token budget."""

_STEP_FILE = re.compile(r"^step_(\d+)\.jsonl$")
_INT_FIELDS = ("index", "prompt_tokens", "response_tokens")
_FLOAT_FIELDS = ("reward", "advantage")
_STR_FIELDS = ("prompt", "response", "finish_reason")
_MAX_REASONS_KEPT = 20


@dataclass(frozen=True, slots=True)
class Sample:
    """One response of a rollout dump, with the fields the viewer shows.

    Attributes:
        index: position in the step's batch (the "original" order).
        prompt: decoded prompt text.
        response: decoded response text.
        prompt_tokens: prompt length, tokens.
        response_tokens: response length, tokens.
        finish_reason: why generation stopped ("eos", "stop", "length", "context", "abort").
        reward: the response's reward.
        advantage: mean advantage over the response's loss tokens.
        prompt_truncated: whether the prompt was cut to fit ``data.max_prompt_tokens``.
        ground_truth: the reference answer ("" when the dump has none).
        data_source: the row's data source ("" when the dump has none).
        turns: a multi-turn response's segments ``(role, text, tokens, in_loss)``; empty otherwise.
        ended_by: what ended a multi-turn trajectory ("" for a single turn).
        dropped_turns: turns the rolling window dropped from the last turn's context.
        length_target: the response length its prompt asked for (``data.length_target``), or None.
        filtered: the filter that took it out of the loss (`packrl.algos.filters`), or None.
        forced: the response split around the end-of-thinking tokens its thinking budget forced
            ``(thinking, forced, answer)``; empty when nothing was forced.
    """

    index: int
    prompt: str
    response: str
    prompt_tokens: int
    response_tokens: int
    finish_reason: str
    reward: float
    advantage: float
    prompt_truncated: bool
    ground_truth: str = ""
    data_source: str = ""
    turns: tuple[tuple[str, str, int, bool], ...] = ()
    ended_by: str = ""
    dropped_turns: int = 0
    length_target: int | None = None
    filtered: str | None = None
    forced: tuple[str, ...] = ()

    @property
    def truncated(self) -> bool:
        """Whether a token budget cut the response (finish reason length or context)."""
        return self.finish_reason in TRUNCATED_REASONS


@dataclass(frozen=True, slots=True)
class StepDump:
    """The samples of one step's dump and the lines that could not be read.

    Attributes:
        step: the step number N of ``step_N.jsonl``.
        path: the dump file.
        samples: the readable responses, in file order.
        malformed: ``(line number, reason)`` of skipped lines, the first 20 at most.
        num_malformed: how many lines were skipped (all of them, not only those kept).
    """

    step: int
    path: Path
    samples: tuple[Sample, ...]
    malformed: tuple[tuple[int, str], ...] = ()
    num_malformed: int = 0

    @property
    def num_samples(self) -> int:
        """Readable responses in the dump."""
        return len(self.samples)

    @property
    def mean_reward(self) -> float:
        """Mean reward over the readable responses; nan when there are none."""
        return _mean([s.reward for s in self.samples])

    @property
    def mean_response_tokens(self) -> float:
        """Mean response length, tokens; nan when there are none."""
        return _mean([s.response_tokens for s in self.samples])

    @property
    def truncated_fraction(self) -> float:
        """Fraction of responses cut by a token budget; nan when there are none."""
        return _mean([float(s.truncated) for s in self.samples])


def _mean(values: list[float] | list[int]) -> float:
    return sum(values) / len(values) if values else math.nan


def rollouts_dir(run_dir: str | Path) -> Path:
    """Return ``RUN_DIR/rollouts``, checking that it exists.

    Raises:
        ValueError: RUN_DIR or its ``rollouts/`` folder does not exist.
    """
    run = Path(run_dir)
    if not run.is_dir():
        raise ValueError(f"run directory {str(run)!r} does not exist; give the RUN_DIR a `packrl train` run wrote (train.out_dir)")
    folder = run / "rollouts"
    if not folder.is_dir():
        raise ValueError(
            f"{str(run)!r} has no rollouts/ folder, so there are no rollout dumps to view; "
            "train with train.dump_rollouts=true to write rollouts/step_N.jsonl"
        )
    return folder


def find_step_files(run_dir: str | Path) -> dict[int, Path]:
    """Map each step N to ``RUN_DIR/rollouts/step_N.jsonl``, in step order.

    Raises:
        ValueError: no ``rollouts/`` folder (see `rollouts_dir`), or it holds no step files.
    """
    folder = rollouts_dir(run_dir)
    found = {int(m.group(1)): p for p in folder.iterdir() if (m := _STEP_FILE.match(p.name)) and p.is_file()}
    if not found:
        raise ValueError(
            f"{str(folder)!r} holds no step_N.jsonl files; the run may have stopped before its first step "
            "ended, or was trained with train.dump_rollouts=false"
        )
    return dict(sorted(found.items()))


def parse_sample(row: Any) -> Sample:
    """Build a `Sample` from one decoded JSON line of a dump.

    Raises:
        ValueError: the row is not an object, or a shown field is missing or of the wrong type.
    """
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    missing = [k for k in (*_INT_FIELDS, *_FLOAT_FIELDS, *_STR_FIELDS, "prompt_truncated") if k not in row]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")
    for key in _INT_FIELDS:
        if not isinstance(row[key], int) or isinstance(row[key], bool):
            raise ValueError(f"{key} should be an integer, got {row[key]!r}")
    for key in _FLOAT_FIELDS:
        if not isinstance(row[key], (int, float)) or isinstance(row[key], bool):
            raise ValueError(f"{key} should be a number, got {row[key]!r}")
    for key in _STR_FIELDS:
        if not isinstance(row[key], str):
            raise ValueError(f"{key} should be a string, got {row[key]!r}")
    if not isinstance(row["prompt_truncated"], bool):
        raise ValueError(f"prompt_truncated should be true or false, got {row['prompt_truncated']!r}")
    return Sample(
        index=row["index"], prompt=row["prompt"], response=row["response"],
        prompt_tokens=row["prompt_tokens"], response_tokens=row["response_tokens"],
        finish_reason=row["finish_reason"], reward=float(row["reward"]), advantage=float(row["advantage"]),
        prompt_truncated=row["prompt_truncated"],
        ground_truth=str(row.get("ground_truth", "")), data_source=str(row.get("data_source", "")),
        turns=_parse_turns(row.get("turns", [])), ended_by=str(row.get("ended_by", "")),
        dropped_turns=_count(row.get("dropped_turns", 0), "dropped_turns"),
        length_target=_count(row["length_target"], "length_target") if "length_target" in row else None,
        filtered=_filtered(row.get("filtered")), forced=_forced(row.get("forced")),
    )


def _forced(value: Any) -> tuple[str, ...]:
    """A dump row's ``forced`` object as ``(thinking, forced, answer)``, or () without one."""
    if value is None:
        return ()
    if not isinstance(value, dict) or not all(isinstance(value.get(k), str) for k in ("thinking", "forced", "answer")):
        raise ValueError(f"forced should be an object of thinking, forced and answer texts, got {value!r}")
    return value["thinking"], value["forced"], value["answer"]


def _count(value: Any, key: str) -> int:
    """A non-negative integer field of a dump row, or ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key} should be a non-negative integer, got {value!r}")
    return value


def _parse_turns(turns: Any) -> tuple[tuple[str, str, int, bool], ...]:
    """The ``turns`` of a dump row as tuples.

    Raises:
        ValueError: ``turns`` is not a list of objects with role, text, tokens and in_loss.
    """
    if not isinstance(turns, list) or not all(isinstance(t, dict) and {"role", "text", "tokens", "in_loss"} <= t.keys() for t in turns):
        raise ValueError("turns should be a list of {role, text, tokens, in_loss} objects")
    return tuple((str(t["role"]), str(t["text"]), int(t["tokens"]), bool(t["in_loss"])) for t in turns)


def read_step(path: str | Path, step: int) -> StepDump:
    """Read one ``step_N.jsonl``; unreadable lines are skipped and counted, blank lines ignored.

    Raises:
        OSError: the file cannot be opened.
    """
    path = Path(path)
    samples: list[Sample] = []
    malformed: list[tuple[int, str]] = []
    num_malformed = 0
    with path.open("rb") as f:
        for line_number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                samples.append(parse_sample(json.loads(raw)))
            except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError
                reason = f"not JSON ({err.msg})" if isinstance(err, json.JSONDecodeError) else str(err)
                num_malformed += 1
                if len(malformed) < _MAX_REASONS_KEPT:
                    malformed.append((line_number, reason))
    return StepDump(step=step, path=path, samples=tuple(samples), malformed=tuple(malformed), num_malformed=num_malformed)


def load_run(run_dir: str | Path) -> list[StepDump]:
    """Read every step dump of a run, in step order.

    Raises:
        ValueError: no ``rollouts/`` folder or no step files in it (see `find_step_files`).
    """
    return [read_step(path, step) for step, path in find_step_files(run_dir).items()]


def sort_samples(samples: tuple[Sample, ...] | list[Sample], key: SortKey, descending: bool = True) -> list[Sample]:
    """Order samples by ``key``; ties (and "original") keep batch order, a nan reward goes last.

    "original" is always ascending batch index; ``descending`` applies to "length" and "reward".
    """
    by_index = sorted(samples, key=lambda s: s.index)
    if key == "original":
        return by_index
    if key == "length":
        return sorted(by_index, key=lambda s: s.response_tokens, reverse=descending)
    if key == "reward":
        finite = [s for s in by_index if not math.isnan(s.reward)]
        return sorted(finite, key=lambda s: s.reward, reverse=descending) + [s for s in by_index if math.isnan(s.reward)]
    raise ValueError(f"unknown sort key {key!r}; use one of original, length, reward")


def filter_samples(samples: tuple[Sample, ...] | list[Sample], finish_reason: str | None) -> list[Sample]:
    """Keep the samples whose finish reason is ``finish_reason``; None keeps all."""
    return [s for s in samples if finish_reason is None or s.finish_reason == finish_reason]


def next_filter(current: str | None) -> str | None:
    """The finish-reason filter after ``current`` in `FINISH_FILTERS` (all -> eos -> ... -> all); unknown -> all."""
    position = FINISH_FILTERS.index(current) if current in FINISH_FILTERS else -1
    return FINISH_FILTERS[(position + 1) % len(FINISH_FILTERS)]


def view_samples(step: StepDump, key: SortKey, descending: bool, finish_reason: str | None) -> list[Sample]:
    """The rows the sample table shows: ``step``'s samples filtered, then sorted."""
    return sort_samples(filter_samples(step.samples, finish_reason), key, descending)


def _fmt(value: float, digits: int = 3) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def describe_sample(step: int, sample: Sample) -> Text:
    """The detail pane's text for one sample: a header line, the prompt and the response."""
    text = Text()
    text.append(f"step {step} · sample {sample.index}", style="bold")
    text.append(
        f" · reward {_fmt(sample.reward)} · advantage {_fmt(sample.advantage)} · finish {sample.finish_reason}"
        + (f" · source {sample.data_source}" if sample.data_source else "")
        + (f" · ground truth {sample.ground_truth!r}" if sample.ground_truth else "")
        + (f" · target {sample.length_target} tokens" if sample.length_target is not None else "")
        + (f" · taken out of the loss by the {sample.filtered} filter (not trained)" if sample.filtered else "")
        + "\n\n"
    )
    cut = " (prompt truncated)" if sample.prompt_truncated else ""
    text.append(f"PROMPT · {sample.prompt_tokens} tokens{cut}\n", style="bold cyan")
    text.append(sample.prompt + "\n\n")
    cut = f" (cut: {sample.finish_reason})" if sample.truncated else ""
    ended = f" · ended by {sample.ended_by}" if sample.ended_by else ""
    ended += f" · {sample.dropped_turns} turns dropped by the rolling window" if sample.dropped_turns else ""
    text.append(f"RESPONSE · {sample.response_tokens} tokens{cut}{ended}\n", style="bold green")
    if sample.forced:
        thinking, forced, answer = sample.forced
        text.append(thinking)
        text.append(f"{forced}", style="bold magenta")
        text.append("  [forced: the thinking budget ran out; not in the loss]\n", style="magenta")
        text.append(answer)
        return text
    if not sample.turns:
        text.append(sample.response)
        return text
    for role, body, tokens, in_loss in sample.turns:
        loss = "in the loss" if in_loss else "not in the loss"
        text.append(f"[{role} · {tokens} tokens · {loss}]\n", style="bold green" if in_loss else "bold magenta")
        text.append(body + "\n")
    return text


# ---------------------------------------------------------------- the Textual app


class RolloutViewer(App[None]):
    """Three panes: steps, the samples of the highlighted step, the highlighted sample's text."""

    TITLE = "packrl view"
    CSS = """
    #steps { width: 52; height: 1fr; }
    #right { width: 1fr; }
    #samples { height: 1fr; }
    #status { height: auto; background: $boost; padding: 0 1; }
    #detail-scroll { height: 1fr; border-top: solid $primary; }
    #detail { padding: 0 1; }
    """
    BINDINGS = [
        Binding("l", "sort('length')", "Sort length"),
        Binding("r", "sort('reward')", "Sort reward"),
        Binding("o", "sort('original')", "Original order"),
        Binding("f", "cycle_filter", "Filter finish"),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(self, steps: list[StepDump], run_dir: str | Path, initial_step: int | None = None) -> None:
        """Show ``steps`` (from `load_run`); ``initial_step`` is a step number, default the first.

        Raises:
            ValueError: ``steps`` is empty, or ``initial_step`` is not among them.
        """
        super().__init__()
        if not steps:
            raise ValueError(f"no step dumps to show for {str(run_dir)!r}; train with train.dump_rollouts=true")
        numbers = [s.step for s in steps]
        if initial_step is not None and initial_step not in numbers:
            raise ValueError(f"--step {initial_step} has no dump in {str(run_dir)!r}; steps with dumps: {_ranges(numbers)}")
        self.steps = steps
        self.run_dir = Path(run_dir)
        self.step_position = numbers.index(initial_step) if initial_step is not None else 0
        self.sort_key: SortKey = "original"
        self.descending = True
        self.finish_filter: str | None = None
        self.shown: list[Sample] = []

    @property
    def current_step(self) -> StepDump:
        """The step whose samples the table shows."""
        return self.steps[self.step_position]

    def compose(self) -> ComposeResult:
        """Lay out the panes."""
        yield Header()
        with Horizontal():
            yield DataTable(id="steps", cursor_type="row", zebra_stripes=True)
            with Vertical(id="right"):
                yield DataTable(id="samples", cursor_type="row", zebra_stripes=True)
                yield Static(id="status", markup=False)
                with VerticalScroll(id="detail-scroll"):
                    yield Static(id="detail", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        """Fill the step list and open the initial step."""
        self.sub_title = str(self.run_dir)
        steps = self.query_one("#steps", DataTable)
        steps.add_columns("step", "samples", "reward", "resp tok", "trunc", "skipped")
        for s in self.steps:
            steps.add_row(
                str(s.step), str(s.num_samples), _fmt(s.mean_reward), _fmt(s.mean_response_tokens, 1),
                "-" if math.isnan(s.truncated_fraction) else f"{s.truncated_fraction:.0%}",
                str(s.num_malformed) if s.num_malformed else "", key=str(s.step),
            )
        table = self.query_one("#samples", DataTable)
        table.add_columns("index", "resp tok", "prompt tok", "finish", "reward", "advantage", "prompt cut")
        steps.move_cursor(row=self.step_position)
        self.open_step(self.step_position)
        table.focus()

    def open_step(self, position: int) -> None:
        """Show the samples of ``self.steps[position]``, keeping the sort and the filter."""
        self.step_position = position
        self.refresh_samples()

    def refresh_samples(self) -> None:
        """Redraw the sample table for the current step, sort and filter; the cursor goes to the top."""
        step = self.current_step
        self.shown = view_samples(step, self.sort_key, self.descending, self.finish_filter)
        table = self.query_one("#samples", DataTable)
        table.clear()
        for s in self.shown:
            table.add_row(
                str(s.index), str(s.response_tokens), str(s.prompt_tokens), s.finish_reason,
                _fmt(s.reward), _fmt(s.advantage), "yes" if s.prompt_truncated else "", key=str(s.index),
            )
        if self.shown:
            table.move_cursor(row=0)
        self.query_one("#status", Static).update(self._status_line())
        self._show_detail(0)

    def _status_line(self) -> str:
        step = self.current_step
        order = "original order" if self.sort_key == "original" else f"by {self.sort_key} {'desc' if self.descending else 'asc'}"
        parts = [
            f"step {step.step}", f"{len(self.shown)}/{step.num_samples} samples",
            f"finish: {self.finish_filter or 'all'}", order,
        ]
        if step.num_malformed:
            line, reason = step.malformed[0]
            parts.append(f"{step.num_malformed} malformed line(s) skipped (line {line}: {reason})")
        return " · ".join(parts)

    def _show_detail(self, row: int) -> None:
        detail = self.query_one("#detail", Static)
        if 0 <= row < len(self.shown):
            detail.update(describe_sample(self.current_step.step, self.shown[row]))
        elif self.finish_filter is not None:
            detail.update(f"no sample of step {self.current_step.step} finished with {self.finish_filter!r}; press f to change the filter")
        else:
            detail.update(f"step {self.current_step.step} has no readable samples")

    @on(DataTable.RowHighlighted, "#steps")
    def _step_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.cursor_row != self.step_position:
            self.open_step(event.cursor_row)

    @on(DataTable.RowSelected, "#steps")
    def _step_selected(self, event: DataTable.RowSelected) -> None:
        self.query_one("#samples", DataTable).focus()

    @on(DataTable.RowHighlighted, "#samples")
    def _sample_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._show_detail(event.cursor_row)

    def action_sort(self, key: SortKey) -> None:
        """Sort by ``key``; the same key again flips the direction (length and reward)."""
        if key == self.sort_key and key != "original":
            self.descending = not self.descending
        else:
            self.sort_key, self.descending = key, True
        self.refresh_samples()

    def action_cycle_filter(self) -> None:
        """Show only the next finish reason of `FINISH_FILTERS`."""
        self.finish_filter = next_filter(self.finish_filter)
        self.refresh_samples()

    def shown_indices(self) -> list[int]:
        """The ``index`` column of the sample table, top to bottom, as drawn."""
        table = self.query_one("#samples", DataTable)
        return [int(table.get_row_at(row)[0]) for row in range(table.row_count)]


def _ranges(numbers: list[int]) -> str:
    """``[1, 2, 3, 5]`` -> ``"1-3, 5"``."""
    spans: list[list[int]] = []
    for n in sorted(numbers):
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _filtered(value: object) -> str | None:
    """A dump's ``filtered``: the filter's name (``true`` in dumps written before filters were named)."""
    if value is True:
        return "group"
    return value if isinstance(value, str) and value else None
