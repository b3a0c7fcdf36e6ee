"""``apply(compile_training=True)``: the policy's decoder layers compiled for the training forward.

Each compiling test first runs stock (eager) PEFT on the same model and inputs, then the compiled
layers: the same losses and gradients to fp32 rounding, one graph per shape class shared by every
layer, no compilation and eager bits where autograd is off (sampling), and the LoRA dropout's masks
eager's, reproduced by the checkpointed recomputation.
"""

from __future__ import annotations

import contextlib
import copy
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import grpo_patches
from grpo_patches import compiled_training
from grpo_patches.compiled_training import check_layout, compiled_layers, enable_compiled_training
from tests.helpers import (
    PROJ,
    grpo_args,
    live_lora_policy,
    patched_trl_trainer,
    patched_vendored_trainer,
)


def peft_model(dropout: float = 0.0, layers: int = 3):
    model = live_lora_policy(dropout, layers=layers)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # TRL 1.x's default
    model.enable_input_require_grads()
    return model


def step(model, ids, seed=7):
    """One forward and backward: (loss, {name: LoRA gradient})."""
    model.zero_grad()
    torch.manual_seed(seed)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def ids(length, seed=0):
    return torch.randint(4, 19, (3, length), generator=torch.Generator().manual_seed(seed))


def graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def test_compiled_layers_give_eagers_losses_and_gradients_and_compile_once_for_every_length():
    eager = peft_model()
    compiled = copy.deepcopy(eager)
    assert enable_compiled_training(compiled) == 3 and len(compiled_layers(compiled)) == 3
    torch._dynamo.reset()
    before = graphs()
    for n, length in enumerate((9, 13, 17, 11)):
        loss_e, grads_e = step(eager, ids(length, n))
        loss_c, grads_c = step(compiled, ids(length, n))
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
        assert grads_c.keys() == grads_e.keys() and len(grads_e) == 2 * 3 * len(PROJ)
        for name, grad in grads_e.items():
            torch.testing.assert_close(grads_c[name], grad, rtol=1e-4, atol=1e-6, msg=name)
        if n == 0:
            assert graphs() > before, "the layers ran compiled"
            settled = graphs()  # one dynamic-shape graph, shared by the layers
    assert graphs() == settled, "no graph per layer or per new length"


def test_lean_lora_layers_share_the_one_compiled_graph():
    """With lean_lora the layers still share one pair of graphs (before and after the down projection's eager
    base matmul, ``recompute_tail``): per-layer forward hooks (lean_lora's first form) made dynamo compile
    graphs per layer (on the 1.5B model past its recompile limit of 8 every later layer ran eager, and after a
    batch without padding all 28 did)."""
    from grpo_patches.lean_lora import enable_lean_lora

    eager = peft_model()
    compiled = copy.deepcopy(eager)
    assert enable_lean_lora(eager) == enable_lean_lora(compiled) == 3 * len(PROJ)
    enable_compiled_training(compiled)
    torch._dynamo.reset()
    before = graphs()
    for n, length in enumerate((9, 13)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss_e, _ = step(eager, ids(length, n))
            loss_c, _ = step(compiled, ids(length, n))
        torch.testing.assert_close(loss_c, loss_e, rtol=2e-2, atol=1e-2)  # bf16: inductor rounds its own way
    assert graphs() - before == 2


def test_no_grad_calls_run_the_eager_layer_and_compile_nothing():
    eager = peft_model()
    compiled = copy.deepcopy(eager)
    enable_compiled_training(compiled)
    for model in (eager, compiled):
        model.eval()
    before = graphs()
    with torch.no_grad():  # how sampling and TRL's no-grad log-prob passes call the policy
        out_e = eager(input_ids=ids(10)).logits
        out_c = compiled(input_ids=ids(10)).logits
        gen = compiled.generate(input_ids=ids(5), max_new_tokens=4, do_sample=False)
    assert torch.equal(out_c, out_e), "the eager layer's bits"
    assert torch.equal(gen, eager.generate(input_ids=ids(5), max_new_tokens=4, do_sample=False))
    assert graphs() == before


def _compile(model, batch, times):
    """``step`` compiled in a fresh cache, then again after dynamo forgets its graphs (a warm start: only the
    on-disk caches are left), ``times`` in all; each time's AOTAutograd cache counters."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache

    runs = []
    with fresh_cache():
        for _ in range(times):
            torch._dynamo.reset()
            counters.clear()
            runs.append((step(model, batch), dict(counters["aot_autograd"])))
    return runs


def test_a_warm_start_takes_the_layers_with_the_fused_gate_up_from_aot_autograds_cache(monkeypatch):
    """The fused gate/up is a custom autograd function, which AOTAutograd's cache bypasses by default: every run
    traced and partitioned the layer's forward and backward again (first, without the kit's setting). The
    compiled layers allow it, so a warm start is a cache hit with the same loss and gradients."""
    from grpo_patches.fused_gate_up import fused_mlps

    model = peft_model(dropout=0.1, layers=1)
    enable_compiled_training(model)
    assert len(fused_mlps(model)) == 1
    batch = ids(11)
    monkeypatch.setattr(compiled_training, "_cacheable_autograd_functions", contextlib.nullcontext)
    [(_, cold)] = _compile(model, batch, 1)
    assert cold.get("autograd_cache_bypass") and not cold.get("autograd_cache_saved"), cold
    monkeypatch.undo()

    ((loss_c, grads_c), cold), ((loss_w, grads_w), warm) = _compile(model, batch, 2)
    assert not cold.get("autograd_cache_bypass") and cold.get("autograd_cache_saved"), cold
    assert warm.get("autograd_cache_hit") and not warm.get("autograd_cache_bypass"), warm
    assert torch.equal(loss_w, loss_c)
    for name, grad in grads_c.items():
        assert torch.equal(grads_w[name], grad), name


def test_the_cache_setting_needs_nothing_but_torch_imported():
    """``torch`` alone does not load its functorch settings (transformers and PEFT happen to, and so does dynamo,
    which the kit imports only when it switches layers): the switch imports them itself, in a fresh interpreter
    too."""
    code = ("import torch\nfrom grpo_patches.compiled_training import _cacheable_autograd_functions as switch\n"
            "with switch():\n    from torch._functorch import config\n"
            "    assert config.autograd_cache_allow_custom_autograd_functions\n"
            "assert not config.autograd_cache_allow_custom_autograd_functions\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]


KIT_OPTIONS = dict(compiled_training._OPTIONS)  # the kit's inductor settings, before a test changes them


def _dropout_grads(options, monkeypatch):
    """(eager PEFT's, the compiled layers', the compiled layers' without checkpointing) loss and LoRA gradients at
    dropout 0.3, the layers compiled with inductor ``options``."""
    monkeypatch.setattr(compiled_training, "_OPTIONS", options)
    monkeypatch.setattr(compiled_training, "_compiled", None)
    torch._dynamo.reset()
    eager = peft_model(dropout=0.3)
    compiled = copy.deepcopy(eager)
    enable_compiled_training(compiled)
    unchecked = copy.deepcopy(compiled)
    unchecked.gradient_checkpointing_disable()
    batch = ids(12)
    return step(eager, batch), step(compiled, batch), step(unchecked, batch)


def test_dropout_masks_are_eagers_and_reproduced_by_the_checkpointed_recomputation(monkeypatch):
    """torch.compile's default draws the dropout masks from inductor's own generator (same p, other masks than
    eager's); the kit's compiled layers draw eager's (ATen's generator), and the recomputation reproduces them."""
    (_, grads_e), _, (_, grads_u) = _dropout_grads({}, monkeypatch)
    differ = [n for n, g in grads_e.items() if not torch.allclose(grads_u[n], g, rtol=1e-3, atol=1e-5)]
    assert differ, "inductor's generator: other masks than eager's"

    (loss_e, grads_e), (loss_c, grads_c), (loss_u, grads_u) = _dropout_grads(KIT_OPTIONS, monkeypatch)
    assert torch.equal(loss_c, loss_u)
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    for name, grad in grads_u.items():  # a recomputation drawing new masks would give other gradients
        torch.testing.assert_close(grads_c[name], grad, rtol=1e-5, atol=1e-7, msg=name)
        torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-4, atol=1e-6, msg=name)  # eager's masks


def test_layers_switch_once_keep_their_class_name_and_a_deep_copy_runs_its_own_weights():
    model = peft_model(layers=2)
    original = type(model.get_base_model().model.layers[0])
    assert enable_compiled_training(model) == 2 and enable_compiled_training(model) == 2
    layer = model.get_base_model().model.layers[0]
    assert isinstance(layer, original) and type(layer).__mro__[1] is original
    assert (type(layer).__name__, type(layer).__qualname__) == (original.__name__, original.__qualname__)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
        twin.eval(), model.eval()
        assert not torch.equal(twin(input_ids=ids(6)).logits, model(input_ids=ids(6)).logits)
    assert len(compiled_layers(twin)) == 2
    assert enable_compiled_training(nn.ModuleDict({"module": twin})) == 2, "found through a wrapper (DDP's .module)"
    with pytest.warns(UserWarning, match="names no decoder layers"):
        assert enable_compiled_training(nn.Sequential(nn.Linear(2, 2))) == 0


def count_compiled_calls(monkeypatch, module) -> dict[bool, int]:
    """Calls of ``module``'s compiled layer function from now on, by whether autograd was on."""
    calls = {True: 0, False: 0}
    compiled = module._compiled_forward

    def counting():
        fn = compiled()

        def call(*args, **kwargs):
            calls[torch.is_grad_enabled()] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(module, "_compiled_forward", counting)
    return calls


class Accelerator:
    """What the layout check reads of a trainer's accelerator: its distributed type, ``kind``."""

    def __init__(self, kind):
        from accelerate.utils import DistributedType

        self.distributed_type = getattr(DistributedType, kind)


def test_compile_training_must_be_a_bool_and_fsdp_or_deepspeed_are_refused():
    with pytest.raises(TypeError, match="compile_training='yes'"):
        grpo_patches.apply(compile_training="yes")
    assert not grpo_patches.is_applied()
    for kind in ("FSDP", "DEEPSPEED"):
        with pytest.raises(ValueError, match=f"under {kind}.*Drop compile_training"):
            check_layout(Accelerator(kind))
    for kind in ("NO", "MULTI_GPU", "MULTI_CPU"):
        check_layout(Accelerator(kind))


def _trainer(**apply_kw):
    return patched_trl_trainer(grpo_args(max_steps=2, gradient_checkpointing=True), **apply_kw)


def test_trl_trainer_with_compiled_layers_trains_like_stock_and_samples_eagerly(monkeypatch):
    """Two GRPO steps with LoRA dropout 0.1: the compiled layers draw stock's masks, so the losses and LoRA
    weights are stock's to fp32 rounding."""
    from tests import helpers

    dropped = copy.copy(helpers.lora())
    dropped.lora_dropout = 0.1
    monkeypatch.setattr(helpers, "lora", lambda: dropped)
    calls = count_compiled_calls(monkeypatch, compiled_training)
    checked = []
    monkeypatch.setattr(compiled_training, "check_layout", checked.append)
    runs = {}
    for name, kw in {"stock": {}, "compiled": {"compile_training": True}}.items():
        trainer = _trainer(**kw)
        assert len(compiled_layers(trainer.model)) == (0 if name == "stock" else 2)
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
        lora_weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
        runs[name] = ([h.get("loss") for h in trainer.state.log_history if "loss" in h], lora_weights)
    assert checked == [trainer.accelerator], "the layout is checked at construction"
    (loss_s, w_s), (loss_c, w_c) = runs["stock"], runs["compiled"]
    assert len(loss_s) == 2 and loss_c == pytest.approx(loss_s, rel=1e-4, abs=1e-6)
    assert any(w.abs().sum() > 0 for n, w in w_s.items() if "lora_B" in n), "the steps trained (B starts at 0)"
    for name, weight in w_s.items():
        torch.testing.assert_close(w_c[name], weight, rtol=1e-4, atol=1e-6, msg=name)
    assert calls[True] > 0 and calls[False] == 0, calls


def test_vendored_trainer_switches_its_policy():
    trainer = patched_vendored_trainer(compile_training=True)
    assert len(compiled_layers(trainer.model)) == 2


def test_cuda_is_initialized_before_the_first_checkpointed_forward_compiles(monkeypatch):
    """On a machine with a GPU, inductor's first compilation initializes CUDA; inside a checkpointed forward
    (a CPU model there) torch.utils.checkpoint raises. enable_compiled_training initializes it first."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "init", lambda: calls.append("init"))
    with pytest.warns(UserWarning, match="names no decoder layers"):
        enable_compiled_training(nn.Sequential(nn.Linear(2, 2)))
    assert calls == ["init"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (inductor's Triton kernels)")
def test_gpu_compiled_layers_under_bf16_autocast_are_as_close_to_fp32_as_eager_bf16():
    """Under bf16 autocast both sides round: the compiled layers' gradients may round differently from
    eager's but must stay about as close to the fp32 gradients (on CPU, inductor's bf16 came within 2.4x of
    eager bf16's relative error; a dropped adapter or a wrong weight is ~100%)."""
    eager = peft_model().cuda()
    compiled = copy.deepcopy(eager)
    enable_compiled_training(compiled)
    for n, length in enumerate((9, 13, 17)):
        batch = ids(length, n).cuda()
        loss_r, grads_r = step(eager, batch)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss_e, grads_e = step(eager, batch)
            loss_c, grads_c = step(compiled, batch)
        assert (loss_c - loss_r).abs() <= 4 * (loss_e - loss_r).abs() + 1e-3
        for name, ref in grads_r.items():
            error_e, error_c = ((g[name] - ref).norm() / ref.norm() for g in (grads_e, grads_c))
            assert error_c <= 4 * error_e + 1e-3, (name, float(error_c), float(error_e))


@pytest.mark.distributed
def test_ddp_run_with_compiled_layers_trains_like_stock_and_keeps_the_ranks_in_sync():
    from tests.launch import describe, run_ranks

    results = run_ranks("tests.workers.dist_trl", "compiled", world_size=2, deadline=400)
    assert all(r.returncode == 0 for r in results), describe(results)
    for r in results:
        stock, compiled = r.data["stock"], r.data["compiled"]
        assert "MULTI_CPU" in compiled["distributed"] and (stock["compiled_layers"], compiled["compiled_layers"]) == (0, 2)
        assert len(stock["losses"]) == 2 and compiled["losses"] == pytest.approx(stock["losses"], rel=1e-4, abs=1e-6)
        for name, values in stock["weights"].items():
            assert compiled["weights"][name] == pytest.approx(values, rel=1e-4, abs=1e-6), name
    assert results[0].data["compiled"]["weights"] == results[1].data["compiled"]["weights"], "DDP kept the ranks equal"
    assert any(any(v != 0 for v in w) for n, w in results[0].data["stock"]["weights"].items() if "lora_B" in n)
