"""Ulysses sequence parallelism on CPU (gloo): a pack split over 2 ranks gives the log-probs and
gradients of one process (odd lengths, several sequences, too few KV heads to split); through the
trainer, SP=2 trains as one process does and holds sequences one rank's budget cannot, which SP=1
refuses naming the key; DP=2 x SP=2 on 4 ranks trains as one process too."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from packrl.config import ConfigError, load_config
from packrl.models.logprobs import pack_logprobs
from packrl.seqlen.packing import pack_sequences

CASES = {"odd single": ([13], 2), "several": ([5, 8, 4], 2), "kv replicated": ([6, 9], 1)}


def _model(kv_heads: int):
    from packrl.testing import tiny_llama

    return tiny_llama(num_key_value_heads=kv_heads)


def _inputs(lengths):
    g = torch.Generator().manual_seed(2)
    pack = pack_sequences([torch.randint(0, 97, (n,), generator=g) for n in lengths])
    weights = torch.randn(pack.num_tokens, generator=g)
    return pack, weights


def _loss_and_grads(model, pack, weights):
    out = pack_logprobs(model, pack, chunk_tokens=8)
    loss = (out.token_logprobs * weights).sum() + 0.1 * (out.entropy * weights).sum()
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return out.token_logprobs.detach(), out.has_logprob, grads


def _rank(rank: int, out_dir: str, case: str) -> None:
    from packrl.models.ulysses import PACKRL_ULYSSES, SequenceParallel, sequence_parallel

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=2)
    torch.set_num_threads(1)
    lengths, kv = CASES[case]
    model = _model(kv)
    sp = SequenceParallel(dist.group.WORLD, 2, rank, inner=model.config._attn_implementation)
    model.set_attn_implementation(PACKRL_ULYSSES)
    pack, weights = _inputs(lengths)
    with sequence_parallel(sp):
        logprobs, has_logprob, grads = _loss_and_grads(model, pack, weights)
    counts = has_logprob.long()
    for t in (logprobs, grads, counts):  # every rank's share, summed as the worker's all-reduces do
        dist.all_reduce(t)
    if rank == 0:
        torch.save({"logprobs": logprobs, "grads": grads, "counts": counts, "all_to_all_s": sp.all_to_all_s}, f"{out_dir}/rank0.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_pack_split_over_two_ranks_equals_one_process(case, tmp_path):
    mp.spawn(_rank, args=(str(tmp_path), case), nprocs=2, join=True)
    got = torch.load(tmp_path / "rank0.pt")
    lengths, kv = CASES[case]
    model = _model(kv)
    pack, weights = _inputs(lengths)
    logprobs, has_logprob, grads = _loss_and_grads(model, pack, weights)
    assert torch.equal(got["counts"], has_logprob.long()), "every token's log-prob computed on exactly one rank"
    # One float32 forward and backward each, no optimizer: the split only reorders sums over at
    # most 17 tokens and 32 hidden units, which moves values by about 1e-7 (a few units of
    # rounding of log-probs near -4.6); 1e-5 is 100x that, and a token that lost a neighbour's
    # keys or was scored on the wrong rank is off by more than 1e-2.
    torch.testing.assert_close(got["logprobs"], logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(got["grads"], grads, atol=1e-5, rtol=1e-5)
    assert got["all_to_all_s"] > 0


pytest.importorskip("ray")

from tests.builders import LAYOUT, RAY_COMMON, metric_lines, rollout_responses  # noqa: E402
from tests.same_training import assert_same_training  # noqa: E402

# Sequences reach 64 + ~46 tokens; 80 tokens per rank cannot hold one, 2 x 80 can.
LONG = ["rollout.max_response_tokens=64", "data.max_prompt_tokens=64", "train.max_tokens_per_microbatch=80",
        "train.max_tokens_per_logprob_microbatch=80", "train.total_steps=2", *LAYOUT]


def _run(out, model_dir, *overrides: str):
    from packrl.trainer.loop import train

    cfg = load_config("demo", [f"train.out_dir={out}", f"model.path={model_dir}", *RAY_COMMON, *LONG, *overrides])
    return train(cfg)


@pytest.mark.slow
def test_sequence_parallel_holds_what_one_rank_cannot_and_trains_as_one_process(tmp_path, model_dir):
    with pytest.raises(ConfigError, match=r"train.max_tokens_per_microbatch=80: smaller than the longest possible sequence"):
        _run(tmp_path / "refused", model_dir)
    one = _run(tmp_path / "one", model_dir, "train.max_tokens_per_microbatch=256", "train.max_tokens_per_logprob_microbatch=256")
    split = _run(tmp_path / "split", model_dir, "trainer.num_workers=2", "trainer.sequence_parallel_size=2")
    for step in (1, 2):
        assert rollout_responses(one, step) == rollout_responses(split, step)
    assert_same_training(_checkpoint(one), _checkpoint(split))  # float64: tests/same_training.py says why
    lines = metric_lines(split)
    assert all(line["seqlen/sequence_parallel_size"] == 2.0 for line in lines)
    assert max(line["seqlen/microbatch_tokens_max"] for line in lines) > 80  # packs longer than one rank's budget ran
    assert all(line["seqlen/microbatch_tokens_per_rank_max"] <= 80 and line["perf/all_to_all_s"] > 0 for line in lines)
    assert "1 data-parallel x 2 sequence-parallel (Ulysses)" in (split / "model.txt").read_text()
    events = json.loads((split / "trace.json").read_text())["traceEvents"]
    exchanges = [e for e in events if e["name"] == "all_to_all"]
    assert {e["args"]["rank"] for e in exchanges} == {0, 1} and all(e["args"]["num_exchanges"] == 4 for e in exchanges)
    assert "per rank; 160 per pack over 2 sequence-parallel ranks" in (split / "budgets.txt").read_text()


@pytest.mark.slow
def test_two_data_parallel_by_two_sequence_parallel_ranks_train_as_one_process(tmp_path, model_dir):
    one = _run(tmp_path / "one", model_dir, "train.max_tokens_per_microbatch=256", "train.max_tokens_per_logprob_microbatch=256")
    grid = _run(tmp_path / "grid", model_dir, "trainer.num_workers=4", "trainer.sequence_parallel_size=2")
    for step in (1, 2):
        assert rollout_responses(one, step) == rollout_responses(grid, step)
    assert_same_training(_checkpoint(one), _checkpoint(grid))
    assert all(line["seqlen/rank_imbalance"] >= 1.0 for line in metric_lines(grid))
    assert "2 data-parallel x 2 sequence-parallel (Ulysses)" in (grid / "model.txt").read_text()


def _checkpoint(run_dir):
    return run_dir / "checkpoints" / "step_2"


def test_config_checks():
    with pytest.raises(ConfigError, match=r"trainer.sequence_parallel_size=2: does not divide trainer.num_workers=3"):
        load_config("demo", ["trainer.num_workers=3", "trainer.sequence_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"sequence_parallel_size=2: splits packs through the varlen attention path"):
        load_config("demo", ["trainer.num_workers=2", "trainer.sequence_parallel_size=2", "model.packed_attention=block_mask"])
    assert load_config("demo", ["trainer.num_workers=4", "trainer.sequence_parallel_size=2"]).trainer.sequence_parallel_size == 2
