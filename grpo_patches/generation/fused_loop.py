"""The decode loop over the fused step: one compiled token step (forward, warping, the pick, the EOS
bookkeeping and the position counters, all on the device), on CUDA captured as a CUDA graph of
``graph_steps`` such steps (one by default), replayed ``check_every / graph_steps`` times before the host
asks whether every row has ended.

Per-token host work (the bookkeeping kernels, dynamo's guard checks over hundreds of weight arguments) is
what kept the one-token compiled loop above the weights' read time at small batches; a replay is one graph
launch. The capture runs each captured step's host code once, so a shorter graph captures faster (1.5B,
1024 rows: ~12 ms a step), and the last check replays only what reaches ``max_new_tokens``. The
graph's steps past ``max_new_tokens`` (its last replay is whole) write nothing that is returned: the output
buffer is wide enough, and their cache writes are clamped to the last slot, which no returned token reads
afterwards.

A captured graph lives in the pool's ``graphs`` with its state tensors and the addresses it was
recorded over (weights, caches). It is replayed only while they are all unchanged, else captured
again. ``release_after_sampling`` frees the caches between calls; the graph (its private memory
pool holds one step's activations) stays with ``keep_graph`` and is replayed when the next call's
caches and merged buffer come back at the recorded addresses, which saves the capture (17 steps
through the compiled function's host code, ~0.12 s at batch 8 on the 1.5B H200 step).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .config import FastGenerationConfig, warn_once
from .decode_attention import use_kernel
from .fused import DecoderShape, FusedDecoder, fused_forward
from .sampler import Sampler, eos_hit, pick, warp

__all__ = ["FusedLoopStats", "fused_decode", "make_room"]


@dataclass
class FusedLoopStats:
    """Counters of the fused loop (kept on ``GraphDecodeStats.fused``)."""

    calls: int = 0  # generate calls decoded by the fused step
    captures: int = 0  # CUDA graphs captured (a new batch, cache or weight address re-captures)
    replays: int = 0
    capture_seconds: float = 0.0
    graph_pool_bytes: int = 0  # memory the last capture reserved for its graph's private pool
    last_reason: str = ""  # why the last call did not use the fused step ("" when it did)
    attention: str = ""  # the last fused call's attention: "kernel" or "matmul" (decode_attention)
    capture_errors: list[str] = field(default_factory=list)


def _make_token_step(s: Sampler, shape: DecoderShape, kernel: bool = False) -> Callable:
    def fused_token_step(embed, layers, norm, head, rotary, keys, values, tokens, position_ids, cache_position,
                         key_mask, unfinished, out, t, source, shared_slots):
        logits = fused_forward(shape, embed, layers, norm, head, rotary, keys, values, tokens, position_ids,
                               cache_position, key_mask, kernel=kernel,
                               shared=(source, shared_slots) if kernel else None)
        nxt = pick(warp(logits, s), s)
        nxt = torch.where(unfinished, nxt, torch.full_like(nxt, s.pad))
        out.index_copy_(1, t, nxt.view(-1, 1).to(out.dtype))
        tokens.copy_(nxt.view(-1, 1))
        unfinished.copy_(unfinished & ~eos_hit(nxt, s))
        position_ids.add_(1)
        cache_position.copy_((cache_position + 1).clamp(max=keys[0].shape[2] - 1))
        t.add_(1)

    return fused_token_step


#: Rows of one prompt read its slots from its first row in the attention kernel (benchmarks switch it off to
#: compare); off, every row reads its own copy.
SHARE_PROMPT = True

_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {key: compiled token step}
_FAILED = ("capture failed",)  # key in the pool's graphs: a capture over these caches failed


def _compile_kwargs(config: FastGenerationConfig) -> dict[str, Any]:
    """The user's compile settings without CUDA graphs of torch.compile's own (the loop captures its own)."""
    kwargs: dict[str, Any] = dict(backend=config.backend, fullgraph=config.fullgraph, dynamic=config.dynamic)
    if config.backend == "inductor":
        options = dict(config.options or {})
        options["triton.cudagraphs"] = False
        if not config.options and config.mode in ("max-autotune", "max-autotune-no-cudagraphs"):
            options["max_autotune"] = True
        kwargs["options"] = options
    return kwargs


def _token_step(model: Any, s: Sampler, shape: DecoderShape, config: FastGenerationConfig,
                kernel: bool = False) -> Callable:
    kwargs = _compile_kwargs(config)
    key = (s, shape, kwargs["backend"], repr(kwargs.get("options")), config.fullgraph, config.dynamic, kernel)
    steps = _STEPS.setdefault(model, {})
    if key not in steps:
        steps[key] = torch.compile(_make_token_step(s, shape, kernel), **kwargs)
    return steps[key]


@dataclass
class _Captured:
    """The state tensors one captured graph reads and writes, and the graph."""

    state: tuple  # tokens, position_ids, cache_position, key_mask, unfinished, out, t, source, shared_slots
    graph: Any = None
    addresses: tuple = ()
    pool_bytes: int = 0  # what the last capture reserved (its private pool)


def _addresses(tensors: list[torch.Tensor]) -> tuple:
    return tuple(t.data_ptr() for t in tensors)


def _flat(args: tuple) -> list[torch.Tensor]:
    embed, layers, norm, head, _ = args
    out = [embed, norm, head]
    for ln1, qkv, o, ln2, gate_up, down in layers:
        out += [ln1, ln2]
        for pieces in (qkv, o, gate_up, down):
            out += [x for w, b in pieces for x in (w, b) if x is not None]
    return out


def fused_decode(model: Any, decoder: FusedDecoder, cache: Any, first: torch.Tensor, key_mask: torch.Tensor,
                 position_ids: torch.Tensor, prompt: int, s: Sampler, max_new: int, config: FastGenerationConfig,
                 stats: FusedLoopStats, graphs: dict | None,
                 source: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """Decode tokens 1 .. max_new-1 after the prefill's ``first``; returns ``(out [B, >= max_new], steps run)``.

    ``graphs``: where captured graphs live between calls (the cache pool's), or None to capture none.
    ``source``: for each row, a row whose cache holds the same ``prompt`` slots (the prefill wrote one prompt's
    keys and values to each of its rows), which the attention kernel then reads for all of them; None: each row
    reads its own.
    """
    batch = first.shape[0]
    device = first.device
    chunk = config.check_every
    n_steps = max_new - 1
    width = 2 + -(-max(n_steps, 1) // chunk) * chunk  # room for a whole last replay
    keys = [layer.keys for layer in cache.layers]
    values = [layer.values for layer in cache.layers]
    kernel = use_kernel(config.decode_attention, device, batch)  # the Triton attention kernel, or the matmuls
    stats.attention = "kernel" if kernel else "matmul"
    step = _token_step(model, s, decoder.shape, config, kernel)
    use_graph = n_steps > 0 and _captures(graphs, device)
    per_graph = config.graph_steps or chunk  # decode steps per captured graph, replayed chunk / per_graph times
    entry_key = (batch, keys[0].shape[2], width, s, decoder.shape, kernel, per_graph)
    entry = graphs.get(entry_key) if use_graph else None
    if entry is None:
        state = (torch.empty(batch, 1, dtype=torch.long, device=device),
                 torch.empty(batch, 1, dtype=torch.long, device=device),
                 torch.empty(1, dtype=torch.long, device=device),
                 torch.empty(batch, keys[0].shape[2], dtype=torch.bool, device=device),
                 torch.empty(batch, dtype=torch.bool, device=device),
                 torch.empty(batch, width, dtype=torch.long, device=device),
                 torch.empty(1, dtype=torch.long, device=device),
                 torch.empty(batch, dtype=torch.long, device=device),
                 torch.empty(1, dtype=torch.long, device=device))
        entry = _Captured(state)
        if use_graph:
            graphs[entry_key] = entry
    tokens, positions, cache_position, mask, unfinished, out, t, source_rows, shared_slots = entry.state
    tokens.copy_(first.view(batch, 1))
    positions.copy_(position_ids)
    cache_position.fill_(prompt)
    mask.copy_(key_mask.bool())
    unfinished.copy_(~eos_hit(first, s))
    out.fill_(s.pad)
    out[:, 0] = first
    t.fill_(1)
    shared = source is not None and SHARE_PROMPT
    if shared:
        source_rows.copy_(source)
    else:
        torch.arange(batch, out=source_rows)
    shared_slots.fill_(prompt if shared else 0)
    args = (*decoder.args, keys, values, tokens, positions, cache_position, mask, unfinished, out, t, source_rows,
            shared_slots)
    stats.calls += 1
    done = 0
    if use_graph:
        addresses = _addresses(_flat(decoder.args) + keys + values)
        if entry.graph is None or entry.addresses != addresses:
            started = time.perf_counter()
            try:
                entry.graph, entry.pool_bytes = _capture(step, args, per_graph,
                                                         entry.pool_bytes or stats.graph_pool_bytes)
                entry.addresses, stats.graph_pool_bytes = addresses, entry.pool_bytes
                done = 1
                stats.captures += 1
            except Exception as exc:  # noqa: BLE001 - a graph is a speed-up: decode step by step instead
                entry.graph = None
                graphs.pop(entry_key, None)
                graphs[_FAILED] = True  # not again over these caches (the pool's release forgets it)
                stats.capture_errors.append(repr(exc)[:300])
                warn_once(f"capture:{type(exc).__name__}", "grpo_patches fast_generation: the fused decode loop "
                          f"could not be captured as a CUDA graph ({exc!r}); decoding step by step.")
                return _stepwise(step, args, n_steps, chunk, unfinished, out, t)
            finally:
                stats.capture_seconds += time.perf_counter() - started
        while done < n_steps:
            replays = -(-min(chunk, n_steps - done) // per_graph)  # the graphs up to the next check, or the end
            for _ in range(replays):
                entry.graph.replay()
            stats.replays += 1
            done += replays * per_graph
            if done < n_steps and not bool(unfinished.any()):
                break
        return out, min(done, n_steps)
    return _stepwise(step, args, n_steps, chunk, unfinished, out, t)


def _graphs_on(device: torch.device) -> bool:
    """Whether the loop captures CUDA graphs on ``device``."""
    return device.type == "cuda"


def _captures(graphs: dict | None, device: torch.device) -> bool:
    """Whether the loop captures over these caches: graphs kept (the pool's), on a device with graphs, and no
    capture over them failed."""
    return graphs is not None and _graphs_on(device) and _FAILED not in graphs


def _stepwise(step: Callable, args: tuple, n_steps: int, chunk: int, unfinished: torch.Tensor,
              out: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Token by token, the host checking for the end every ``chunk`` steps (CPU, or no graph)."""
    done = int(t.item()) - 1
    while done < n_steps:
        step(*args)
        done += 1
        if done % chunk == 0 and not bool(unfinished.any()):
            break
    return out, done


_SIDE: dict[int, Any] = {}  # device index -> the side stream every capture on it runs on


def _side_stream() -> Any:
    """The current device's capture stream, made once. A matmul on a stream gets a cuBLAS workspace (32 MiB on
    Hopper, plus cuBLASLt's) that PyTorch keeps per (handle, stream) until the process ends: a new stream per
    capture held 33 MiB more after every sampling round (1.5B policy, 1024 rows, H100 and H200)."""
    device = torch.cuda.current_device()
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream()
    return _SIDE[device]


def make_room(graphs: dict | None, device: torch.device, stats: FusedLoopStats) -> None:
    """Before a round's prefill, where the loop will capture (``graphs``: as :func:`fused_decode` takes them):
    empty the allocator's cache where less than the pool the last capture took or a quarter of the memory the
    process may use (``_room``) is left.

    The capture's private pool cannot use cached blocks, and long-lived tensors allocated into the training
    phase's cached segments can fragment them (under a 24 GiB cap at batch 256, lean_lora + keep_graph ran out
    of memory with the cache kept, where the same options had fit with it emptied at every capture; that run
    changed one other thing too, so the cause is not separated). Emptied here, before the round's caches and
    prefill allocate, ``cudaFree``'s wait for the device covers only what came before the round (the merged
    buffer's fill); at the capture it would wait for the whole prefill. Not the ``torch.cuda.graph`` context's
    flush at every capture: that handed each freed block (the released caches and merged buffer, the training
    phase's activations) back to the driver where memory was plentiful too, so the next round's caches came
    back at other addresses (a kept graph captured again) and the training phase allocated from the driver
    again (H200, 1.5B, batch 8: the training phase took 0.46-0.48 s with the cache emptied at every capture,
    0.35 s, stock's, with it kept).
    """
    if not _captures(graphs, device):
        return
    room, allowed = _room()
    if room < max(stats.graph_pool_bytes, allowed // 4):
        torch.cuda.empty_cache()


def _capture(step: Callable, args: tuple, chunk: int, need: int = 0) -> tuple[Any, int]:
    """One real step on a side stream (compilation, lazy initialization), then ``chunk`` steps captured
    on it; returns the graph and the memory reserved during the capture (its private pool). ``need``: the
    pool an earlier capture of this entry (or, for a new entry, the last capture) took; 0: none yet.

    Nothing here waits for the device unless memory is short: the host records the graph (~12 ms of host time
    per captured step of a 1.5B model) while the device still runs the prefill and the real step, which the
    replays then follow on the current stream; waiting first left the device idle for the whole recording
    (196 ms a round at 16 steps). The cache (``make_room`` ran before the prefill) is emptied here only where
    ``need`` no longer fits, and after a capture that ran out of memory, which is then tried once more.
    """
    side = _side_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(*args)
    if _room()[0] < need:
        torch.cuda.empty_cache()
    try:
        return _record(step, args, chunk, side)
    except torch.cuda.OutOfMemoryError:
        pass  # again outside this block: its traceback holds the failed graph, and so its pool
    torch.cuda.empty_cache()
    return _record(step, args, chunk, side)


def _record(step: Callable, args: tuple, chunk: int, side: Any) -> tuple[Any, int]:
    graph = torch.cuda.CUDAGraph()
    reserved = torch.cuda.memory_reserved()
    with torch.cuda.stream(side):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            for _ in range(chunk):
                step(*args)
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    return graph, torch.cuda.memory_reserved() - reserved


def _room() -> tuple[int, int]:
    """``(room, allowed)``: the bytes the allocator can still take from the device (free memory, within the
    process's memory fraction: ``torch.cuda.set_per_process_memory_fraction``, e.g. a benchmark's cap) and
    the bytes that fraction allows in all."""
    free, total = torch.cuda.mem_get_info()
    allowed = int(getattr(torch.cuda, "get_per_process_memory_fraction", lambda: 1.0)() * total)
    return int(min(free, allowed - torch.cuda.memory_reserved())), allowed
