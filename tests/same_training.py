"""Did two runs train alike? A comparison of two checkpoints (AdamW moments and weights) with
tolerances that follow from the optimizer and the dtype, not from the CPU a test runs on.

Two layouts of one run (one process against 2 ranks, 1 rank against 2 sequence-parallel ones, a
checkpoint resumed under another layout) sum each gradient entry in another order. In float32
that moves an entry by units of rounding of the terms it sums, which depend on the kernels the
CPU runs (AVX2, AVX-512, AMX), and AdamW amplifies it: its step ``lr * m / (sqrt(v) + eps)``
turns a rounding difference ``d`` of a near-zero gradient into ``lr * d / eps`` (a 1e-11
difference becomes 1e-5 of weight at ``lr = 1e-2``), and the next steps' gradients see that.
One absolute tolerance on float32 weights then fails on some CPU sooner or later (measured on an
AVX2 host: 1.1e-4 > 1e-4). So the layout tests train in float64 (``model.dtype=fp64``) at
``lr = 1e-4``, where rounding differences stay small and do not compound over steps, and check:

- the moments ``m`` and ``v``, sums of the gradients and of their squares, where nothing divides:
  each entry within ``rho = 1e-5`` of its tensor's largest entry. transformers computes RMSNorm
  and RoPE in float32 even in a float64 model, so a float64 run still rounds in places: over 4
  steps the moments of two layouts differed by at most 1.5e-7 of their largest entry (70x below
  ``rho``); at ``lr = 1e-2`` the runs drift apart (1.3e-5);
- the weights within 1% of ``lr`` per optimizer step. An AdamW step moves an entry by about
  ``lr`` (at most ``lr (1 - beta1) / sqrt(1 - beta2)`` = 3.2 ``lr``, Kingma & Ba 2015, section
  2.1); rounding moved weights by at most 3.2e-4 ``lr`` over 4 steps (30x below).

A rank that trained on other data, at another loss scale or without its share of the gradient
changes the moments by a large fraction of their largest entry (AdamW's step is scale-free, so
the moments are what see a scale error), and the weights of every entry with a real gradient by
a good fraction of ``lr`` per step: far outside both tolerances.
"""

from __future__ import annotations

from pathlib import Path

import torch

RHO = 1e-5  # moments: allowed difference relative to the tensor's largest entry
STEP_SHARE = 1e-2  # weights: allowed difference per optimizer step, as a share of lr


def checkpoint_state(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """``(weights, optimizer state dict)`` of a ``checkpoints/step_N`` folder. The weights of a
    LoRA checkpoint are its adapter's, under the names the optimizer state uses: peft writes
    ``...q_proj.lora_A.weight`` for the parameter ``...q_proj.lora_A.default.weight``."""
    from safetensors.torch import load_file

    if (path / "adapter_model.safetensors").is_file():
        adapter = load_file(str(path / "adapter_model.safetensors"))
        weights = {name.removesuffix(".weight") + ".default.weight": value for name, value in adapter.items()}
    else:
        weights = load_file(str(path / "model.safetensors")) if (path / "model.safetensors").is_file() else {}
    return weights, torch.load(path / "optimizer.pt", weights_only=False)["optimizer"]


def assert_same_training(a: Path | tuple[dict, dict], b: Path | tuple[dict, dict]) -> dict[str, float]:
    """Assert that two checkpoints (``checkpoints/step_N`` folders, or ``(weights, optimizer
    state)`` pairs) of one config hold the same AdamW training (see the module docstring).

    Returns:
        ``{"moments": worst difference / allowed, "weights": worst difference / allowed}``, both
        <= 1 when the assertion holds.
    """
    weights_a, opt_a = checkpoint_state(a) if isinstance(a, Path) else a
    weights_b, opt_b = checkpoint_state(b) if isinstance(b, Path) else b
    lr = opt_a["param_groups"][0]["lr"]
    assert sorted(opt_a["state"]) == sorted(opt_b["state"]), "the runs hold different parameters"
    worst = {"moments": 0.0, "weights": 0.0}
    for name, state in opt_a["state"].items():
        other = opt_b["state"][name]
        steps = int(state["step"])
        assert steps == int(other["step"]) > 0, f"{name}: {steps} vs {int(other['step'])} optimizer steps"
        for moment in ("exp_avg", "exp_avg_sq"):
            x, y = state[moment].double(), other[moment].double()
            ratio = float((x - y).abs().max()) / (RHO * (float(x.abs().max()) or 1.0))
            assert ratio <= 1, f"{name} {moment}: differs by {ratio * RHO:.3g} of its largest entry > {RHO}"
            worst["moments"] = max(worst["moments"], ratio)
        if name in weights_a:
            diff = float((weights_a[name].double() - weights_b[name].double()).abs().max())
            ratio = diff / (STEP_SHARE * lr * steps)
            assert ratio <= 1, f"{name}: weights differ by {diff:.3g} > {STEP_SHARE} x lr {lr} x {steps} optimizer steps"
            worst["weights"] = max(worst["weights"], ratio)
    return worst
