"""LoRA on 2 FSDP2 ranks (Ray, gloo on this CPU) trains as one process: the adapters sharded in their
decoder layers, the reference the base model with the adapters off, checkpoints holding the adapter
alone and resuming under either layout, and the rollout engine getting the merged weights."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("ray")

from packrl.config import load_config  # noqa: E402
from packrl.trainer.loop import train  # noqa: E402
from tests.builders import LAYOUT, RAY_COMMON, metric_lines  # noqa: E402
from tests.diagnostics.tiny_run import BASE  # noqa: E402  (also registers reward test_letter_e)
from tests.same_training import STEP_SHARE, assert_same_training, checkpoint_state  # noqa: E402

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "algorithm.kl_coef=0.05"]
"""An adapter on every Linear of the tiny model and a KL term, so the reference (the base model with
the adapter off) enters the loss."""
LOSS_REL = 1e-6  # float64 layouts differ by summation order only (tests/distributed/test_ray_group.py says why)
PG_LOSS_ABS = 1e-8
"""The policy loss here is a near-zero mean (about 1e-5) of per-token terms of size |A| ~ 1 that
cancel, so its rounding follows the terms, not the mean: the layouts differed by 1.6e-10."""


def _run(out, model_dir, workers: int, *overrides: str):
    cfg = load_config("demo", [f"train.out_dir={out}", f"model.path={model_dir}", f"trainer.num_workers={workers}", *RAY_COMMON,
                               *LORA, *LAYOUT, *overrides])
    return train(cfg)


def _checkpoint(run_dir, step):
    return run_dir / "checkpoints" / f"step_{step}"


@pytest.mark.slow
def test_lora_on_two_workers_trains_and_resumes_as_one_process(tmp_path, model_dir):
    """2 steps on 1 process == on 2 ranks (adapter weights and AdamW moments, float64); each
    checkpoint holds the adapter alone; 2 more steps resumed under the other layout == 4 steps
    straight in one process."""
    from safetensors.torch import load_file

    one = _run(tmp_path / "one", model_dir, 1, "train.total_steps=2")
    two = _run(tmp_path / "two", model_dir, 2, "train.total_steps=2")
    for run in (one, two):
        files = {p.name for p in _checkpoint(run, 2).iterdir()}
        assert {"adapter_model.safetensors", "adapter_config.json", "optimizer.pt"} <= files and "model.safetensors" not in files
    weights, optimizer = checkpoint_state(_checkpoint(two, 2))
    assert sorted(weights) == sorted(optimizer["state"]) and all(".lora_" in name for name in weights)  # the adapter, whole
    base = load_file(str(model_dir / "model.safetensors"))
    for name, w in weights.items():  # whole, not one rank's shard: A [r, in] and B [out, r] of the layer's W [out, in]
        out, inner = base[name.removeprefix("base_model.model.").split(".lora_")[0] + ".weight"].shape
        assert tuple(w.shape) == ((4, inner) if ".lora_A." in name else (out, 4)), name
    assert any(name.endswith("lora_B.default.weight") and (w != 0).any() for name, w in weights.items()), "B starts at 0 and trains"
    assert_same_training(_checkpoint(one, 2), _checkpoint(two, 2))  # 4 optimizer steps
    for x, y in zip(metric_lines(one), metric_lines(two), strict=True):
        for key in ("actor/kl_loss", "actor/grad_norm", "actor/entropy"):
            assert y[key] == pytest.approx(x[key], rel=LOSS_REL), key
        assert y["actor/pg_loss"] == pytest.approx(x["actor/pg_loss"], rel=0, abs=PG_LOSS_ABS)
    assert metric_lines(two)[1]["actor/kl_loss"] > 0, "the adapter moved the policy away from the reference"

    straight = _run(tmp_path / "straight", model_dir, 1, "train.total_steps=4")
    to_two = _run(tmp_path / "one", model_dir, 2, "train.total_steps=4", "train.resume=auto")
    to_one = _run(tmp_path / "two", model_dir, 1, "train.total_steps=4", "train.resume=auto")
    assert [line["step"] for line in metric_lines(to_two)] == [1, 2, 3, 4]
    assert_same_training(_checkpoint(straight, 4), _checkpoint(to_two, 4))  # 8 optimizer steps
    assert_same_training(_checkpoint(straight, 4), _checkpoint(to_one, 4))


@pytest.mark.slow
def test_lora_dropout_on_two_workers_trains_as_one_process(tmp_path, model_dir):
    """With ``model.lora.dropout`` the masks are keyed by token, layer and optimizer step
    (`packrl.models.lora_dropout`), not drawn per rank: 2 steps on 2 ranks == on 1 process
    (float64), and the dropout changed the training."""
    dropout = ["model.lora.dropout=0.3", "train.total_steps=2"]
    one = _run(tmp_path / "one", model_dir, 1, *dropout)
    two = _run(tmp_path / "two", model_dir, 2, *dropout)
    plain = _run(tmp_path / "plain", model_dir, 1, "train.total_steps=2")
    assert_same_training(_checkpoint(one, 2), _checkpoint(two, 2))
    for x, y in zip(metric_lines(one), metric_lines(two), strict=True):
        for key in ("actor/kl_loss", "actor/grad_norm", "actor/entropy"):
            assert y[key] == pytest.approx(x[key], rel=LOSS_REL), key
    grad_norms = [(line["actor/grad_norm"], base["actor/grad_norm"]) for line, base in zip(metric_lines(one), metric_lines(plain))]
    assert any(abs(x - y) > 1e-3 * abs(y) for x, y in grad_norms), "the dropout masks changed the gradients"


def _batch(tokenizer):
    """One scored batch of 2 prompts x 3 responses of the tiny model's vocabulary."""
    from packrl.config.schema import AlgorithmConfig, RewardConfig
    from packrl.reward.score import score_rollout
    from packrl.trainer.batch import build_train_batch
    from packrl.types import PromptBatch, Response, RolloutBatch

    g = torch.Generator().manual_seed(0)
    ids = lambda n: tuple(torch.randint(100, 5000, (n,), generator=g).tolist())  # noqa: E731
    prompts = PromptBatch((ids(12), ids(9)), ("1", "2"), ("t", "t"), (0, 1), (False, False))
    responses = tuple(Response(ids(n), "length") for n in (10, 7, 12, 5, 9, 11))
    scored = score_rollout(RolloutBatch(prompts, 3, responses), tokenizer, RewardConfig(name="test_letter_e"), 64)
    return build_train_batch(scored, None, None, AlgorithmConfig())[0]


def _engine_weights(worker) -> dict[str, torch.Tensor]:
    """The parameters of a worker's rollout engine (an unsharded merged copy under FSDP2)."""
    return {name: p.detach().clone() for name, p in worker.engine.model.named_parameters()}


def _merged(base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """``W + (alpha / r) B A`` (Hu et al. 2021, Eq. 3) of every adapted weight; the others as they are."""
    merged = dict(base)
    for name in {k.rsplit(".lora_", 1)[0] for k in adapter}:
        a, b = adapter[f"{name}.lora_A.weight"], adapter[f"{name}.lora_B.weight"]
        weight = f"{name.removeprefix('base_model.model.')}.weight"
        merged[weight] = base[weight] + scaling * (b @ a)
    return merged


@pytest.mark.slow
def test_the_rollout_engine_of_every_rank_holds_the_merged_weights_of_one_process(tmp_path, model_dir, smollm_tokenizer):
    """After one update on 2 ranks (gradient checkpointing on) the engine of each rank holds
    ``W + (alpha / r) B A`` of the trained adapter (gathered from the shards, computed here from the
    checkpoint's adapter and the base weights), and that equals the merged weights of one process
    after the same update."""
    from safetensors.torch import load_file

    from packrl.distributed.local import local_group
    from packrl.distributed.ray_group import ray_group

    overrides = [f"model.path={model_dir}", *BASE, *RAY_COMMON[len(BASE):], *LORA, *LAYOUT,
                 "model.gradient_checkpointing=true"]  # as LoRA commands of the tuning guides run
    batch = _batch(smollm_tokenizer)
    group = ray_group(load_config("demo", [*overrides, "trainer.num_workers=2"]), tmp_path)
    try:
        group.update(batch)
        engines = group.transport.call("__ray_call__", [(_engine_weights,)] * 2)
        group.transport.call("save_checkpoint", [(tmp_path, 1, {"sampler": {}})] * 2)
    finally:
        group.close()
    local = local_group(load_config("demo", overrides))
    local.update(batch)
    policy = local.transport.worker.model  # float64: the engine generates on the policy itself, adapters included
    trained = {name.replace(".default", ""): p.detach() for name, p in policy.named_parameters() if ".lora_" in name}

    base = {name: value.double() for name, value in load_file(str(model_dir / "model.safetensors")).items()}
    base.setdefault("lm_head.weight", base["model.embed_tokens.weight"])  # tied: saved once
    adapter = load_file(str(tmp_path / "checkpoints" / "step_1" / "adapter_model.safetensors"))
    expected = _merged(base, adapter, scaling=8 / 4)
    one = _merged(base, trained, scaling=8 / 4)
    assert set(expected) - set(engines[0]) == {"lm_head.weight"} and sorted(trained) == sorted(adapter)  # the tie: named once
    lr, steps = 1e-4, 2  # LAYOUT's lr; RAY_COMMON's two mini-batches per step
    for name in engines[0]:
        value = expected[name]
        for rank in range(2):
            torch.testing.assert_close(engines[rank][name], value, rtol=0, atol=1e-12, msg=f"rank {rank}: {name}")
        # one process: the same training to rounding, within 1% of lr per optimizer step as the weights
        # (tests/same_training.py); measured at most 2e-5 of that, an A drawn on another rank 150x over it
        assert float((one[name] - value).abs().max()) <= STEP_SHARE * lr * steps, name
    adapted = [n for n in expected if n.endswith("q_proj.weight")]
    assert adapted and all(not torch.equal(expected[n], base[n]) for n in adapted), "the update moved the merged weights"
