"""The trainer's AdamW: fused where torch has the kernel, the same update rule as torch's default;
its warm-up ramps once per optimizer step."""

from __future__ import annotations

import pytest
import torch

from packrl.worker.optim import Optimization, adamw, optimizer_step


def test_adamw_is_fused_on_cpu_and_steps_as_the_default_implementation():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(37, 5)), torch.nn.Parameter(torch.randn(11))]
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    initial = [p.detach().clone() for p in params]
    fused = adamw(params, lr=1e-2, weight_decay=0.1)
    plain = torch.optim.AdamW(copies, lr=1e-2, weight_decay=0.1, foreach=False)
    assert fused.defaults["fused"] is True
    for step in range(4):
        grads = [torch.randn_like(p) for p in params]
        for p, q, g in zip(params, copies, grads):
            p.grad, q.grad = g.clone(), g.clone()
        fused.step()
        plain.step()
    for p, q in zip(params, copies):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-6)
    assert all((p - p0).abs().max() > 5e-3 for p, p0 in zip(params, initial))  # the steps moved them


def test_adamw_falls_back_to_foreach_for_parameters_without_a_fused_kernel():
    params = [torch.nn.Parameter(torch.randn(3, dtype=torch.float64)), torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))]
    assert adamw(params, lr=1e-3, weight_decay=0.0).defaults["foreach"] is True


def test_a_checkpoint_from_another_implementation_resumes_on_the_fused_one():
    from packrl.worker.checkpoint import load_full_optimizer_state

    model = torch.nn.Linear(4, 3)
    old = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    model(torch.randn(2, 4)).sum().backward()
    old.step()
    new = adamw(list(model.parameters()), lr=1e-2, weight_decay=0.0)
    load_full_optimizer_state(model, new, old.state_dict())
    assert [(g["fused"], g["foreach"]) for g in new.param_groups] == [(True, None)]
    assert torch.equal(new.state[model.weight]["exp_avg"], old.state[model.weight]["exp_avg"])


def test_the_warmup_ramps_once_per_optimizer_step_from_lr_over_w():
    """Optimizer step s trains at lr x min(1, (s + 1) / W): the first step already moves (verl 0.9.1
    steps its schedule once per training step and trains the first at lr x 0 / W: docs/verl.md,
    Deliberate differences)."""
    model = torch.nn.Linear(3, 1)
    opt = Optimization.build(list(model.parameters()), lr=0.8, weight_decay=0.0, warmup_steps=4, max_consecutive_skips=0,
                             grad_clip=0.0)
    lrs = []
    for _ in range(6):
        model(torch.ones(1, 3)).sum().backward()
        lrs.append(optimizer_step(model, opt)[1])
    assert lrs == pytest.approx([0.2, 0.4, 0.6, 0.8, 0.8, 0.8])
