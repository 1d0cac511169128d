"""The filter seam: registered filters between a sampling stage and the update decide which groups
and responses are trained on (`packrl.registry.FILTERS`; docs/algorithms/filters.md).

Shapes: ``N = B*G`` responses (``B`` prompts x ``G`` per prompt, groups contiguous) · ``R_i``
response tokens of response i.

A filter is a function `FilterInputs` -> `FilterOutput` registered with its options dataclass, its
config check and a `packrl.capabilities.FilterInfo` saying where it acts:

- ``sampling``: after each generation round of a stage, whole groups (its ``keep`` must agree
  within a group); it may ask the stage for further rounds to refill the batch
  (`FilterOutput.max_rounds`). Dynamic sampling (``dynamic_sampling``).
- ``advantages``: before the estimator, which sees each group's kept responses alone (every group
  keeps the same number); the others get advantage 0 and no loss tokens. GFPO (``gfpo``).
- ``loss``: after the advantages, responses leave the loss (their masks all False) and per-token
  extras may be added for the loss. Rollout correction (``rollout_correction``: rejection and
  weights, set by ``algorithm.rollout_correction``) and the entropy filter (``entropy``).

The config chooses filters by name in one mapping, ``algorithm.filters.<name>.<knob>`` (an empty
mapping takes the defaults; null turns a preset's filter off), checked at load as reward-shaping
parts are. Filters compose in a declared order: the sampling stage, then advantages, then loss,
and within a stage by `FilterInfo.order` (ties by name). A response taken out is never lost: it
stays in the rollout, is dumped with the name of the filter that took it (``filtered`` in
``rollouts/step_N.jsonl``) and counted (``filter/<name>/dropped``); a group a sampling filter drops
is counted by the stage (``train/num_dropped_prompts/<name>``).

A plugin adds one in one file named in ``trainer.plugins``::

    @FILTERS.register("long_only", options=LongOnly, info=FilterInfo(stage="loss"))
    def long_only(inputs: FilterInputs) -> FilterOutput: ...
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from packrl.capabilities import FilterInfo, FilterStage
from packrl.config.load import build_options
from packrl.config.schema import AlgorithmConfig
from packrl.errors import ConfigError
from packrl.registry import FILTERS
from packrl.types import ScoredBatch


@dataclass(frozen=True)
class FilterInputs:
    """What a filter may read.

    Attributes:
        scored: the scored responses (``rewards``: as the advantages see them, after shaping and
            in-reward KL; at the sampling stage, after shaping). ``scored.rollout.group_size``
            responses per group, contiguous.
        masks: the loss masks so far, ``N`` x Shape [R_i] bool (True = the token is in the loss):
            the policy's tokens of responses the truncation policy keeps, less what earlier
            filters removed. At the sampling stage the policy's tokens.
        old_logprobs: log pi_old per token, ``N`` x Shape [R_i] float32 nats (the old-log-prob
            pass), or None when it did not run (and at the sampling stage).
        old_entropy: that pass's entropy, ``N`` x Shape [R_i] float32 nats, or None.
        options: the filter's options (its registered dataclass built from
            ``algorithm.filters.<name>``), or its `FilterInfo.settings_key` section.
    """

    scored: ScoredBatch
    masks: tuple[torch.Tensor, ...]
    old_logprobs: tuple[torch.Tensor, ...] | None = None
    old_entropy: tuple[torch.Tensor, ...] | None = None
    options: Any = None


@dataclass(frozen=True)
class FilterOutput:
    """What a filter returns.

    Attributes:
        keep: per response, False = the filter takes it out (``N`` bools). At the sampling stage
            the value must be the same for every response of a group.
        metrics: its own metrics (name -> value).
        extras: per-token values for the policy loss, name -> ``N`` x Shape [R_i]
            (`packrl.types.TrainBatch.extras`); loss stage only.
        max_rounds: sampling stage: the generation rounds a step may run to refill the batch with
            groups this filter keeps (1: no refill).
    """

    keep: tuple[bool, ...]
    metrics: dict[str, float] = field(default_factory=dict)
    extras: dict[str, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    max_rounds: int = 1


FilterFn = Callable[[FilterInputs], FilterOutput]


@dataclass(frozen=True)
class ChosenFilter:
    """A filter of a run's chain: its name, its built options and its declaration."""

    name: str
    options: Any
    info: FilterInfo

    def __call__(self, inputs: FilterInputs) -> FilterOutput:
        """Run it; its output checked (one bool per response).

        Raises:
            ValueError: it returned something else than one keep flag per response (names it).
        """
        out = FILTERS.lookup(self.name)(replace(inputs, options=self.options))
        num = len(inputs.scored.rollout.responses)
        if not isinstance(out, FilterOutput) or len(out.keep) != num:
            raise ValueError(f"filter {self.name!r} returned {type(out).__name__} with "
                             f"{len(getattr(out, 'keep', ()))} keep flags for {num} responses; return "
                             "FilterOutput(keep=one bool per response)")
        return out


def filter_chain(algorithm: AlgorithmConfig, stage: FilterStage) -> list[ChosenFilter]:
    """The run's filters of ``stage`` in their declared order: those ``algorithm.filters`` chooses
    and those in every chain (`FilterInfo.settings_key`), by `FilterInfo.order`, then name.

    Raises:
        ValueError: a chosen filter is not registered; ConfigError: its options do not fit.
    """
    chosen = {name: dict(args) for name, args in algorithm.filters.items() if args is not None}
    names = [n for n in FILTERS.names() if FILTERS.info(n).settings_key is not None and n not in chosen] + list(chosen)
    out = [ChosenFilter(name, _options(name, chosen.get(name, {}), algorithm), FILTERS.info(name))
           for name in names if FILTERS.info(name).stage == stage]
    return sorted(out, key=lambda f: (f.info.order, f.name))


def _options(name: str, args: dict[str, Any], algorithm: AlgorithmConfig) -> Any:
    info = FILTERS.info(name)
    if info.settings_key is not None:
        return operator.attrgetter(info.settings_key.removeprefix("algorithm."))(algorithm)
    cls = FILTERS.options_class(name)
    if cls is None:
        return None
    options, problems = build_options(cls, args, f"algorithm.filters.{name}.")
    if problems:
        raise ConfigError(problems)
    return options


@dataclass(frozen=True)
class Filtered:
    """What one stage's filters decided.

    Attributes:
        keep: per response, True = it goes on (``N``).
        filtered_by: per response, the filter that took it out (the first), or None.
        masks: the loss masks after the filters (``N`` x Shape [R_i] bool).
        extras: the loss filters' per-token extras.
        metrics: each filter's own and ``filter/<name>/dropped`` (responses it took out).
        max_rounds: the most generation rounds a sampling filter asked for (1: none).
    """

    keep: tuple[bool, ...]
    filtered_by: tuple[str | None, ...]
    masks: tuple[torch.Tensor, ...]
    extras: dict[str, tuple[torch.Tensor, ...]]
    metrics: dict[str, float]
    max_rounds: int = 1


def run_filters(chain: Sequence[ChosenFilter], inputs: FilterInputs, *, count_masked: bool = False) -> Filtered:
    """Each filter of ``chain`` in order, each seeing the masks the ones before it left. A response
    is counted for the first filter that takes it out while it still has loss tokens (any
    response with ``count_masked``: the advantage filters, whose choice moves the others' baseline)."""
    by: list[str | None] = [None] * len(inputs.masks)
    masks, rounds = inputs.masks, 1
    extras: dict[str, tuple[torch.Tensor, ...]] = {}
    metrics: dict[str, float] = {}
    for chosen in chain:
        out = chosen(replace(inputs, masks=masks))
        took = [i for i, (k, m) in enumerate(zip(out.keep, masks)) if not k and by[i] is None and (count_masked or bool(m.any()))]
        for i in took:
            by[i] = chosen.name
        masks = tuple(m if k else torch.zeros_like(m) for m, k in zip(masks, out.keep))
        extras |= out.extras
        metrics |= out.metrics | {f"filter/{chosen.name}/dropped": float(len(took))}
        rounds = max(rounds, out.max_rounds)
    return Filtered(tuple(b is None for b in by), tuple(by), masks, extras, metrics, rounds)


def kept_groups(chain: Sequence[ChosenFilter], scored: ScoredBatch) -> tuple[list[int], dict[str, int], dict[str, float], int]:
    """The sampling stage's filters on one generation round.

    Returns:
        ``(groups, dropped, metrics, max_rounds)``: the indices of the groups kept (in order), the
        groups each filter dropped (name -> count), the filters' own metrics and the rounds a step
        may run.

    Raises:
        ValueError: a filter kept part of a group.
    """
    size = scored.rollout.group_size
    masks = tuple(r.generated_mask() for r in scored.rollout.responses)
    dropped: dict[str, int] = {f.name: 0 for f in chain}
    keep, rounds = [True] * (len(masks) // size), 1
    metrics: dict[str, float] = {}
    for chosen in chain:
        out = chosen(FilterInputs(scored, masks))
        metrics |= out.metrics
        for g in range(len(keep)):
            flags = set(out.keep[g * size:(g + 1) * size])
            if len(flags) > 1:
                raise ValueError(f"filter {chosen.name!r} (a sampling filter) kept part of group {g}; a sampling filter "
                                 "keeps or drops whole groups (FilterInfo(stage='advantages' or 'loss') for responses)")
            if keep[g] and flags == {False}:
                keep[g], dropped[chosen.name] = False, dropped[chosen.name] + 1
        rounds = max(rounds, out.max_rounds)
    return [g for g, k in enumerate(keep) if k], dropped, metrics, rounds


def kept_for_advantages(chain: Sequence[ChosenFilter], inputs: FilterInputs) -> Filtered:
    """The advantage stage's filters: every group keeps the same number of responses.

    Raises:
        ValueError: the groups keep different numbers of responses (names the counts).
    """
    out = run_filters(chain, inputs, count_masked=True)
    size = inputs.scored.rollout.group_size
    counts = {sum(out.keep[g:g + size]) for g in range(0, len(out.keep), size)}
    if len(counts) > 1 or counts == {0}:
        names = ", ".join(f.name for f in chain)
        raise ValueError(f"the advantage filters ({names}) kept {sorted(counts)} responses per group; the estimator needs "
                         "the same number (>= 1) of every group: keep k of each group")
    return out
