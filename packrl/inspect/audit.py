"""Length audit of a prompt dataset: what `packrl train` would do with every row, before it runs.

`audit_sources` reads the data files, renders and tokenizes every row through the path
training takes (`packrl.data.prompts`: row normalisation, chat template, instruction, system
prompt, prompt policy), and reports:

- prompt tokens (template and generation prompt included, before any truncation): nearest-rank
  percentiles p50/p90/p95/p99/max, mean and a histogram. `length_percentiles` computes them, as
  `PromptDataset.prompt_length_percentiles` does for the trainer, from the same accounting;
- reference-answer tokens as a response-length proxy: the GSM8K ``answer`` field or verl's
  ``extra_info.answer``, tokenized without template (rows without one are left out);
- for ``data.max_prompt_tokens``, what each ``data.overlong_prompt`` policy would do;
- bad rows with their numbers and reasons (the rejection logic of training);
- suggested budgets (`suggest_budgets`);
- multimodal rows (`packrl.inspect.images`): image tokens per row, and what each policy would do
  when image tokens are fixed and only text is shortened.

Rows are numbered from 0 across the DATA files in order, as training numbers them (a jsonl row
is a non-blank line). Percentiles are nearest-rank: ``pQ`` is the smallest length L with at
least Q% of the rows at or under L, so every value is a length some row has.

Multimodal rows and training: training reads text chats only; a row whose message content is
a list of parts is a bad row there (``prompt[i].content is list, expected a string``), so it
is in ``bad_rows`` with that reason. The audit counts such rows separately: each message's
text parts joined, image parts replaced by `IMAGE_PLACEHOLDER`, rendered through the chat
template like any row, plus `image_tokens` per image. A truncating policy shortens only that
text, to ``data.max_prompt_tokens`` minus the image tokens; a row whose text cannot shrink
enough is counted as filtered (over budget), never cut inside an image.

Results are cached (`cache_key`): sha256 of every data file's bytes, the tokenizer identity,
and the config values the report depends on. A report that read image files, or a hub source,
is not cached (those inputs are not in the key). Cost, measured with `bench/bench_audit.py` on
the 2-core CPU (SmolLM2 tokenizer, demo preset, GSM8K train, 7,473 rows): cold 6.8 s wall on a
lightly loaded machine, 6.3 s of CPU (about 3 s importing transformers and loading the
tokenizer, 1.1 s the render + tokenize pass `PromptDataset.build` also makes, 1.7 s truncating
the 732 rows over 128 tokens three ways); warm 0.3 s per command, 0.1 s of it in the audit.

JSON keys (`AuditReport.to_dict`; every token count is in tokens of the audited tokenizer):

    schema                  int, report format version (2)
    sources                 [{source, num_rows, sha256 (null for task:/hub sources)}]
    model, tokenizer        the --model value; hex identity of the tokenizer files
    config                  {dotted key: value} of the config values used
    num_rows, num_bad_rows  rows read; rows training rejects
    bad_rows                [{row, source, source_row, reason}], first 1,000
    prompt_tokens           {num_rows, p50, p90, p95, p99, max, mean, histogram: {bin_edges, counts}}
    answer_tokens           same shape, or null when no row has a reference answer
    num_overlong            rendered rows over data.max_prompt_tokens
    policies                {filter|left|right|middle|error: {num_kept, num_truncated,
                            num_filtered, num_rejected, num_tokens_removed, num_rows_affected,
                            rows (first 20 affected rows), stops_training}}
    multimodal              null, or {num_rows, num_images, image_tokens, text_tokens,
                            total_tokens (length stats), policies (as above), rows: [{row,
                            num_images, image_tokens, text_tokens}] (first 20), bad_rows, training}
    suggested               {data.max_prompt_tokens, train.max_tokens_per_microbatch, rule}
    problems                [str]: what would stop `packrl train` with this data and config
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
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packrl.data.examples import GSM8K_SOURCE, to_example
from packrl.data.loaders import BadRow
from packrl.data.prompts import account_rows, budget_examples, load_examples, rendered_prompt_lengths
from packrl.inspect.audit_report import (
    SCHEMA_VERSION,
    AuditReport,
    BadRowInfo,
    LengthStats,
    MultimodalRow,
    MultimodalStats,
    PolicyOutcome,
    SourceInfo,
    SuggestedBudgets,
)
from packrl.inspect.images import image_size, image_tokens, split_content
from packrl.seqlen.prompt_policy import POLICIES, Policy, RowOutcome
from packrl.seqlen.stats import length_percentiles

if TYPE_CHECKING:
    from packrl.config.schema import RunConfig
    from packrl.data.examples import Example
    from packrl.data.prompts import LoadedRows, RowSource

__all__ = [
    "AuditReport", "LengthStats", "PolicyOutcome", "audit_rows", "audit_sources", "cache_key",
    "length_percentiles", "suggest_budgets",
]

PROMPT_BUDGET_MULTIPLE = 64
MICROBATCH_MULTIPLE = 256
DATA_KEY = "DATA"
"""The name data-file errors use for the audited sources."""

_CHUNK_ROWS = 1024  # rows per render/tokenize call: the progress bar's step
_NO_BUDGET = 1 << 62  # a prompt budget no row reaches: renders without truncating
_MULTIMODAL_TRAINING = (
    "packrl train reads these rows through a vision-language model's processor (docs/multimodal.md; a text "
    "model.path rejects them); the counts here are what a Qwen2-VL-style model at the processor's default sizing "
    "would take: rendered text plus image tokens (packrl preflight gives the sizing of the configured model)"
)


def suggest_budgets(prompt_tokens: LengthStats, max_response_tokens: int) -> SuggestedBudgets:
    """Budgets that fit the audited prompts.

    Rules:
        ``data.max_prompt_tokens`` = p99 of the prompt tokens rounded up to a multiple of 64:
        at most 1% of the rows are over it.
        ``train.max_tokens_per_microbatch`` = (that prompt budget + ``rollout.max_response_tokens``)
        rounded up to a multiple of 256: one micro-batch holds the longest sequence the two
        budgets allow, which is also the smallest value the config accepts for that pair.

    Args:
        prompt_tokens: the audited prompt lengths (tokens).
        max_response_tokens: ``rollout.max_response_tokens``.

    Returns:
        `SuggestedBudgets`; ``max_prompt_tokens`` is None when no row rendered.
    """
    if prompt_tokens.p99 is None:
        return SuggestedBudgets(None, None, "no rendered prompt: no suggestion")
    prompt = _round_up(prompt_tokens.p99, PROMPT_BUDGET_MULTIPLE)
    microbatch = _round_up(prompt + max_response_tokens, MICROBATCH_MULTIPLE)
    rule = (
        f"data.max_prompt_tokens = p99 ({prompt_tokens.p99:,}) rounded up to a multiple of {PROMPT_BUDGET_MULTIPLE}; "
        f"train.max_tokens_per_microbatch = ({prompt:,} + rollout.max_response_tokens={max_response_tokens:,}) "
        f"rounded up to a multiple of {MICROBATCH_MULTIPLE}"
    )
    return SuggestedBudgets(prompt, microbatch, rule)


def _round_up(value: int, multiple: int) -> int:
    return max(multiple, -(-value // multiple) * multiple)


def audit_rows(loaded: LoadedRows, tokenizer: Any, cfg: RunConfig, *, progress: bool | None = None) -> AuditReport:
    """Audit rows already read and normalised (`packrl.data.load_examples`).

    Args:
        loaded: the rows, their origins, examples and bad-row reasons.
        tokenizer: HF (fast) tokenizer with a chat template: the model's.
        cfg: the run config (``data``, ``rollout.max_response_tokens``, ``train``).
        progress: show a tqdm bar on stderr (None: only on a terminal).

    Returns:
        The report with ``cached=False``; ``wall_s`` covers this call only.

    Raises:
        ValueError: a multimodal row names an image that needs Pillow when it is not installed.
    """
    start = time.perf_counter()
    data = cfg.data
    outcomes = _render_all(loaded.examples, tokenizer, data.max_prompt_tokens, progress)
    accounting = account_rows(outcomes, loaded.bad, loaded.num_rows)
    prompt_tokens = LengthStats.from_lengths(rendered_prompt_lengths(accounting))
    overlong = [loaded.examples[i] for i, o in enumerate(outcomes) if o.status == "filtered"]
    base = _Counts.of(accounting.outcomes)
    cuts = _truncate_overlong(overlong, tokenizer, data.max_prompt_tokens, progress)
    policies = tuple(_policy_outcome(p, base, overlong, cuts.get(p, [])) for p in POLICIES)
    answers = _answer_lengths(loaded, tokenizer)
    multimodal, read_images = _multimodal(loaded, tokenizer, cfg)
    bad_rows = tuple(
        BadRowInfo(o.row, loaded.origins[o.row].source, loaded.origins[o.row].source_row, o.reason)
        for o in accounting.outcomes if o.status == "rejected"
    )
    report = AuditReport(
        sources=_source_infos(loaded), model="", tokenizer="", config=_config_values(cfg),
        num_rows=loaded.num_rows, num_bad_rows=len(bad_rows), bad_rows=bad_rows[: AuditReport.MAX_BAD_ROWS],
        prompt_tokens=prompt_tokens, answer_tokens=LengthStats.from_lengths(answers) if answers else None,
        num_overlong=len(overlong), policies=policies, multimodal=multimodal,
        suggested=suggest_budgets(prompt_tokens, cfg.rollout.max_response_tokens),
        problems=(), read_image_files=read_images,
    )
    report = replace(report, problems=_problems(report, cfg))
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


def _render_all(examples: Sequence[Example], tokenizer: Any, max_prompt_tokens: int, progress: bool | None) -> list[RowOutcome]:
    """Outcomes of every example under ``filter`` (so ``num_tokens`` is each full prompt length),
    in chunks of `_CHUNK_ROWS` rows for the progress bar."""
    from tqdm import tqdm

    outcomes: list[RowOutcome] = []
    with tqdm(total=len(examples), unit="row", desc="audit: render + tokenize", disable=_no_bar(progress)) as bar:
        for start in range(0, len(examples), _CHUNK_ROWS):
            chunk = examples[start : start + _CHUNK_ROWS]
            outcomes += budget_examples(chunk, tokenizer, max_prompt_tokens=max_prompt_tokens, policy="filter")[1]
            bar.update(len(chunk))
    return outcomes


def _no_bar(progress: bool | None) -> bool | None:
    return None if progress is None else not progress


def _truncate_overlong(
    overlong: Sequence[Example], tokenizer: Any, budget: int, progress: bool | None
) -> dict[str, list[RowOutcome]]:
    """Outcomes of the overlong rows under each truncating policy (left, right, middle)."""
    from tqdm import tqdm

    sides = [p for p in POLICIES if p not in ("filter", "error")]
    cuts: dict[str, list[RowOutcome]] = {side: [] for side in sides}
    with tqdm(total=len(sides) * len(overlong), unit="row", desc="audit: truncate overlong rows",
              disable=_no_bar(progress) if overlong else True) as bar:
        for side in sides:
            for start in range(0, len(overlong), _CHUNK_ROWS // 8):
                chunk = overlong[start : start + _CHUNK_ROWS // 8]
                cuts[side] += budget_examples(chunk, tokenizer, max_prompt_tokens=budget, policy=side)[1]
                bar.update(len(chunk))
    return cuts


def _policy_outcome(policy: str, base: _Counts, overlong: Sequence[Example], cuts: list[RowOutcome]) -> PolicyOutcome:
    """What ``policy`` does with the overlong rows (``cuts``: their outcomes under a truncating
    policy); every other row is as the base pass left it."""
    rows = [e.row for e in overlong]
    common: dict[str, Any] = {"policy": policy, "num_kept": base.kept, "num_rows_affected": len(rows),
                              "rows": tuple(rows[: PolicyOutcome.MAX_ROWS])}
    if policy in ("filter", "error"):
        filtered = len(rows) if policy == "filter" else 0
        return PolicyOutcome(**common, num_truncated=0, num_filtered=filtered, num_rejected=base.rejected,
                             num_tokens_removed=0, stops_training=policy == "error" and bool(rows))
    cut = _Counts.of(cuts)
    return PolicyOutcome(**common, num_truncated=cut.truncated, num_filtered=0, num_rejected=base.rejected + cut.rejected,
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


def _text_only_row(raw: Any) -> tuple[dict, list[dict]] | None:
    """A verl-schema row with image parts as (the row with text-only messages, its image parts);
    None when the row has no image part."""
    if not isinstance(raw, dict):
        return None
    prompt: Any = raw.get("prompt")  # a list, or a numpy array when read from parquet
    if hasattr(prompt, "tolist") and not isinstance(prompt, (list, tuple, str)):
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        return None
    messages, images = [], []
    for message in prompt:
        split = split_content(message.get("content")) if isinstance(message, dict) else None
        if split is None:
            messages.append(message)
            continue
        messages.append({k: v for k, v in message.items() if v is not None} | {"content": split[0]})
        images += split[1]
    return (raw | {"prompt": messages}, images) if images else None


@dataclass(frozen=True, slots=True)
class _MultimodalRow:
    example: Example
    num_images: int
    image_tokens: int


def _multimodal(loaded: LoadedRows, tokenizer: Any, cfg: RunConfig) -> tuple[MultimodalStats | None, bool]:
    """The multimodal section, and whether an image file was read to size an image."""
    rows: list[_MultimodalRow] = []
    bad: list[BadRowInfo] = []
    num_found, read_files = 0, False
    for row, raw in enumerate(loaded.raw_rows):
        found = _text_only_row(raw)
        if found is None:
            continue
        num_found += 1
        text_raw, parts = found
        origin = loaded.origins[row]
        base_dir = None if origin.source.startswith("task:") else Path(origin.source).expanduser().parent
        example = to_example(text_raw, row=row, instruction=cfg.data.instruction,
                             system_prompt=cfg.data.system_prompt, data_source=GSM8K_SOURCE)
        try:
            sizes = [image_size(p, base_dir) for p in parts]
        except ValueError as err:
            if "Pillow" in str(err):
                raise
            example = str(err)
        read_files |= any(not (_positive_int(p.get("width")) and _positive_int(p.get("height"))) for p in parts)
        if isinstance(example, str):
            bad.append(BadRowInfo(row, origin.source, origin.source_row, example))
        else:
            rows.append(_MultimodalRow(example, len(parts), sum(image_tokens(w, h) for w, h in sizes)))
    if not num_found:
        return None, False
    return _multimodal_stats(rows, bad, num_found, tokenizer, cfg.data.max_prompt_tokens, loaded.origins), read_files


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _multimodal_stats(
    rows: list[_MultimodalRow], bad: list[BadRowInfo], num_found: int, tokenizer: Any, budget: int, origins: Sequence[RowSource]
) -> MultimodalStats:
    outcomes = budget_examples([r.example for r in rows], tokenizer, max_prompt_tokens=_NO_BUDGET, policy="filter")[1]
    text = {o.row: o.num_tokens for o in outcomes if o.num_tokens is not None}
    for o in outcomes:
        if o.num_tokens is None:
            bad.append(BadRowInfo(o.row, origins[o.row].source, origins[o.row].source_row, o.reason))
    rows = [r for r in rows if r.example.row in text]
    totals = [text[r.example.row] + r.image_tokens for r in rows]
    policies = tuple(_multimodal_policy(p, rows, text, budget, tokenizer, num_rejected=len(bad)) for p in POLICIES)
    return MultimodalStats(
        num_rows=num_found, num_images=sum(r.num_images for r in rows),
        image_tokens=LengthStats.from_lengths([r.image_tokens for r in rows]),
        text_tokens=LengthStats.from_lengths([text[r.example.row] for r in rows]),
        total_tokens=LengthStats.from_lengths(totals), policies=policies,
        rows=tuple(MultimodalRow(r.example.row, r.num_images, r.image_tokens, text[r.example.row]) for r in rows[: PolicyOutcome.MAX_ROWS]),
        bad_rows=tuple(sorted(bad, key=lambda b: b.row)), training=_MULTIMODAL_TRAINING,
    )


def _multimodal_policy(
    policy: Policy, rows: list[_MultimodalRow], text: dict[int, int], budget: int, tokenizer: Any, *, num_rejected: int
) -> PolicyOutcome:
    """``policy`` on multimodal rows: images fixed, only text shortened, to ``budget - image tokens``."""
    over = [r for r in rows if text[r.example.row] + r.image_tokens > budget]
    truncated = removed = 0
    if policy in ("left", "right", "middle"):
        for r in over:
            text_budget = budget - r.image_tokens
            if text_budget < 1:
                continue  # the images alone are over budget: filtered
            (outcome,) = budget_examples([r.example], tokenizer, max_prompt_tokens=text_budget, policy=policy)[1]
            if outcome.status == "truncated":
                truncated, removed = truncated + 1, removed + outcome.num_tokens_removed
    filtered = 0 if policy == "error" else len(over) - truncated
    affected = [r.example.row for r in over]
    return PolicyOutcome(
        policy=policy, num_kept=len(rows) - len(over), num_truncated=truncated, num_filtered=filtered,
        num_rejected=num_rejected, num_tokens_removed=removed, num_rows_affected=len(affected),
        rows=tuple(affected[: PolicyOutcome.MAX_ROWS]), stops_training=policy == "error" and bool(over),
    )


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
        "rollout.max_response_tokens": cfg.rollout.max_response_tokens,
        "train.max_tokens_per_microbatch": cfg.train.max_tokens_per_microbatch,
    }


def _problems(report: AuditReport, cfg: RunConfig) -> tuple[str, ...]:
    """What would stop `packrl train` with this data and config, each with its fix."""
    data, out = cfg.data, []
    if report.num_bad_rows and not data.skip_bad_rows:
        first = report.bad_rows[0]
        out.append(f"{report.num_bad_rows:,} bad row(s) (first: row {first.row}: {first.reason}) with data.skip_bad_rows=false; "
                   "fix the rows or set data.skip_bad_rows=true")
    chosen = report.policy(data.overlong_prompt)
    if chosen.stops_training:
        out.append(f"{report.num_overlong:,} prompt(s) > data.max_prompt_tokens={data.max_prompt_tokens:,} with "
                   f"data.overlong_prompt=error; raise data.max_prompt_tokens to >= {report.prompt_tokens.max:,} or pick another policy")
    usable = chosen.num_kept + chosen.num_truncated
    if usable < data.batch_size and not chosen.stops_training:
        more = " or raise data.max_prompt_tokens" if chosen.num_filtered else ""
        out.append(f"{usable:,} usable prompt(s) < data.batch_size={data.batch_size:,}; add rows or lower data.batch_size{more}")
    return tuple(out)


def cache_key(sources: Sequence[str], tokenizer_id: str, cfg: RunConfig) -> str | None:
    """Hex sha256 of what a report depends on: the format version, each source (its string
    and the sha256 of its bytes), the tokenizer identity, the transformers and tokenizers
    versions (rendering and tokenization code) and `_config_values`. None when a source is not
    a local file or ``task:`` (a hub dataset can change without its id changing)."""
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
    blob = json.dumps([SCHEMA_VERSION, parts, tokenizer_id, versions, _config_values(cfg)], sort_keys=True, default=str)
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
    cache_dir: Path | None = None,
    progress: bool | None = None,
) -> AuditReport:
    """Audit the rows of ``sources`` with the tokenizer ``tokenizer_loader`` returns, using the cache.

    Args:
        sources: data files (``.jsonl``/``.json``/``.parquet``), ``task:arithmetic`` or hub ids,
            as ``data.train_files`` accepts; read as the training split.
        cfg: the run config.
        tokenizer_loader: returns the tokenizer; called only on a cache miss.
        tokenizer_id: identity of that tokenizer (e.g. a hash of its files), part of the cache key.
        model: the model path the tokenizer came from, for the report.
        cache_dir: where reports are cached (``<packrl cache>/audit``); None = no cache.
        progress: show progress bars (None: only on a terminal).

    Returns:
        The report; ``cached`` says whether it came from the cache, ``wall_s`` is this call's time.

    Raises:
        ValueError: a source is missing, empty, of an unsupported kind, or a file none of whose
            rows could be read (the message names the file); see also `audit_rows`.
    """
    start = time.perf_counter()
    key = cache_key(sources, tokenizer_id, cfg) if cache_dir is not None else None
    cached = _read_cache(cache_dir, key)
    if cached is not None:
        return cached.timed(time.perf_counter() - start)
    loaded = load_examples(sources, cfg.data, seed=cfg.train.seed, split="train", key=DATA_KEY)
    _check_readable(loaded)
    report = audit_rows(loaded, tokenizer_loader(), cfg, progress=progress)
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
