"""From raw rows to budgeted prompts: the one path `packrl train` and `packrl audit` both take.

    load_examples       sources -> raw rows (numbered globally) -> `Example` or bad-row reason
    budget_examples     examples -> chat template + tokenizer + prompt policy -> prompts, outcomes
    account_rows        outcomes + bad rows -> `PromptAccounting` (one outcome per input row)
    accounting_dict     accounting + where each row came from -> ``data_accounting.json``'s entry
                        (RL's prompts and SFT's traces alike)
    rendered_prompt_lengths   accounting -> prompt tokens of every rendered row, before the policy

`PromptDataset.build` (training) and `packrl.inspect.audit` (the audit) call exactly these
functions, so the prompt lengths the audit reports are the ones the trainer computes for the
same rows. `budget_examples` treats each row on its own (rendering is per row, the tokenizer
call is batched but per text), so running it over chunks of the examples, as the audit does
for its progress bar, gives the same outcomes as one call over all of them.

No torch import here: the audit loads this module without the trainer.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from packrl.config.schema import DataConfig
from packrl.config.tasks import TASK_PREFIX
from packrl.data.examples import GSM8K_SOURCE, Example, to_example
from packrl.data.length_targets import with_length_target
from packrl.data.loaders import load_rows
from packrl.data.task_sources import task_data_source
from packrl.seqlen.microbatch import CapLimit
from packrl.seqlen.prompt_policy import Policy, PromptAccounting, RowOutcome, apply_prompt_policy

if TYPE_CHECKING:
    from packrl.types import ExtraInputs


@dataclass(frozen=True, slots=True)
class RowSource:
    """Where a global row came from: the source string and the row's index inside it (0-based)."""

    source: str
    source_row: int


@dataclass(frozen=True, slots=True)
class DatasetPrompt:
    """One usable prompt: its example and its canonical prompt ids.

    Attributes:
        example: the normalised row (chat, ground truth, data source, global row).
        prompt_ids: rendered and tokenized prompt, ``len <= data.max_prompt_tokens``.
        truncated: True where the prompt policy shortened the prompt (or shrank its images).
        part_sizes: the size of each of the example's non-text parts as the prompt holds it, as
            its modality fitted it (an image's ``(width, height)`` pixels,
            `packrl.data.vision_prompts`): the size it is read at again when the prompt is drawn
            (`ExtraRows.inputs`); empty for a text prompt.
    """

    example: Example
    prompt_ids: tuple[int, ...]
    truncated: bool
    part_sizes: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class LoadedRows:
    """Every row read from the sources of one split, normalised.

    Attributes:
        raw_rows: the rows as loaded, in global row order.
        origins: where each global row came from (same length as ``raw_rows``).
        examples: the usable rows, in global row order (``Example.row`` is the global row).
        bad: global row -> the reason it is not usable (e.g. ``"missing field 'answer'"``).
    """

    raw_rows: tuple[Any, ...]
    origins: tuple[RowSource, ...]
    examples: tuple[Example, ...]
    bad: dict[int, str]

    @property
    def num_rows(self) -> int:
        return len(self.raw_rows)


def load_examples(sources: Sequence[str], data_cfg: DataConfig, *, seed: int, split: str, key: str,
                  max_target_tokens: int | None = None) -> LoadedRows:
    """Read every source in order and normalise each row (`packrl.data.examples.to_example`).

    Args:
        sources: ``data.train_files`` or ``data.val_files`` (files, ``task:`` sources, hub ids).
        data_cfg: the ``data`` section (instruction, system prompt, ``max_val_rows``, the tasks' options).
        seed: ``train.seed`` (picks the rows of a ``task:`` source).
        split: ``"train"`` or ``"val"``; for ``val`` only the first ``data.max_val_rows`` rows.
        key: the config key of ``sources``, for messages.
        max_target_tokens: the response budget a row's ``data.length_target.column`` must not
            exceed (`packrl.data.length_targets.with_length_target`), or None.

    Returns:
        `LoadedRows`; rows are numbered globally across the sources, from 0.

    Raises:
        ValueError: ``sources`` is empty, or a source cannot be read (see `load_rows`).
    """
    raw_rows, origins = _load_all(sources, data_cfg, seed=seed, split=split, key=key)
    examples: list[Example] = []
    bad: dict[int, str] = {}
    for row, (raw, origin) in enumerate(zip(raw_rows, origins)):
        made = origin.source.startswith(TASK_PREFIX)  # by a registered task: no file, rows labelled packrl/<task>
        data_source = task_data_source(origin.source) if made else GSM8K_SOURCE
        base_dir = None if made else Path(origin.source).expanduser().parent
        result = to_example(raw, row=row, instruction=data_cfg.instruction,
                            system_prompt=data_cfg.system_prompt, data_source=data_source, base_dir=base_dir)
        if not isinstance(result, str):
            result = with_length_target(result, raw, data_cfg.length_target, seed, max_tokens=max_target_tokens)
        if isinstance(result, str):
            bad[row] = result
        else:
            examples.append(result)
    return LoadedRows(tuple(raw_rows), tuple(origins), tuple(examples), bad)


def _load_all(sources: Sequence[str], data_cfg: DataConfig, *, seed: int, split: str, key: str) -> tuple[list[Any], list[RowSource]]:
    if not sources:
        raise ValueError(f"{key} is empty; set {key} to a file, task:arithmetic or a hub id")
    rows: list[Any] = []
    origins: list[RowSource] = []
    for source in sources:
        loaded = load_rows(source, data=data_cfg, seed=seed, split=split, key=key)
        rows.extend(loaded)
        origins.extend(RowSource(source, i) for i in range(len(loaded)))
    limit = data_cfg.max_val_rows if split == "val" else None
    if limit is not None and len(rows) > limit:
        logging.getLogger("packrl.data").info("%s: using the first %d of %d rows (data.max_val_rows)", key, limit, len(rows))
        rows, origins = rows[:limit], origins[:limit]
    return rows, origins


class ExtraRows(Protocol):
    """A modality's data side: how rows whose chat holds non-text parts (`Example.images`) become
    prompts through the model's processor, and how a drawn prompt's extra inputs are read again
    (rows with images: `packrl.data.vision_prompts.ImageRows`). `extra_rows` finds the one that
    serves a prompt encoder.
    """

    @property
    def tokenizer(self) -> Any:
        """The tokenizer of the text rows (the processor's own)."""
        ...

    def budget(self, examples: Sequence[Example], *, max_prompt_tokens: int, policy: Policy) -> list[tuple[Any, RowOutcome]]:
        """Per example, ``(prompt, outcome)``: ``prompt`` = ``(prompt_ids, part_sizes,
        num_tokens_removed)`` or None; ``outcome.row`` is the example's global row."""
        ...

    def inputs(self, example: Example, prompt_ids: Sequence[int], sizes: Sequence[tuple[int, ...]]) -> ExtraInputs:
        """A drawn prompt's extra inputs, read again at its ``part_sizes``.

        Raises:
            RuntimeError: they no longer give ``prompt_ids`` (a file changed during the run).
        """
        ...

    def summary(self, prompts: Sequence[tuple[Sequence[int], Sequence[tuple[int, ...]]]], key: str) -> str:
        """A line for ``RUN_DIR/budgets.txt`` on the prompts (each prompt's ids and part sizes)."""
        ...


def extra_rows(encoder: Any, data_cfg: DataConfig, caps: Sequence[CapLimit] = ()) -> ExtraRows | None:
    """The data side of the prompt encoder's modality (None for a text model's tokenizer), with
    the ``data`` section's settings and the grouped caps (`packrl.config.grouped_caps.grouped_cap_limits`)
    its parts must fit. Each modality's data module is asked in turn (images:
    `packrl.data.vision_prompts.image_rows`); another modality adds its own line.

    """
    from packrl.data.vision_prompts import image_rows

    return image_rows(encoder, data_cfg, caps)


def budget_examples(
    examples: Sequence[Example], tokenizer: Any, *, max_prompt_tokens: int, policy: Policy, data_cfg: DataConfig | None = None,
    caps: Sequence[CapLimit] = (), chat_template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[DatasetPrompt], list[RowOutcome]]:
    """Render, tokenize and fit each example's chat to the prompt budget (`apply_prompt_policy`;
    rows with non-text parts through the model's processor, `extra_rows`).

    Args:
        examples: usable rows; their ``row`` is the global row number.
        tokenizer: HF tokenizer with a chat template, or a multimodal model's processor
            (a vision-language one: ``image_processor`` + ``tokenizer``).
        max_prompt_tokens: ``data.max_prompt_tokens`` (tokens, template and generation prompt included).
        policy: ``data.overlong_prompt``.
        data_cfg: the ``data`` section, for rows with images (``image``, ``max_image_tokens``).
        caps: the grouped caps a row's parts must fit in one micro-batch (images are resized to
            ``train.max_vision_patches_per_microbatch``; `packrl.config.grouped_caps.grouped_cap_limits`).
        chat_template_kwargs: extra arguments of the text rows' ``apply_chat_template`` (the tool
            schemas, `packrl.chat.tool_schemas.template_kwargs`).

    Returns:
        ``(prompts, outcomes)``: the surviving prompts in row order, and one `RowOutcome` per
        example, numbered by global row. ``num_tokens`` of an outcome is the rendered prompt
        length before the policy (tokens), whatever the policy did.

    Raises:
        ValueError: as `apply_prompt_policy` (under ``error``, any overlong prompt), or as `extra_rows`.
    """
    extra = extra_rows(tokenizer, data_cfg or DataConfig(), caps)
    text = [e for e in examples if not e.images]
    result = apply_prompt_policy([e.chat for e in text], tokenizer if extra is None else extra.tokenizer, max_prompt_tokens, policy,
                                 row_numbers=[e.row for e in text], chat_template_kwargs=chat_template_kwargs)
    outcomes = [RowOutcome(text[o.row].row, o.status, o.reason, o.num_tokens, o.num_tokens_removed) for o in result.accounting.outcomes]
    prompts = [DatasetPrompt(text[p.row], p.prompt_ids, p.truncated) for p in result.prompts]
    parted = [e for e in examples if e.images]
    if extra is None:
        outcomes += [RowOutcome(e.row, "rejected", "a row with images needs a vision-language model.path (this model has no "
                                                   "image processor)") for e in parted]
    elif parted:
        fitted = extra.budget(parted, max_prompt_tokens=max_prompt_tokens, policy=policy)
        prompts += [DatasetPrompt(example, prompt[0], prompt[2] > 0, tuple(prompt[1]))
                    for example, (prompt, _) in zip(parted, fitted) if prompt is not None]
        outcomes += [outcome for _, outcome in fitted]
    order = {e.row: k for k, e in enumerate(examples)}
    return sorted(prompts, key=lambda p: order[p.example.row]), sorted(outcomes, key=lambda o: order[o.row])


def account_rows(outcomes: Sequence[RowOutcome], bad: dict[int, str], num_rows: int) -> PromptAccounting:
    """The accounting of all ``num_rows`` rows: bad rows ``rejected`` with their reason, the rest
    as the policy left them (length invariant 6: the counts sum to ``num_rows``)."""
    by_row: dict[int, RowOutcome] = {row: RowOutcome(row, "rejected", reason) for row, reason in bad.items()}
    for outcome in outcomes:
        by_row[outcome.row] = outcome
    assert sorted(by_row) == list(range(num_rows)), "every input row must have exactly one outcome"
    return PromptAccounting(tuple(by_row[r] for r in range(num_rows)))


def accounting_dict(accounting: PromptAccounting, origins: Sequence[RowSource],
                    duplicates: Mapping[int, int] | None = None) -> dict[str, Any]:
    """One split's entry of ``RUN_DIR/data_accounting.json``, for RL's prompts and SFT's traces
    alike: `PromptAccounting.to_dict` with, per row, ``source`` and ``source_row`` (where the row
    came from: the file or task and the row's 0-based index among that source's rows, blank jsonl
    lines not counted; None when ``origins`` is empty) and, when ``duplicates`` (row -> the
    earlier row it repeats) is given, ``duplicate_of`` per row and ``totals.num_duplicates``."""
    out = accounting.to_dict()
    for entry in out["rows"]:
        origin = origins[entry["row"]] if origins else None
        entry["source"] = origin and origin.source
        entry["source_row"] = origin and origin.source_row
        if duplicates is not None:
            entry["duplicate_of"] = duplicates.get(entry["row"])
    if duplicates is not None:
        out["totals"]["num_duplicates"] = len(duplicates)
    return out


def rendered_prompt_lengths(accounting: PromptAccounting) -> list[int]:
    """Prompt tokens of every row that was rendered (kept, truncated, filtered, or rejected after
    rendering), before any truncation, in row order. Rows rejected before rendering (bad rows)
    have no length and are left out."""
    return [o.num_tokens for o in accounting.outcomes if o.num_tokens is not None]
