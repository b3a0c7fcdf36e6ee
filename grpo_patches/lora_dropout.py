"""PEFT's ``lora_A(dropout(x))`` in one Triton kernel, with the dropout mask drawn from a seed.

In the compiled training layers (``compile_training``, inductor with ``fallback_random``) each LoRA
dropout materializes ATen's fp32 random tensor (4 bytes written and read per input element), the dropped
copy of the input and a bool mask for the backward, in the forward, the checkpointed recomputation and the
backward: about a tenth of a compiled layer's time on the GRPO step of the benchmarks. Here the forward reads ``x`` once
and writes only ``u = (x * keep / (1 - p)) @ A^T``; the backward draws the same mask again from the seed,
so no mask, random tensor or dropped copy is ever stored.

The mask is counter-based (Philox4x32, Triton's ``tl.randint4x``, ``ROUNDS`` rounds) and does not depend on
the tile sizes: one draw gives four uint32 words, eight 16-bit halves, for eight consecutive elements of a row.
With ``K8 = ceil(K / 8)``, element ``(t, 8 c + i)`` of the ``[T, K]`` input takes counter ``t * K8 + c``,
word ``(0, 2, 1, 3)[i // 2]``, its low half for even ``i`` and its high half for odd (the order Triton's
``interleave`` lays the halves out in), and is kept iff that half is ``>= round(p * 2**16)``: kept with
probability ``1 - round(p * 2**16) / 2**16``, within ``2**-17`` of ``1 - p``. A column tile is a contiguous
slice of the row, read once. :func:`keep_mask` computes the same mask in plain torch, for tests.

It is a torch custom op (``<top package>::dropout_lora_a``, its backward another), registered at its
first use, so a compiled layer calls it as one opaque op. Triton is optional: this module imports
without it (:func:`available` is then False). CPU tensors run in Triton's interpreter, which needs
``TRITON_INTERPRET=1`` set before Triton is first imported (tests, ``benchmarks/lora_dropout.py --tiny``).
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

__all__ = ["available", "dropout_lora_a", "keep_mask", "prepare", "self_check", "threshold", "use_kernel"]

_NAMESPACE = __name__.split(".")[0]  # the custom ops' namespace: this package's
_HAS_CUSTOM_OP = hasattr(torch, "library") and hasattr(torch.library, "custom_op")
RANK_PAD = 16  # tl.dot's smallest dimension
ROUNDS = 10  # Philox rounds per draw (Random123's default; 7 passes BigCrush too)
BWD_PROGRAMS = 1024  # the backward's grid: row splits x column blocks, about this many programs
# Tiles (block_t, block_k, num_warps), forward and backward, by input width K (first row with K <= bound).
# Fixed rather than autotuned: the tiles set the fp32 summation order, and a run should not change its
# numbers with a timing. 32 x 128 was the fastest forward and backward at K = 1536 and 8960 on an H100
# (benchmarks/lora_dropout.py --sweep, which times the candidates).
TILES: tuple[tuple[int, tuple[int, int, int], tuple[int, int, int]], ...] = (
    (1 << 62, (32, 128, 4), (32, 128, 4)),
)
_AVAILABLE: bool | None = None  # set by available(); read as a plain global by use_kernel (compiled code)
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # Triton reads it at its import, as here
_CHECKED_CUDA = False  # set by a passing check on a CUDA device (prepare): the kernels run there only after one


def available() -> bool:
    """Triton imports and this torch has ``torch.library.custom_op`` (torch >= 2.4)."""
    global _AVAILABLE
    if _AVAILABLE is None:
        _AVAILABLE = _HAS_CUSTOM_OP
        if _AVAILABLE:
            try:
                import triton  # noqa: F401
                import triton.language  # noqa: F401
            except Exception:  # noqa: BLE001 - missing or broken: PEFT's path
                _AVAILABLE = False
    return _AVAILABLE


def use_kernel(device: torch.device) -> bool:
    """Whether the op runs for tensors on ``device``: CUDA with Triton once the kernels passed their check on a
    CUDA device (:func:`prepare`; a model moved there after its layers were switched keeps PEFT's path), or CPU
    in Triton's interpreter (``TRITON_INTERPRET=1``, tests). Reads only globals once :func:`available` has run
    (compiled callers)."""
    ok = _AVAILABLE if _AVAILABLE is not None else available()
    if device.type == "cuda":
        return ok and _CHECKED_CUDA
    return ok and _INTERPRETED and device.type == "cpu"


def prepare(device: torch.device | str | None = None) -> bool:
    """Probe Triton and register the op (once) where it runs, before any compiled code calls
    :func:`use_kernel` or :func:`dropout_lora_a` (both then read only globals); for a ``device`` the op runs
    on, check the kernels there once (:func:`self_check`): one that fails turns the op off for the process,
    with one warning, so PEFT's dropout runs. Whether the op is available."""
    if available():
        _op()
        device = None if device is None else torch.device(device)
        if device is not None and (device.type == "cuda" or (_INTERPRETED and device.type == "cpu")):
            _check_once(device)
    return bool(_AVAILABLE)


@functools.cache
def _check_once(device: torch.device) -> None:
    global _AVAILABLE, _CHECKED_CUDA
    problem = self_check(device)
    if not problem and device.type == "cuda":
        _CHECKED_CUDA = True
    if problem:
        _AVAILABLE = False
        warnings.warn(f"grpo_patches: the fused LoRA dropout kernel failed its check on {device} ({problem}); LoRA "
                      "dropout runs as in PEFT.", RuntimeWarning, stacklevel=4)


def self_check(device: torch.device | str) -> str:
    """The op's forward and backward on ``device`` against float64 torch math on :func:`keep_mask`, at a
    shape off every tile, in bf16 and fp32: ``""``, or what failed (a compilation error, a wrong value).
    The hardware compiles kernels the interpreted tests cannot reach; this runs them once before training."""
    try:
        g = torch.Generator(device=device).manual_seed(0)
        seed, p, rows, k, rank = torch.tensor([20261205], device=device), 0.25, 67, 97, 16
        for dtype, tolerance in ((torch.bfloat16, 2e-2), (torch.float32, 1e-4)):
            x = torch.randn(rows, k, device=device, generator=g).to(dtype).requires_grad_()
            a = (torch.randn(rank, k, device=device, generator=g) * k**-0.5).requires_grad_()
            grad_u = torch.randn(rows, rank, device=device, generator=g).to(dtype)
            with torch.enable_grad(), torch.autocast(torch.device(device).type, enabled=False):
                u = dropout_lora_a(x, a, p, seed)
                u.backward(grad_u)
            keep = keep_mask(seed, rows, k, p)
            dropped = torch.where(keep, x.detach().double() / (1 - p), 0.0).to(dtype).double()
            a_in, gu = a.detach().to(dtype).double(), grad_u.double()
            wanted = {"u": (u, dropped @ a_in.T), "grad_x": (x.grad, torch.where(keep, gu @ a_in / (1 - p), 0.0)),
                      "grad_A": (a.grad, gu.T @ dropped)}
            for name, (got, want) in wanted.items():
                error = ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
                if not error <= tolerance:
                    return f"{name} in {str(dtype).split('.')[-1]} off by {error:.1e} of its largest value"
    except Exception as exc:  # noqa: BLE001 - any failure to run is a failed check
        return repr(exc)[:300]
    return ""


def threshold(p: float) -> int:
    """The 16-bit draw below which an element is dropped: ``round(p * 2**16)``."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_lora_a: p={p} must be in [0, 1)")
    return min(round(p * 2**16), 2**16 - 1)


def tiles(k: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The (forward, backward) tiles for input width ``k`` (``TILES``)."""
    return next((fwd, bwd) for bound, fwd, bwd in TILES if k <= bound)


# ----------------------------------------------------------------------------------------------- reference

_PHILOX_KEY = (0x9E3779B9, 0xBB67AE85)  # Triton's philox_impl for 32-bit counters
_PHILOX_ROUND = (0xD2511F53, 0xCD9E8D57)
_LOW = 0xFFFFFFFF


def _mulhilo(a: int, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of ``a * c`` (``a``, ``c`` < 2**32; int64 tensors hold no 64-bit product, so
    in 16-bit halves of ``c``)."""
    p1, p0 = a * (c >> 16), a * (c & 0xFFFF)  # < 2**48
    mid = p1 + (p0 >> 16)
    return mid >> 16, ((mid & 0xFFFF) << 16) | (p0 & 0xFFFF)


def philox4x32(seed: int, counters: torch.Tensor, rounds: int = 10) -> tuple[torch.Tensor, ...]:
    """Triton's ``randint4x(seed, counters)`` (Philox4x32-10, 64-bit counter split into its low and high
    words, the 64-bit seed into the key's) for an int64 tensor of counters >= 0: four int64 tensors of
    uint32 values."""
    c0, c1 = counters & _LOW, counters >> 32
    c2 = c3 = torch.zeros_like(c0)
    k0, k1 = seed & _LOW, (seed >> 32) & _LOW
    for _ in range(rounds):
        hi_b, lo_b = _mulhilo(_PHILOX_ROUND[1], c2)
        hi_a, lo_a = _mulhilo(_PHILOX_ROUND[0], c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _PHILOX_KEY[0]) & _LOW, (k1 + _PHILOX_KEY[1]) & _LOW
    return c0, c1, c2, c3


def keep_mask(seed: int | torch.Tensor, rows: int, k: int, p: float, *, first_row: int = 0,
              device: torch.device | str | None = None, rounds: int = 0) -> torch.Tensor:
    """The op's keep mask (bool ``[rows, k]``) for rows ``first_row ..`` of a ``[T, k]`` input, in plain
    torch on ``device`` (the seed's by default): the same Philox draws and element mapping as the kernel's,
    a reference for tests and checks."""
    if isinstance(seed, torch.Tensor):
        device = seed.device if device is None else device
        seed = int(seed.reshape(-1)[0])
    rounds = rounds or ROUNDS
    seed &= 2**64 - 1  # the kernel reads the int64 seed as uint64
    k8 = -(-k // 8)
    t = torch.arange(first_row, first_row + rows, dtype=torch.int64, device=device)
    counters = t[:, None] * k8 + torch.arange(k8, dtype=torch.int64, device=device)[None, :]
    w = philox4x32(seed, counters, rounds)

    def interleave(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # Triton's tl.interleave
        return torch.stack((a, b), dim=-1).flatten(-2)

    lo = interleave(interleave(w[0] & 0xFFFF, w[1] & 0xFFFF), interleave(w[2] & 0xFFFF, w[3] & 0xFFFF))
    hi = interleave(interleave(w[0] >> 16, w[1] >> 16), interleave(w[2] >> 16, w[3] >> 16))
    return interleave(lo, hi)[:, :k] >= threshold(p)


# ------------------------------------------------------------------------------------------------- kernels


@functools.cache
def _kernels():
    # The helpers are module globals, not closures: Triton's interpreter resolves a kernel's callees there.
    global _dot, _keep
    import triton
    import triton.language as tl

    @triton.jit
    def _dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        """``acc + a @ b``; ``UPCAST``: in fp32 (exact products of bf16 values; the interpreter's bf16 dot
        multiplies the raw bits)."""
        if UPCAST:
            out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            out = tl.dot(a, b, acc, input_precision=PRECISION)
        return out

    @triton.jit
    def _keep(seed, rows, k0, K8, thr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, ROUNDS: tl.constexpr):
        """The keep mask of the ``[BLOCK_T, BLOCK_K]`` tile at rows ``rows``, columns ``k0 ..``: one Philox draw
        per 8 columns, its eight 16-bit halves interleaved as :func:`keep_mask` lays them out."""
        counters = rows[:, None] * K8 + (k0 // 8 + tl.arange(0, BLOCK_K // 8))[None, :]
        w0, w1, w2, w3 = tl.randint4x(seed, counters, ROUNDS)
        lo = tl.interleave(tl.interleave(w0 & 0xFFFF, w1 & 0xFFFF), tl.interleave(w2 & 0xFFFF, w3 & 0xFFFF))
        hi = tl.interleave(tl.interleave(w0 >> 16, w1 >> 16), tl.interleave(w2 >> 16, w3 >> 16))
        return tl.interleave(lo, hi) >= thr

    @triton.jit(do_not_specialize=["threshold"])
    def forward(x_ptr, a_ptr, seed_ptr, u_ptr, T, K, K8, R, stride_xt, stride_ar, stride_ut, threshold, scale,
                R_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                UPCAST: tl.constexpr, ROUNDS: tl.constexpr):
        rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        row_ok = rows < T
        seed = tl.load(seed_ptr)
        thr = threshold.to(tl.uint32)
        r = tl.arange(0, R_PAD)
        acc = tl.zeros((BLOCK_T, R_PAD), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_ok = cols < K
            x = tl.load(x_ptr + rows[:, None] * stride_xt + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                        other=0.0)
            keep = _keep(seed, rows, k0, K8, thr, BLOCK_T, BLOCK_K, ROUNDS)
            d = tl.where(keep, x.to(tl.float32) * scale, 0.0).to(x.dtype)
            a = tl.load(a_ptr + r[None, :] * stride_ar + cols[:, None], mask=col_ok[:, None] & (r < R)[None, :],
                        other=0.0).to(x.dtype)
            acc = _dot(d, a, acc, PRECISION, UPCAST)
        tl.store(u_ptr + rows[:, None] * stride_ut + r[None, :], acc.to(u_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (r < R)[None, :])

    @triton.jit(do_not_specialize=["threshold"])
    def backward(x_ptr, a_ptr, seed_ptr, gu_ptr, gx_ptr, part_ptr, T, K, K8, R, stride_xt, stride_ar, stride_ut,
                 stride_gt, stride_ps, threshold, scale, R_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, ROUNDS: tl.constexpr):
        k0 = tl.program_id(0) * BLOCK_K
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        split = tl.program_id(1)
        splits = tl.num_programs(1)
        seed = tl.load(seed_ptr)
        thr = threshold.to(tl.uint32)
        dtype = x_ptr.dtype.element_ty
        r = tl.arange(0, R_PAD)
        r_ok = r < R
        a = tl.load(a_ptr + r[:, None] * stride_ar + cols[None, :], mask=r_ok[:, None] & col_ok[None, :],
                    other=0.0).to(dtype)
        acc = tl.zeros((R_PAD, BLOCK_K), tl.float32)
        for t0 in range(split * BLOCK_T, T, splits * BLOCK_T):  # this split's row blocks
            rows = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
            row_ok = rows < T
            ok = row_ok[:, None] & col_ok[None, :]
            gu = tl.load(gu_ptr + rows[:, None] * stride_ut + r[None, :], mask=row_ok[:, None] & r_ok[None, :],
                         other=0.0)
            x = tl.load(x_ptr + rows[:, None] * stride_xt + cols[None, :], mask=ok, other=0.0)
            keep = _keep(seed, rows, k0, K8, thr, BLOCK_T, BLOCK_K, ROUNDS)
            d = tl.where(keep, x.to(tl.float32) * scale, 0.0).to(dtype)
            acc = _dot(tl.trans(gu), d, acc, PRECISION, UPCAST)
            gx = _dot(gu, a, tl.zeros((BLOCK_T, BLOCK_K), tl.float32), PRECISION, UPCAST)
            gx = tl.where(keep, gx * scale, 0.0)
            tl.store(gx_ptr + rows[:, None] * stride_gt + cols[None, :], gx.to(gx_ptr.dtype.element_ty), mask=ok)
        tl.store(part_ptr + split * stride_ps + r[:, None] * K + cols[None, :], acc,
                 mask=r_ok[:, None] & col_ok[None, :])

    return forward, backward


def _check(x: torch.Tensor, weight_a: torch.Tensor, seed: torch.Tensor) -> None:
    if x.device.type == "cpu" and not _INTERPRETED:
        raise RuntimeError("dropout_lora_a: CPU tensors run in Triton's interpreter only (TRITON_INTERPRET=1 "
                           "set before Triton is imported)")
    if weight_a.dim() != 2 or weight_a.shape[1] != x.shape[-1]:
        raise ValueError(f"dropout_lora_a: weight_a {tuple(weight_a.shape)} must be [R, K] with K = x's last "
                         f"dimension ({x.shape[-1]})")
    if seed.numel() != 1 or seed.dtype != torch.int64 or seed.device != x.device:
        raise ValueError("dropout_lora_a: seed must be one int64 on x's device")


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32: ignored for bf16 / fp16 inputs


def _upcast(x: torch.Tensor) -> bool:
    return _INTERPRETED and x.dtype == torch.bfloat16  # the interpreter's bf16 tl.dot is not a product


def _pick(k: int, block_t: int, block_k: int, num_warps: int, backward: bool) -> tuple[int, int, int]:
    if block_t and block_k and num_warps:
        return block_t, block_k, num_warps
    fwd, bwd = tiles(k)
    return bwd if backward else fwd


def _forward(x: torch.Tensor, weight_a: torch.Tensor, seed: torch.Tensor, p: float, block_t: int, block_k: int,
             num_warps: int, rounds: int = 0) -> torch.Tensor:
    _check(x, weight_a, seed)
    x2 = _rows(x)
    rows, k = x2.shape
    rank = weight_a.shape[0]
    a = weight_a if weight_a.stride(1) == 1 else weight_a.contiguous()
    u = torch.empty(rows, rank, dtype=x.dtype, device=x.device)
    if rows and rank:
        bt, bk, warps = _pick(k, block_t, block_k, num_warps, backward=False)
        _kernels()[0][(triton_cdiv(rows, bt),)](
            x2, a, seed, u, rows, k, -(-k // 8), rank, x2.stride(0), a.stride(0), u.stride(0), threshold(p),
            1.0 / (1.0 - p), R_PAD=max(RANK_PAD, 1 << (rank - 1).bit_length()), BLOCK_T=bt, BLOCK_K=bk,
            PRECISION=_precision(x.dtype), UPCAST=_upcast(x), ROUNDS=rounds or ROUNDS, num_warps=warps)
    return u.reshape(*x.shape[:-1], rank)


def _backward(grad_u: torch.Tensor, x: torch.Tensor, weight_a: torch.Tensor, seed: torch.Tensor, p: float,
              block_t: int, block_k: int, num_warps: int, rounds: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    _check(x, weight_a, seed)
    x2 = _rows(x)
    rows, k = x2.shape
    rank = weight_a.shape[0]
    a = weight_a if weight_a.stride(1) == 1 else weight_a.contiguous()
    gu = grad_u.reshape(rows, rank).to(x.dtype)
    if gu.stride(-1) != 1:
        gu = gu.contiguous()
    grad_x = torch.empty(rows, k, dtype=x.dtype, device=x.device)
    if not (rows and rank):
        grad_x.zero_()
        return grad_x.reshape(x.shape), torch.zeros_like(weight_a)
    bt, bk, warps = _pick(k, block_t, block_k, num_warps, backward=True)
    col_blocks = triton_cdiv(k, bk)
    # grad_A's partial sums, one per row split, summed below (deterministic: no atomics)
    splits = max(1, min(triton_cdiv(rows, bt), BWD_PROGRAMS // col_blocks))
    partial = torch.empty(splits, rank, k, dtype=torch.float32, device=x.device)
    _kernels()[1][(col_blocks, splits)](
        x2, a, seed, gu, grad_x, partial, rows, k, -(-k // 8), rank, x2.stride(0), a.stride(0), gu.stride(0),
        grad_x.stride(0), partial.stride(0), threshold(p), 1.0 / (1.0 - p),
        R_PAD=max(RANK_PAD, 1 << (rank - 1).bit_length()), BLOCK_T=bt, BLOCK_K=bk,
        PRECISION=_precision(x.dtype), UPCAST=_upcast(x), ROUNDS=rounds or ROUNDS, num_warps=warps)
    return grad_x.reshape(x.shape), partial.sum(0).to(weight_a.dtype)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------- custom op


@functools.cache
def _op():
    """Register the custom ops, once, at the first use (importing the kit registers nothing)."""

    @torch.library.custom_op(f"{_NAMESPACE}::dropout_lora_a_backward", mutates_args=())
    def backward_op(grad_u: torch.Tensor, x: torch.Tensor, weight_a: torch.Tensor, seed: torch.Tensor, p: float,
                    block_t: int, block_k: int, num_warps: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _backward(grad_u, x, weight_a, seed, p, block_t, block_k, num_warps)

    @backward_op.register_fake
    def _(grad_u, x, weight_a, seed, p, block_t, block_k, num_warps):
        return x.new_empty(x.shape), weight_a.new_empty(weight_a.shape)

    @torch.library.custom_op(f"{_NAMESPACE}::dropout_lora_a", mutates_args=())
    def op(x: torch.Tensor, weight_a: torch.Tensor, seed: torch.Tensor, p: float, block_t: int, block_k: int,
           num_warps: int) -> torch.Tensor:
        return _forward(x, weight_a, seed, p, block_t, block_k, num_warps)

    @op.register_fake
    def _(x, weight_a, seed, p, block_t, block_k, num_warps):
        return x.new_empty(*x.shape[:-1], weight_a.shape[0])

    def setup_context(ctx, inputs, output):
        x, weight_a, seed, p, block_t, block_k, num_warps = inputs
        ctx.save_for_backward(x, weight_a, seed)  # no mask: the backward draws it again from the seed
        ctx.args = (p, block_t, block_k, num_warps)

    def backward(ctx, grad_u):
        x, weight_a, seed = ctx.saved_tensors
        grad_x, grad_a = getattr(torch.ops, _NAMESPACE).dropout_lora_a_backward(grad_u, x, weight_a, seed, *ctx.args)
        return grad_x, grad_a, None, None, None, None, None

    op.register_autograd(backward, setup_context=setup_context)
    global _OP
    _OP = getattr(torch.ops, _NAMESPACE).dropout_lora_a
    return _OP


_OP = None  # the registered op (set by _op(): compiled callers read this global, never the cached call)


def dropout_lora_a(x: torch.Tensor, weight_a: torch.Tensor, p: float, seed: torch.Tensor, *, block_t: int = 0,
                   block_k: int = 0, num_warps: int = 0) -> torch.Tensor:
    """``(x * keep / (1 - p)) @ weight_a.T`` in ``x``'s dtype, ``[..., R]``, differentiable in ``x`` and
    ``weight_a``.

    ``x``: ``[..., K]`` (bf16, fp16 or fp32); ``weight_a``: ``[R, K]`` (PEFT's ``lora_A.weight``, cast to
    ``x``'s dtype for the matmul as autocast does; fp32 accumulation); ``seed``: one int64 on ``x``'s
    device, which with ``p`` fixes ``keep`` (see the module docstring, :func:`keep_mask`). ``grad_x`` comes
    in ``x``'s dtype, ``grad_A`` (summed in fp32, deterministically) in ``weight_a``'s. The tiles default
    to ``TILES``; the mask does not depend on them.
    """
    op = _OP if _OP is not None else _op()
    return op(x, weight_a, seed.reshape(1), float(p), int(block_t), int(block_k), int(num_warps))
