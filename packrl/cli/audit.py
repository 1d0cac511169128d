"""`packrl audit DATA... [--model M] [--preset NAME] [key=value ...] [--json] [--html FILE]`.

Audits the prompt lengths of data files with the model's tokenizer, through the path training
takes (see `packrl.inspect.audit`). The config is the preset (``--preset``, default ``demo``)
plus ``key=value`` overrides, as for `packrl train`; DATA replaces ``data.train_files`` and
``--model`` replaces ``model.path`` (default: the config's ``model.path``). Arguments with
``=`` whose left side is a dotted key (``data.max_prompt_tokens=1024``) are overrides; every
other argument is a data source. Give DATA before any ``--flag``.

Only the tokenizer is loaded, never the weights: ``--model`` may be a model directory (or any
directory with tokenizer files), a ``.gguf`` file, a hub id or the alias
``smollm2-135m-instruct``. For a ``.gguf``, the tokenizer is the one training would use: that
of its converted copy in the packrl cache when there is one, else the tokenizer files beside
it (what a conversion stores), else the GGUF is converted once as training would. When the
model's ``config.json`` has a vision tower, its prompt encoder is loaded as training loads it
(`packrl.models.loading.load_prompt_encoder`): the processor of a vision-language model, which
reads and sizes the rows' images (another multimodal family is refused, as training refuses it).

Reports are cached under ``<packrl cache>/audit/`` (env ``PACKRL_CACHE``, else
``~/.cache/packrl``); ``--no-cache`` skips the cache. Exit status: 0 when the audit ran (what
would stop training is listed under ``problems``), 2 on bad input (a message, not a traceback).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packrl.config import load_config

if TYPE_CHECKING:
    from packrl.config.schema import ModelConfig

_OVERRIDE = re.compile(r"^[A-Za-z_][\w]*(\.[\w]+)+=")
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model",
)
"""Files that define a tokenizer and its chat template; their bytes are its identity."""

PROCESSOR_FILES: tuple[str, ...] = (
    "config.json", "preprocessor_config.json", "processor_config.json", "chat_template.json", "chat_template.jinja",
)
"""Files that define a vision-language model's processor (image geometry, image token ids, the
template that places images); with `TOKENIZER_FILES`, their bytes are its identity."""


@dataclass(frozen=True, slots=True)
class TokenizerSource:
    """Where the audit's tokenizer comes from.

    Attributes:
        model: the ``--model`` / ``model.path`` value.
        directory: folder with the tokenizer files; None when a ``.gguf`` must be converted first.
        identity: hex sha256 of the tokenizer files (or of the ``.gguf`` to convert).
        processor: hex sha256 of `PROCESSOR_FILES` when the directory's ``config.json`` has a
            vision tower (the audit then loads the prompt encoder training loads); else None.
    """

    model: str
    directory: Path | None
    identity: str
    processor: str | None = None


def locate_tokenizer(model: str) -> TokenizerSource:
    """Find the tokenizer of ``model`` without loading it (see the module docstring).

    Raises:
        ValueError: the model does not resolve (the message lists where it looked, as for
            ``model.path``), or a ``.gguf`` path does not exist.
    """
    from packrl.models.resolve import cache_root, file_sha256, is_complete, resolve_model

    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"--model {model!r} does not exist; give an existing .gguf file, a model directory or an alias")
        digest = file_sha256(path)
        converted = cache_root() / "gguf" / f"{path.stem}-{digest[:12]}"
        if is_complete(converted):
            return TokenizerSource(model, converted, _files_identity(converted))
        if (path.parent / "tokenizer.json").is_file():
            return TokenizerSource(model, path.parent, _files_identity(path.parent))
        return TokenizerSource(model, None, hashlib.sha256(f"gguf:{digest}".encode()).hexdigest())
    folder = path if path.is_dir() and any((path / name).is_file() for name in TOKENIZER_FILES) else None
    folder = folder or resolve_model(model, weights=False).tokenizer_dir
    vision = _has_vision_tower(folder)
    return TokenizerSource(model, folder, _files_identity(folder), _files_identity(folder, PROCESSOR_FILES) if vision else None)


def _files_identity(folder: Path, names: tuple[str, ...] = TOKENIZER_FILES) -> str:
    h = hashlib.sha256()
    for name in names:
        if (folder / name).is_file():
            h.update(name.encode() + b"\0" + (folder / name).read_bytes() + b"\0")
    return h.hexdigest()


def _has_vision_tower(folder: Path) -> bool:
    """True when ``folder/config.json`` names a ``vision_config``: a read of the json alone, so a
    text model's audit imports neither torch nor the model config classes. Which processor (or
    refusal) follows is `load_prompt_encoder`'s decision (`packrl.models.modality.modality_of`)."""
    try:
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):  # no config (tokenizer files alone) or not json: a text tokenizer
        return False
    return isinstance(raw, dict) and raw.get("vision_config") is not None


def load_audit_tokenizer(source: TokenizerSource) -> Any:
    """Load the tokenizer `locate_tokenizer` found, as training loads it (`load_tokenizer`).

    Raises:
        ValueError: no tokenizer there, or it has no chat template (see `load_tokenizer`).
    """
    from packrl.models.loading import load_tokenizer
    from packrl.models.resolve import ResolvedModel, resolve_model

    if source.directory is None:
        return load_tokenizer(resolve_model(source.model), source.model)
    folder = source.directory
    return load_tokenizer(ResolvedModel(folder, None, f"tokenizer files in {folder}", folder), source.model)


def load_audit_encoder(source: TokenizerSource, model_cfg: ModelConfig) -> Any:
    """What renders the prompts in training, for the audit: the tokenizer (`load_audit_tokenizer`),
    or, when the model has a vision tower (``source.processor``), `load_prompt_encoder`'s result
    for ``model_cfg`` (the ``model`` section): a vision-language model's processor.

    Raises:
        ValueError: as `load_audit_tokenizer`; a multimodal family packrl does not train, or a
            vision-language model without its processor files (as `load_prompt_encoder`).
    """
    tokenizer = load_audit_tokenizer(source)
    if source.processor is None:
        return tokenizer
    from packrl.models.loading import load_prompt_encoder

    return load_prompt_encoder(model_cfg, tokenizer)


def split_arguments(arguments: list[str]) -> tuple[list[str], list[str]]:
    """``(data sources, overrides)``: an override is ``dotted.key=value``; anything else is a source.

    =================================  ==========
    argument                           kind
    =================================  ==========
    ``data.max_prompt_tokens=1024``    override
    ``train.jsonl``                    source
    ``runs/a=b/train.jsonl``           source
    =================================  ==========
    """
    sources = [a for a in arguments if not _OVERRIDE.match(a)]
    return sources, [a for a in arguments if _OVERRIDE.match(a)]


def run(args: argparse.Namespace) -> int:
    """The `packrl audit` command; returns the exit status (0 audited, 2 bad input)."""
    from packrl.inspect.audit import audit_sources
    from packrl.models.resolve import cache_root

    start = time.perf_counter()
    sources, overrides = split_arguments([*args.data, *args.overrides])
    if not sources:
        print("packrl audit: no DATA given; pass one or more .jsonl/.json/.parquet files or task:arithmetic", file=sys.stderr)
        return 2
    cfg = load_config(args.preset, [*overrides, *([f"model.path={args.model}"] if args.model else [])])
    try:
        located = locate_tokenizer(cfg.model.path)
        report = audit_sources(
            sources, cfg, tokenizer_loader=lambda: load_audit_encoder(located, cfg.model), tokenizer_id=located.identity,
            processor_id=located.processor, model=cfg.model.path, cache_dir=None if args.no_cache else cache_root() / "audit",
            max_context_tokens=_model_context(cfg.model),
        )
        report = report.timed(time.perf_counter() - start)
        if args.html:
            _write_html(report, Path(args.html))
    except (ValueError, OSError) as err:
        print(f"packrl audit: {err}", file=sys.stderr)
        return 2
    print(report.to_json() if args.as_json else report.to_text())
    return 0


def _model_context(model_cfg: ModelConfig) -> int | None:
    """The model context the suggested budgets must fit, from the model's config; None (no bound,
    and the report's rule does not claim one) when there is no readable config (tokenizer files
    alone, or a config without a context)."""
    from packrl.models.model_config import load_model_context

    try:
        return load_model_context(model_cfg)
    except ValueError:
        return None


def _write_html(report: Any, path: Path) -> None:
    from packrl.inspect.audit_html import render_html

    if path.is_dir():
        raise ValueError(f"--html {path} is a directory; pass a file path such as {path / 'audit.html'}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(render_html(report), encoding="utf-8")
    tmp.replace(path)
    print(f"packrl audit: wrote {path}", file=sys.stderr)


def add_parser(subparsers: Any) -> None:
    """Add the ``audit`` command to the `packrl` parser's subparsers."""
    p = subparsers.add_parser(
        "audit",
        help="prompt-length audit of data files: percentiles, overlong rows per policy, bad rows, suggested budgets",
        description="Render and tokenize every row of DATA as training would (chat template, instruction, prompt "
        "policy) and report prompt-length percentiles, what each data.overlong_prompt policy would do at "
        "data.max_prompt_tokens, bad rows, rows with images (through a vision-language model's processor: vision "
        "and text tokens per row) and suggested budgets. Config: --preset "
        "(default demo) plus dotted key=value overrides. Exit 2 on bad input.",
    )
    p.add_argument("data", nargs="+", metavar="DATA", help=".jsonl/.json/.parquet files or task:arithmetic; key=value overrides may follow")
    p.add_argument("--model", default=None, help="model dir, .gguf file, hub id or alias (default: the config's model.path); "
                   "a vision-language model's processor reads and sizes the rows' images")
    p.add_argument("--preset", default=None, help="preset name or .yaml path (default: demo)")
    p.add_argument("--json", dest="as_json", action="store_true", help="print one JSON object instead of the text table")
    p.add_argument("--html", metavar="FILE", default=None, help="also write a self-contained HTML page with the histogram")
    p.add_argument("--no-cache", action="store_true", help="ignore and do not write the report cache")
    p.set_defaults(func=run, overrides=[])


__all__ = ["TokenizerSource", "add_parser", "load_audit_encoder", "load_audit_tokenizer", "locate_tokenizer", "run", "split_arguments"]
