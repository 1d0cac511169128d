"""The prompt dataset of one split, and the seeded, resumable sampler over it (`packrl.data.sampler`).

`PromptDataset.build` reads every source, normalises each row (`examples.to_example`), and runs
the prompt policy once over all good chats at build time (through `packrl.data.prompts`, the
path `packrl audit` takes too), so every batch afterwards is a
lookup of canonical prompt ids. The cost is paid up front: building the 7,473-row GSM8K
training set with the SmolLM2 tokenizer took 1.0 s on a 2-core CPU. Rows are numbered globally
across the sources in order; the dataset's `PromptAccounting` has one outcome per input row
(bad rows are `rejected` with their reason), so its counts sum to the row count (length
invariant 6).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Sequence
from typing import Any

from packrl.config.budgets import PromptRoom, prompt_budget_fix
from packrl.config.schema import DataConfig
from packrl.data.prompts import (
    DatasetPrompt,
    ExtraRows,
    RowSource,
    account_rows,
    accounting_dict,
    budget_examples,
    extra_rows,
    load_examples,
    rendered_prompt_lengths,
)
from packrl.data.sampler import EpochSampler
from packrl.seqlen.microbatch import CapLimit
from packrl.seqlen.prompt_policy import PromptAccounting
from packrl.seqlen.stats import length_percentiles
from packrl.types import PromptBatch

logger = logging.getLogger("packrl.data")

_SHOWN_BAD_ROWS = 10
_NO_ROOM = re.compile(r"no room for any content after the template \((\d+) of")

__all__ = ["DatasetPrompt", "PromptDataset", "PromptSampler", "check_enough_prompts", "duplicate_rows"]


class PromptDataset:
    """Usable prompts of one split, in global row order, with the accounting of every input row."""

    def __init__(
        self,
        prompts: Sequence[DatasetPrompt],
        accounting: PromptAccounting,
        *,
        key: str = "data.train_files",
        origins: Sequence[RowSource] = (),
        extra: ExtraRows | None = None,
        room: PromptRoom | None = None,
    ):
        """``extra``: what reads a drawn prompt's extra inputs (its images: `ExtraRows.inputs`);
        None for a text dataset. ``room``: what the
        model context leaves for a prompt, so a fix never proposes a prompt budget it cannot hold
        (None: the context was not read)."""
        self.prompts: tuple[DatasetPrompt, ...] = tuple(prompts)
        self.accounting = accounting
        self.key = key
        self.room = room
        self.origins: tuple[RowSource, ...] = tuple(origins)
        self.duplicates: dict[int, int] = duplicate_rows(self.prompts)
        self.extra = extra if any(p.part_sizes for p in self.prompts) else None

    def __len__(self) -> int:
        return len(self.prompts)

    @classmethod
    def build(
        cls,
        sources: list[str],
        tokenizer: Any,
        data_cfg: DataConfig,
        *,
        seed: int,
        split: str,
        key: str,
        caps: Sequence[CapLimit] = (),
        chat_template_kwargs: dict[str, Any] | None = None,
        room: PromptRoom | None = None,
        max_target_tokens: int | None = None,
    ) -> PromptDataset:
        """Load, normalise and budget every row of ``sources``.

        Args:
            sources: ``data.train_files`` or ``data.val_files``, read in order.
            tokenizer: HF tokenizer with a chat template.
            data_cfg: the ``data`` section (instruction, system prompt, prompt budget and
                policy, ``skip_bad_rows``; for ``val``, ``max_val_rows``).
            seed: ``train.seed`` (picks the rows of ``task:arithmetic``).
            split: ``"train"`` or ``"val"``. For ``val`` with ``data.max_val_rows`` set, only
                the first ``max_val_rows`` rows (in source order) are read into the dataset.
            key: the config key of ``sources``, for messages.
            caps: the grouped caps a row's parts must fit (`budget_examples`).
            chat_template_kwargs: extra ``apply_chat_template`` arguments (`budget_examples`).
            room: what the model context leaves for a prompt (`PromptRoom.of`); the fixes of
                the errors below stay within it. None when the context is unknown.
            max_target_tokens: the response budget a row's length target must not exceed
                (`packrl.data.prompts.load_examples`), or None.

        Returns:
            The dataset; its accounting covers every row read.

        Raises:
            ValueError: a source cannot be read (see `load_rows`); bad rows without
                ``data.skip_bad_rows`` or, under ``data.overlong_prompt=error``, overlong prompts
                (one message names all of them, up to 10 of each kind); no usable prompt; for
                ``train``, fewer usable prompts than ``data.batch_size``.
        """
        rows = load_examples(sources, data_cfg, seed=seed, split=split, key=key, max_target_tokens=max_target_tokens)
        policy, budget = data_cfg.overlong_prompt, data_cfg.max_prompt_tokens
        # under `error` the budget is applied as `filter` first, so one message names every bad and overlong row
        prompts, outcomes = budget_examples(rows.examples, tokenizer, max_prompt_tokens=budget,
                                            policy="filter" if policy == "error" else policy, data_cfg=data_cfg,
                                            caps=caps, chat_template_kwargs=chat_template_kwargs)
        bad = {} if data_cfg.skip_bad_rows else rows.bad | {o.row: o.reason for o in outcomes if o.status == "rejected"}
        # a filtered outcome always records its prompt's token count (`apply_prompt_policy`)
        # (an image row whose images cannot fit data.max_image_tokens has no prompt length: its reason is named)
        overlong = {o.row: o.num_tokens or o.reason for o in outcomes if o.status == "filtered"} if policy == "error" else {}
        if bad or overlong:
            _raise_bad_rows(bad, overlong, rows.origins, key, budget, room)
        dataset = cls(prompts, account_rows(outcomes, rows.bad, rows.num_rows), key=key, origins=rows.origins,
                      extra=extra_rows(tokenizer, data_cfg, caps), room=room)
        lengths = dataset.prompt_length_percentiles()
        logger.info("%s: %s; prompt_length p50 %s, p99 %s, max %s tokens", key, dataset.accounting.summary(),
                    lengths["p50"], lengths["p99"], lengths["max"])
        if dataset.duplicates:
            first = next(iter(dataset.duplicates.items()))
            # a built-in task draws its questions with replacement: repeats there are expected
            built_in = all(dataset.origins[row].source.startswith("task:") for row in dataset.duplicates)
            logger.log(logging.INFO if built_in else logging.WARNING,
                       "%s: %d row(s) repeat an earlier row's prompt and answer (first: row %d = row %d); they are kept "
                       "and sampled as often as they appear (listed as duplicate_of in RUN_DIR/data_accounting.json)",
                       key, len(dataset.duplicates), *first)
        if not dataset.prompts:
            raise ValueError(f"{key}: no usable prompt ({dataset.accounting.summary()}); "
                             f"{_fix_hint(dataset.accounting, policy, room)}")
        if split == "train":
            check_enough_prompts(dataset, data_cfg.batch_size)
        return dataset

    def fingerprint(self) -> str:
        """sha256 (hex, 16 characters) of every usable prompt's ids, ground truth and data source, in
        order: what a resumed run must find again for its saved data position to mean the same prompts."""
        import hashlib

        digest = hashlib.sha256()
        for p in self.prompts:
            digest.update(repr((p.prompt_ids, p.example.ground_truth, p.example.data_source)).encode())
        return digest.hexdigest()[:16]

    def prompt_lengths(self) -> list[int]:
        """Prompt tokens of each usable prompt, in dataset order."""
        return [len(p.prompt_ids) for p in self.prompts]

    def prompt_length_percentiles(self) -> dict[str, int | None]:
        """Nearest-rank percentiles of the rendered prompt lengths (tokens, before the prompt
        policy) of every rendered row: keys ``p50 p90 p95 p99 max`` (None when no row rendered).

        Computed from the accounting with `rendered_prompt_lengths` and
        `packrl.seqlen.stats.length_percentiles`, as `packrl audit` computes its prompt
        percentiles, so the two agree for the same rows and config.
        """
        return length_percentiles(rendered_prompt_lengths(self.accounting))

    def extra_summary(self) -> str:
        """A line on the prompts' extra parts (`ExtraRows.summary`: a vision-language dataset's text
        and vision tokens and encoder patches) for ``RUN_DIR/budgets.txt``; "" for text prompts."""
        return "" if self.extra is None else self.extra.summary([(p.prompt_ids, p.part_sizes) for p in self.prompts], self.key)

    def accounting_dict(self) -> dict[str, Any]:
        """`PromptAccounting.to_dict` with, per row, ``source`` and ``source_row`` (where the row came
        from; 0-based among the rows of that source, blank jsonl lines not counted) and ``duplicate_of``
        (the earlier row it repeats, or None), and ``totals.num_duplicates``."""
        return accounting_dict(self.accounting, self.origins, self.duplicates)

    def batch(self, indices: Sequence[int]) -> PromptBatch:
        """The prompts at dataset positions ``indices`` (0 .. len-1, not global rows) as a `PromptBatch`."""
        chosen = [self.prompts[i] for i in indices]
        extra = self.extra
        inputs = None if extra is None else tuple(extra.inputs(p.example, p.prompt_ids, p.part_sizes) if p.part_sizes else None
                                                  for p in chosen)
        return PromptBatch(
            prompt_ids=tuple(p.prompt_ids for p in chosen),
            ground_truths=tuple(p.example.ground_truth for p in chosen),
            data_sources=tuple(p.example.data_source for p in chosen),
            rows=tuple(p.example.row for p in chosen),
            prompt_truncated=tuple(p.truncated for p in chosen),
            extra_inputs=inputs,
            length_targets=(tuple(p.example.length_target or 0 for p in chosen)
                            if any(p.example.length_target is not None for p in chosen) else None),
            length_modes=(tuple(p.example.length_mode or "exact" for p in chosen)
                          if any(p.example.length_mode is not None for p in chosen) else None),
        )

    def iter_batches(self, batch_size: int) -> Iterator[PromptBatch]:
        """Every prompt once, in order, ``batch_size`` at a time; the last batch may be smaller (validation)."""
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        for start in range(0, len(self), batch_size):
            yield self.batch(range(start, min(start + batch_size, len(self))))


def _raise_bad_rows(bad: dict[int, str], overlong: dict[int, int | str], origins: tuple[RowSource, ...], key: str, budget: int,
                    room: PromptRoom | None) -> None:
    """One error naming the bad rows (unreadable or unusable) and, under ``data.overlong_prompt=error``,
    the overlong ones (row -> prompt tokens, or why an image row cannot fit), each with its file and
    row inside the file. The fix for the overlong ones stays within ``room`` (`prompt_budget_fix`)."""
    def where(row: int) -> str:
        source, inner = origins[row].source, origins[row].source_row
        return f"row {row} ({source} line {inner + 1})" if source.endswith(".jsonl") else f"row {row} ({source} row {inner})"

    def listed(items: list[str]) -> str:
        more = f"; and {len(items) - _SHOWN_BAD_ROWS} more" if len(items) > _SHOWN_BAD_ROWS else ""
        return "; ".join(items[:_SHOWN_BAD_ROWS]) + more

    parts, fixes = [], []
    if bad:
        counted = f"{len(bad)} bad row(s) of {len(origins)} (rows count from 0, jsonl lines from 1)"
        parts.append(f"{counted}: " + listed([f"{where(r)}: {why}" for r, why in sorted(bad.items())]))
        fixes.append("fix the rows, or set data.skip_bad_rows=true to skip and count them")
    if overlong:
        lengths = [n for n in overlong.values() if isinstance(n, int)]
        unsized = len(lengths) < len(overlong)  # image rows whose images cannot fit their image budget
        parts.append(f"{len(overlong)} prompt(s) exceed data.max_prompt_tokens={budget}{' or their image budget' if unsized else ''}: "
                     + listed([f"{where(r)}: {n} tokens" if isinstance(n, int) else f"{where(r)}: {n}"
                               for r, n in sorted(overlong.items())]))
        fits = not lengths or room is None or max(lengths) <= room.max_prompt_tokens
        raise_to = f"{', or ' if fits else '; '}{prompt_budget_fix(max(lengths), room)}" if lengths else ""
        images = "; raise data.max_image_tokens or train.max_vision_patches_per_microbatch for the image rows" if unsized else ""
        fixes.append(f"set data.overlong_prompt to filter, left, right or middle{raise_to}{images}")
    message = "; ".join(fixes)
    raise ValueError(f"{key}: " + ". ".join(parts) + ". " + message[0].upper() + message[1:])


def duplicate_rows(prompts: Sequence[DatasetPrompt]) -> dict[int, int]:
    """Global row -> the earlier row it repeats, for usable prompts whose prompt ids, ground truth,
    data source and images equal an earlier one's (after the template and the prompt policy)."""
    first: dict[tuple, int] = {}
    repeats: dict[int, int] = {}
    for p in prompts:
        images = tuple((ref.data, ref.path) for ref in p.example.images)  # same text, other images: not a repeat
        seen = first.setdefault((p.prompt_ids, p.example.ground_truth, p.example.data_source, images), p.example.row)
        if seen != p.example.row:
            repeats[p.example.row] = seen
    return repeats


def check_enough_prompts(dataset: PromptDataset, batch_size: int) -> None:
    """Raise unless ``dataset`` holds at least ``batch_size`` usable prompts.

    Raises:
        ValueError: naming ``data.batch_size``, the count and the accounting summary.
    """
    if len(dataset) < batch_size:
        raise ValueError(
            f"{dataset.key}: {len(dataset)} usable prompt(s) < data.batch_size={batch_size} "
            f"({dataset.accounting.summary()}); add rows or lower data.batch_size"
            + (f", or {_fix_hint(dataset.accounting, room=dataset.room)}" if dataset.accounting.num_filtered else "")
        )


def _fix_hint(accounting: PromptAccounting, policy: str = "filter", room: PromptRoom | None = None) -> str:
    """The fix for a dataset with no usable prompt, by what filtered its rows: the chat template
    alone over the budget (truncation cannot help), an image budget (``data.max_image_tokens``,
    ``train.max_vision_patches_per_microbatch``), or the prompt budget (raising it, within what
    ``room`` leaves, or a truncating ``data.overlong_prompt`` when ``policy`` is not one already)."""
    overheads = [int(m.group(1)) for o in accounting.outcomes if (m := _NO_ROOM.search(o.reason))]
    if overheads:
        if room is not None and max(overheads) >= room.max_prompt_tokens:
            return (f"the chat template alone takes {max(overheads)} tokens, and no prompt budget the model context holds "
                    f"has room for more ({room.describe()}): shorten data.system_prompt / data.instruction, lower "
                    "rollout.max_response_tokens, or use a model with a longer context")
        return (f"raise data.max_prompt_tokens above {max(overheads)} tokens: the chat template alone takes that many, "
                "so no truncation can fit the prompt")
    for key in ("data.max_image_tokens", "train.max_vision_patches_per_microbatch"):
        capped = [o for o in accounting.outcomes if o.status == "filtered" and key in o.reason]
        if capped:
            return (f"raise {key} (the images of {len(capped):,} rows do not fit it even at data.image.min_pixels) "
                    "or lower data.image.min_pixels")
    if accounting.num_filtered:
        truncate = "" if policy in ("left", "right", "middle") else " or set data.overlong_prompt=left"
        shortest = min((o.num_tokens for o in accounting.outcomes if o.status == "filtered" and o.num_tokens), default=None)
        if room is not None and shortest is not None and shortest > room.max_prompt_tokens:
            return (f"no data.max_prompt_tokens the model context holds keeps the {accounting.num_filtered:,} filtered rows "
                    f"(the shortest has {shortest:,} tokens; {room.describe()}): set data.overlong_prompt=left, right or middle "
                    "to cut them to the budget, or use a model with a longer context")
        up_to = "" if room is None else f" up to {room.max_prompt_tokens:,} ({room.describe()})"
        return f"raise data.max_prompt_tokens{up_to} (it filtered {accounting.num_filtered:,} rows){truncate}"
    return "fix the rejected rows (reasons in parentheses); data.skip_bad_rows=true trains on the rest"


class PromptSampler(EpochSampler):
    """Batches of training prompts (`packrl.data.sampler.EpochSampler` over a `PromptDataset`,
    drop-last), reshuffled every epoch, resumable exactly, refused on other data. Without shuffle
    the same tail is always dropped, which is warned about.

    Raises:
        ValueError: fewer usable prompts than ``batch_size`` (`check_enough_prompts`).
    """

    def __init__(self, dataset: PromptDataset, batch_size: int, shuffle: bool, seed: int):
        check_enough_prompts(dataset, batch_size)
        super().__init__(dataset, batch_size, shuffle=shuffle, seed=seed, drop_last=True, noun="prompts")
        self.dataset = dataset
        left_out = len(dataset) % batch_size
        if left_out and not shuffle:
            logger.warning(
                "%d prompt(s) at the end of %s are never sampled: %d prompts do not divide into data.batch_size=%d "
                "without shuffling; set data.shuffle=true or a data.batch_size that divides %d",
                left_out, dataset.key, len(dataset), batch_size, len(dataset),
            )

    def next_batch(self) -> PromptBatch:
        """The next ``batch_size`` prompts; starts the next epoch when too few remain in this one."""
        return self.dataset.batch(self.next_indices())
