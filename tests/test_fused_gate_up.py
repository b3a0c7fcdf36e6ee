"""fused_gate_up: in the compiled training layers the MLP's gate and up projections, adapters included, are one
matmul. Stock PEFT runs six (a base and two adapter matmuls each); the fused form runs the two ``lora_A`` and
one for both outputs, with PEFT's outputs and gradients (its dropout masks, in its order) to rounding, and only
where PEFT's semantics hold."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from grpo_patches import fused_gate_up
from grpo_patches.compiled_training import enable_compiled_training
from grpo_patches.fused_gate_up import enable_fused_gate_up, fused_mlps
from grpo_patches.lean_lora import enable_lean_lora
from tests.helpers import live_lora_policy

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


class CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in MATMULS
        return func(*args, **(kwargs or {}))


def close(got: torch.Tensor, expected: torch.Tensor, rel: float) -> bool:
    """Within ``rel`` of the expected tensor's largest magnitude, everywhere (bf16 rounds every product)."""
    return (got.float() - expected.float()).abs().max().item() <= rel * expected.float().abs().max().item()


def mlp_of(model: nn.Module) -> nn.Module:
    return next(m for m in model.modules() if type(m).__name__.endswith("MLP"))


def gate_up_params(mlp: nn.Module) -> list[torch.Tensor]:
    return [p for n, p in mlp.named_parameters() if p.requires_grad and n.split(".")[0] in ("gate_proj", "up_proj")]


@pytest.mark.parametrize("lean,autocast", [(False, False), (False, True), (True, True)])
def test_one_matmul_gives_peft_gate_and_up_with_its_masks_and_gradients(lean, autocast):
    model = live_lora_policy(0.3, layers=1)
    model.train()
    if lean:
        enable_lean_lora(model)
    mlp = mlp_of(model)
    x = torch.randn(2, 5, mlp.gate_proj.in_features, requires_grad=True)
    inputs = x.to(torch.bfloat16) if lean else x  # lean layers skip PEFT's cast where x is in the autocast dtype
    results = []
    for fused in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), CountMatmuls() as counted:
            torch.manual_seed(3)
            gate, up = fused_gate_up._fused(mlp, inputs) if fused else (mlp.gate_proj(inputs), mlp.up_proj(inputs))
        loss = (gate.float() * up.float()).sum()
        results.append((counted.count, gate, up, torch.autograd.grad(loss, [x, *gate_up_params(mlp)])))
    (stock_mm, gate_s, up_s, grads_s), (fused_mm, gate_f, up_f, grads_f) = results
    assert (stock_mm, fused_mm) == (6, 3), "PEFT: base + A + B per projection; fused: the two A and one"
    rel = 1e-2 if autocast else 1e-5
    assert gate_f.dtype == gate_s.dtype and up_f.dtype == up_s.dtype
    assert close(gate_f, gate_s, rel) and close(up_f, up_s, rel)
    for fused, stock in zip(grads_f, grads_s, strict=True):
        assert close(fused, stock, rel)
    # meaningful: other dropout masks (another seed) are far outside the tolerance
    torch.manual_seed(4)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        other = mlp.gate_proj(inputs)
    assert not close(other, gate_s, 10 * rel)


def test_the_compiled_layers_take_it_and_match_eager_training(monkeypatch):
    eager = live_lora_policy(0.0, layers=2)
    eager.train()
    compiled = copy.deepcopy(eager)
    enable_compiled_training(compiled)
    assert len(fused_mlps(compiled)) == 2 and [type(m).__name__ for m in fused_mlps(compiled)] == ["LlamaMLP"] * 2
    traced = []
    real = fused_gate_up._fused
    monkeypatch.setattr(fused_gate_up, "_fused", lambda mlp, x: traced.append(1) or real(mlp, x))
    torch._dynamo.reset()
    ids = torch.randint(4, 19, (3, 9), generator=torch.Generator().manual_seed(0))
    losses, grads = [], []
    for model in (eager, compiled):
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert traced, "the compiled training forward went through the fused gate and up"
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    traced.clear()
    with torch.no_grad():  # sampling: the eager layer and PEFT's own projections
        torch.testing.assert_close(compiled(input_ids=ids).logits, eager(input_ids=ids).logits, rtol=0, atol=0)
    assert not traced


def test_only_transformers_gated_mlps_with_vanilla_adapters_fuse():
    class OtherMLP(nn.Module):  # gate / up / down / act_fn, another forward: not switched
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(8, 4)
            self.act_fn = nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) + self.up_proj(x))

    class AnnotatedMLP(OtherMLP):  # the gated forward with annotations and a docstring: switched
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            """Gated."""
            down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
            return down_proj

    assert enable_fused_gate_up([OtherMLP()]) == 0
    assert enable_fused_gate_up([AnnotatedMLP()]) == 1
    model = live_lora_policy(0.1, layers=1)
    assert enable_fused_gate_up([model]) == 1 and type(mlp_of(model)).__name__ == "LlamaMLP"
    assert enable_fused_gate_up([model]) == 1, "switched once"
    mlp = mlp_of(model)
    x = torch.randn(2, 3, mlp.gate_proj.in_features)
    assert fused_gate_up._fused(mlp, x) is not None
    mlp.gate_proj.base_layer.weight.requires_grad_(True)  # a trained base weight: PEFT's own path
    assert fused_gate_up._fused(mlp, x) is None
    mlp.gate_proj.base_layer.weight.requires_grad_(False)
    mlp.up_proj.merge()  # merged adapter: PEFT's own path
    assert fused_gate_up._fused(mlp, x) is None
    mlp.up_proj.unmerge()
    dora = live_lora_policy(0.1, layers=1, use_dora=True)
    assert fused_gate_up._fused(mlp_of(dora), x) is None
