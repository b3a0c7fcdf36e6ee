"""``apply(lean_lora=True)``: LoRA layers skip PEFT's fp32 copy of their input under autocast.

Each test first shows what stock PEFT does on the same model (the fp32 copy before the dropout),
then that the lean layers make no copy and give the same bits, and that the copy stays wherever
it changes a value (no autocast, another autocast dtype, DoRA, the user's own switch).
"""

from __future__ import annotations

import copy

import pytest
import torch

import grpo_patches
from grpo_patches.lean_lora import enable_lean_lora, lean_layers
from tests.helpers import (
    PROJ,
    grpo_args,
    live_lora_policy,
    patched_trl_trainer,
    patched_vendored_trainer,
    tiny_policy,
)


def peft_model(dropout: float, *, dtype=torch.bfloat16, **lora_kw):
    return live_lora_policy(dropout, dtype=dtype, **lora_kw)


def dropout_inputs(model) -> list[torch.dtype]:
    """Records the dtype each LoRA dropout module is called with (PEFT's cast happens right before)."""
    seen: list[torch.dtype] = []
    for layer in model.modules():
        if hasattr(layer, "lora_dropout"):
            for module in layer.lora_dropout.values():
                module.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    return seen


def run(model, ids, *, autocast=torch.bfloat16, train=True):
    model.train(train)
    torch.manual_seed(11)  # a live dropout draws the same masks in both runs where both cast alike
    device = ids.device.type
    context = torch.autocast(device, dtype=autocast) if autocast else torch.autocast(device, enabled=False)
    with context:
        logits = model(input_ids=ids).logits
    logits.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def ids(seed=0, shape=(3, 9)):
    return torch.randint(0, 19, shape, generator=torch.Generator().manual_seed(seed))


def check_bits(dropout: float, train: bool, device: str = "cpu") -> None:
    stock = peft_model(dropout).to(device)
    lean = copy.deepcopy(stock)
    assert enable_lean_lora(lean) == 2 * len(PROJ)
    seen_stock, seen_lean = dropout_inputs(stock), dropout_inputs(lean)
    logits_stock, grads_stock = run(stock, ids().to(device), train=train)
    logits_lean, grads_lean = run(lean, ids().to(device), train=train)
    # upstream: every adapted projection's input is copied to the adapter's fp32 before its dropout
    assert seen_stock == [torch.float32] * 2 * len(PROJ)
    assert seen_lean == [torch.bfloat16] * 2 * len(PROJ)
    assert torch.equal(logits_lean, logits_stock)
    assert grads_lean.keys() == grads_stock.keys() and any("lora_A" in n for n in grads_lean)
    for name, grad in grads_stock.items():
        assert torch.equal(grads_lean[name], grad), name
    assert all(m.cast_input_dtype_enabled for m in lean_layers(lean)), "the user's switch is never written"


@pytest.mark.parametrize("dropout,train", [(0.0, True), (0.05, False)])  # dropout a no-op: bits must match
def test_lean_layers_skip_the_fp32_copy_and_give_stocks_bits(dropout, train):
    check_bits(dropout, train)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (cuBLAS bf16 matmuls, CUDA autocast)")
@pytest.mark.parametrize("dropout,train", [(0.0, True), (0.05, False)])
def test_gpu_lean_layers_skip_the_fp32_copy_and_give_stocks_bits(dropout, train):
    check_bits(dropout, train, "cuda")


def test_live_dropout_runs_on_the_bf16_input_with_its_p():
    model = peft_model(0.5)
    enable_lean_lora(model)
    outputs = []
    for layer in lean_layers(model):
        layer.lora_dropout["default"].register_forward_hook(lambda m, a, out: outputs.append((a[0], out)))
    logits, grads = run(model, ids(shape=(8, 64)))
    assert len(outputs) == 2 * len(PROJ) and torch.isfinite(logits.float()).all()
    for x, out in outputs:
        assert out.dtype == torch.bfloat16
        kept = out != 0
        assert 0.4 < kept.float().mean().item() < 0.6, "the layer's p = 0.5"
        assert torch.equal(out[kept], x[kept] * 2), "kept entries scaled by 1 / (1 - p)"
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for n, g in grads.items() if "lora_A" in n)


@pytest.mark.parametrize("case", ["no autocast", "fp16 autocast", "dora", "user switched the cast off"])
def test_the_cast_stays_where_it_changes_a_value(case):
    build = dict(use_dora=True) if case == "dora" else {}  # DoRA calls its dropout only when it is live
    # a bf16 base with PEFT's fp32 adapters: without autocast the adapter needs the cast
    stock = peft_model(0.1 if case == "dora" else 0.0, **build)
    lean = copy.deepcopy(stock)
    enable_lean_lora(lean)
    if case == "user switched the cast off":
        for m in (stock, lean):
            for layer in m.modules():
                if hasattr(layer, "cast_input_dtype_enabled"):
                    layer.cast_input_dtype_enabled = False
    autocast = {"no autocast": None, "fp16 autocast": torch.float16}.get(case, torch.bfloat16)
    seen_stock, seen_lean = dropout_inputs(stock), dropout_inputs(lean)
    arriving: list[torch.dtype] = []  # what each lean layer is called with
    for layer in lean_layers(lean):
        layer.register_forward_pre_hook(lambda m, args: arriving.append(args[0].dtype))
    out_stock, grads_stock = run(stock, ids(), autocast=autocast)
    out_lean, grads_lean = run(lean, ids(), autocast=autocast)
    user_off = case == "user switched the cast off"
    assert seen_stock == [torch.bfloat16 if user_off else torch.float32] * 2 * len(PROJ)
    if case == "fp16 autocast":  # bf16 inputs (the norms' outputs) keep the copy; fp16 ones (matmul outputs) skip it
        assert {torch.bfloat16, torch.float16} <= set(arriving)
        assert seen_lean == [torch.float16 if d == torch.float16 else torch.float32 for d in arriving]
    else:
        assert seen_lean == seen_stock
    assert torch.equal(out_lean, out_stock)
    for name, grad in grads_stock.items():
        assert torch.equal(grads_lean[name], grad), name
    # the kit never overrides the user's own setting
    assert all(m.cast_input_dtype_enabled is not user_off for m in lean_layers(lean))


def test_enabling_twice_switches_once_keeps_peft_class_and_a_model_without_lora_warns():
    from peft.tuners.lora.layer import Linear

    model = peft_model(0.0)
    assert enable_lean_lora(model) == enable_lean_lora(model) == 2 * len(PROJ)
    layer = lean_layers(model)[0]
    assert isinstance(layer, Linear) and type(layer).__mro__[1] is Linear, "one subclass of PEFT's, not two"
    assert type(layer).__qualname__ == "Linear" and repr(layer).startswith("lora.Linear")
    assert not layer._forward_pre_hooks and not layer._forward_hooks
    clone = copy.deepcopy(model)  # TRL copies models for reference policies
    assert len(lean_layers(clone)) == 2 * len(PROJ)
    with pytest.warns(UserWarning, match="no LoRA Linear layer"):
        assert enable_lean_lora(tiny_policy()) == 0


def test_lean_lora_must_be_a_bool():
    with pytest.raises(TypeError, match="lean_lora='yes'"):
        grpo_patches.apply(lean_lora="yes")
    assert not grpo_patches.is_applied()


def _trainer(**apply_kw):
    return patched_trl_trainer(grpo_args(bf16=True, max_steps=2), **apply_kw)


def test_trl_trainer_with_lean_lora_trains_to_stocks_bits():
    # LoRA dropout 0 (tests.helpers.lora): the lean step must equal stock PEFT's bit for bit. Under
    # bf16 autocast on an fp32 base, o_proj's and down_proj's inputs arrive in bf16 (autocast's matmul
    # outputs), and those are the copies the lean layers skip.
    runs = {}
    for name, kw in {"stock": {}, "lean": {"lean_lora": True}}.items():
        trainer = _trainer(**kw)
        layers = lean_layers(trainer.model)
        assert len(layers) == (0 if name == "stock" else 2 * len(PROJ))
        seen = dropout_inputs(trainer.model)
        torch.manual_seed(0)
        trainer.train()
        lora_weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
        runs[name] = ([h.get("loss") for h in trainer.state.log_history if "loss" in h], lora_weights, seen)
    (loss_s, w_s, seen_s), (loss_l, w_l, seen_l) = runs["stock"], runs["lean"]
    assert seen_s.count(torch.bfloat16) == 0 < seen_l.count(torch.bfloat16), "stock copies every bf16 input"
    assert len(loss_s) == 2 and loss_l == loss_s
    assert any(w.abs().sum() > 0 for n, w in w_s.items() if "lora_B" in n), "the steps trained (B starts at 0)"
    for name, weight in w_s.items():
        assert torch.equal(w_l[name], weight), name


def test_vendored_trainer_switches_its_policy():
    trainer = patched_vendored_trainer(lean_lora=True)
    assert len(lean_layers(trainer.model)) == 2 * len(PROJ)


def test_a_peft_without_the_cast_switch_is_refused_at_apply(monkeypatch):
    import grpo_patches.lean_lora as lean

    class OldLinear:  # peft < 0.15: the LoRA layer casts its input unconditionally, no switch to turn
        pass

    monkeypatch.setattr(lean, "_lora_linear", lambda: OldLinear)
    with pytest.raises(ValueError, match=r"lean_lora=True needs peft >= 0\.15.*peft is \d"):
        grpo_patches.apply(lean_lora=True)
    assert not grpo_patches.is_applied()
