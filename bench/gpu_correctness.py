"""Stage 2 of the GPU check (bench/gpu_check.py): packrl's length invariants on the device, within
the tolerances packrl's own tests hold them to on the CPU (tests/invariance/).

Checks, each recorded on its own (one that fails or raises leaves the others running):

- ``packed_padded_alone``: a sequence's log-probs alone, in a left- or right-padded batch (the
  plain HF forward with a 2D mask) and packed first, in the middle and last, on each packed path
  this device runs: ``varlen`` (SDPA per sequence, ``packrl_sdpa``), ``block_mask`` and
  ``position_ids``, float32, |diff| <= 1e-5 (tests/invariance/test_logprob_invariance.py);
  flash-attn's varlen kernel (``flash_attention_2``, bf16, packed vs alone, 2e-2, the CUDA test
  of the same file) only where ``flash_attn`` is installed; torch's own varlen attention
  (``torch.nn.attention.varlen.varlen_attn``, not a packrl path) against causal SDPA per
  sequence at the kernel level, bf16, 2e-2, where this torch has it and the device is CUDA.
- ``chunked_vs_full``: `packrl.seqlen.chunked.chunked_logprobs` against `full_logprobs`, values,
  entropy and gradients, float32, 1e-5 (tests/invariance/test_chunked_logprobs.py).
- ``microbatch_split``: one GRPO mini-batch's loss and gradients through the update's
  micro-batch path (`packrl.worker.actor.actor_microbatches`, planned by
  `packrl.seqlen.update_plan`) under three micro-batch budgets, float64, relative 1e-6
  (tests/invariance/test_loss_invariance.py).
- ``first_step_kl``: two real GRPO steps (`packrl.trainer.loop.train`, the HF engine, the
  compute dtype a run on this device gets): step 1's ``actor/kl_loss`` must be exactly 0 (the
  policy is the reference), step 2's must not (the check can fail).

Models: Qwen2.5-0.5B's dimensions with 2 decoder layers (``--cpu-smoke``: the tiny shape).
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from bench.gpu_setup import (
    REWARD,
    model_config,
    model_folder,
    offline_tokenizer,
    progress,
    random_policy,
    register_hash_reward,
    scratch_dir,
)
from packrl.models.attention import PackedAttention

LOGPROB_ATOL = 1e-5
"""tests/invariance/test_logprob_invariance.py and test_chunked_logprobs.py (float32)."""
FLASH_ATOL = 2e-2
"""tests/invariance/test_logprob_invariance.py's CUDA flash-attn test (bf16)."""
LOSS_RTOL = 1e-6
"""tests/builders.py RTOL: the float64 loss-invariance checks."""
PATHS: tuple[PackedAttention, ...] = ("varlen", "block_mask", "position_ids")


def run_correctness(device: str, smoke: bool, save: Callable[..., None]) -> dict[str, Any]:
    """Every check of the module docstring on ``device``; ``save(checks=...)`` after each.
    Returns ``{name: result}``; each result has ``passed`` (or ``error`` and ``traceback``)."""
    checks: dict[str, Any] = {}
    for name, fn in (("packed_padded_alone", _packed_padded_alone), ("chunked_vs_full", _chunked_vs_full),
                     ("microbatch_split", _microbatch_split), ("first_step_kl", _first_step_kl)):
        start = time.perf_counter()
        try:
            checks[name] = fn(device, smoke)
        except Exception as err:  # a broken check is a result; the next one still runs
            checks[name] = {"passed": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
        checks[name]["seconds"] = round(time.perf_counter() - start, 2)
        progress(f"correctness: {name} {'passed' if checks[name]['passed'] else 'FAILED'} in {checks[name]['seconds']} s")
        save(checks=checks)
    return checks


def _small_policy(device: str, smoke: bool, dtype: torch.dtype, attn: str = "sdpa") -> Any:
    """Qwen2.5-0.5B's dimensions with 2 layers (or the tiny shape), randomly initialised on ``device``, in eval mode."""
    from transformers import AutoModelForCausalLM

    from packrl.models.attention import use_packed_attention

    config = model_config("0.5B", smoke, num_layers=2)
    config._attn_implementation = attn
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if attn == "sdpa":
        use_packed_attention(model, compute_dtype=dtype)
    return model.eval()


def _sequences(smoke: bool, vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    lengths = (11, 4, 17, 1, 9, 23) if smoke else (37, 5, 130, 1, 64, 211)
    return [torch.randint(3, vocab, (n,), generator=g) for n in lengths]


def _padded(model: Any, seqs: list[torch.Tensor], side: str, extra: int) -> torch.Tensor:
    """The first sequence's log-probs in a padded batch through the plain HF forward (a 2D mask)."""
    device = next(model.parameters()).device
    width = max(len(s) for s in seqs) + extra
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        span = slice(width - len(s), width) if side == "left" else slice(0, len(s))
        ids[i, span], mask[i, span] = s, 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=position_ids.to(device),
                       use_cache=False).logits.float()
    start, target = (width - len(seqs[0]) if side == "left" else 0), seqs[0].to(device)
    pred = torch.log_softmax(logits[0, start:start + len(target) - 1], -1).gather(1, target[1:, None]).squeeze(1)
    return torch.cat([pred.new_zeros(1), pred])


def _packed(model: Any, seqs: list[torch.Tensor], attention: PackedAttention) -> list[torch.Tensor]:
    from packrl.models.logprobs import pack_logprobs
    from packrl.seqlen.packing import pack_sequences

    pack = pack_sequences(seqs).to(next(model.parameters()).device)
    with torch.no_grad():
        return pack.unpack(pack_logprobs(model, pack, attention=attention, chunk_tokens=64).token_logprobs)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _packed_padded_alone(device: str, smoke: bool) -> dict[str, Any]:
    model = _small_policy(device, smoke, torch.float32)
    seqs = _sequences(smoke, model.config.vocab_size)
    out: dict[str, dict[str, Any]] = {attention: _guarded(_path, model, seqs, attention) for attention in PATHS}
    out["flash_attention_2"] = _guarded(_flash, device, smoke, seqs)
    out["torch_varlen_attn"] = _guarded(_torch_varlen, device, seqs)
    ran = [v for v in out.values() if v.get("ran", True)]
    return {"paths": out, "passed": all(v["passed"] for v in ran)} | _tf32(device)


def _guarded(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``fn(*args)``, or its error as a failed result (one path's failure leaves the others' results)."""
    try:
        return fn(*args)
    except Exception as err:
        return {"passed": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}


def _tf32(device: str) -> dict[str, Any]:
    """Whether float32 matmuls and convolutions may use TF32 here (they would loosen the float32 checks)."""
    if device != "cuda":
        return {}
    return {"tf32": {"matmul": torch.backends.cuda.matmul.allow_tf32, "cudnn": torch.backends.cudnn.allow_tf32}}


def _path(model: Any, seqs: list[torch.Tensor], attention: PackedAttention) -> dict[str, Any]:
    """The first sequence alone against it padded (left, right) and packed (first, middle, last) on one path."""
    target = seqs[0]
    alone = _packed(model, [target], attention)[0]
    variants = {
        "left pad 3": _padded(model, [target, seqs[2]], "left", 3), "left pad 8": _padded(model, [target, seqs[5]], "left", 8),
        "right pad 3": _padded(model, [target, seqs[2]], "right", 3), "right pad 8": _padded(model, [target, seqs[5]], "right", 8),
        "packed first": _packed(model, [target, seqs[1], seqs[2]], attention)[0],
        "packed middle": _packed(model, [seqs[5], target, seqs[3]], attention)[1],
        "packed last": _packed(model, [seqs[4], seqs[3], target], attention)[2],
    }
    diffs = {name: _diff(got, alone) for name, got in variants.items()}
    return {"dtype": "fp32", "attn_implementation": model.config._attn_implementation, "atol": LOGPROB_ATOL,
            "max_abs_diff": diffs, "passed": max(diffs.values()) <= LOGPROB_ATOL}


def _flash(device: str, smoke: bool, seqs: list[torch.Tensor]) -> dict[str, Any]:
    """flash-attn's varlen kernel through packrl's ``varlen`` path: packed vs alone, bf16."""
    if device != "cuda" or importlib.util.find_spec("flash_attn") is None:
        return {"ran": False, "reason": "needs CUDA and the flash_attn package" + ("" if device == "cuda" else "; this run is on the CPU")}
    model = _small_policy(device, smoke, torch.bfloat16, attn="flash_attention_2")
    packed = _packed(model, seqs[:3], "varlen")
    diffs = {f"sequence {i}": _diff(got, _packed(model, [s], "varlen")[0]) for i, (s, got) in enumerate(zip(seqs[:3], packed))}
    return {"ran": True, "dtype": "bf16", "atol": FLASH_ATOL, "max_abs_diff": diffs, "passed": max(diffs.values()) <= FLASH_ATOL}


def _torch_varlen(device: str, seqs: list[torch.Tensor]) -> dict[str, Any]:
    """torch's varlen attention against causal SDPA per sequence on random q, k, v (bf16)."""
    if device != "cuda" or importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return {"ran": False, "reason": "needs CUDA and torch.nn.attention.varlen (torch >= 2.10)"}
    from torch.nn.attention.varlen import varlen_attn

    lengths = [len(s) for s in seqs]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), 8, 64, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    params = inspect.signature(varlen_attn).parameters  # the causal flag's name changed between torch releases
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    out = varlen_attn(q, k, v, cu, cu, max(lengths), max(lengths), **causal)
    assert isinstance(out, torch.Tensor), "no auxiliary outputs were asked for"
    diffs = {}
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        qs, ks, vs = (x[s:e].transpose(0, 1)[None] for x in (q, k, v))  # [1, heads, L, d]
        want = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        diffs[f"sequence {i}"] = _diff(out[s:e], want[0].transpose(0, 1))
    return {"ran": True, "packrl_path": False, "causal_argument": next(iter(causal)), "dtype": "bf16", "atol": FLASH_ATOL,
            "max_abs_diff": diffs, "passed": max(diffs.values()) <= FLASH_ATOL}


def _chunked_vs_full(device: str, smoke: bool) -> dict[str, Any]:
    from packrl.seqlen.chunked import chunked_logprobs, full_logprobs

    config = model_config("0.5B", smoke)
    tokens, chunk = (37, 5) if smoke else (1024, 256)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, config.hidden_size, generator=g).to(device).requires_grad_()
    w = (0.02 * torch.randn(config.vocab_size, config.hidden_size, generator=g)).to(device).requires_grad_()
    labels = torch.randint(0, config.vocab_size, (tokens,), generator=g).to(device)
    weights = torch.randn(tokens, generator=g).to(device)
    results = []
    for fn in (lambda: chunked_logprobs(h, w, labels, chunk_tokens=chunk), lambda: full_logprobs(h, w, labels)):
        lp, ent = fn()
        (lp * weights).sum().backward()
        assert h.grad is not None and w.grad is not None, "both take part in the loss"
        results.append((lp.detach(), ent.detach(), h.grad.clone(), w.grad.clone()))
        h.grad, w.grad = None, None
    names = ("logprobs", "entropy", "grad_hidden", "grad_head")
    diffs = {name: _diff(a, b) for name, a, b in zip(names, *results)}
    return {"dtype": "fp32", "tokens": tokens, "chunk_tokens": chunk, "vocab_size": config.vocab_size, "atol": LOGPROB_ATOL,
            "max_abs_diff": diffs, "passed": max(diffs.values()) <= LOGPROB_ATOL}


def _split_batch(vocab: int) -> Any:
    """tests/builders.py's loss batch: 8 sequences in 4 groups of 2, old and reference log-probs, one response masked."""
    from packrl.types import PromptBatch, Response, RolloutBatch, ScoredBatch, TrainBatch

    prompt_lens, response_lens = [5, 9, 3, 12], [14, 3, 22, 6, 17, 9, 1, 11]
    g = torch.Generator().manual_seed(3)
    prompts = PromptBatch(tuple(tuple(torch.randint(3, vocab, (n,), generator=g).tolist()) for n in prompt_lens),
                          ("0",) * 4, ("t",) * 4, (0, 1, 2, 3), (False,) * 4)
    responses = tuple(Response(tuple(torch.randint(3, vocab, (n,), generator=g).tolist()), "length" if i == 5 else "eos")
                      for i, n in enumerate(response_lens))
    rewards = torch.zeros(len(responses))
    masks = tuple(torch.full((n,), i != 5) for i, n in enumerate(response_lens))
    draw = lambda mean, scale: tuple(mean + scale * torch.randn(n, generator=g, dtype=torch.float64) for n in response_lens)  # noqa: E731
    return TrainBatch(ScoredBatch(RolloutBatch(prompts, 2, responses), rewards, rewards), draw(0.0, 1.0), masks,
                      draw(-4.6, 0.3), draw(-4.6, 0.3))


def _pass_config(budget: int) -> Any:
    from packrl.config.schema import AlgorithmConfig, DataConfig, ModelConfig, RolloutConfig, RunConfig, TrainConfig

    return RunConfig(model=ModelConfig(dtype="fp64", packed_attention="varlen"), data=DataConfig(batch_size=4, max_prompt_tokens=12),
                     rollout=RolloutConfig(n=2, max_response_tokens=24),
                     train=TrainConfig(max_tokens_per_microbatch=budget, max_tokens_per_logprob_microbatch=4096),
                     algorithm=AlgorithmConfig(kl_coef=0.1, entropy_coeff=0.01, clip_ratio_low=0.1, clip_ratio_high=0.1))


def _loss_and_grads(device: str, smoke: bool, budget: int) -> tuple[float, torch.Tensor, int]:
    """`packrl.testing.minibatch_grads` for one rank: the first mini-batch's forward and
    backward as the controller plans it; returns (loss, gradients, micro-batches)."""
    from packrl.config.plan import BatchPlan
    from packrl.seqlen.update_plan import groups_of
    from packrl.testing import minibatch_objective
    from packrl.worker.actor import MicrobatchLoss, ResponseSums, actor_microbatches

    model = _small_policy(device, smoke, torch.float64).train()
    batch, cfg = _split_batch(model.config.vocab_size), _pass_config(budget)
    rollout = batch.rollout
    planner = replace(BatchPlan.from_config(cfg).planner(packed=True, share_prompts=False), num_ranks=1, num_epochs=1)
    plan = planner.update(rollout.sequence_lengths(), [int(m.sum()) for m in batch.loss_masks],
                          [rollout.prompt_ids_of(i) for i in range(len(rollout))], groups=groups_of(len(rollout), rollout.group_size))
    minibatch = plan.minibatches[0]
    micro = [mb for mb in minibatch.microbatches(0) if mb]
    totals = actor_microbatches(model, batch, micro, den=minibatch.denominators, loss=MicrobatchLoss.from_config(cfg),
                                context=contextlib.nullcontext, sums=ResponseSums.zeros(len(rollout)))
    loss = minibatch_objective(totals.metrics, cfg.algorithm)
    return loss, torch.cat([p.grad.reshape(-1) for p in model.parameters()]).cpu(), len(micro)


def _microbatch_split(device: str, smoke: bool) -> dict[str, Any]:
    ref_loss, ref_grads, _ = _loss_and_grads(device, smoke, 4096)
    out: dict[str, Any] = {"dtype": "fp64", "rtol": LOSS_RTOL, "budgets": {}}
    ok = bool(ref_grads.abs().max() > 0)
    for budget in (40, 64):
        loss, grads, num_micro = _loss_and_grads(device, smoke, budget)
        loss_ok = abs(loss - ref_loss) <= LOSS_RTOL * abs(ref_loss) + 1e-12  # pytest.approx(rel=RTOL), as the test
        grads_ok = bool(((grads - ref_grads).abs() <= 1e-12 + LOSS_RTOL * ref_grads.abs()).all())  # assert_close(rtol, atol=1e-12)
        out["budgets"][budget] = {"num_microbatches": num_micro, "loss": loss, "loss_one_microbatch": ref_loss,
                                  "loss_rel_diff": abs(loss - ref_loss) / max(abs(ref_loss), 1e-300),
                                  "grad_max_abs_diff": _diff(grads, ref_grads), "loss_within_rtol": loss_ok, "grads_within_rtol": grads_ok}
        ok = ok and loss_ok and grads_ok and num_micro > 1
    return out | {"passed": ok}


def _first_step_kl(device: str, smoke: bool) -> dict[str, Any]:
    """Two GRPO steps of the real loop on a small model (8,192 tokens of vocabulary on CUDA, so
    its final checkpoint stays small); step 1's KL to the reference is exactly 0. Both passes
    take the step's sequences in one pack (equal budgets, larger than the step), so the same
    kernels see the same shapes and any difference is the reference's or the loss's, not a
    matmul's rounding over another pack."""
    from packrl.config import load_config
    from packrl.config.plan import BatchPlan
    from packrl.distributed.local import local_group
    from packrl.trainer.loop import train

    register_hash_reward()
    config = model_config("0.5B", smoke, num_layers=2, vocab_size=None if smoke else 8192)
    tokenizer = offline_tokenizer(config.vocab_size)
    dtype = "fp32" if smoke else "bf16"
    with scratch_dir("gpu-check-kl-") as tmp:
        path = model_folder(config, tokenizer, Path(tmp) / "model")
        cfg = load_config("demo", [f"model.path={path}", f"train.out_dir={tmp}/run", "train.total_steps=2", "data.batch_size=4",
                                   "rollout.n=2", f"rollout.max_response_tokens={8 if smoke else 32}", f"model.dtype={dtype}",
                                   "algorithm.kl_coef=0.01", "train.lr=1e-3", f"reward.name={REWARD}", "data.val_files=[]",
                                   "train.loggers=[]", "train.dump_rollouts=false", "train.max_tokens_per_microbatch=4096",
                                   "train.max_tokens_per_logprob_microbatch=4096"])
        policy = random_policy(config, cfg.model, tokenizer, device, BatchPlan.from_config(cfg).compute_dtype)
        run_dir = train(cfg, local_group(cfg, policy, tokenizer))
        steps = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    kl = [s["actor/kl_loss"] for s in steps]
    return {"dtype": dtype, "kl_loss": kl, "num_microbatches": [s["seqlen/num_microbatches"] for s in steps],
            "passed": len(kl) == 2 and kl[0] == 0.0 and kl[1] != 0.0}
