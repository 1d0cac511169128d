"""The rollout engine contract: sampling parameters in, one group of responses per prompt out.

Shapes: ``B`` prompts · ``G`` responses per prompt (``SamplingParams.n``) · ``P_b`` tokens of
prompt b · ``R_i`` tokens of response i.

An engine receives canonical prompt ids (invariant 5: it generates from exactly these ids) and
one seed per prompt, and returns, for each prompt in input order, ``G`` `Response` objects whose
finish reason says why each one stopped (invariant 7: truncation is read from it, never from
tensor widths) and whose ``response_mask`` says which tokens the policy generated. After every
update the worker hands the engine the new weights (`RolloutEngine.load_weights`); around
generation it wakes the engine and puts it to sleep (`wake_up`, `sleep`), so an engine that holds
device memory (a KV cache) can give it back to training.

Engines are built by name (``rollout.engine``) from `packrl.registry.ROLLOUT_ENGINES`: a factory
takes an `EngineContext` and returns the engine. What an engine can do beyond the five methods of
`RolloutEngine` it declares when it registers, as `EngineCapabilities` (``register("name",
info=EngineCapabilities(...))``): taking prompts' extra inputs of a modality (a vision-language
prompt's images: `ExtraInputsEngine`) and stopping a call on a condition (`InterruptibleEngine`).
Set-up, preflight and the sampling stages read the declaration through `engine_capabilities`,
and `check_capabilities` holds a built engine to it.

Greedy decoding is ``temperature == 0`` rather than a separate flag, so the two can never
disagree; `SamplingParams.greedy` reads it. This module imports no torch, so config-only tools
can build sampling parameters.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from packrl.capabilities import EngineCapabilities
from packrl.hardware import ComputeDtype
from packrl.registry import ENGINE_WRAPPERS, ROLLOUT_ENGINES, call_with_sections, resolve_target

if TYPE_CHECKING:
    from packrl.config.schema import AlgorithmConfig, DataConfig, RolloutConfig
    from packrl.config.train import TrainConfig
    from packrl.types import ExtraInputs, Response

logger = logging.getLogger(__name__)

T = TypeVar("T")

@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    """How one `RolloutEngine.generate` call samples.

    Attributes:
        n: responses per prompt (the group size G).
        temperature: softmax temperature; 0.0 = greedy decoding (argmax, `n` identical responses).
        top_p: nucleus mass in (0, 1]; 1.0 = off. Ignored when greedy.
        top_k: keep the k most likely tokens; 0 = off. Ignored when greedy.
        max_response_tokens: response budget in tokens; a response reaching it ends with `length`.
        stop: stop strings; a response ending on one ends with `stop` and keeps the string.
        return_logprobs: fill `Response.rollout_logprobs` with the log-prob of each response
            token under the temperature-scaled full distribution (top-k/top-p not applied);
            greedy responses report it at temperature 1.

    Raises:
        ValueError: a value is out of range; the message names the `rollout.*` key to change.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_response_tokens: int = 512
    stop: tuple[str, ...] = ()
    return_logprobs: bool = False

    def __post_init__(self) -> None:
        problems = []
        if self.n < 1:
            problems.append(f"n={self.n} must be >= 1; set rollout.n")
        if not self.temperature >= 0:
            problems.append(f"temperature={self.temperature} must be >= 0 (0 = greedy); set rollout.temperature")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p={self.top_p} must be in (0, 1]; set rollout.top_p=1.0 (off)")
        if self.top_k < 0:
            problems.append(f"top_k={self.top_k} must be >= 0; set rollout.top_k=0 (off)")
        if self.max_response_tokens < 1:
            problems.append(f"max_response_tokens={self.max_response_tokens} must be >= 1; set rollout.max_response_tokens")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            problems.append(f"stop={self.stop!r} must be a tuple of non-empty strings; fix rollout.stop")
        if problems:
            raise ValueError("invalid sampling parameters: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax token (``temperature == 0``)."""
        return self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        """Temperature of the distribution `rollout_logprobs` are taken from (1.0 when greedy)."""
        return self.temperature if self.temperature > 0 else 1.0

    @classmethod
    def from_config(cls, cfg: RolloutConfig, *, validation: bool = False, max_response_tokens: int | None = None,
                    return_logprobs: bool | None = None) -> SamplingParams:
        """Sampling parameters of a training rollout, or of validation.

        Args:
            cfg: the run's `RolloutConfig`.
            validation: True for validation: one response per prompt at
                ``rollout.val_temperature`` (0 = greedy) and no log-probs (nothing consumes them).
            max_response_tokens: the step's response budget in tokens (a length curriculum's
                stage, `packrl.seqlen.curriculum.ResponseBudgetSchedule.at`); None =
                ``rollout.max_response_tokens``.
            return_logprobs: whether a training rollout returns the engine's log-probs; None =
                ``rollout.return_logprobs``. The loop passes `packrl.config.plan.BatchPlan.return_logprobs`,
                also True when ``algorithm.rollout_correction`` reads them.

        Returns:
            The parameters; `top_p`, `top_k` and `stop` come from `cfg` in both cases.

        Raises:
            ValueError: ``max_response_tokens`` < 1.
        """
        return cls(
            n=1 if validation else cfg.n,
            temperature=cfg.val_temperature if validation else cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            max_response_tokens=cfg.max_response_tokens if max_response_tokens is None else max_response_tokens,
            stop=tuple(cfg.stop),
            return_logprobs=False if validation else (cfg.return_logprobs if return_logprobs is None else return_logprobs),
        )

    def continuation(self, grant: int) -> SamplingParams:
        """These parameters for one call that continues responses already begun, one per request
        (``n=1``: each prompt is a response's prompt + its tokens so far), by at most ``grant``
        tokens: a partial rollout's chunk grant (`packrl.trainer.stages.pool.RolloutGroup.chunk_grant`).
        In that call ``max_response_tokens`` is the grant, not the response's budget."""
        return replace(self, n=1, max_response_tokens=grant)


@runtime_checkable
class RolloutEngine(Protocol):
    """Anything that turns prompts into groups of responses and follows the policy's weights."""

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]) -> list[list[Response]]:
        """Generate `params.n` responses for each prompt.

        Args:
            prompt_ids: B prompts, ``[B][P_b]`` token ids; the model receives exactly these.
            params: how to sample.
            seeds: one seed per prompt; sample g of prompt b draws its randomness from
                ``(seeds[b], g)`` alone, so a response does not depend on the batch or the worker
                that generates it.

        Returns:
            ``[B][G]`` responses: the outer list follows the input order of the prompts, the
            inner list holds the G responses of that prompt.

        Raises:
            ValueError: a prompt leaves no room for a response in the model context.
        """
        ...

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Take the policy's new weights: ``(name, tensor)`` pairs named as in the plain
        transformers model (a LoRA policy's adapters merged in), full (not sharded). An engine
        that generates on the policy's own parameters ignores them without reading them."""
        ...

    def sleep(self) -> None:
        """Release the device memory generation holds (weights copy, KV cache) until `wake_up`;
        a no-op for an engine that holds none of its own."""
        ...

    def wake_up(self) -> None:
        """Reacquire what `sleep` released, before the next `generate`."""
        ...

    def close(self) -> None:
        """Release everything the engine holds (processes, files) when the worker closes."""
        ...


class EngineWrapper:
    """The base of an engine that wraps another one (multi-turn trajectories, thinking budgets):
    weights, sleep, wake-up and close go to the wrapped ``engine``; a subclass writes `generate`."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        self.engine.load_weights(weights)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()

    def close(self) -> None:
        self.engine.close()


@runtime_checkable
class ExtraInputsEngine(Protocol):
    """An engine that generates from prompts' extra inputs too (`EngineCapabilities.modalities`:
    a vision-language prompt's images)."""

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int],
                 extra_inputs: Sequence[ExtraInputs | None] | None = None) -> list[list[Response]]:
        """`RolloutEngine.generate`, with ``extra_inputs``: each prompt's inputs beyond its ids
        (`packrl.types.ExtraInputs`; None for a text prompt), whose placeholders ``prompt_ids``
        holds expanded."""
        ...


@runtime_checkable
class InterruptibleEngine(Protocol):
    """An engine that stops a call on a condition of the whole call (`EngineCapabilities.stop_on_condition`)."""

    def generate_until(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int],
                       caps: Sequence[int], enough: Callable[[Sequence[bool]], bool]) -> list[Response]:
        """One response per prompt (``params.n`` is ignored), each capped at ``caps[i]`` tokens,
        generation stopped between decode rounds once ``enough(finished)`` holds; responses still
        running come back with the tokens they have and finish reason ``abort``. Prompt i draws
        as sample 0 of ``seeds[i]``, so a response cut here and continued later draws what it
        would have drawn uninterrupted (partial rollouts, `packrl.trainer.stages.partial`)."""
        ...


@runtime_checkable
class DescribedEngine(Protocol):
    """An engine that says in one phrase how it generates, for ``model.txt`` (optional)."""

    def describe(self) -> str: ...


def declared_capabilities(engine: str) -> EngineCapabilities:
    """What ``rollout.engine=engine`` declared with its registration (none: `EngineCapabilities()`;
    `packrl.registry.Registry.info`, which refused any other kind of declaration when it registered).

    Raises:
        ValueError: ``engine`` is not a registered engine.
    """
    return ROLLOUT_ENGINES.info(engine)


@dataclass(frozen=True)
class WrapperContext:
    """What an engine wrapper's factory gets (`packrl.registry.ENGINE_WRAPPERS`).

    Attributes:
        tokenizer: the policy's tokenizer.
        rollout: the ``rollout`` section.
        max_prompt_tokens: the prompt budget (``data.max_prompt_tokens``), tokens.
        max_context_tokens: the model's context, tokens.
    """

    tokenizer: Any
    rollout: RolloutConfig
    max_prompt_tokens: int
    max_context_tokens: int


WrapperFn = Callable[[Any, WrapperContext], Any]
"""``fn(engine, context) -> RolloutEngine``: the engine serving ``engine`` (an `EngineWrapper`)."""


def active_wrappers(rollout: RolloutConfig) -> list[str]:
    """The registered wrappers that apply to a run with this ``rollout`` section
    (`packrl.capabilities.WrapperInfo.applies`), innermost first (by ``order``, then name)."""
    chosen = [(ENGINE_WRAPPERS.info(n).order, n) for n in ENGINE_WRAPPERS.names()
              if (applies := ENGINE_WRAPPERS.info(n).applies) is not None
              and resolve_target(applies, f"the engine wrapper {n}'s WrapperInfo(applies=)")(rollout)]
    return [name for _, name in sorted(chosen)]


def wrap_engine(engine: Any, context: WrapperContext) -> Any:
    """``engine`` wrapped by every wrapper that applies (`active_wrappers`), innermost first.

    Raises:
        ValueError: a wrapper returned an object without the engine contract (names it).
    """
    for name in active_wrappers(context.rollout):
        engine = ENGINE_WRAPPERS.lookup(name)(engine, context)
        if not isinstance(engine, RolloutEngine):
            raise ValueError(f"engine wrapper {name!r} returned a {type(engine).__name__} without the methods of "
                             "packrl.rollout.engine.RolloutEngine; subclass packrl.rollout.engine.EngineWrapper")
    return engine


def engine_capabilities(rollout: RolloutConfig) -> EngineCapabilities:
    """What the rollouts of a run can do: ``rollout.engine``'s declaration, less what each wrapper
    that applies does not keep (`packrl.capabilities.WrapperInfo.keeps`: a wrapper serving the
    engine call by call, multi-turn tool loops or thinking budgets, keeps none of it).

    Raises:
        ValueError: as `declared_capabilities`.
    """
    capabilities, default = declared_capabilities(rollout.engine), EngineCapabilities()
    for name in active_wrappers(rollout):
        kept = ENGINE_WRAPPERS.info(name).keeps
        capabilities = replace(capabilities, **{f: getattr(default, f) for f in EngineCapabilities.__dataclass_fields__ if f not in kept})
    return capabilities


def wrapper_notes(cfg: Any) -> list[str]:
    """What ``packrl preflight`` notes for the wrappers that apply (their
    `packrl.capabilities.WrapperInfo.preflight_notes`, given the sections their parameters name)."""
    return [note for name in active_wrappers(cfg.rollout) if (target := ENGINE_WRAPPERS.info(name).preflight_notes) is not None
            for note in call_with_sections(resolve_target(target, f"the engine wrapper {name}'s WrapperInfo(preflight_notes=)"), cfg)]


def wrapper_problems(cfg: Any, said: set[str]) -> list[Any]:
    """The problems set-up would raise for the wrappers that apply (their
    `packrl.capabilities.WrapperInfo.preflight_problems`, e.g. found with the policy's tokenizer),
    each hook given the sections its parameters name and not run while a key of those sections is
    in ``said`` (a key that did not parse or already has a problem)."""
    out: list[Any] = []
    for name in active_wrappers(cfg.rollout):
        if (target := ENGINE_WRAPPERS.info(name).preflight_problems) is None:
            continue
        hook = resolve_target(target, f"the engine wrapper {name}'s WrapperInfo(preflight_problems=)")
        if not any(key.split(".", 1)[0] in inspect.signature(hook).parameters for key in said):
            out += call_with_sections(hook, cfg)
    return out


def check_capabilities(engine: Any, name: str, capabilities: EngineCapabilities) -> None:
    """Hold a built engine to what its registration declared.

    Logs a warning when it has ``generate_until`` but does not declare ``stop_on_condition`` (a
    subclass of the hf engine registered without its declaration: partial rollouts then chunk).

    Raises:
        ValueError: it declares modalities but its ``generate`` takes no ``extra_inputs``, or
            declares stop-on-condition without ``generate_until``; the message names the engine and the method.
    """
    if capabilities.modalities and "extra_inputs" not in inspect.signature(engine.generate).parameters:
        raise ValueError(f"rollout.engine={name!r} declares EngineCapabilities(modalities={capabilities.modalities}) but its "
                         "generate() takes no extra_inputs=; add the argument (packrl.rollout.engine.ExtraInputsEngine) "
                         "or declare modalities=()")
    if capabilities.stop_on_condition and not isinstance(engine, InterruptibleEngine):
        raise ValueError(f"rollout.engine={name!r} declares EngineCapabilities(stop_on_condition=True) but has no generate_until(); "
                         "add it (packrl.rollout.engine.InterruptibleEngine) or declare stop_on_condition=False")
    if not capabilities.stop_on_condition and isinstance(engine, InterruptibleEngine):
        logger.warning("rollout.engine=%s has generate_until() but its registration does not declare stop_on_condition: partial "
                       "rollouts generate in chunks of rollout.partial_chunk_tokens instead of one call stopped between decode "
                       "rounds; register it with info=EngineCapabilities(stop_on_condition=True) (as packrl.capabilities."
                       "HF_ENGINE) to use it", name)


@dataclass(frozen=True)
class EngineOptions:
    """The settings an engine takes from the run, and nothing else of its config.

    Attributes:
        max_num_seqs: sequences per generation batch (``rollout.max_num_seqs``).
        max_prompt_tokens: the prompt budget (``data.max_prompt_tokens``).
        max_response_tokens: the response budget (``rollout.max_response_tokens``, the largest
            curriculum stage).
        seed: the run's seed (``train.seed``).
        engine_kwargs: further engine arguments passed through (``rollout.engine_kwargs``).
        returns_logprobs: the run reads the engine's log-probs (``rollout.return_logprobs`` or
            ``algorithm.rollout_correction``).
        truncates_sampling: top-k or top-p truncate the sampled distribution (``rollout.top_k``,
            ``rollout.top_p``).
    """

    max_num_seqs: int = 32
    max_prompt_tokens: int = 512
    max_response_tokens: int = 512
    seed: int = 0
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    returns_logprobs: bool = False
    truncates_sampling: bool = False

    @classmethod
    def of_sections(cls, rollout: RolloutConfig, data: DataConfig, train: TrainConfig, algorithm: AlgorithmConfig) -> EngineOptions:
        """The options the ``rollout``, ``data``, ``train`` and ``algorithm`` sections of a run's
        config set (the engine reads nothing else of it)."""
        r = rollout
        return cls(max_num_seqs=r.max_num_seqs, max_prompt_tokens=data.max_prompt_tokens, max_response_tokens=r.max_response_tokens,
                   seed=train.seed, engine_kwargs=dict(r.engine_kwargs),
                   returns_logprobs=r.return_logprobs or algorithm.rollout_correction.enabled,
                   truncates_sampling=r.top_k > 0 or r.top_p < 1.0)


@dataclass(frozen=True)
class EngineContext:
    """What an engine factory gets.

    Attributes:
        policy: the policy model as loaded (``torch.nn.Module``; a peft model with LoRA), before
            any sharding.
        tokenizer: its tokenizer.
        options: the engine's settings from the run (`EngineOptions`).
        max_context_tokens: the model context, RoPE scaling included; prompt + response never exceed it.
        may_share_policy: the engine may generate on ``policy``'s own parameters (one process,
            float32); False when the policy will be sharded, so the engine must hold its own copy.
        compute_dtype: the run's compute dtype (``model.dtype`` resolved for the machine,
            `packrl.hardware.ComputeDtype`, as `BatchPlan.compute_dtype` holds it); the engine
            generates in it.
    """

    policy: Any
    tokenizer: Any
    options: EngineOptions
    max_context_tokens: int
    may_share_policy: bool
    compute_dtype: ComputeDtype


EngineFactory = Callable[[EngineContext], RolloutEngine]
"""``factory(context) -> engine``, registered in `packrl.registry.ROLLOUT_ENGINES`."""


# Helpers every engine shares: per-request seeds, the EOS and pad ids of a model and tokenizer.


def request_seed(prompt_seed: int, sample_index: int) -> int:
    """The sampling seed of sample ``sample_index`` of a prompt whose seed is ``prompt_seed``."""
    return (prompt_seed * 1_000_003 + sample_index) % (1 << 63)


_INVERSE = pow(1_000_003, -1, 1 << 63)  # 1_000_003 is odd, so it is invertible modulo 2**63


def single_sample_seed(prompt_seed: int, sample_index: int) -> int:
    """The prompt seed under which the only sample of a ``n=1`` request draws what sample
    ``sample_index`` of ``prompt_seed`` draws: ``request_seed(result, 0) == request_seed(prompt_seed,
    sample_index)``. A resumed member of a group is continued alone with it."""
    return request_seed(prompt_seed, sample_index) * _INVERSE % (1 << 63)


def awake(engine: Any, call: Callable[..., T], *args: Any) -> T:
    """``call(*args)`` with ``engine`` awake (`RolloutEngine.wake_up`), put back to sleep after it
    whatever happens, so a failed call never leaves an engine holding its memory."""
    engine.wake_up()
    try:
        return call(*args)
    finally:
        engine.sleep()


def eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """Every id that ends a response: the model's ``generation_config.eos_token_id`` (int or
    list) and the tokenizer's EOS."""
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = set(config_eos if isinstance(config_eos, (list, tuple)) else [config_eos])
    ids.add(getattr(tokenizer, "eos_token_id", None))
    ids.discard(None)
    if not ids:
        raise ValueError(
            "neither the tokenizer nor model.generation_config names an EOS token id, so no response could end with "
            "finish reason 'eos'; set tokenizer.eos_token or model.generation_config.eos_token_id"
        )
    return frozenset(int(i) for i in ids)


def pad_id(model: Any, tokenizer: Any, eos_ids: frozenset[int]) -> int:
    """The tokenizer's pad id, else the model's, else the smallest EOS id. Padding never reaches
    a response: left pads are masked out and columns after a row's end are cut."""
    for pad in (getattr(tokenizer, "pad_token_id", None), getattr(getattr(model, "generation_config", None), "pad_token_id", None)):
        if pad is not None:
            return int(pad)
    return min(eos_ids)
