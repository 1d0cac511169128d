"""The `packrl audit` report: frozen dataclasses, their JSON form and the text table.

`packrl.inspect.audit` fills an `AuditReport`; its module docstring lists every JSON key.
Percentiles are nearest-rank (`packrl.seqlen.stats.length_percentiles`); histogram bins are half-open integer
ranges ``[edge_i, edge_i+1)`` of equal width.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from packrl.seqlen.stats import length_percentiles

SCHEMA_VERSION = 3
"""Version of the audit JSON (and its cache); raised whenever a key changes."""

NUM_HISTOGRAM_BINS = 20
_BAR_WIDTH = 40


@dataclass(frozen=True, slots=True)
class Histogram:
    """Counts of lengths in equal-width integer bins ``[bin_edges[i], bin_edges[i+1])``.

    The width is ``ceil((max - min + 1) / 20)`` tokens (at least 1) and the first edge is the
    largest multiple of the width at or under the smallest length.
    """

    bin_edges: tuple[int, ...] = ()
    counts: tuple[int, ...] = ()

    @classmethod
    def of(cls, lengths: Sequence[int], num_bins: int = NUM_HISTOGRAM_BINS) -> Histogram:
        if not lengths:
            return cls()
        lo, hi = min(lengths), max(lengths)
        width = max(1, -(-(hi - lo + 1) // num_bins))
        first = lo - lo % width
        num = (hi - first) // width + 1
        counts = [0] * num
        for n in lengths:
            counts[(n - first) // width] += 1
        return cls(tuple(first + i * width for i in range(num + 1)), tuple(counts))


@dataclass(frozen=True, slots=True)
class LengthStats:
    """Length statistics in tokens; percentiles are None when ``num_rows == 0``."""

    num_rows: int
    p50: int | None
    p90: int | None
    p95: int | None
    p99: int | None
    max: int | None
    mean: float | None
    histogram: Histogram = field(default_factory=Histogram)

    @classmethod
    def from_lengths(cls, lengths: Sequence[int]) -> LengthStats:
        p = length_percentiles(lengths)
        mean = round(sum(lengths) / len(lengths), 2) if lengths else None
        return cls(len(lengths), p["p50"], p["p90"], p["p95"], p["p99"], p["max"], mean, Histogram.of(lengths))

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in ("num_rows", "p50", "p90", "p95", "p99", "max", "mean")}
        return out | {"histogram": {"bin_edges": list(self.histogram.bin_edges), "counts": list(self.histogram.counts)}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LengthStats:
        hist = Histogram(tuple(d["histogram"]["bin_edges"]), tuple(d["histogram"]["counts"]))
        return cls(d["num_rows"], d["p50"], d["p90"], d["p95"], d["p99"], d["max"], d["mean"], hist)


@dataclass(frozen=True, slots=True)
class PolicyOutcome:
    """What one ``data.overlong_prompt`` policy does with the audited rows (row counts, tokens).

    ``rows`` lists the first `MAX_ROWS` affected rows (those over the budget); ``stops_training``
    is True for ``error`` when any row is over the budget.
    """

    MAX_ROWS: ClassVar[int] = 20
    policy: str
    num_kept: int
    num_truncated: int
    num_filtered: int
    num_rejected: int
    num_tokens_removed: int
    num_rows_affected: int
    rows: tuple[int, ...]
    stops_training: bool

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(getattr(self, k)) if k == "rows" else getattr(self, k)) for k in _POLICY_KEYS}

    @classmethod
    def from_dict(cls, policy: str, d: dict[str, Any]) -> PolicyOutcome:
        fields: dict[str, Any] = {k: (tuple(d[k]) if k == "rows" else d[k]) for k in _POLICY_KEYS}
        return cls(policy=policy, **fields)


_POLICY_KEYS = ("num_kept", "num_truncated", "num_filtered", "num_rejected", "num_tokens_removed",
                "num_rows_affected", "rows", "stops_training")


@dataclass(frozen=True, slots=True)
class BadRowInfo:
    """A row training rejects: global row number, its source and index there, and why."""

    row: int
    source: str
    source_row: int
    reason: str


@dataclass(frozen=True, slots=True)
class SourceInfo:
    """One audited source: its string, rows read from it, and sha256 of its bytes (None if not a file)."""

    source: str
    num_rows: int
    sha256: str | None


@dataclass(frozen=True, slots=True)
class MultimodalRow:
    """One row with images under the configured ``data.overlong_prompt`` (as training builds it).

    Attributes:
        row: global row number.
        status: ``kept``, ``truncated`` (its images resized to fit), ``filtered`` or ``rejected``.
        num_images: images of the row.
        vision_tokens: each image's placeholder tokens plus its start/end markers at the size the
            row was fitted to (tokens); None without a prompt (filtered, rejected) or a processor.
        text_tokens: the rest of the prompt ids (template, text, generation prompt); None likewise.
        image_sizes: ``(width, height)`` pixels of each image as the prompt holds it; empty
            without a prompt.
        reason: training's reason for the status ("" when kept).
    """

    row: int
    status: str
    num_images: int
    vision_tokens: int | None
    text_tokens: int | None
    image_sizes: tuple[tuple[int, int], ...]
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return _fields(self) | {"image_sizes": [list(s) for s in self.image_sizes]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MultimodalRow:
        return cls(**(d | {"image_sizes": tuple(tuple(s) for s in d["image_sizes"])}))


@dataclass(frozen=True, slots=True)
class ImageSizeTokens:
    """The images of one fitted size: ``vision_tokens`` per image (placeholders + markers),
    ``encoder_patches`` per image (placeholders x merge^2, what the vision tower runs), and how
    many images of the prompts have that size."""

    width: int
    height: int
    vision_tokens: int
    encoder_patches: int
    num_images: int


@dataclass(frozen=True, slots=True)
class MultimodalStats:
    """Rows with images: what training makes of them, with vision and text tokens per row.

    Per-row numbers (``vision_tokens``, ``text_tokens``, ``total_tokens``, ``image_sizes``,
    ``rows``, ``changed``) are those of the prompts the configured ``data.overlong_prompt`` gives
    (``error``: as ``filter``); ``policies`` counts these rows under each policy. Without a
    processor (a text ``model.path``) ``processor`` and ``geometry`` are None and no row has tokens.
    """

    MAX_SIZES: ClassVar[int] = 20
    num_rows: int
    num_images: int
    policy: str
    vision_tokens: LengthStats
    text_tokens: LengthStats
    total_tokens: LengthStats
    image_sizes: tuple[ImageSizeTokens, ...]
    num_sizes: int
    policies: tuple[PolicyOutcome, ...]
    rows: tuple[MultimodalRow, ...]
    changed: tuple[MultimodalRow, ...]
    processor: str | None
    geometry: dict[str, int] | None
    training: str

    def policy_outcome(self, name: str) -> PolicyOutcome:
        """These rows under ``data.overlong_prompt=name``."""
        return next(p for p in self.policies if p.policy == name)

    def to_dict(self) -> dict[str, Any]:
        stats = {k: getattr(self, k).to_dict() for k in _MULTIMODAL_STATS}
        return {"num_rows": self.num_rows, "num_images": self.num_images, "policy": self.policy, **stats,
                "image_sizes": [_fields(s) for s in self.image_sizes], "num_sizes": self.num_sizes,
                "policies": {p.policy: p.to_dict() for p in self.policies},
                "rows": [r.to_dict() for r in self.rows], "changed": [r.to_dict() for r in self.changed],
                "processor": self.processor, "geometry": dict(self.geometry) if self.geometry else None,
                "training": self.training}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MultimodalStats:
        vision, text, total = (LengthStats.from_dict(d[k]) for k in _MULTIMODAL_STATS)
        return cls(
            num_rows=d["num_rows"], num_images=d["num_images"], policy=d["policy"], vision_tokens=vision, text_tokens=text,
            total_tokens=total, image_sizes=tuple(ImageSizeTokens(**s) for s in d["image_sizes"]), num_sizes=d["num_sizes"],
            policies=tuple(PolicyOutcome.from_dict(p, v) for p, v in d["policies"].items()),
            rows=tuple(MultimodalRow.from_dict(r) for r in d["rows"]),
            changed=tuple(MultimodalRow.from_dict(r) for r in d["changed"]),
            processor=d["processor"], geometry=dict(d["geometry"]) if d["geometry"] else None, training=d["training"],
        )


_MULTIMODAL_STATS = ("vision_tokens", "text_tokens", "total_tokens")


@dataclass(frozen=True, slots=True)
class SuggestedBudgets:
    """Budgets that fit the audited prompts (tokens), and the rule that gave them."""

    max_prompt_tokens: int | None
    max_tokens_per_microbatch: int | None
    rule: str


def _fields(obj: Any) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in obj.__slots__}


@dataclass(frozen=True, slots=True)
class AuditReport:
    """Everything `packrl audit` found. Token counts are in tokens of the audited tokenizer.

    See `packrl.inspect.audit` for the meaning of every field (they are the JSON keys).
    ``read_image_files`` (not in the JSON) is True when image files were opened to size images.
    """

    MAX_BAD_ROWS: ClassVar[int] = 1000
    sources: tuple[SourceInfo, ...]
    model: str
    tokenizer: str
    config: dict[str, Any]
    num_rows: int
    num_bad_rows: int
    bad_rows: tuple[BadRowInfo, ...]
    prompt_tokens: LengthStats
    answer_tokens: LengthStats | None
    num_overlong: int
    policies: tuple[PolicyOutcome, ...]
    multimodal: MultimodalStats | None
    suggested: SuggestedBudgets
    problems: tuple[str, ...]
    read_image_files: bool = False
    cached: bool = False
    wall_s: float = 0.0
    rows_per_s: float = 0.0

    def timed(self, wall_s: float) -> AuditReport:
        """This report with ``wall_s`` (seconds) and ``rows_per_s`` = ``num_rows / wall_s``."""
        return replace(self, wall_s=round(wall_s, 4), rows_per_s=round(self.num_rows / wall_s, 1) if wall_s > 0 else 0.0)

    def policy(self, name: str) -> PolicyOutcome:
        """The outcome of ``data.overlong_prompt=name``."""
        return next(p for p in self.policies if p.policy == name)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object (keys documented in `packrl.inspect.audit`)."""
        return {
            "schema": SCHEMA_VERSION, "sources": [_fields(s) for s in self.sources], "model": self.model,
            "tokenizer": self.tokenizer, "config": dict(self.config), "num_rows": self.num_rows,
            "num_bad_rows": self.num_bad_rows, "bad_rows": [_fields(b) for b in self.bad_rows],
            "prompt_tokens": self.prompt_tokens.to_dict(),
            "answer_tokens": self.answer_tokens.to_dict() if self.answer_tokens else None,
            "num_overlong": self.num_overlong, "policies": {p.policy: p.to_dict() for p in self.policies},
            "multimodal": self.multimodal.to_dict() if self.multimodal else None,
            "suggested": {"data.max_prompt_tokens": self.suggested.max_prompt_tokens,
                          "train.max_tokens_per_microbatch": self.suggested.max_tokens_per_microbatch,
                          "rule": self.suggested.rule},
            "problems": list(self.problems), "cached": self.cached, "wall_s": self.wall_s, "rows_per_s": self.rows_per_s,
        }

    def to_json(self) -> str:
        """`to_dict` as one line of JSON."""
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AuditReport:
        """The report `to_dict` wrote (``cached`` as stored; ``read_image_files`` False)."""
        s = d["suggested"]
        return cls(
            sources=tuple(SourceInfo(**x) for x in d["sources"]), model=d["model"], tokenizer=d["tokenizer"],
            config=dict(d["config"]), num_rows=d["num_rows"], num_bad_rows=d["num_bad_rows"],
            bad_rows=tuple(BadRowInfo(**b) for b in d["bad_rows"]), prompt_tokens=LengthStats.from_dict(d["prompt_tokens"]),
            answer_tokens=LengthStats.from_dict(d["answer_tokens"]) if d["answer_tokens"] else None,
            num_overlong=d["num_overlong"], policies=tuple(PolicyOutcome.from_dict(p, v) for p, v in d["policies"].items()),
            multimodal=MultimodalStats.from_dict(d["multimodal"]) if d["multimodal"] else None,
            suggested=SuggestedBudgets(s["data.max_prompt_tokens"], s["train.max_tokens_per_microbatch"], s["rule"]),
            problems=tuple(d["problems"]), cached=d["cached"], wall_s=d["wall_s"], rows_per_s=d["rows_per_s"],
        )

    def to_text(self) -> str:
        """A readable report: tables of lengths, policies, bad rows, suggestions and problems."""
        c = self.config
        lines = [
            f"packrl audit: {self.num_rows:,} rows from " + ", ".join(f"{s.source} ({s.num_rows:,})" for s in self.sources),
            f"model {self.model}  (tokenizer {self.tokenizer[:12]})",
            f"data.max_prompt_tokens={c['data.max_prompt_tokens']:,}  data.overlong_prompt={c['data.overlong_prompt']}  "
            f"rollout.max_response_tokens={c['rollout.max_response_tokens']:,}",
            "",
            *_stats_lines("prompt tokens (chat template, instruction and generation prompt included)", self.prompt_tokens),
        ]
        if self.answer_tokens is not None:
            lines += ["", *_stats_lines("reference answer tokens (response-length proxy)", self.answer_tokens, histogram=False)]
        lines += ["", *_policy_lines(f"over data.max_prompt_tokens={c['data.max_prompt_tokens']:,}: {self.num_overlong:,} row(s)",
                                     self.policies, c["data.overlong_prompt"])]
        lines += ["", *_bad_row_lines(self.num_bad_rows, self.bad_rows)]
        if self.multimodal is not None:
            lines += ["", *_multimodal_lines(self.multimodal, c["data.overlong_prompt"])]
        s = self.suggested
        lines += ["", "suggested budgets"]
        if s.max_prompt_tokens is not None:
            lines += [f"  data.max_prompt_tokens={s.max_prompt_tokens}",
                      f"  train.max_tokens_per_microbatch={s.max_tokens_per_microbatch}"]
        lines += [f"  ({s.rule})", ""]
        lines += (["would stop packrl train:"] + [f"  - {p}" for p in self.problems] if self.problems
                  else ["would stop packrl train: nothing"])
        source = "from the cache" if self.cached else "computed"
        lines.append(f"audited in {self.wall_s:.2f} s ({self.rows_per_s:,.0f} rows/s), {source}")
        return "\n".join(lines)


def _stats_lines(title: str, stats: LengthStats, *, histogram: bool = True) -> list[str]:
    lines = [f"{title}: {stats.num_rows:,} rows"]
    if not stats.num_rows:
        return lines
    names = ("p50", "p90", "p95", "p99", "max", "mean")
    lines.append("  " + "".join(f"{n:>9}" for n in names))
    lines.append("  " + "".join(f"{getattr(stats, n):>9,}" for n in names))
    if histogram:
        edges, counts = stats.histogram.bin_edges, stats.histogram.counts
        top = max(counts)
        for lo, hi, n in zip(edges, edges[1:], counts):
            bar = "#" * (max(1, round(_BAR_WIDTH * n / top)) if n else 0)
            lines.append(f"  [{lo:>7,}, {hi:>7,})  {n:>7,}  {bar}")
    return lines


def _policy_lines(title: str, policies: Sequence[PolicyOutcome], configured: str) -> list[str]:
    head = f"  {'policy':<10}{'kept':>9}{'truncated':>11}{'filtered':>10}{'rejected':>10}{'tokens cut':>12}  note"
    lines = [title, head]
    for p in policies:
        mark = "*" if p.policy == configured else " "
        note = "stops training" if p.stops_training else ""
        lines.append(f" {mark}{p.policy:<10}{p.num_kept:>9,}{p.num_truncated:>11,}{p.num_filtered:>10,}"
                     f"{p.num_rejected:>10,}{p.num_tokens_removed:>12,}  {note}")
    affected = policies[0] if policies else None
    if affected is not None and affected.num_rows_affected:
        more = f" (first {len(affected.rows)} of {affected.num_rows_affected:,})" if affected.num_rows_affected > len(affected.rows) else ""
        lines.append(f"  {affected.num_rows_affected:,} row(s) over the budget{more}, row numbers: " + ", ".join(map(str, affected.rows)))
    lines.append("  (* = data.overlong_prompt; rejected includes the bad rows)")
    return lines


def _bad_row_lines(num_bad: int, bad_rows: Sequence[BadRowInfo], shown: int = 20) -> list[str]:
    lines = [f"bad rows: {num_bad:,}"]
    for b in bad_rows[:shown]:
        where = f" ({b.source} row {b.source_row})" if b.source else ""
        lines.append(f"  row {b.row}{where}: {b.reason}")
    if num_bad > shown:
        lines.append(f"  ... and {num_bad - shown:,} more (--json lists up to {AuditReport.MAX_BAD_ROWS:,})")
    return lines


def _multimodal_lines(m: MultimodalStats, configured: str) -> list[str]:
    lines = [f"multimodal rows: {m.num_rows:,} ({m.num_images:,} images); {m.training}"]
    if m.geometry is not None:
        under = f"data.overlong_prompt={m.policy}"
        for title, stats in ((f"vision tokens per row ({under}; markers included)", m.vision_tokens),
                             ("text tokens per row (the rest of the prompt)", m.text_tokens),
                             ("prompt tokens per row (vision + text)", m.total_tokens)):
            lines += ["  " + line for line in _stats_lines(title, stats, histogram=False)]
        lines += ["  " + line for line in _size_lines(m)]
    lines += ["  " + line for line in _policy_lines("rows with images under each policy:", m.policies, configured)]
    if m.changed:
        lines.append(f"  truncated or filtered under data.overlong_prompt={m.policy} (first {len(m.changed)}):")
        lines += [f"    row {r.row}: {r.status}: {r.reason}" for r in m.changed]
    return lines


def _size_lines(m: MultimodalStats) -> list[str]:
    more = f", the {len(m.image_sizes)} most frequent shown" if m.num_sizes > len(m.image_sizes) else ""
    lines = [f"images per fitted size: {m.num_sizes:,} size(s){more}"]
    lines += [f"  {s.width}x{s.height} -> {s.vision_tokens:,} tokens (markers included), {s.encoder_patches:,} encoder patches; "
              f"{s.num_images:,} images" for s in m.image_sizes]
    return lines
