"""The options of fast generation, checked at construction, and the compile decision."""

from __future__ import annotations

import difflib
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

__all__ = ["DECODE_ATTENTIONS", "DECODE_LOOPS", "FAST_GEN_ATTR", "FastGenerationConfig", "cache_length", "compile_decision", "split_devices"]

FAST_GEN_ATTR = "_grpo_patches_fast_generation"
COMPILE_DEVICES = ("cuda", "xpu")
DECODE_LOOPS = ("transformers", "graph")
DECODE_ATTENTIONS = ("auto", "kernel", "matmul")
_warned: set[str] = set()
_warn_lock = threading.Lock()

_BOOLS = ("pad_prompts", "dropout_off_while_sampling", "compile", "force_compile", "fullgraph", "reuse_cache",
          "record_sampling_logprobs", "merge_lora", "release_after_sampling", "fused_decode", "keep_graph")


@dataclass(frozen=True)
class FastGenerationConfig:
    """Options of ``apply(fast_generation=...)``; ``True`` means ``FastGenerationConfig()``.

    Attributes:
        bucket: the static cache length is ``round_up(prompt_length, bucket) + max_new_tokens``;
            decoding recompiles at most once per bucket a prompt first reaches.
        max_prompt_length: size the cache for prompts up to this length from the first call on (no
            recompilation at all below it); longer prompts still work (one recompilation).
        pad_prompts: also left-pad the prompt tensors to a multiple of ``bucket``.
        dropout_off_while_sampling: sample with the policy in eval mode (restored afterwards).
        compile: compile decoding where it is supported (CUDA/XPU); ``False``: always eager.
        force_compile: compile on any device, CPU included (tests, debugging).
        backend, mode, fullgraph, dynamic, options: the ``transformers.CompileConfig`` (``mode`` is
            ignored for a backend other than inductor).
        reuse_cache: keep one static cache per (batch, cache length) and reset it in place for every
            call, so the compiled step (and its CUDA graph) sees the same cache addresses each step;
            ``False``: transformers allocates a new static cache per call.
        record_sampling_logprobs: keep the log-probabilities (after temperature, before top-k/top-p
            truncation: TRL's recomputation's semantic) of the sampled tokens on the trainer's state
            (``last_sampling_logprobs``). Diagnostic only: TRL's regular path is still given ``None``.
            Runs on the ``"transformers"`` decode loop only (``"graph"`` falls back to it).
        decode_loop: ``"transformers"``: transformers' ``generate`` runs the loop (compiled forward,
            eager sampling); ``"graph"``: one compiled step per token that also samples and keeps the
            EOS bookkeeping, the host checking for the end only every ``check_every`` steps
            (compiled decoding and a plain temperature/top-k/top-p or greedy config only; anything
            else falls back to ``"transformers"``, with one warning).
        check_every: ``decode_loop="graph"``: decode steps between host checks of "every row ended".
        graph_steps: the fused loop's decode steps per captured CUDA graph, a divisor of ``check_every``
            (the graph is replayed ``check_every / graph_steps`` times between checks); ``None``:
            ``check_every``. A capture runs each captured step's host code once, while the device idles
            once the prefill is done: 1 (the default) records in ~12 ms what 16 steps take ~196 ms for
            (1.5B, 1024 rows), and a replay costs one graph launch per step.
        merge_lora: sample from a separate buffer holding ``W + scaling * B @ A`` of every plain LoRA
            linear layer (computed in fp32 once per call, so always from the current adapter), so
            decoding runs base-shaped matmuls only; the base weights are never written. ``False``:
            the adapter's two matmuls run in every projection at every token.
        release_after_sampling: free the static KV caches and the merged-weight buffer after each
            call, so the training phase has that memory back (the next call allocates them again).
        fused_decode: ``decode_loop="graph"``: decode with the kit's own step for Llama / Qwen2 /
            Mistral-shaped policies (q/k/v and gate/up as one matmul each over the merged buffer,
            attention without ``repeat_kv``) and, on CUDA, ``graph_steps`` steps per CUDA graph.
            Taken only where every projection is a plain linear map at sampling time (the merged
            buffer, or no adapter); otherwise, or with ``False``, the model's own forward runs.
        keep_graph: with ``release_after_sampling``, keep the fused loop's captured CUDA graph (its
            private memory holds one decode step's activations, about ``batch x vocab x 2`` bytes)
            while the caches and the buffer are freed; the next call replays it if they come back at
            the same addresses (the allocator usually hands the same blocks back), and captures anew
            if any moved. ``False`` (default): the graph goes with the caches and every call captures
            again (~0.12 s of host time per call on the 1.5B H200 step at batch 8).
        decode_attention: the fused step's attention. ``"matmul"``: two batched matmuls and an fp32
            softmax over the whole static cache; ``"kernel"``: one Triton kernel
            (``generation/decode_attention.py``) that reads only the slots up to the new token's,
            wherever it runs (CUDA with Triton installed, or CPU under ``TRITON_INTERPRET=1``; elsewhere
            the matmul path); ``"auto"`` (default): the kernel on CUDA from
            ``decode_attention.KERNEL_MIN_BATCH`` rows on, the matmul path below and on CPU.
    """

    bucket: int = 64
    max_prompt_length: int | None = None
    pad_prompts: bool = False
    dropout_off_while_sampling: bool = True
    compile: bool = True
    force_compile: bool = False
    backend: str | Callable = "inductor"
    mode: str | None = "reduce-overhead"
    fullgraph: bool = False
    dynamic: bool | None = False
    options: dict | None = None
    reuse_cache: bool = True
    record_sampling_logprobs: bool = False
    decode_loop: str = "graph"
    check_every: int = 16
    graph_steps: int | None = 1
    merge_lora: bool = True
    release_after_sampling: bool = True
    fused_decode: bool = True
    keep_graph: bool = False
    decode_attention: str = "auto"

    def __post_init__(self) -> None:
        for name in _BOOLS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                hint = (f" (a non-empty string is truthy: {value!r} would mean True)" if isinstance(value, str)
                        else "")
                raise TypeError(f"FastGenerationConfig: {name}={value!r} must be True or False{hint}; pass "
                                f"{name}=True or {name}=False.")
        if not isinstance(self.decode_loop, str) or self.decode_loop not in DECODE_LOOPS:
            raise ValueError(f"FastGenerationConfig: decode_loop={self.decode_loop!r} must be one of {DECODE_LOOPS}.")
        if not isinstance(self.decode_attention, str) or self.decode_attention not in DECODE_ATTENTIONS:
            raise ValueError(f"FastGenerationConfig: decode_attention={self.decode_attention!r} must be one of "
                             f"{DECODE_ATTENTIONS}.")
        for name in ("bucket", "check_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"FastGenerationConfig: {name}={value!r} must be a positive integer, e.g. "
                                 f"{name}={getattr(type(self), name)}.")
        steps = self.graph_steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1
                                  or self.check_every % steps):
            raise ValueError(f"FastGenerationConfig: graph_steps={steps!r} must be None or a positive divisor of "
                             f"check_every={self.check_every} (e.g. graph_steps=1).")
        mpl = self.max_prompt_length
        if mpl is not None and (isinstance(mpl, bool) or not isinstance(mpl, int) or mpl < 1):
            raise ValueError(f"FastGenerationConfig: max_prompt_length={mpl!r} must be None or a positive integer "
                             f"(the longest prompt in tokens).")
        if not (isinstance(self.backend, str) or callable(self.backend)):
            raise TypeError(f"FastGenerationConfig: backend={self.backend!r} must be a torch.compile backend name "
                            f"(e.g. 'inductor') or a backend callable.")
        if self.mode is not None and not isinstance(self.mode, str):
            raise TypeError(f"FastGenerationConfig: mode={self.mode!r} must be None or a torch.compile mode name "
                            f"(e.g. 'reduce-overhead').")
        if self.dynamic is not None and not isinstance(self.dynamic, bool):
            raise TypeError(f"FastGenerationConfig: dynamic={self.dynamic!r} must be None, True or False.")
        if self.options is not None and not isinstance(self.options, dict):
            raise TypeError(f"FastGenerationConfig: options={self.options!r} must be None or a dict of inductor "
                            f"options.")

    @classmethod
    def coerce(cls, value: Any) -> FastGenerationConfig | None:
        """``False``/``None`` -> None, ``True`` -> defaults, a dict -> fields, a config -> itself."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            known = {f.name for f in fields(cls)}
            for key in value:
                if key not in known:
                    close = difflib.get_close_matches(str(key), sorted(known), n=3)
                    hint = f" Did you mean {' or '.join(close)}?" if close else f" Fields: {', '.join(sorted(known))}."
                    raise TypeError(f"fast_generation: {key!r} is not a FastGenerationConfig field.{hint}")
            return cls(**value)
        raise TypeError(
            f"fast_generation={value!r}: expected a bool, a dict of FastGenerationConfig fields or a "
            f"FastGenerationConfig."
        )


def warn_once(key: str, message: str) -> None:
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def split_devices(model: Any) -> list[str]:
    """The devices a layer-split policy (``device_map`` over several devices: ``hf_device_map`` on the
    model or a wrapped submodule) spans; [] when it lives on one."""
    for module in model.modules() if hasattr(model, "modules") else ():
        devices = {str(d) for d in (getattr(module, "hf_device_map", None) or {}).values()}
        if len(devices) > 1:
            return sorted(devices)
    return []


def compile_decision(device: torch.device | str, config: FastGenerationConfig, *,
                     sharded: str | None = None, split: Sequence[str] = ()) -> tuple[bool, str]:
    """Whether decoding is compiled on ``device``, and why not when it is not. ``split``: the devices
    of a layer-split policy (:func:`split_devices`)."""
    device = torch.device(device)
    if not config.compile:
        return False, "compile=False"
    if sharded is not None:
        return False, f"{sharded} gathers parameters for every generation call"
    if len(split) > 1:
        return False, (f"the policy is split over {', '.join(split)} (device_map): the compiled static-cache "
                       "decode needs the whole model on one device")
    if not hasattr(torch, "compile"):
        return False, "this torch has no torch.compile"
    try:
        import torch._dynamo as dynamo

        if not dynamo.is_dynamo_supported():
            return False, "torch.compile (dynamo) is not supported on this Python/platform"
    except Exception as exc:  # pragma: no cover - exotic installs
        return False, f"torch._dynamo is unavailable ({exc})"
    if device.type not in COMPILE_DEVICES and not config.force_compile:
        return False, f"the policy is on {device.type} (compiled decoding targets CUDA; force_compile=True compiles anyway)"
    return True, ""


def compile_config(config: FastGenerationConfig, device: torch.device):
    """The ``transformers.CompileConfig`` of the transformers decode loop."""
    from transformers import CompileConfig

    mode = config.mode if config.backend == "inductor" else None
    cc = CompileConfig(fullgraph=config.fullgraph, dynamic=config.dynamic, backend=config.backend, mode=mode,
                       options=config.options)
    if device.type not in COMPILE_DEVICES:
        cc._compile_all_devices = True  # transformers' own switch for compiling on e.g. CPU
    return cc


def cache_length(prompt_length: int, max_new_tokens: int, config: FastGenerationConfig) -> int:
    """The static cache length for a (padded) prompt length: bucketed, so it repeats across steps."""
    longest = max(prompt_length, config.max_prompt_length or 0)
    return round_up(longest, config.bucket) + max_new_tokens
