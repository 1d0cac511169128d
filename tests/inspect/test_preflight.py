"""packrl preflight and the memory estimate, on config-only model dirs (no weights)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from packrl.cli.main import main
from packrl.config import load_config
from packrl.config.schema import LoraConfig
from packrl.inspect.memory import GIB, ModelShape, activation_bytes_per_token_layer, estimate_memory, max_fitting_tokens
from packrl.inspect.preflight import preflight
from packrl.testing import tiny_llama_config


def _config(**kw) -> LlamaConfig:
    return tiny_llama_config(**kw)


@pytest.fixture
def model_dir(tmp_path):
    """A model directory with config.json only: preflight must never need weights."""
    _config().save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))
    return tmp_path


def _keys(report) -> set[str]:
    return {p.key for p in report.problems}


def test_five_distinct_mistakes_are_reported_at_once(model_dir):
    report = preflight("demo", [
        f"model.path={model_dir}",
        "data.batch_sizee=8",  # 1: unknown key
        "algorithm.loss_agg_mode=token_mean",  # 2: invalid choice
        "rollout.max_response_tokens=500",  # 3: 128 + 500 > context 512
        "train.max_tokens_per_logprob_microbatch=300",  # 4: below the longest sequence
        "model.lora.rank=4", "model.lora.target_modules=[qkv]",  # 5: matches no module
    ])
    assert not report.ok
    assert _keys(report) >= {"data.batch_sizee", "algorithm.loss_agg_mode", "rollout.max_response_tokens",
                             "train.max_tokens_per_logprob_microbatch", "model.lora.target_modules"}
    by_key = {p.key: p for p in report.problems}
    assert "did you mean data.batch_size" in by_key["data.batch_sizee"].fix
    assert "token-mean" in by_key["algorithm.loss_agg_mode"].fix
    context = by_key["rollout.max_response_tokens"]
    assert "628" in context.message and "512" in context.message
    assert "model.rope_scaling.type=yarn model.rope_scaling.factor=2" in context.fix
    assert report.rope_scaling == {"type": "yarn", "factor": 2.0, "max_context_tokens": 1024}
    assert "q_proj" in by_key["model.lora.target_modules"].message  # lists the real names


def test_rope_scaling_in_the_config_extends_the_context(model_dir):
    over = [f"model.path={model_dir}", "rollout.max_response_tokens=500", "train.max_tokens_per_logprob_microbatch=4096"]
    assert "rollout.max_response_tokens" in _keys(preflight("demo", over))
    report = preflight("demo", [*over, "model.rope_scaling.type=yarn", "model.rope_scaling.factor=2"])
    assert report.ok, report.to_text()
    assert report.budgets.max_context_tokens == 1024 and report.rope_scaling is None


def test_memory_that_does_not_fit_recommends_the_largest_micro_batch(model_dir):
    cfg = load_config("demo", [f"model.path={model_dir}"])
    shape = ModelShape.from_config(_config(), cfg.model.lora)
    fixed = estimate_memory(cfg, shape, tokens_per_microbatch=256).phases["update"]
    budget_gib = (fixed + 3000 * 0.6 * (estimate_memory(cfg, shape, tokens_per_microbatch=512).phases["update"] - fixed) / 256) / GIB
    report = preflight("demo", [f"model.path={model_dir}", "train.max_tokens_per_microbatch=100000"], device_memory_gib=budget_gib)
    rec = report.recommended_tokens_per_microbatch
    assert rec is not None and rec % 256 == 0 and rec >= 256
    assert estimate_memory(cfg, shape, tokens_per_microbatch=rec).phases["update"] <= budget_gib * GIB
    assert estimate_memory(cfg, shape, tokens_per_microbatch=rec + 256).phases["update"] > budget_gib * GIB
    problem = next(p for p in report.problems if p.key == "train.max_tokens_per_microbatch")
    assert f"train.max_tokens_per_microbatch={rec}" in problem.fix
    ok = preflight("demo", [f"model.path={model_dir}", f"train.max_tokens_per_microbatch={rec}", "rollout.max_num_seqs=1",
                            "train.max_tokens_per_logprob_microbatch=256"], device_memory_gib=budget_gib)
    assert ok.ok, ok.to_text()


def test_the_vllm_engine_settings_and_kv_cache_are_reported(model_dir):
    from packrl.rollout.engine import EngineOptions
    from packrl.rollout.vllm_settings import kv_cache_bytes

    report = preflight("demo", [f"model.path={model_dir}", "rollout.engine=vllm", "rollout.max_num_seqs=4", "model.dtype=bf16"])
    note = next(n for n in report.notes if n.startswith("vllm engine:"))
    cfg = load_config("demo", [f"model.path={model_dir}", "rollout.max_num_seqs=4"])
    shape = ModelShape.from_config(_config(), None)
    per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 2
    assert f"max_model_len={cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens:,}" in note and "max_num_seqs=4" in note
    options = EngineOptions.of_sections(cfg.rollout, cfg.data, cfg.train, cfg.algorithm)
    assert f"KV cache {kv_cache_bytes(options, per_token) / GIB:.2f} GiB" in note
    assert f"({per_token:,} bytes per token)" in note


def test_multi_turn_without_the_call_stop_string_is_noted(model_dir):
    plain = preflight("demo", [f"model.path={model_dir}", "rollout.multi_turn.tools=[calculator]"])
    assert any("does not hold '</tool_call>'" in n for n in plain.notes) and not plain.problems
    stopped = preflight("demo", [f"model.path={model_dir}", "rollout.multi_turn.tools=[calculator]", "rollout.stop=[</tool_call>]"])
    assert not any("</tool_call>" in n for n in stopped.notes)


def test_the_async_modes_name_their_generation_pool_and_rollout_workers(model_dir):
    colocated = preflight("demo", [f"model.path={model_dir}", "trainer.rollout_mode=colocate_async", "rollout.over_provision=3"])
    assert any("up to 44 sequences generate per step" in n for n in colocated.notes)  # (8 + 3) x 4
    assert not any("rollout worker holds" in n for n in colocated.notes)
    assert not any("do not fit one engine batch" in n for n in colocated.notes)  # 44 <= rollout.max_num_seqs=64
    split = preflight("demo", [f"model.path={model_dir}", "trainer.rollout_mode=colocate_async", "rollout.max_num_seqs=16"])
    assert any("the 40 sequences of a step do not fit one engine batch" in n and n.endswith("set rollout.max_num_seqs=40")
               for n in split.notes)  # (8 + 1) x 4 > 16 too: lowering over_provision cannot help
    roomy = preflight("demo", [f"model.path={model_dir}", "trainer.rollout_mode=colocate_async", "rollout.max_num_seqs=38"])
    assert any(n.endswith("set rollout.max_num_seqs=40 or lower rollout.over_provision") for n in roomy.notes)
    chunked = preflight("demo", [f"model.path={model_dir}", "trainer.rollout_mode=colocate_async", "rollout.max_num_seqs=16",
                                 "trainer.num_workers=2"])
    assert not any("do not fit one engine batch" in n for n in chunked.notes)  # chunks: no call is stopped
    separate = preflight("demo", [f"model.path={model_dir}", "trainer.rollout_mode=separate_async", "trainer.num_rollout_workers=2"])
    assert any("num_rollout_workers=2: each rollout worker holds its own policy copy" in n for n in separate.notes)
    assert not any("rollout_mode" in n for n in preflight("demo", [f"model.path={model_dir}"]).notes)


@pytest.mark.parametrize("workers, hint", [(1, True), (2, False)])
def test_a_device_smaller_than_the_weights_says_so(model_dir, workers, hint):
    report = preflight("demo", [f"model.path={model_dir}", f"trainer.num_workers={workers}", "model.dtype=bf16"], device_memory_gib=0.01)
    problem = next(p for p in report.problems if p.key == "train.max_tokens_per_microbatch")
    assert "the weights and runtime alone need" in problem.fix
    assert ("model.dtype=fp32 to drop the bf16 rollout engine copy" in problem.fix) is hint  # FSDP2 keeps a copy either way


def test_parameter_counts_match_the_real_model():
    config = _config(tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    shape = ModelShape.from_config(config)
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    linears = [m for m in model.model.modules() if isinstance(m, torch.nn.Linear)]
    assert shape.num_matmul_params == sum(m.weight.numel() for m in linears)
    lora = ModelShape.from_config(config, LoraConfig(rank=4, target_modules=["q_proj", "v_proj"]))
    q, v = model.model.layers[0].self_attn.q_proj, model.model.layers[0].self_attn.v_proj
    assert lora.num_lora_params == 2 * 4 * (q.in_features + q.out_features + v.in_features + v.out_features)


def test_lora_count_matches_peft():
    peft = pytest.importorskip("peft")
    config = _config()
    lora = LoraConfig(rank=8)
    wrapped = peft.get_peft_model(LlamaForCausalLM(config), peft.LoraConfig(r=8, target_modules=lora.target_modules))
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    assert ModelShape.from_config(config, lora).num_lora_params == trainable


def test_estimate_responds_to_each_memory_feature():
    config = _config(hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    base = load_config("demo", ["model.dtype=bf16"])  # the bf16 layout, whatever this CPU would choose
    shape = ModelShape.from_config(config, base.model.lora)
    est = lambda cfg: estimate_memory(cfg, ModelShape.from_config(config, cfg.model.lora), tokens_per_microbatch=4096)  # noqa: E731
    plain = est(base)
    ckpt = est(load_config("demo", ["model.dtype=bf16", "model.gradient_checkpointing=true"]))
    lora = est(load_config("demo", ["model.dtype=bf16", "model.lora.rank=4"]))
    fp32 = est(load_config("demo", ["model.dtype=fp32"]))
    assert ckpt.parts["activations"] * 2 < plain.parts["activations"]
    assert lora.parts["gradients"] * 10 < plain.parts["gradients"]
    assert lora.parts["optimizer states (AdamW)"] * 10 < plain.parts["optimizer states (AdamW)"]
    assert fp32.parts["rollout engine copy"] == 0 and plain.parts["rollout engine copy"] == 2 * shape.num_params
    assert activation_bytes_per_token_layer(shape, 4) != activation_bytes_per_token_layer(shape, 2)
    small, big = (max_fitting_tokens(base, shape, g * GIB) for g in (1, 4))
    assert small <= big


def test_estimate_reads_the_strategy_layout():
    """FSDP2 ranks hold 1/D of parameters, gradients and moments, gather whole units while they
    compute, and keep an unsharded engine copy even in float32 (`packrl.worker.strategy.weight_layout`)."""
    config = _config(hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    shape = ModelShape.from_config(config, None)
    one = estimate_memory(load_config("demo", ["model.dtype=fp32"]), shape, tokens_per_microbatch=1024)
    two = estimate_memory(load_config("demo", ["model.dtype=fp32", "trainer.num_workers=2"]), shape, tokens_per_microbatch=1024)
    for part in ("parameters", "gradients", "optimizer states (AdamW)"):
        assert two.parts[part] == one.parts[part] // 2, part
    assert one.parts["rollout engine copy"] == 0 and two.parts["rollout engine copy"] == 4 * shape.num_params
    assert one.parts["gathered parameters (FSDP2)"] == 0 < two.parts["gathered parameters (FSDP2)"] < 4 * shape.num_params
    assert two.parts["activations"] == one.parts["activations"]


def test_lora_on_two_ranks_splits_base_and_adapters_and_gathers_the_adapters_of_a_layer():
    """LoRA under FSDP2: the base weights and the adapters (with their gradients and moments) are
    split over the ranks, the reference is the base model (no copy), the engine holds the merged
    weights whole, and a gathered decoder layer holds its adapters."""
    config = _config(hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    shape = ModelShape.from_config(config, LoraConfig(rank=8))
    est = lambda *o: estimate_memory(load_config("demo", ["model.dtype=fp32", "algorithm.kl_coef=0.1", *o]), shape,  # noqa: E731
                                     tokens_per_microbatch=1024)
    one, two = est("model.lora.rank=8"), est("model.lora.rank=8", "trainer.num_workers=2")
    assert two.parts["gradients"] == 4 * shape.num_lora_params // 2 and one.parts["gradients"] == 4 * shape.num_lora_params
    assert two.parts["optimizer states (AdamW)"] == 8 * shape.num_lora_params // 2
    assert two.parts["parameters"] == one.parts["parameters"] // 2
    assert one.parts["reference model"] == two.parts["reference model"] == 0
    assert one.parts["rollout engine copy"] == 0 and two.parts["rollout engine copy"] == 4 * shape.num_params
    full = est("trainer.num_workers=2")
    assert full.parts["reference model"] == 4 * shape.num_params // 2
    gathered = two.parts["gathered parameters (FSDP2)"] - full.parts["gathered parameters (FSDP2)"]
    assert gathered == 4 * 2 * (shape.num_lora_params // shape.num_layers)  # two layers' adapters


@pytest.mark.parametrize("workers", [1, 2])
def test_a_micro_batch_that_does_not_fit_suggests_lora_on_any_number_of_ranks(model_dir, workers):
    overrides = [f"model.path={model_dir}", f"trainer.num_workers={workers}", "model.dtype=fp32"]
    cfg = load_config("demo", overrides)
    memory = estimate_memory(cfg, ModelShape.from_config(_config(), cfg.model.lora), device="cpu")
    weights = sum(memory.parts[k] for k in ("runtime", "parameters", "reference model", "rollout engine copy",
                                            "gathered parameters (FSDP2)"))
    report = preflight("demo", overrides, device_memory_gib=(weights + 1000) / GIB, device="cpu")  # the weights fit, no tokens do
    fix = next(p for p in report.problems if p.key == "train.max_tokens_per_microbatch").fix
    assert fix.startswith("no micro-batch holding the longest sequence fits") and "set model.lora.rank=16" in fix
    with_lora = preflight("demo", [*overrides, "model.lora.rank=4"], device_memory_gib=(weights + 1000) / GIB, device="cpu")
    assert "model.lora.rank" not in next(p for p in with_lora.problems if p.key == "train.max_tokens_per_microbatch").fix


def test_fp64_doubles_the_float32_parts_and_auto_follows_the_device():
    from packrl.hardware import resolve_for_device

    shape = ModelShape.from_config(_config(hidden_size=256, intermediate_size=512, num_hidden_layers=4), None)
    fp32, fp64 = (estimate_memory(load_config("demo", [f"model.dtype={d}"]), shape, tokens_per_microbatch=1024) for d in ("fp32", "fp64"))
    for part in ("parameters", "gradients", "optimizer states (AdamW)", "activations", "logits chunk"):
        assert fp64.parts[part] > fp32.parts[part] and fp64.parts[part] <= 2 * fp32.parts[part], part
    auto = estimate_memory(load_config("demo"), shape, tokens_per_microbatch=1024)
    resolved = estimate_memory(load_config("demo", [f"model.dtype={resolve_for_device('auto', 'cpu').name}"]), shape,
                               tokens_per_microbatch=1024)
    assert auto.parts == resolved.parts


def test_preflight_says_which_dtype_it_estimated_and_why(model_dir):
    report = preflight("demo", [f"model.path={model_dir}"])
    assert any(n.startswith("compute dtype ") and "(model.dtype=auto: " in n for n in report.notes)


def test_an_attention_free_model_is_estimated_and_a_multimodal_one_refused_by_name(tmp_path):
    """Mamba has no attention heads (no KV cache); a multimodal checkpoint would load only its
    text model with fresh weights, so it is refused, naming the text model that trains."""
    import transformers

    transformers.MambaConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, state_size=8, max_position_embeddings=512
                             ).save_pretrained(tmp_path / "mamba")
    report = preflight("demo", [f"model.path={tmp_path / 'mamba'}"])
    assert report.ok, [str(p) for p in report.problems]
    assert report.memory.parts["rollout KV cache"] == 0 and any("packing: off" in n for n in report.notes)
    if not hasattr(transformers, "Qwen3_5Config"):
        pytest.skip("this transformers has no Qwen3.5")
    transformers.Qwen3_5Config().save_pretrained(tmp_path / "vl")
    problems = preflight("demo", [f"model.path={tmp_path / 'vl'}"]).problems
    assert len(problems) == 1 and "is a multimodal checkpoint (Qwen3_5Config" in problems[0].message
    assert "model_type 'qwen3_5_text'" in problems[0].fix


def test_model_config_without_context_is_named(tmp_path):
    cfg = _config().to_dict()
    del cfg["max_position_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    report = preflight("demo", [f"model.path={tmp_path}"])
    problem = next(p for p in report.problems if p.key == "model.path")
    assert "max_position_embeddings" in problem.message and "config.json" in problem.message


def test_missing_model_is_a_problem_naming_the_path(tmp_path):
    report = preflight("demo", [f"model.path={tmp_path / 'nope'}"])
    assert [p.key for p in report.problems] == ["model.path"] and "nope" in report.problems[0].message


@pytest.mark.parametrize("gib", [0, -3])
def test_non_positive_device_memory_is_an_error(model_dir, gib, capsys):
    assert main(["preflight", "demo", f"model.path={model_dir}", f"--device-memory={gib}"]) == 2
    assert "--device-memory" in capsys.readouterr().err


def test_cli_json_and_exit_status(model_dir, capsys):
    assert main(["preflight", "demo", f"model.path={model_dir}", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["budgets"]["max_context_tokens"] == 512 and out["memory"]["peak_bytes"] > 0
    assert main(["preflight", "demo", f"model.path={model_dir}", "rollout.max_response_tokens=600", "--json"]) == 1
    assert not json.loads(capsys.readouterr().out)["ok"]


def _saved_bytes_per_token(num_layers: int, tokens: int, lora_rank: int) -> float:
    """Bytes of the token-sized tensors autograd saves in a packed forward under bf16 autocast."""
    from packrl.models.attention import use_packed_attention
    from packrl.models.logprobs import pack_logprobs
    from packrl.seqlen.packing import pack_sequences

    torch.manual_seed(0)
    model = LlamaForCausalLM(_config(num_hidden_layers=num_layers))
    use_packed_attention(model)
    if lora_rank:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=lora_rank, target_modules=LoraConfig().target_modules))
    seen: dict[int, int] = {}

    def pack_hook(t):
        if tokens in t.shape:  # activations, not weights or their casts
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    pack = pack_sequences([torch.randint(0, 97, (tokens,))])
    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        pack_logprobs(model, pack, needed=torch.ones(tokens, dtype=torch.bool))
    return sum(seen.values()) / tokens


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_activation_count_is_what_autograd_saves_per_layer(lora_rank):
    tokens = 101  # matches no model dimension
    per_layer = (_saved_bytes_per_token(3, tokens, lora_rank) - _saved_bytes_per_token(1, tokens, lora_rank)) / 2
    shape = ModelShape.from_config(_config(), LoraConfig(rank=lora_rank))
    assert activation_bytes_per_token_layer(shape, 2, lora_rank) == pytest.approx(per_layer, rel=0.03)


def test_no_rope_factor_above_four_is_proposed(model_dir):
    """128 + 5,000 tokens in a 512-token model would take factor 11: the fix says so instead of proposing it."""
    over = [f"model.path={model_dir}", "rollout.max_response_tokens=5000", "train.max_tokens_per_microbatch=8192",
            "train.max_tokens_per_logprob_microbatch=8192"]
    report = preflight("demo", over)
    assert report.rope_scaling is None and not any("rope_scaling" in n for n in report.notes)
    problem = next(p for p in report.problems if p.key == "rollout.max_response_tokens")
    assert problem.fix == (
        "lower data.max_prompt_tokens or rollout.max_response_tokens so their sum is <= 512, or use a model with a longer "
        "context; RoPE scaling cannot make up the difference: it would take model.rope_scaling.factor=11 on the model's "
        "512 tokens, more than the factor 4 packrl proposes (the YaRN extension Qwen2.5 and Qwen3 document)")
    four = preflight("demo", [*over[:1], "rollout.max_response_tokens=1900", *over[2:]])  # 2,028 tokens: factor 4 fits
    assert four.rope_scaling == {"type": "yarn", "factor": 4.0, "max_context_tokens": 2048}


def test_preflight_lists_the_config_warnings_among_its_notes(model_dir):
    report = preflight("demo", [f"model.path={model_dir}", "algorithm.filters.dynamic_sampling={}",
                                "reward.shaping.group_length.weight=0.5"])
    assert any(n.startswith("warning: algorithm.filters.dynamic_sampling.metric='score': drops every group") for n in report.notes)
