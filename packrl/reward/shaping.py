"""Reward shaping (``reward.shaping``): registered parts added to the task score, each reported.

Shapes: ``N`` responses (``B`` prompts x ``G`` per prompt, groups contiguous).

A shaping part is a function `ShapingInputs` -> `ShapingOutput` registered in
`packrl.registry.REWARD_SHAPING` with a dataclass of its own knobs. The config turns parts on by
name and sets their knobs in one mapping, ``reward.shaping.<part>.<knob>`` (an empty mapping,
``reward.shaping.<part>={}``, takes the defaults), checked at load against the dataclass as policy
losses' options are (`packrl.config.load.build_options`). `shape_rewards` is the one place that
sums them: a response's reward is its task score plus the sum of every chosen part's value, and
every part is reported as ``reward/<part>/mean`` (its sub-terms as ``reward/<part>/<term>/mean``,
`packrl.diagnostics.metrics.score_metrics`).

Built in (listed in `packrl.registry.REWARD_SHAPING`): ``overlong`` (DAPO's soft overlong
punishment, `packrl.reward.overlong`), ``tool_format`` (the tool-call format reward,
`packrl.reward.tool_format`) and the four length objectives of `packrl.reward.length`:
``group_length``, ``efficiency``, ``shortest_correct`` and ``target_length``. A user adds one with
one decorated function in a file named in ``trainer.plugins``::

    @REWARD_SHAPING.register("brevity", options=BrevityOptions)
    def brevity(inputs: ShapingInputs) -> ShapingOutput: ...

A part's config check (other keys it depends on) registers with
``REWARD_SHAPING.register_check("brevity")`` on a function of the config sections it reads, as
every other config check (`packrl.registry.call_with_sections`), e.g. ``def check(reward:
RewardConfig, rollout: RolloutConfig) -> list[ConfigProblem]``; it reads its own settings as
given, ``reward.shaping["brevity"]`` (a mapping not yet built into its options).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from packrl.config.load import build_options
from packrl.config.schema import RewardConfig
from packrl.errors import ConfigError
from packrl.registry import REWARD_SHAPING
from packrl.types import RolloutBatch


@dataclass(frozen=True)
class ShapingInputs:
    """What a shaping part may read.

    Attributes:
        rollout: the ``N`` responses and their prompts (``rollout.group_size`` responses per group,
            contiguous; each `Response` has its finish reason, token ids and multi-turn trajectory).
        scores: the task score of each response (the reward function's value; 0 for a response a
            budget cut unless the reward scores those). Shape [N], float32.
        texts: the text each response was scored on (its policy turns, special tokens skipped).
        tokenizer: the policy's tokenizer.
        response_budgets: the response budget each response was sampled under, in tokens: the
            step's (the current stage's under a length curriculum), or for a partial-rollout group
            carried across steps its dispatching step's (`packrl.types.RolloutBatch.response_budgets`).
        step: the training step (1-based; 0 outside training, e.g. validation).
        correct: True where a response is correct: its task score reaches the reward's
            `packrl.capabilities.RewardInfo.correct_score` and no budget cut it (an answer cut
            short is not correct). Shape [N], bool; None when the reward has no notion of correct.
        options: the part's own options (its registered dataclass built from
            ``reward.shaping.<part>``).
    """

    rollout: RolloutBatch
    scores: torch.Tensor
    texts: tuple[str, ...]
    tokenizer: Any
    response_budgets: tuple[int, ...]
    step: int = 0
    correct: torch.Tensor | None = None
    options: Any = None


@dataclass(frozen=True)
class ShapingOutput:
    """What a shaping part returns.

    Attributes:
        values: added to each response's reward. Shape [N], float32.
        terms: named sub-terms of ``values`` for the metrics (each Shape [N], float32; reported as
            ``reward/<part>/<term>/mean``), e.g. the format reward's ``call``, ``answer_used`` and
            ``malformed``. They are reported only, not added again.
    """

    values: torch.Tensor
    terms: dict[str, torch.Tensor] = field(default_factory=dict)


ShapingFn = Callable[[ShapingInputs], ShapingOutput]


def shaping_options(cfg: RewardConfig) -> dict[str, Any]:
    """Every chosen part's options, built from ``reward.shaping`` (a config that passed
    `packrl.config.load.load_config` always builds).

    Returns:
        part name -> its options dataclass (or None for a part registered without one), in the
        order the config lists them.

    Raises:
        ValueError: a part is not registered; ConfigError: its options do not fit its dataclass.
    """
    out: dict[str, Any] = {}
    for name, args in cfg.shaping_parts().items():
        REWARD_SHAPING.lookup(name)
        cls = REWARD_SHAPING.options_class(name)
        if cls is None:
            out[name] = None
            continue
        options, problems = build_options(cls, args, f"reward.shaping.{name}.")
        if problems:
            raise ConfigError(problems)
        out[name] = options
    return out


def shape_rewards(base: ShapingInputs, cfg: RewardConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The sum of every chosen part and each part's values.

    Args:
        base: the inputs without options (`ShapingInputs.options` is set per part).
        cfg: the ``reward`` section (``shaping``).

    Returns:
        ``(total, parts)``: total Shape [N] float32 (0 without parts); parts ``<part>`` and
        ``<part>/<term>`` -> Shape [N] float32, for `packrl.types.ScoredBatch.parts`.

    Raises:
        ValueError: a part returned values that are not one finite number per response (names the part).
    """
    num = len(base.rollout.responses)
    total = torch.zeros(num)
    parts: dict[str, torch.Tensor] = {}
    for name, options in shaping_options(cfg).items():
        out = REWARD_SHAPING.lookup(name)(replace(base, options=options))
        values = _checked(name, out.values, num)
        total = total + values
        parts[name] = values
        parts |= {f"{name}/{term}": _checked(f"{name}/{term}", v, num) for term, v in out.terms.items()}
    return total, parts


def _checked(name: str, values: Any, num: int) -> torch.Tensor:
    if not isinstance(values, torch.Tensor) or tuple(values.shape) != (num,):
        raise ValueError(f"reward.shaping part {name!r} returned {getattr(values, 'shape', type(values).__name__)} for {num} "
                         "responses; return one value per response, Shape [N]")
    values = values.detach().float().cpu()
    if not torch.isfinite(values).all():
        raise ValueError(f"reward.shaping part {name!r} returned a non-finite value {values.tolist()}; return finite rewards")
    return values
