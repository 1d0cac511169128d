"""What a registered rollout engine declares about itself (``ROLLOUT_ENGINES.register(name,
info=EngineCapabilities(...))``), in a module of the bottom layer (no torch, no config), so the
config rules, preflight, set-up and the sampling stages all read one declaration and never an
engine's name. The engine contract itself is `packrl.rollout.engine` (which re-exports
`EngineCapabilities`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineCapabilities:
    """What a registered engine can do beyond the `RolloutEngine` contract; declared with its
    registration (``ROLLOUT_ENGINES.register("name", info=EngineCapabilities(...))``)."""

    modalities: tuple[str, ...] = ()
    """The modalities whose extra inputs `generate` takes (``extra_inputs=``,
    `packrl.rollout.engine.ExtraInputsEngine`), by `packrl.models.modality.Modality.name`:
    ``("image",)`` serves a vision-language policy."""

    stop_on_condition: bool = False
    """It has `packrl.rollout.engine.InterruptibleEngine.generate_until`: a partial-rollout step can
    stop generating once its batch is complete instead of generating in chunks."""

    shares_policy_weights: bool = False
    """It generates on the policy's own parameters where the context allows
    (`packrl.rollout.engine.EngineContext.may_share_policy`: one process, parameters in the
    compute dtype), holding no copy of the weights (preflight's memory estimate counts none)."""

    packs_cpu_weights: bool = False
    """Generating on the CPU in a 2-byte compute dtype, it holds packed copies of its Linear and LM
    head weights (`packrl.rollout.packed_linear`; preflight's memory estimate counts them)."""

    preflight_notes: str | None = None
    """``"module:function"`` that preflight (`packrl.inspect.preflight`) calls for notes on the
    settings the engine derives from the run, e.g. its KV cache: ``function(options: EngineOptions,
    *, max_context_tokens: int, kv_bytes_per_token: int, dtype: str, cuda: bool) -> list[str]``
    (``dtype``: the compute dtype's name, ``fp32`` or ``bf16``; imported only when preflight
    runs). None: no notes."""

    def __post_init__(self) -> None:
        """Raises ValueError where a field holds a value of another kind (``stop_on_condition="no"``
        would read as true), naming the field and what it takes."""
        if not (isinstance(self.modalities, tuple) and all(isinstance(m, str) for m in self.modalities)):
            raise ValueError(f"EngineCapabilities(modalities={self.modalities!r}): a tuple of modality names, e.g. ('image',)")
        for name in ("stop_on_condition", "shares_policy_weights", "packs_cpu_weights"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineCapabilities({name}={getattr(self, name)!r}): True or False")
        if self.preflight_notes is not None and (not isinstance(self.preflight_notes, str) or ":" not in self.preflight_notes):
            raise ValueError(f"EngineCapabilities(preflight_notes={self.preflight_notes!r}): a 'module:function' string, or None")


HF_ENGINE = EngineCapabilities(modalities=("image",), stop_on_condition=True, shares_policy_weights=True, packs_cpu_weights=True)
"""What ``rollout.engine=hf`` declares (`packrl.rollout.hf_engine`), readable without importing it."""

VLLM_ENGINE = EngineCapabilities(preflight_notes="packrl.rollout.vllm_settings:preflight_notes")
"""What ``rollout.engine=vllm`` declares (`packrl.rollout.vllm_engine`), readable without importing it."""
