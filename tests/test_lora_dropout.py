"""lora_dropout: PEFT's ``lora_A(dropout(x))`` as one Triton op, run on CPU in Triton's interpreter.

The mask reference (``keep_mask``, plain torch) is Philox4x32 as Triton draws it (Random123's known answers at 7
and 10 rounds, Triton's own ``randint4x``), eight 16-bit draws per call laid out as the kernel interleaves them;
against it the op's ``u``, ``grad_x`` and ``grad_A`` equal torch math over shapes off
every tile and rank 1 .. 16, in fp32 tightly and bf16 loosely; the threshold is inclusive and ``1 / (1 - p)``
scales; the mask does not depend on the tiles, follows the seed (high bits, negative seeds too) and keeps
``1 - p`` of the elements; p = 0 is ``x @ A^T``. The lean LoRA layer takes the op on its fast path (under bf16
autocast) and matches stock PEFT fed the op's masks, redraws them in a checkpointed recomputation (gradients
equal without checkpointing), traces into one graph, and stays bit-identical to stock wherever the op is not taken;
the compiled layers' fused gate / up and down adapter take it too, in PEFT's order of masks.

``TRITON_INTERPRET=1`` must be set before Triton is first imported, and this process may have imported it
already, so each kernel test runs itself again in a fresh interpreter with the variable set (:func:`interpreted`).
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch

from grpo_patches import lora_dropout as ld
from tests.interpreted import interpreted


def reference(x, a, grad_u, seed, p, keep=None):
    """u, grad_x, grad_A in torch from keep_mask: the dropped input rounded to x's dtype (as the matmul sees it
    under autocast), then fp32 matmuls; u and grad_x rounded to x's dtype, grad_A in fp32."""
    x2 = x.reshape(-1, x.shape[-1])
    keep = ld.keep_mask(seed, *x2.shape, p) if keep is None else keep
    scale = 1.0 / (1.0 - p)
    dropped = torch.where(keep, x2.float() * scale, 0.0).to(x.dtype).float()
    a_in = a.to(x.dtype).float()
    gu = grad_u.reshape(-1, a.shape[0]).float()
    u = (dropped @ a_in.T).to(x.dtype).reshape(*x.shape[:-1], a.shape[0])
    grad_x = torch.where(keep, (gu @ a_in) * scale, 0.0).to(x.dtype).reshape(x.shape)
    return u, grad_x, gu.T @ dropped


def run_op(x, a, grad_u, seed, p, **tiles):
    x = x.detach().clone().requires_grad_()
    a = a.detach().clone().requires_grad_()
    u = ld.dropout_lora_a(x, a, p, seed, **tiles)
    u.backward(grad_u)
    return u.detach(), x.grad, a.grad


def rel(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12)).item()


def data(rows, k, rank, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype)
    a = torch.randn(rank, k, generator=g) * k ** -0.5  # PEFT's fp32 lora_A
    grad_u = torch.randn(rows, rank, generator=g).to(dtype)
    return x, a, grad_u


def column_mask(seed, rows, k, p, **tiles):
    """The op's backward mask, read through the op: R = 1, A = ones, grad_u = ones give grad_x = keep / (1 - p)."""
    x = torch.ones(rows, k, requires_grad=True)
    ld.dropout_lora_a(x, torch.ones(1, k), p, seed, **tiles).backward(torch.ones(rows, 1))
    return x.grad != 0


# --------------------------------------------------------------------------------------- reference (no Triton)

def test_reference_philox_is_random123s_known_answer_and_the_threshold_rounds_p():
    # Random123's kat_vectors: philox4x32 10, counter 0, key 0
    assert [int(v) for v in ld.philox4x32(0, torch.zeros(1, dtype=torch.int64))] == [
        0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    # seven rounds: the same words through 7 of the 10 rounds (Random123's philox4x32_R(7, ...) known answer)
    assert [int(v) for v in ld.philox4x32(0, torch.zeros(1, dtype=torch.int64), rounds=7)] == [
        0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48]
    assert ld.threshold(0.0) == 0 and ld.threshold(0.5) == 2**15 and ld.threshold(0.05) == round(0.05 * 2**16)
    for bad in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="must be in"):
            ld.threshold(bad)
    # column 8 c + i of row t takes counter t * K8 + c, word (0, 2, 1, 3)[i // 2], its low half for even i and
    # high for odd (Triton's interleave of the words' halves); K = 19 (K8 = 3): the last counter's i = 3 .. 7 unused
    seed, k = 77, 19
    for rounds in (7, 10):
        words = ld.philox4x32(seed, torch.arange(6, dtype=torch.int64).reshape(2, 3), rounds)
        mask = ld.keep_mask(seed, 2, k, 0.5, rounds=rounds)
        for t in range(2):
            for col in range(k):
                c, i = divmod(col, 8)
                half = (int(words[(0, 2, 1, 3)[i // 2]][t, c]) >> (16 * (i % 2))) & 0xFFFF
                assert bool(mask[t, col]) == (half >= 2**15), (rounds, t, col)


def test_use_kernel_runs_on_cuda_with_triton_and_on_cpu_only_interpreted_and_no_triton_means_no_op(monkeypatch):
    monkeypatch.setattr(ld, "_AVAILABLE", True)
    monkeypatch.setattr(ld, "_INTERPRETED", False)
    monkeypatch.setattr(ld, "_CHECKED_CUDA", False)
    assert not ld.use_kernel(torch.device("cuda", 0)), "CUDA before a passing check on a CUDA device"
    monkeypatch.setattr(ld, "self_check", lambda device: "")
    ld._check_once.cache_clear()
    ld.prepare("cpu")  # a check on the CPU (uninterpreted: none runs) does not clear CUDA
    assert not ld.use_kernel(torch.device("cuda", 0))
    assert ld.prepare("cuda:0") is True  # a model on CUDA: its check (here a stand-in that passes) clears it
    ld._check_once.cache_clear()
    assert ld.use_kernel(torch.device("cuda", 0)) and not ld.use_kernel(torch.device("cpu"))
    monkeypatch.setattr(ld, "_INTERPRETED", True)
    assert ld.use_kernel(torch.device("cpu")) and not ld.use_kernel(torch.device("meta"))
    monkeypatch.setattr(ld, "_AVAILABLE", False)
    assert not ld.use_kernel(torch.device("cuda", 0)) and not ld.use_kernel(torch.device("cpu"))
    # without Triton: the module imports (it did: torch only), available() says so, the op is not registered
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    monkeypatch.setattr(ld, "_AVAILABLE", None)
    assert ld.available() is False and ld.prepare() is False and not ld.use_kernel(torch.device("cuda", 0))


def test_fast_path_is_taken_only_where_all_its_conditions_hold(monkeypatch):
    from peft import LoraConfig

    from grpo_patches import lean_lora
    from tests.helpers import PROJ, live_lora_policy

    monkeypatch.setattr(ld, "use_kernel", lambda device: device.type == "cpu")  # as under TRITON_INTERPRET=1
    monkeypatch.setattr(ld, "_check_once", lambda device: None)  # the kernels cannot run here, uninterpreted
    model = live_lora_policy(0.3, dtype=torch.bfloat16)
    lean_lora.enable_lean_lora(model)
    layer = lean_lora.lean_layers(model)[0].train()
    x = torch.randn(2, 3, layer.in_features, dtype=torch.bfloat16)

    def taken(*args, x=x, **kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return lean_lora._fused_adapter(layer, x, args, kwargs)

    assert taken() == "default"
    assert taken(x=x.float()) is None, "autocast's dtype is not x's"
    with torch.autocast("cpu", enabled=False):
        assert lean_lora._fused_adapter(layer, x, (), {}) is None, "no autocast"
    assert taken(adapter_names=["default"] * 2) is None and taken(7) is None, "per-call arguments"
    monkeypatch.setattr(ld, "use_kernel", lambda device: False)
    assert taken() is None, "no kernel for x's device"
    monkeypatch.setattr(ld, "use_kernel", lambda device: True)
    dropout = layer.lora_dropout["default"]
    for change, undo in [(lambda: layer.eval(), lambda: layer.train()),  # the layer's mode (and its dropout's)
                         (lambda: dropout.eval(), lambda: dropout.train()),
                         (lambda: setattr(dropout, "p", 0.0), lambda: setattr(dropout, "p", 0.3)),
                         (lambda: layer.lora_dropout.update({"default": torch.nn.Identity()}),
                          lambda: layer.lora_dropout.update({"default": dropout})),
                         (lambda: setattr(layer, "_disable_adapters", True),
                          lambda: setattr(layer, "_disable_adapters", False)),
                         (lambda: layer.merge(), lambda: layer.unmerge())]:
        change()
        assert taken() is None
        undo()
        assert taken() == "default"
    model.add_adapter("second", LoraConfig(r=2, lora_alpha=4, lora_dropout=0.3, target_modules=PROJ))
    layer.set_adapter(["default", "second"])
    assert taken() is None, "two active adapters"
    layer.set_adapter("second")
    assert taken() == "second"


# ------------------------------------------------------------------------------------------ the op, interpreted

@interpreted
def test_reference_mask_is_tritons_randint4x():
    import triton
    import triton.language as tl

    @triton.jit
    def draw(seed_ptr, offset_ptr, out_ptr, N: tl.constexpr, ROUNDS: tl.constexpr):
        i = tl.arange(0, N)
        b0, b1, b2, b3 = tl.randint4x(tl.load(seed_ptr), tl.load(offset_ptr + i), ROUNDS)
        tl.store(out_ptr + i, b0.to(tl.int64) & 0xFFFFFFFF)
        tl.store(out_ptr + N + i, b1.to(tl.int64) & 0xFFFFFFFF)
        tl.store(out_ptr + 2 * N + i, b2.to(tl.int64) & 0xFFFFFFFF)
        tl.store(out_ptr + 3 * N + i, b3.to(tl.int64) & 0xFFFFFFFF)

    offsets = torch.tensor([0, 1, 2, 77, 2**31 - 1, 2**31, 2**32 - 1, 2**32 + 5, 3 * 2**40 + 9, 2**62, 12345, 7,
                            2**33, 99, 2**32, 1 << 50])
    for seed in (0, 5, 2**31 - 2, 2**40 + 123, -3):
        for rounds in (7, 10):
            out = torch.empty(4 * 16, dtype=torch.int64)
            draw[(1,)](torch.tensor([seed]), offsets, out, N=16, ROUNDS=rounds)
            want = torch.stack(ld.philox4x32(seed & (2**64 - 1), offsets, rounds)).reshape(-1)
            assert torch.equal(out, want), (seed, rounds)


SHAPES = [(1, 5, 1), (7, 97, 8), (130, 64, 16), (130, 97, 1), (7, 5, 16), (1, 64, 8)]  # (T, K, R)


@interpreted
def test_forward_and_gradients_equal_torch_on_the_reference_mask_and_p_zero_is_a_matmul():
    seed = torch.tensor([1234567])
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for rows, k, rank in SHAPES:
            x, a, grad_u = data(rows, k, rank, dtype)
            got = run_op(x, a, grad_u, seed, 0.3)
            want = reference(x, a, grad_u, seed, 0.3)
            assert got[0].dtype == got[1].dtype == dtype and got[2].dtype == torch.float32
            for name, g, w in zip(("u", "grad_x", "grad_A"), got, want, strict=True):
                assert g.shape == w.shape and rel(g, w) <= tolerance, (dtype, rows, k, rank, name, rel(g, w))
    # meaningful at this tolerance: another seed's mask, or no 1 / (1 - p), is far off
    x, a, grad_u = data(130, 97, 8, torch.bfloat16)
    got = run_op(x, a, grad_u, seed, 0.3)
    assert rel(got[0], reference(x, a, grad_u, torch.tensor([7]), 0.3)[0]) > 0.2
    assert rel(got[1], reference(x, a, grad_u, seed, 0.3)[1] * 0.7) > 0.2
    # batch dimensions: [B, S, K] in, [B, S, R] out, the same rows
    x3 = x.reshape(10, 13, 97)
    got3 = run_op(x3, a, grad_u.reshape(10, 13, 8), seed, 0.3)
    assert got3[0].shape == (10, 13, 8) and torch.equal(got3[0].reshape(130, 8), got[0])
    assert torch.equal(got3[1].reshape(130, 97), got[1]) and torch.equal(got3[2], got[2])
    # p = 0: a plain matmul
    x, a, grad_u = data(130, 97, 16, torch.float32)
    u, grad_x, grad_a = run_op(x, a, grad_u, torch.tensor([3]), 0.0)
    assert rel(u, x @ a.T) <= 1e-6 and rel(grad_x, grad_u @ a) <= 1e-6 and rel(grad_a, grad_u.T @ x) <= 1e-6


@interpreted
def test_threshold_is_inclusive_mask_follows_the_seed_not_the_tiles_and_keeps_one_minus_p():
    seed = torch.tensor([42])
    # an element whose draw equals round(p * 2**16) is kept: p set to element (0, 0)'s own draw
    draw = int(ld.philox4x32(42, torch.zeros(1, dtype=torch.int64), ld.ROUNDS)[0]) & 0xFFFF
    p = draw / 2**16
    assert ld.threshold(p) == draw and bool(ld.keep_mask(seed, 1, 8, p)[0, 0])
    x, a, grad_u = data(1, 8, 1, torch.float32)
    assert column_mask(seed, 1, 8, p)[0, 0], "the draw equal to the threshold is kept"
    assert run_op(x, a, grad_u, seed, p)[0].item() == pytest.approx(reference(x, a, grad_u, seed, p)[0].item(),
                                                                    rel=1e-6)
    # tiles: the same mask (and values) under two tile configs; rows and columns off both tiles
    rows, k = 70, 203
    first = column_mask(seed, rows, k, 0.3, block_t=16, block_k=16, num_warps=4)
    assert torch.equal(first, column_mask(seed, rows, k, 0.3, block_t=32, block_k=64, num_warps=4))
    assert torch.equal(first, ld.keep_mask(seed, rows, k, 0.3))
    x, a, grad_u = data(rows, k, 8, torch.float32)
    small = run_op(x, a, grad_u, seed, 0.3, block_t=16, block_k=16, num_warps=4)
    large = run_op(x, a, grad_u, seed, 0.3, block_t=32, block_k=64, num_warps=4)
    assert all(rel(s, g) <= 1e-5 for s, g in zip(small, large, strict=True))
    # the seed: the same seed the same mask, another another; 64-bit and negative seeds as the reference reads them
    assert torch.equal(first, column_mask(torch.tensor([42]), rows, k, 0.3))
    assert not torch.equal(first, column_mask(torch.tensor([43]), rows, k, 0.3))
    for big in (2**40 + 42, -42):
        assert torch.equal(column_mask(torch.tensor([big]), 9, 21, 0.3), ld.keep_mask(big, 9, 21, 0.3))
        assert not torch.equal(column_mask(torch.tensor([big]), 9, 21, 0.3), ld.keep_mask(42, 9, 21, 0.3))
    # keep rate: 1 - p within 5 sigma over 80k draws (the op's mask), and the forward's mask is the backward's
    mask = column_mask(torch.tensor([9]), 200, 401, 0.3)
    n = mask.numel()
    assert abs(mask.float().mean().item() - 0.7) <= 5 * (0.3 * 0.7 / n) ** 0.5
    x, a, grad_u = data(200, 401, 4, torch.float32)
    u = run_op(x, a, grad_u, torch.tensor([9]), 0.3)[0]
    assert rel(u, reference(x, a, grad_u, None, 0.3, keep=mask)[0]) <= 1e-5


@interpreted
def test_self_check_passes_and_a_kernel_that_fails_it_turns_the_op_off_with_a_warning(monkeypatch):
    """``prepare(device)`` checks the kernels once on the device the model trains on; a wrong (or failing)
    kernel there sends every layer back to PEFT's dropout instead of training on wrong gradients."""
    monkeypatch.setattr(ld, "_AVAILABLE", ld._AVAILABLE)  # restored after the test
    ld._check_once.cache_clear()
    assert ld.self_check("cpu") == ""
    real = ld._backward
    monkeypatch.setattr(ld, "_backward", lambda *args: (real(*args)[0], real(*args)[1] * 1.01))  # grad_A 1% off
    assert ld.self_check("cpu").startswith("grad_A in float32 off by 1.0e-02")  # within bf16's rounding, not fp32's
    with pytest.warns(RuntimeWarning, match="fused LoRA dropout kernel failed its check on cpu"):
        assert ld.prepare("cpu") is False
    assert not ld.use_kernel(torch.device("cpu"))
    ld._check_once.cache_clear()


# ------------------------------------------------------------------------------------ the lean layer, interpreted

def _models(dropout):
    from grpo_patches.lean_lora import enable_lean_lora
    from tests.helpers import PROJ, live_lora_policy

    stock = live_lora_policy(dropout, dtype=torch.bfloat16)
    lean = copy.deepcopy(stock)
    assert enable_lean_lora(lean) == 2 * len(PROJ)
    return stock, lean


def _train_step(model, ids, *, seed=11):
    model.train()
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=ids).logits
    logits.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logits.detach().float(), grads


def _recording(monkeypatch, seeds=True):
    """Records each op call's (seed, p, rows, K) in call order (after the op's one check on this device); with
    ``seeds=False`` only its p, which dynamo traces without a graph break (``int(seed)`` would break the graph
    at every call and run the op eagerly between the pieces)."""
    ld.prepare("cpu")
    calls, original = [], ld.dropout_lora_a

    def record(x, weight_a, p, seed, **kw):
        calls.append((int(seed), p, x.reshape(-1, x.shape[-1]).shape) if seeds else p)
        return original(x, weight_a, p, seed, **kw)

    monkeypatch.setattr(ld, "dropout_lora_a", record)
    return calls


class Replay(torch.nn.Module):
    """A dropout that applies the masks of recorded op calls, in order (stock PEFT's fp32 dropout input)."""

    def __init__(self, calls, offset=0):
        super().__init__()
        self.calls, self.offset = calls, offset

    def forward(self, x):
        seed, p, shape = self.calls.pop(0)
        keep = ld.keep_mask(seed + self.offset, *shape, p).reshape(x.shape)
        return torch.where(keep, x * (1.0 / (1.0 - p)), 0.0).to(x.dtype)


def _replayed(stock, calls, offset=0):
    model = copy.deepcopy(stock)
    for layer in model.modules():
        if hasattr(layer, "lora_dropout"):
            layer.lora_dropout["default"] = Replay(calls, offset)
    return model


def _ids(shape=(3, 9)):
    return torch.randint(0, 19, shape, generator=torch.Generator().manual_seed(0))


@interpreted
def test_lean_layer_fast_path_equals_stock_peft_on_the_ops_masks_and_checkpointing_redraws_them(monkeypatch):
    from tests.helpers import PROJ

    stock, lean = _models(0.5)
    calls = _recording(monkeypatch)
    logits, grads = _train_step(lean, _ids())
    assert len(calls) == 2 * len(PROJ) and all(p == 0.5 for _, p, _ in calls), "every adapted projection fused"
    assert len({s for s, _, _ in calls}) == len(calls), "a seed per call"
    want_logits, want_grads = _train_step(_replayed(stock, list(calls)), _ids())
    other_logits, other_grads = _train_step(_replayed(stock, list(calls), offset=1), _ids())  # other masks
    err, other = rel(logits, want_logits), rel(logits, other_logits)
    assert err <= 0.1 and other > 10 * err, (err, other)
    assert grads.keys() == want_grads.keys() and any("lora_A" in n for n in grads)
    for name, grad in grads.items():
        if "lora_" in name:
            err, other = rel(grad, want_grads[name]), rel(grad, other_grads[name])
            assert err <= 0.15 and other > 5 * err, (name, err, other)  # bf16 rounding through two layers
    # torch.manual_seed fixes the masks
    calls.clear()
    again, _ = _train_step(lean, _ids())
    assert torch.equal(again, logits) and len(calls) == 2 * len(PROJ)
    # gradient checkpointing: the recomputation redraws the forward's seeds (torch's RNG state restored), so
    # the gradients are those without checkpointing, bit for bit
    first = list(calls)
    calls.clear()
    lean.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    logits_ckpt, grads_ckpt = _train_step(lean, _ids())
    assert len(calls) == 2 * 2 * len(PROJ), "forward and recomputation"
    assert calls[:len(first)] == first and sorted(calls[len(first):]) == sorted(first), "the same seeds"
    assert torch.equal(logits_ckpt, logits) and grads_ckpt.keys() == grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grads_ckpt[name], grad), name


@interpreted
def test_lean_layer_compiles_into_one_graph():
    from grpo_patches.lean_lora import lean_layers

    _, lean = _models(0.3)
    layer = lean_layers(lean)[0].train()
    x = torch.randn(2, 5, layer.in_features, dtype=torch.bfloat16, requires_grad=True)

    def step(fn):
        torch.manual_seed(5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(x)
        grads = torch.autograd.grad(out.float().sum(), (x, layer.lora_A["default"].weight))
        return out.detach(), grads

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break raises
    got, want = step(compiled), step(layer)
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(g, w) for g, w in zip(got[1], want[1], strict=True))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert not torch.equal(want[0], layer.base_layer(x)), "the adapter adds something"


@interpreted
def test_lean_layer_is_stocks_bits_wherever_the_op_is_not_taken(monkeypatch):
    from grpo_patches.lean_lora import enable_lean_lora
    from tests.test_lean_lora import check_bits, peft_model, run

    calls = _recording(monkeypatch)
    check_bits(0.0, True)  # dropout 0: nothing to fuse
    check_bits(0.05, False)  # eval mode
    assert calls == []
    # no autocast: PEFT's fp32 copy stays, and so does its dropout
    stock = peft_model(0.3)
    lean = copy.deepcopy(stock)
    enable_lean_lora(lean)
    out_stock, grads_stock = run(stock, _ids(), autocast=None)
    out_lean, grads_lean = run(lean, _ids(), autocast=None)
    assert torch.equal(out_lean, out_stock)
    assert all(torch.equal(grads_lean[n], g) for n, g in grads_stock.items())
    assert calls == []


@interpreted
def test_fused_gate_up_and_the_down_tail_take_the_op_with_peft_values_on_its_masks(monkeypatch):
    """The compiled layers' own paths to the adapters (``fused_gate_up``, ``recompute_tail``) draw through
    ``lean_lora.adapter_input`` too: gate's mask first, then up's, then down's, as PEFT's calls would."""
    from grpo_patches import fused_gate_up, recompute_tail

    stock, lean = _models(0.5)
    calls = _recording(monkeypatch)

    def mlp(model):
        return next(m for m in model.modules() if type(m).__name__.endswith("MLP"))

    x = torch.randn(2, 5, mlp(lean).gate_proj.in_features, dtype=torch.bfloat16)

    def kit(model):
        layers = mlp(model).train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            gate, up = fused_gate_up._fused(layers, x)
            return gate, up, recompute_tail.down_projection(layers.down_proj, "default", layers.act_fn(gate) * up)

    def peft(model):
        layers = mlp(model).train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            gate, up = layers.gate_proj(x), layers.up_proj(x)
            return gate, up, layers.down_proj(layers.act_fn(gate) * up)

    got = kit(lean)
    width, inner = x.shape[-1], mlp(lean).down_proj.in_features
    assert [(p, tuple(shape)) for _, p, shape in calls] == [(0.5, (10, width)), (0.5, (10, width)), (0.5, (10, inner))]
    want, other = peft(_replayed(stock, list(calls))), peft(_replayed(stock, list(calls), offset=1))
    for name, g, w, o in zip(("gate", "up", "down"), got, want, other, strict=True):
        err = rel(g, w)
        assert err <= 2e-2 and rel(g, o) > 10 * err, (name, err, rel(g, o))


@interpreted
def test_compiled_layers_with_checkpointing_redraw_the_forwards_masks(monkeypatch):
    """``compile_training``'s layers (inductor, ``fallback_random``) call the op inside the compiled graph; the
    checkpointed recomputation must draw the forward's seeds again (torch's RNG state restored), so the
    gradients equal those of the same compiled model without checkpointing, bit for bit."""
    from grpo_patches.compiled_training import enable_compiled_training
    from tests.helpers import PROJ

    _, lean = _models(0.3)
    calls = _recording(monkeypatch, seeds=False)
    results = []
    for checkpointing in (False, True):
        model = copy.deepcopy(lean)
        assert enable_compiled_training(model) == 2
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        calls.clear()
        results.append(_train_step(model, _ids()))
        assert len(calls) == (2 if checkpointing else 1) * 2 * len(PROJ), "every projection fused, recomputed once"
    (logits, grads), (logits_ckpt, grads_ckpt) = results
    assert torch.equal(logits_ckpt, logits) and grads_ckpt.keys() == grads.keys()
    assert any("lora_A" in name for name in grads)
    for name, grad in grads.items():
        assert torch.equal(grads_ckpt[name], grad), name
