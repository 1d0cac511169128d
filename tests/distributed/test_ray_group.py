"""Data-parallel training over Ray + FSDP2 (gloo on this CPU): 2 workers train exactly as 1 process,
checkpoints move between the two, skewed lengths do not hang, and a local run listens on loopback only."""

from __future__ import annotations

import json
import threading

import pytest
import torch

pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # every test here starts Ray and worker processes

from packrl.config import load_config  # noqa: E402
from packrl.trainer.loop import train  # noqa: E402
from tests.builders import LAYOUT, RAY_COMMON, metric_lines, rollout_responses  # noqa: E402
from tests.diagnostics.tiny_run import BASE  # noqa: E402  (also registers reward test_letter_e)
from tests.same_training import assert_same_training  # noqa: E402

# Layouts are compared in float64 at a step size where rounding differences do not compound
# (`LAYOUT`; tests/same_training.py says why, with the figures). transformers keeps RMSNorm and
# RoPE in float32 inside a float64 model, so losses and gradient norms of two layouts still differ
# by about 1e-9 relative; LOSS_REL allows 1e-6, 1,000x that, and 1,000x below a rank that trained
# on the wrong data or scale.
LOSS_REL = 1e-6


def _run(out, model_dir, workers: int, *overrides: str):
    cfg = load_config("demo", [f"train.out_dir={out}", f"model.path={model_dir}", f"trainer.num_workers={workers}", *RAY_COMMON,
                               *overrides])
    return train(cfg)


def _weights(run_dir, step):
    from safetensors.torch import load_file

    return load_file(str(run_dir / "checkpoints" / f"step_{step}" / "model.safetensors"))


def _checkpoint(run_dir, step):
    return run_dir / "checkpoints" / f"step_{step}"


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_two_workers_train_as_one_process(tmp_path, model_dir, mode):
    one = _run(tmp_path / "one", model_dir, 1, "train.total_steps=2", f"algorithm.loss_agg_mode={mode}", *LAYOUT)
    two = _run(tmp_path / "two", model_dir, 2, "train.total_steps=2", f"algorithm.loss_agg_mode={mode}", *LAYOUT)
    for step in (1, 2):
        assert rollout_responses(one, step) == rollout_responses(two, step)  # per-prompt seeds: the same samples on any rank
    assert_same_training(_checkpoint(one, 2), _checkpoint(two, 2))  # weights and AdamW moments, 4 optimizer steps
    assert (_weights(one, 2)["model.norm.weight"] != 1).any(), "the run must actually train"
    a, b = metric_lines(one), metric_lines(two)
    for x, y in zip(a, b):
        assert y["actor/pg_loss"] == pytest.approx(x["actor/pg_loss"], rel=LOSS_REL)
        assert y["actor/grad_norm"] == pytest.approx(x["actor/grad_norm"], rel=LOSS_REL)
        assert y["seqlen/rank_imbalance"] >= 1.0 and "seqlen/rank_imbalance" not in x
    trace = json.loads((two / "trace.json").read_text())
    assert trace["otherData"]["ray_timeline"] == "ray_timeline.json" and (two / "ray_timeline.json").is_file()
    ranks = {e["args"]["rank"] for e in trace["traceEvents"] if e["name"] == "microbatch"}
    assert ranks == {0, 1}


def test_checkpoints_move_between_one_process_and_two_workers(tmp_path, model_dir):
    """4 steps straight in one process == 2 steps on either side + resume for 2 on the other."""
    straight = _run(tmp_path / "straight", model_dir, 1, "train.total_steps=4", *LAYOUT)
    half_one = _run(tmp_path / "half_one", model_dir, 1, "train.total_steps=2", *LAYOUT)
    half_two = _run(tmp_path / "half_two", model_dir, 2, "train.total_steps=2", *LAYOUT)
    to_two = _run(tmp_path / "half_one", model_dir, 2, "train.total_steps=4", "train.resume=auto", *LAYOUT)
    to_one = _run(tmp_path / "half_two", model_dir, 1, "train.total_steps=4", "train.resume=auto", *LAYOUT)
    assert [line["step"] for line in metric_lines(to_two)] == [1, 2, 3, 4]
    # 8 optimizer steps on each side, in float64 (tests/same_training.py: the tolerances and why)
    assert_same_training(_checkpoint(straight, 4), _checkpoint(to_two, 4))
    assert_same_training(_checkpoint(straight, 4), _checkpoint(to_one, 4))
    assert half_two == to_one and half_one == to_two


def _skewed_batch(tokenizer):
    """One prompt with a response 10x as long as the other prompt's three (a rank's share 10x longer)."""
    from packrl.config.schema import AlgorithmConfig, RewardConfig
    from packrl.reward.score import score_rollout
    from packrl.trainer.batch import build_train_batch
    from packrl.types import PromptBatch, Response, RolloutBatch

    g = torch.Generator().manual_seed(0)
    ids = lambda n: tuple(torch.randint(100, 5000, (n,), generator=g).tolist())  # noqa: E731
    prompts = PromptBatch((ids(30), ids(20)), ("1", "2"), ("t", "t"), (0, 1), (False, False))
    responses = tuple(Response(ids(n), "length") for n in (300, 290, 280, 30, 25, 28))
    rollout = RolloutBatch(prompts, 3, responses)
    scored = score_rollout(rollout, tokenizer, RewardConfig(name="test_letter_e"), 512)
    return build_train_batch(scored, None, None, AlgorithmConfig())[0]


def test_skewed_lengths_do_not_hang_and_memory_features_work_on_every_rank(tmp_path, model_dir, smollm_tokenizer):
    """Ranks with 10x different work stay in step; with model.activation_offload=true every rank's
    update saves its activations through the offload hook (gradient checkpointing on too); the
    result equals one process's."""
    from packrl.distributed.local import local_group
    from packrl.distributed.ray_group import ray_group
    from packrl.worker.actor import update_metrics

    overrides = [f"model.path={model_dir}", "trainer.num_workers=2", "model.dtype=fp64", "rollout.max_response_tokens=320",
                 "data.max_prompt_tokens=64", "train.max_tokens_per_microbatch=400", "data.batch_size=2", "rollout.n=3",
                 "model.activation_offload=true", "model.gradient_checkpointing=true"]
    cfg = load_config("demo", overrides)
    batch = _skewed_batch(smollm_tokenizer)
    group = ray_group(cfg, tmp_path)
    try:
        plan = group.plan_update(batch)
        counts = [len(plan.minibatches[0].microbatches(rank)) for rank in range(2)]
        assert counts[0] == counts[1], "every rank runs the same number of micro-batches"
        stats: list = []
        shared = group.transport.share(batch)
        worker = threading.Thread(target=lambda: stats.extend(s for s, _ in group.transport.call("update", [(shared, plan, None)] * 2)),
                                  daemon=True)
        worker.start()
        worker.join(timeout=300)
        assert not worker.is_alive(), "the data-parallel update hung"
    finally:
        group.close()
    assert len(stats) == 2 and all(s.offloaded_bytes > 0 for s in stats), "each rank's saved tensors went through the hook"
    assert plan.imbalance() >= 1.0
    result = update_metrics(stats, batch, cfg.rollout.max_response_tokens)
    local = local_group(load_config("demo", [*overrides[:1], *overrides[2:]]))
    expected = local.update(batch)
    # one update from equal weights, in float64: only summation order differs (see LAYOUT)
    assert result["actor/grad_norm"] == pytest.approx(expected["actor/grad_norm"], rel=LOSS_REL)
    assert result["actor/pg_loss"] == pytest.approx(expected["actor/pg_loss"], rel=LOSS_REL)


def test_a_local_run_listens_on_loopback_only(tmp_path, model_dir):
    """Also: each rank imports trainer.plugins itself (the policy loss it names is looked up there)."""
    import psutil

    from packrl.distributed.ray_group import ray_group

    plugin = tmp_path / "rank_plugin.py"
    plugin.write_text("from packrl.algos.policy_losses import ppo_clip\nfrom packrl.registry import POLICY_LOSSES\n\n"
                      "POLICY_LOSSES.register('test_rank_plugin_loss')(lambda inputs: ppo_clip(inputs))\n")
    cfg = load_config("demo", [f"model.path={model_dir}", "trainer.num_workers=2", *BASE, f"trainer.plugins=[{plugin}]",
                               "algorithm.policy_loss=test_rank_plugin_loss"])
    group = ray_group(cfg, tmp_path)
    try:
        processes = [psutil.Process(), *psutil.Process().children(recursive=True)]
        listening = []
        for proc in processes:
            try:
                listening += [(proc.name(), c.laddr) for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
            except psutil.NoSuchProcess:
                continue
    finally:
        group.close()
    assert len(processes) > 4 and listening, "Ray's processes and sockets must be visible"
    outside = [(name, addr) for name, addr in listening if addr.ip not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")]
    assert not outside, f"sockets listening beyond loopback: {outside}"
    assert (tmp_path / "ray").exists(), "Ray's temp dir (or a link to it) lives in the run dir"


def test_ppo_with_a_critic_trains_on_two_workers_as_in_one_process(tmp_path, model_dir):
    """The critic is data-parallel like the actor: its weights, values and losses on 2 FSDP2 ranks
    equal one process's."""
    critic = ["algorithm.adv_estimator=gae", "critic.lr=1e-4", "train.total_steps=2", *LAYOUT]
    one = _run(tmp_path / "one", model_dir, 1, *critic)
    two = _run(tmp_path / "two", model_dir, 2, *critic)
    a, b = metric_lines(one), metric_lines(two)
    for x, y in zip(a, b):
        for key in ("critic/vf_loss", "critic/values/mean", "critic/returns/mean", "actor/pg_loss"):
            assert y[key] == pytest.approx(x[key], rel=LOSS_REL, abs=1e-12), key
        assert y["critic/grad_norm"] == pytest.approx(x["critic/grad_norm"], rel=LOSS_REL)
    first, second = (torch.load(_checkpoint(run, 2) / "critic.pt", weights_only=False) for run in (one, two))
    assert_same_training((first["weights"], first["optimizer"]), (second["weights"], second["optimizer"]))
    assert_same_training(_checkpoint(one, 2), _checkpoint(two, 2))
    assert (first["weights"]["value_head.bias"] != 0).any(), "the critic must actually train"
