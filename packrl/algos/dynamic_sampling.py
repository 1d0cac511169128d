"""Dynamic sampling (DAPO, Yu et al. 2025, arXiv 2503.14476, "dynamic sampling"; verl's
``algorithm.filter_groups``), the sampling filter ``algorithm.filters.dynamic_sampling``: drop the
prompt groups whose responses all got the same value and refill the batch from further generation
rounds (docs/algorithms/dynamic_sampling.md).

Shapes: ``N = B*G`` responses, groups contiguous.

A group whose responses all score the same gets advantage 0 under GRPO (and RLOO): it adds no
policy gradient but still costs its tokens in every update pass, and it shrinks the batch's
effective size as training solves more prompts. The stage repeats rounds of ``data.batch_size``
prompts until ``data.batch_size`` groups are kept or ``max_num_gen_batches`` rounds ran
(`packrl.trainer.stages.rounds.filtered_rounds`). Dropped groups are not data rows lost (their rows
stay in the dataset and come back next epoch); they are counted (``train/num_dropped_prompts/dynamic_sampling``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from packrl.algos.filters import FilterInputs, FilterOutput
from packrl.config.length_control import LENGTH_PARTS
from packrl.config.schema import AlgorithmConfig, RewardConfig, RolloutConfig
from packrl.errors import ConfigProblem, check_positive
from packrl.registry import FILTERS

KEY = "algorithm.filters.dynamic_sampling"

FilterMetric = Literal["score", "reward"]


@dataclass(frozen=True, kw_only=True)
class DynamicSamplingOptions:
    """``algorithm.filters.dynamic_sampling``'s knobs."""

    metric: FilterMetric = "score"
    """The per-response value whose spread decides: ``score`` = the task score (verl's ``score``),
    ``reward`` = the score plus shaping (overlong penalty, length parts; in-reward KL is added later
    and not seen). A group is kept when its largest value exceeds its smallest."""

    max_num_gen_batches: int = 10
    """Generation rounds per step at most (DAPO's recipe uses 10). At the cap the step trains on
    the groups kept so far with a warning (verl raises instead; 0 there = unlimited, not here)."""

    def problems(self, prefix: str) -> list[ConfigProblem]:
        return check_positive(f"{prefix}.max_num_gen_batches", self.max_num_gen_batches)


def groups_with_variance(values: torch.Tensor, group_size: int) -> list[int]:
    """Indices of the groups whose values are not all equal (std > 0, tested exactly as max > min,
    so float rounding in a mean cannot keep a constant group).

    Args:
        values: one value per response, groups contiguous. Shape [N], float.
        group_size: G.

    ========================  ==  =======
    values                    G   result
    ========================  ==  =======
    [1, 1, 0, 1, 1, 0, 0, 0]  2   [1, 2]
    [1, 1, 1]                 3   []
    ========================  ==  =======
    """
    per_group = values.reshape(-1, group_size)  # [B, G]
    return torch.nonzero(per_group.amax(dim=1) > per_group.amin(dim=1)).flatten().tolist()


@FILTERS.register("dynamic_sampling", options=DynamicSamplingOptions)
def dynamic_sampling(inputs: FilterInputs) -> FilterOutput:
    """Keep the groups whose ``metric`` values vary; ask for up to ``max_num_gen_batches`` rounds."""
    options: DynamicSamplingOptions = inputs.options
    scored, size = inputs.scored, inputs.scored.rollout.group_size
    values = scored.scores if options.metric == "score" else scored.rewards
    varied = set(groups_with_variance(values, size))
    keep = tuple(i // size in varied for i in range(len(values)))
    return FilterOutput(keep=keep, max_rounds=options.max_num_gen_batches)


def config_problems(rollout: RolloutConfig) -> list[ConfigProblem]:
    """With one response per group every group would be dropped (one value has no spread)."""
    if rollout.n == 1:
        return [ConfigProblem(KEY, {}, "with rollout.n=1 every group is one response, whose value has no variance: every "
                              "group would be dropped", f"set rollout.n >= 2 or {KEY}=null", keys=(KEY, "rollout.n"))]
    return []


def config_warnings(algorithm: AlgorithmConfig, reward: RewardConfig) -> list[ConfigProblem]:
    """A warning: on the task score it drops every group whose scores are all equal, the
    all-correct groups included, whose only signal is a length part's (on an easy task, most of
    it). ``metric=reward`` compares the scores plus shaping and keeps them."""
    parts = [p for p in LENGTH_PARTS if reward.shaping.get(p) is not None]
    metric = (algorithm.filters.get("dynamic_sampling") or {}).get("metric", "score")
    if not parts or metric != "score":
        return []
    keys = [f"reward.shaping.{p}" for p in parts]
    return [ConfigProblem(f"{KEY}.metric", "score", f"drops every group whose task scores are all equal, the "
                          f"all-correct ones included, whose rewards differ only by the length term of {', '.join(keys)}",
                          f"set {KEY}.metric=reward (the score plus shaping) to train on them",
                          keys=(f"{KEY}.metric", KEY, *keys))]
