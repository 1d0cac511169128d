"""Length audit of a prompt dataset: what `packrl train` would do with every row, before it runs.

`audit_sources` reads the data files, renders and tokenizes every row through the path
training takes (`packrl.data.prompts`: row normalisation, chat template, instruction, system
prompt, prompt policy; rows with images through the configured model's processor), and reports:

- prompt tokens (template and generation prompt included, before any truncation): nearest-rank
  percentiles p50/p90/p95/p99/max, mean and a histogram. `length_percentiles` computes them, as
  `PromptDataset.prompt_length_percentiles` does for the trainer, from the same accounting;
- reference-answer tokens as a response-length proxy: the GSM8K ``answer`` field or verl's
  ``extra_info.answer``, tokenized without template (rows without one are left out);
- for ``data.max_prompt_tokens``, what each ``data.overlong_prompt`` policy would do;
- bad rows with their numbers and reasons (the rejection logic of training);
- suggested budgets (`suggest_budgets`);
- rows with images (`packrl.inspect.audit_images`): what training makes of them, and with a
  vision-language ``model.path`` their vision and text tokens per row and per fitted image size.

Rows are numbered from 0 across the DATA files in order, as training numbers them (a jsonl row
is a non-blank line). Percentiles are nearest-rank: ``pQ`` is the smallest length L with at
least Q% of the rows at or under L, so every value is a length some row has.

Rows with images and training: the audit gets the prompt encoder training gets
(`packrl.models.loading.load_prompt_encoder`). For a vision-language ``model.path`` that is its
processor, and image rows go through `packrl.data.vision_prompts` exactly as in training: each
image sized under ``data.image.*``, ``data.max_image_tokens`` and
``train.max_vision_patches_per_microbatch``, a row over
``data.max_prompt_tokens`` truncated by resizing its images (never cut inside one) or filtered,
an unreadable image a bad row; the counts per policy are what `PromptDataset.build` gives. For a
text ``model.path`` such rows are rejected with training's reason (``a row with images needs a
vision-language model.path ...``), and ``problems`` names the fix.

Results are cached (`cache_key`): sha256 of every data file's bytes, the tokenizer identity,
the processor identity (vision-language models), and every config value the audit reads
(`AuditSettings`, the whole ``data`` section among them).
A report that read image files, or a hub source, is not cached (those inputs are not in the
key). Cost, measured with `bench/bench_audit.py` on the 2-core CPU (SmolLM2 tokenizer, demo
preset, GSM8K train, 7,473 rows): cold 6.8 s wall on a lightly loaded machine, 6.3 s of CPU
(about 3 s importing transformers and loading the tokenizer, 1.1 s the render + tokenize pass
`PromptDataset.build` also makes, 1.7 s truncating the 732 rows over 128 tokens three ways);
warm 0.3 s per command, 0.1 s of it in the audit.

JSON keys (`AuditReport.to_dict`; every token count is in tokens of the audited tokenizer):

    schema                  int, report format version (3)
    sources                 [{source, num_rows, sha256 (null for task:/hub sources)}]
    model, tokenizer        the --model value; hex identity of the tokenizer files
    config                  {dotted key: value} of the config values used
    num_rows, num_bad_rows  rows read; rows training rejects
    bad_rows                [{row, source, source_row, reason}], first 1,000
    prompt_tokens           {num_rows, p50, p90, p95, p99, max, mean, histogram: {bin_edges, counts}}
    answer_tokens           same shape, or null when no row has a reference answer
    num_overlong            rows data.overlong_prompt=filter filters: over data.max_prompt_tokens,
                            or images that do not fit data.max_image_tokens
    policies                {filter|left|right|middle|error: {num_kept, num_truncated,
                            num_filtered, num_rejected, num_tokens_removed, num_rows_affected,
                            rows (first 20 affected rows), stops_training}}
    multimodal              null, or the rows with images: {num_rows, num_images, policy (the
                            configured one, error as filter, that the per-row numbers are under),
                            vision_tokens, text_tokens, total_tokens (length stats per row),
                            image_sizes: [{width, height, vision_tokens, encoder_patches,
                            num_images}] (first 20 fitted sizes), num_sizes, policies (as above,
                            these rows only), rows and changed: [{row, status, num_images,
                            vision_tokens, text_tokens, image_sizes, reason}] (first 20; changed:
                            truncated or filtered), processor (class name, or null for a text
                            model), geometry ({factor, merge, min_pixels, max_pixels,
                            extra_tokens}, or null), training}
    suggested               {data.max_prompt_tokens, train.max_tokens_per_microbatch, rule}
    problems                [str]: what would stop `packrl train` with this data and config, or
                            make it reject its rows with images (a text model.path)
    cached                  true when the report came from the cache
    wall_s, rows_per_s      time of this audit (s) and rows per second
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packrl.chat.tool_schemas import template_kwargs
from packrl.config.budgets import PromptRoom, prompt_budget_fix, response_schedule
from packrl.config.grouped_caps import grouped_cap_limits
from packrl.data.loaders import BadRow
from packrl.data.prompts import account_rows, budget_examples, load_examples, rendered_prompt_lengths
from packrl.inspect.audit_images import NEEDS_VISION_MODEL, image_rows, is_processor, multimodal_stats, reads_image_files
from packrl.inspect.audit_report import (
    SCHEMA_VERSION,
    AuditReport,
    BadRowInfo,
    LengthStats,
    PolicyOutcome,
    SourceInfo,
    SuggestedBudgets,
)
from packrl.models.modality import MODALITIES
from packrl.seqlen.microbatch import CapLimit
from packrl.seqlen.prompt_policy import POLICIES, Policy, RowOutcome
from packrl.seqlen.stats import length_percentiles

if TYPE_CHECKING:
    from packrl.config.schema import DataConfig, RunConfig
    from packrl.data.examples import Example
    from packrl.data.prompts import DatasetPrompt, LoadedRows

__all__ = [
    "AuditReport", "LengthStats", "PolicyOutcome", "audit_rows", "audit_sources", "cache_key",
    "length_percentiles", "suggest_budgets",
]

PROMPT_BUDGET_MULTIPLE = 64
MICROBATCH_MULTIPLE = 256
DATA_KEY = "DATA"
"""The name data-file errors use for the audited sources."""

_CHUNK_ROWS = 1024  # rows per render/tokenize call: the progress bar's step


def suggest_budgets(prompt_tokens: LengthStats, max_response_tokens: int, max_context_tokens: int | None = None) -> SuggestedBudgets:
    """Budgets that fit the audited prompts, within the model context.

    Rules:
        ``data.max_prompt_tokens`` = p99 of the prompt tokens rounded up to a multiple of 64:
        at most 1% of the rows are over it. When the model context minus
        ``rollout.max_response_tokens`` (`packrl.config.budgets.PromptRoom`) is smaller, that
        room instead (rounded down to a multiple of 64 when it is at least 64): more than 1% of
        the rows are then over it, and the rule says so and what to do with them.
        ``train.max_tokens_per_microbatch`` = (that prompt budget + ``rollout.max_response_tokens``)
        rounded up to a multiple of 256: one micro-batch holds the longest sequence the two
        budgets allow, which is also the smallest value the config accepts for that pair.

    Args:
        prompt_tokens: the audited prompt lengths (tokens).
        max_response_tokens: ``rollout.max_response_tokens``.
        max_context_tokens: the model context (``model.rope_scaling`` included); None when the
            model config was not read (no bound then).

    Returns:
        `SuggestedBudgets`; the budgets are None when no row rendered, or when the response
        budget leaves no room for a prompt in the model context.
    """
    if prompt_tokens.p99 is None:
        return SuggestedBudgets(None, None, "no rendered prompt: no suggestion")
    prompt = _round_up(prompt_tokens.p99, PROMPT_BUDGET_MULTIPLE)
    rule = f"data.max_prompt_tokens = p99 ({prompt_tokens.p99:,}) rounded up to a multiple of {PROMPT_BUDGET_MULTIPLE}"
    room = None if max_context_tokens is None else PromptRoom(max_context_tokens, max_response_tokens)
    if room is not None and prompt > room.max_prompt_tokens:
        if room.max_prompt_tokens < 1:
            return SuggestedBudgets(None, None, f"no prompt budget fits: {room.describe()}; lower rollout.max_response_tokens "
                                                "or use a model with a longer context")
        fitted = room.max_prompt_tokens // PROMPT_BUDGET_MULTIPLE * PROMPT_BUDGET_MULTIPLE or room.max_prompt_tokens
        rule = (f"p99 rounded up ({prompt:,}) does not fit: {room.describe()}, so data.max_prompt_tokens = {fitted:,} and more "
                "than 1% of the rows are over it: set data.overlong_prompt=filter (drop them) or left/right/middle (cut them), "
                "or use a model with a longer context")
        prompt = fitted
    microbatch = _round_up(prompt + max_response_tokens, MICROBATCH_MULTIPLE)
    rule += (f"; train.max_tokens_per_microbatch = ({prompt:,} + rollout.max_response_tokens={max_response_tokens:,}) "
             f"rounded up to a multiple of {MICROBATCH_MULTIPLE}")
    return SuggestedBudgets(prompt, microbatch, rule)


def _round_up(value: int, multiple: int) -> int:
    return max(multiple, -(-value // multiple) * multiple)


def audit_rows(loaded: LoadedRows, tokenizer: Any, cfg: RunConfig, *, progress: bool | None = None,
               max_context_tokens: int | None = None) -> AuditReport:
    """Audit rows already read and normalised (`packrl.data.load_examples`).

    Args:
        loaded: the rows, their origins, examples and bad-row reasons.
        tokenizer: what renders the model's prompts, as training gets it (`load_prompt_encoder`):
            the HF (fast) tokenizer with a chat template of a text model, or a vision-language
            model's processor (``image_processor`` + ``tokenizer``), which reads and sizes images.
        cfg: the run config (``data``, ``model.path``, ``rollout.max_response_tokens``, ``train``).
        progress: show a tqdm bar on stderr (None: only on a terminal).
        max_context_tokens: the model context (`packrl.models.model_config.load_model_context`);
            the suggested budgets and the fixes stay within it. None: not read.

    Returns:
        The report with ``cached=False``; ``wall_s`` covers this call only.

    Raises:
        ValueError: a processor without Qwen2-VL-style geometry when rows have images (as
            training raises, `packrl.data.images.ImageGeometry.of`).
    """
    start = time.perf_counter()
    settings = AuditSettings.of(cfg)
    data = settings.data
    passes = _Passes.run(loaded.examples, tokenizer, settings, progress)
    accounting = account_rows(passes.base, loaded.bad, loaded.num_rows)
    prompt_tokens = LengthStats.from_lengths(rendered_prompt_lengths(accounting))
    answers = _answer_lengths(loaded, tokenizer.tokenizer if is_processor(tokenizer) else tokenizer)
    with_images = set(image_rows(loaded))
    configured = {o.row: o for o in accounting.outcomes} | passes.outcomes(data.overlong_prompt)
    multimodal = multimodal_stats(loaded, tokenizer, data, outcomes=configured,
                                  prompts=passes.image_prompts(data.overlong_prompt),
                                  policies=passes.policies(accounting.outcomes, keep=with_images.__contains__),
                                  max_image_patches=settings.max_image_patches)
    bad_rows = tuple(
        BadRowInfo(o.row, loaded.origins[o.row].source, loaded.origins[o.row].source_row, o.reason)
        for o in accounting.outcomes if o.status == "rejected"
    )
    report = AuditReport(
        sources=_source_infos(loaded), model="", tokenizer="", config=dict(settings.shown),
        num_rows=loaded.num_rows, num_bad_rows=len(bad_rows), bad_rows=bad_rows[: AuditReport.MAX_BAD_ROWS],
        prompt_tokens=prompt_tokens, answer_tokens=LengthStats.from_lengths(answers) if answers else None,
        num_overlong=len(passes.overlong), policies=passes.policies(accounting.outcomes), multimodal=multimodal,
        suggested=suggest_budgets(prompt_tokens, settings.max_response_tokens, max_context_tokens),
        problems=(), read_image_files=reads_image_files(loaded, tokenizer),
    )
    needs_vision = 0 if is_processor(tokenizer) else sum(1 for e in loaded.examples if e.images)
    room = None if max_context_tokens is None else PromptRoom(max_context_tokens, settings.max_response_tokens)
    report = replace(report, problems=_problems(report, data, settings.model_path, num_need_vision=needs_vision, room=room))
    return report.timed(time.perf_counter() - start)


@dataclass(frozen=True, slots=True)
class _Counts:
    """Row counts per status of a set of outcomes (kept, truncated, filtered, rejected)."""

    kept: int
    truncated: int
    filtered: int
    rejected: int

    @classmethod
    def of(cls, outcomes: Sequence[RowOutcome]) -> _Counts:
        statuses = [o.status for o in outcomes]
        return cls(*(statuses.count(s) for s in ("kept", "truncated", "filtered", "rejected")))


_TRUNCATING = tuple(p for p in POLICIES if p not in ("filter", "error"))


@dataclass(frozen=True, slots=True)
class AuditSettings:
    """Every config value an audit reads, and nothing else of the config: a report is a function of
    these, the rows, the tokenizer (or processor) and the model context, so the cache key holds
    them all (`cache_key`: a new ``data`` option is in it without being named there).

    Attributes:
        data: the whole ``data`` section (sources' tasks and their options, rendering, budgets,
            images, length targets).
        seed: ``train.seed`` (the rows of a ``task:`` source, drawn length targets).
        model_path: ``model.path`` (named in the report's problems).
        max_response_tokens: ``rollout.max_response_tokens`` (suggested budgets, the prompt room).
        max_target_tokens: the smallest response budget of the schedule
            (``rollout.max_response_tokens_schedule``): a length target every stage can reach.
        caps: the grouped caps images are sized to (`packrl.config.grouped_caps.grouped_cap_limits`),
            as `PromptDataset.build` passes them.
        max_image_patches: ``train.max_vision_patches_per_microbatch`` (the report's image rows).
        chat_template_kwargs: what every prompt renders with (the tool schemas of
            ``rollout.multi_turn``, `packrl.chat.tool_schemas.template_kwargs`).
        shown: the config values the report lists (``config``, `_config_values`).
    """

    data: DataConfig
    seed: int
    model_path: str
    max_response_tokens: int
    max_target_tokens: int
    caps: tuple[CapLimit, ...]
    max_image_patches: int | None
    chat_template_kwargs: dict[str, Any]
    shown: dict[str, Any]

    @classmethod
    def of(cls, cfg: RunConfig) -> AuditSettings:
        return cls(data=cfg.data, seed=cfg.train.seed, model_path=cfg.model.path, max_response_tokens=cfg.rollout.max_response_tokens,
                   max_target_tokens=min(budget for _, budget in response_schedule(cfg.rollout).stages),
                   caps=grouped_cap_limits(cfg.train), max_image_patches=cfg.train.max_vision_patches_per_microbatch,
                   chat_template_kwargs=template_kwargs(cfg.rollout.multi_turn), shown=_config_values(cfg))

    def apply(self, examples: Sequence[Example], encoder: Any, policy: Policy) -> tuple[list[DatasetPrompt], list[RowOutcome]]:
        """`budget_examples` over ``examples`` under ``policy``, as `PromptDataset.build` calls it in training."""
        return budget_examples(examples, encoder, max_prompt_tokens=self.data.max_prompt_tokens, policy=policy,
                               data_cfg=self.data, caps=self.caps, chat_template_kwargs=self.chat_template_kwargs)


@dataclass(frozen=True, slots=True)
class _Passes:
    """The audit's calls of `budget_examples`, as `PromptDataset.build` makes them for each policy.

    ``base``: every example under ``filter`` (an outcome's ``num_tokens`` is the row's full prompt
    length); ``overlong``: the rows it filtered (over ``data.max_prompt_tokens``, or images over
    ``data.max_image_tokens``); ``cuts``: those rows under each truncating policy. Any other row's
    outcome is its base one under every policy: a row within the budget is kept, and a row
    rejected before the budget applies is rejected, whatever the policy. ``prompts``: the
    prompts of rows with images, per pass (``filter`` and each truncating policy).
    """

    base: list[RowOutcome]
    overlong: list[int]
    cuts: dict[str, list[RowOutcome]]
    prompts: dict[str, list[DatasetPrompt]]

    @classmethod
    def run(cls, examples: Sequence[Example], encoder: Any, settings: AuditSettings, progress: bool | None) -> _Passes:
        base, prompts = _render_all(examples, encoder, settings, progress)
        overlong = [e for e, o in zip(examples, base) if o.status == "filtered"]
        cuts, cut_prompts = _truncate_overlong(overlong, encoder, settings, progress)
        return cls(base, [e.row for e in overlong], cuts, {"filter": prompts} | cut_prompts)

    def outcomes(self, policy: str) -> dict[int, RowOutcome]:
        """Global row -> outcome under ``policy`` for the rows a truncating policy changes (none otherwise)."""
        return {o.row: o for o in self.cuts.get(policy, [])}

    def image_prompts(self, policy: str) -> list[DatasetPrompt]:
        """The prompts of rows with images under ``policy`` (``error``: as ``filter``), in row order."""
        cut = self.prompts[policy] if policy in _TRUNCATING else []
        return sorted([*self.prompts["filter"], *cut], key=lambda p: p.example.row)

    def policies(self, outcomes: Sequence[RowOutcome], keep: Callable[[int], bool] | None = None) -> tuple[PolicyOutcome, ...]:
        """Every policy's `PolicyOutcome` over ``outcomes`` (the base accounting of all rows, bad rows
        included), or over the rows ``keep`` accepts."""
        def kept(items: Sequence[RowOutcome]) -> list[RowOutcome]:
            return [o for o in items if keep is None or keep(o.row)]

        base, overlong = _Counts.of(kept(outcomes)), [r for r in self.overlong if keep is None or keep(r)]
        return tuple(_policy_outcome(p, base, overlong, kept(self.cuts.get(p, []))) for p in POLICIES)


def _render_all(examples: Sequence[Example], encoder: Any, settings: AuditSettings,
                progress: bool | None) -> tuple[list[RowOutcome], list[DatasetPrompt]]:
    """Outcomes of every example under ``filter`` (so ``num_tokens`` is each full prompt length),
    in chunks of `_CHUNK_ROWS` rows for the progress bar, and the prompts of rows with images."""
    from tqdm import tqdm

    outcomes: list[RowOutcome] = []
    prompts: list[DatasetPrompt] = []
    with tqdm(total=len(examples), unit="row", desc="audit: render + tokenize", disable=_no_bar(progress)) as bar:
        for start in range(0, len(examples), _CHUNK_ROWS):
            chunk = examples[start : start + _CHUNK_ROWS]
            made, outcome = settings.apply(chunk, encoder, "filter")
            outcomes += outcome
            prompts += [p for p in made if p.example.images]
            bar.update(len(chunk))
    return outcomes, prompts


def _no_bar(progress: bool | None) -> bool | None:
    return None if progress is None else not progress


def _truncate_overlong(overlong: Sequence[Example], encoder: Any, settings: AuditSettings,
                       progress: bool | None) -> tuple[dict[str, list[RowOutcome]], dict[str, list[DatasetPrompt]]]:
    """Outcomes of the overlong rows under each truncating policy (left, right, middle), and the
    prompts of those with images."""
    from tqdm import tqdm

    cuts: dict[str, list[RowOutcome]] = {side: [] for side in _TRUNCATING}
    prompts: dict[str, list[DatasetPrompt]] = {side: [] for side in _TRUNCATING}
    with tqdm(total=len(_TRUNCATING) * len(overlong), unit="row", desc="audit: truncate overlong rows",
              disable=_no_bar(progress) if overlong else True) as bar:
        for side in _TRUNCATING:
            for start in range(0, len(overlong), _CHUNK_ROWS // 8):
                chunk = overlong[start : start + _CHUNK_ROWS // 8]
                made, outcomes = settings.apply(chunk, encoder, side)
                cuts[side] += outcomes
                prompts[side] += [p for p in made if p.example.images]
                bar.update(len(chunk))
    return cuts, prompts


def _policy_outcome(policy: str, base: _Counts, overlong: Sequence[int], cuts: list[RowOutcome]) -> PolicyOutcome:
    """What ``policy`` does with the ``overlong`` rows (``cuts``: their outcomes under a truncating
    policy); every other row is as the base pass left it. A truncating policy filters a row only
    when its images cannot shrink enough (text rows are truncated or rejected)."""
    rows = list(overlong)
    common: dict[str, Any] = {"policy": policy, "num_kept": base.kept, "num_rows_affected": len(rows),
                              "rows": tuple(rows[: PolicyOutcome.MAX_ROWS])}
    if policy in ("filter", "error"):
        filtered = len(rows) if policy == "filter" else 0
        return PolicyOutcome(**common, num_truncated=0, num_filtered=filtered, num_rejected=base.rejected,
                             num_tokens_removed=0, stops_training=policy == "error" and bool(rows))
    cut = _Counts.of(cuts)
    return PolicyOutcome(**common, num_truncated=cut.truncated, num_filtered=cut.filtered, num_rejected=base.rejected + cut.rejected,
                         num_tokens_removed=sum(o.num_tokens_removed for o in cuts), stops_training=False)


def _reference_answer(raw: Any) -> str | None:
    """The reference solution of a row: GSM8K ``answer``, else verl ``extra_info.answer``."""
    if not isinstance(raw, dict):
        return None
    if "prompt" not in raw and isinstance(raw.get("answer"), str):
        return raw["answer"]
    extra = raw.get("extra_info")
    answer = extra.get("answer") if isinstance(extra, dict) else None
    return answer if isinstance(answer, str) else None


def _answer_lengths(loaded: LoadedRows, tokenizer: Any) -> list[int]:
    texts = [a for e in loaded.examples if (a := _reference_answer(loaded.raw_rows[e.row])) is not None]
    lengths: list[int] = []
    for start in range(0, len(texts), _CHUNK_ROWS):
        lengths += map(len, tokenizer(texts[start : start + _CHUNK_ROWS], add_special_tokens=False)["input_ids"])
    return lengths


def _source_infos(loaded: LoadedRows) -> tuple[SourceInfo, ...]:
    counts: dict[str, int] = {}
    for origin in loaded.origins:
        counts[origin.source] = counts.get(origin.source, 0) + 1
    return tuple(SourceInfo(s, n, None) for s, n in counts.items())


def _config_values(cfg: RunConfig) -> dict[str, Any]:
    """The config values a report depends on, by dotted key (also part of the cache key)."""
    d, a = cfg.data, cfg.data.arithmetic
    return {
        "data.max_prompt_tokens": d.max_prompt_tokens, "data.overlong_prompt": d.overlong_prompt,
        "data.instruction": d.instruction, "data.system_prompt": d.system_prompt,
        "data.skip_bad_rows": d.skip_bad_rows, "data.batch_size": d.batch_size,
        "data.arithmetic": [a.num_rows, a.digits, a.num_operands, a.operators], "train.seed": cfg.train.seed,
        "data.char_count": [getattr(d.char_count, f.name) for f in fields(d.char_count)],
        "rollout.max_response_tokens": cfg.rollout.max_response_tokens,
        "rollout.max_response_tokens_schedule": cfg.rollout.max_response_tokens_schedule,
        "data.length_target": [getattr(d.length_target, f.name) for f in fields(d.length_target)],
        "train.max_tokens_per_microbatch": cfg.train.max_tokens_per_microbatch,
        "data.max_image_tokens": d.max_image_tokens,
        "train.max_vision_patches_per_microbatch": cfg.train.max_vision_patches_per_microbatch,
        **{f"data.image.{f.name}": getattr(d.image, f.name) for f in fields(d.image)},
    }


def _problems(report: AuditReport, data: DataConfig, model_path: str, *, num_need_vision: int,
              room: PromptRoom | None) -> tuple[str, ...]:
    """What would stop `packrl train` with this data and the ``data`` section, each with its fix (a
    prompt budget within ``room``, what the model context leaves); and the ``num_need_vision``
    rows with images that a text ``model_path`` (``model.path``) makes training reject."""
    out = []
    if report.num_bad_rows and not data.skip_bad_rows:
        first = report.bad_rows[0]
        out.append(f"{report.num_bad_rows:,} bad row(s) (first: row {first.row}: {first.reason}) with data.skip_bad_rows=false; "
                   "fix the rows or set data.skip_bad_rows=true")
    chosen = report.policy(data.overlong_prompt)
    if chosen.stops_training:
        longest = report.prompt_tokens.max or 0
        fix = (f"{prompt_budget_fix(longest, room)}, or pick another policy" if room is None or longest <= room.max_prompt_tokens
               else f"pick another policy: {prompt_budget_fix(longest, room)}")
        out.append(f"{report.num_overlong:,} prompt(s) > data.max_prompt_tokens={data.max_prompt_tokens:,} with "
                   f"data.overlong_prompt=error; {fix}")
    usable = chosen.num_kept + chosen.num_truncated
    if usable < data.batch_size and not chosen.stops_training:
        can_raise = room is None or data.max_prompt_tokens < room.max_prompt_tokens
        more = ""
        if chosen.num_filtered:
            more = (" or raise data.max_prompt_tokens" + ("" if room is None else f" (up to {room.max_prompt_tokens:,}: "
                                                          f"{room.describe()})") if can_raise else
                    f" (data.max_prompt_tokens cannot grow: {room.describe() if room else ''}; a truncating "
                    "data.overlong_prompt keeps the filtered rows)")
        if chosen.num_filtered and report.multimodal is not None:
            more += (" (for image rows, also data.max_image_tokens and train.max_vision_patches_per_microbatch; "
                     "the filtered rows' reasons are in the rows listed above)")
        out.append(f"{usable:,} usable prompt(s) < data.batch_size={data.batch_size:,}; add rows or lower data.batch_size{more}")
    if num_need_vision:
        out.append(f"{num_need_vision:,} row(s) with images, which training rejects with the text model.path={model_path!r} "
                   f"({NEEDS_VISION_MODEL}); set model.path (or --model) to a vision-language model "
                   f"({', '.join(MODALITIES.names())}) to train on them")
    return tuple(out)


def cache_key(sources: Sequence[str], tokenizer_id: str, cfg: RunConfig, processor_id: str | None = None,
              max_context_tokens: int | None = None) -> str | None:
    """Hex sha256 of what a report depends on: the format version, each source (its string
    and the sha256 of its bytes; a ``task:`` source is made from the config, which the key holds),
    the tokenizer identity, the processor identity (its files: the image geometry and how images
    expand; None for a text model), the transformers and tokenizers versions (rendering,
    tokenization and image processing code), every config value the audit reads
    (`AuditSettings`: the whole ``data`` section, so every task's options and every new ``data``
    option, with the seed, ``model.path``, the response budgets, the grouped caps and the tool
    schemas) and the model context (it bounds the suggested budgets; None when not read).
    None when a source is not a local file or ``task:`` (a hub dataset can change without its id
    changing)."""
    parts: list[Any] = []
    for source in sources:
        path = Path(source).expanduser()
        if source.startswith("task:"):
            parts.append([source, None])
        elif path.is_file():
            parts.append([source, file_sha256(path)])
        else:
            return None
    versions = [_version("transformers"), _version("tokenizers")]
    settings = asdict(AuditSettings.of(cfg))
    blob = json.dumps([SCHEMA_VERSION, parts, tokenizer_id, processor_id, versions, settings, max_context_tokens],
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes (1 MiB reads)."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def audit_sources(
    sources: Sequence[str],
    cfg: RunConfig,
    *,
    tokenizer_loader: Callable[[], Any],
    tokenizer_id: str,
    model: str,
    processor_id: str | None = None,
    cache_dir: Path | None = None,
    progress: bool | None = None,
    max_context_tokens: int | None = None,
) -> AuditReport:
    """Audit the rows of ``sources`` with the tokenizer (or processor) ``tokenizer_loader`` returns, using the cache.

    Args:
        sources: data files (``.jsonl``/``.json``/``.parquet``), ``task:arithmetic`` or hub ids,
            as ``data.train_files`` accepts; read as the training split.
        cfg: the run config.
        tokenizer_loader: returns what renders the prompts (see `audit_rows`: the tokenizer, or a
            vision-language model's processor); called only on a cache miss.
        tokenizer_id: identity of that tokenizer (e.g. a hash of its files), part of the cache key.
        model: the model path the tokenizer came from, for the report.
        processor_id: identity of the processor (a hash of its files) when the loader returns one,
            part of the cache key; None for a text model.
        cache_dir: where reports are cached (``<packrl cache>/audit``); None = no cache.
        progress: show progress bars (None: only on a terminal).
        max_context_tokens: the model context, as `audit_rows` takes it; part of the cache key.

    Returns:
        The report; ``cached`` says whether it came from the cache, ``wall_s`` is this call's time.

    Raises:
        ValueError: a source is missing, empty, of an unsupported kind, or a file none of whose
            rows could be read (the message names the file); see also `audit_rows`.
    """
    start = time.perf_counter()
    key = cache_key(sources, tokenizer_id, cfg, processor_id, max_context_tokens) if cache_dir is not None else None
    cached = _read_cache(cache_dir, key)
    if cached is not None:
        return cached.timed(time.perf_counter() - start)
    settings = AuditSettings.of(cfg)
    loaded = load_examples(sources, settings.data, seed=settings.seed, split="train", key=DATA_KEY,
                           max_target_tokens=settings.max_target_tokens)
    _check_readable(loaded)
    report = audit_rows(loaded, tokenizer_loader(), cfg, progress=progress, max_context_tokens=max_context_tokens)
    report = replace(report, model=model, tokenizer=tokenizer_id, sources=_with_hashes(report.sources))
    if cache_dir is not None and key is not None and not report.read_image_files:  # key is None iff cache_dir is
        _write_cache(cache_dir, key, report)
    return report.timed(time.perf_counter() - start)


def _with_hashes(infos: tuple[SourceInfo, ...]) -> tuple[SourceInfo, ...]:
    return tuple(
        replace(i, sha256=file_sha256(Path(i.source).expanduser())) if Path(i.source).expanduser().is_file() else i
        for i in infos
    )


def _check_readable(loaded: LoadedRows) -> None:
    """Raise for a file none of whose rows could be read: it is not what its suffix says."""
    by_source: dict[str, list[Any]] = {}
    for raw, origin in zip(loaded.raw_rows, loaded.origins):
        by_source.setdefault(origin.source, []).append(raw)
    for source, raws in by_source.items():
        if all(isinstance(r, BadRow) for r in raws):
            raise ValueError(
                f"{DATA_KEY}: {source!r} is not JSON Lines: none of its {len(raws):,} line(s) could be read "
                f"({raws[0].reason}); give a .jsonl file with one JSON object per line, a .json list or a .parquet file"
            )


def _read_cache(cache_dir: Path | None, key: str | None) -> AuditReport | None:
    if cache_dir is None or key is None:
        return None
    path = Path(cache_dir) / f"{key}.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("schema") != SCHEMA_VERSION:
            return None
        return replace(AuditReport.from_dict(data), cached=True)
    except (OSError, ValueError, KeyError, TypeError):  # absent or unreadable: a miss
        return None


def _write_cache(cache_dir: Path, key: str, report: AuditReport) -> None:
    """Write ``<cache_dir>/<key>.json`` atomically (a temporary sibling, then a rename)."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{key[:16]}-", suffix=".tmp", dir=cache_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(report.to_dict(), f)
        os.replace(tmp, cache_dir / f"{key}.json")
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
