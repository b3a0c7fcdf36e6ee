"""The public fast path: the per-call generation config, the sampling context, the state a trainer
carries, and :func:`fast_generate` (``model.generate`` the way the trainer adapters run it)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .cache import StaticCachePool
from .config import (
    FastGenerationConfig,
    cache_length,
    compile_config,
    compile_decision,
    split_devices,
    warn_once,
)
from .decode import GRAPH_STATS, GraphDecodeStats, call_generate
from .merged import MergedLoRAWeights
from .modes import hidden_require_grad_hooks, left_pad, sampling_mode

__all__ = ["FastGenerationState", "build_generation_config", "fast_generate", "sampling"]

_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # fast_generate's caches, per model
_MERGED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # fast_generate's merged buffers, per model


def build_generation_config(base: Any, config: FastGenerationConfig, *, prompt_length: int,
                            device: torch.device | str, compiled: bool) -> Any:
    """A copy of ``base`` (TRL's ``GenerationConfig``) for fast sampling; ``base`` is not modified."""
    gc = copy.deepcopy(base)
    if not compiled:
        return gc  # eager: keep TRL's cache (a dynamic cache is the faster one without compilation)
    max_new = gc.max_new_tokens if gc.max_new_tokens is not None else max(gc.max_length - prompt_length, 1)
    gc.cache_implementation = "static"
    gc.disable_compile = False
    gc.compile_config = compile_config(config, torch.device(device))
    gc.max_cache_len = max(cache_length(prompt_length, max_new, config), getattr(gc, "max_cache_len", None) or 0)
    return gc


@contextlib.contextmanager
def sampling(model: nn.Module, config: FastGenerationConfig, *, compiled: bool,
             merged: MergedLoRAWeights | None) -> Iterator[int]:
    """Dropout off (if configured), for compiled decoding gradient checkpointing's hooks hidden, and
    (``merge_lora``) the merged-weight buffer in place of the adapters; yields the merged layer count."""
    hooks = hidden_require_grad_hooks(model) if compiled else contextlib.nullcontext()
    with sampling_mode(model, config.dropout_off_while_sampling), hooks:
        if merged is None or not config.merge_lora:
            yield 0
            return
        with merged.applied(model) as layers:
            yield layers


def graphs_compiled() -> int:
    """Dynamo's count of compiled graphs so far (recompilation detection)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # pragma: no cover
        return 0


@dataclass
class FastGenerationState:
    """What a trainer with fast generation carries (``trainer._grpo_patches_fast_generation``)."""

    config: FastGenerationConfig
    compiled: bool | None = None  # decided at the first call (the device is known then)
    reason: str = ""
    calls: int = 0
    graphs_compiled: int = 0  # dynamo graphs compiled during generation calls
    graphs_after_first_call: int = 0  # recompilations after warm-up (ideally 0)
    cache_length: int = 0  # the largest static cache length requested so far
    seconds: list[float] = field(default_factory=list)  # wall time of each generation call
    last_sampling_logprobs: list[list[float]] | None = None
    merged_layers: int = 0  # LoRA layers sampled from the merged buffer at the last call
    graph: GraphDecodeStats = field(default_factory=lambda: GraphDecodeStats())  # decode_loop="graph"
    pool: StaticCachePool = field(default_factory=StaticCachePool, repr=False)
    merged: MergedLoRAWeights = field(default_factory=MergedLoRAWeights, repr=False)
    _active: bool = False

    def release(self) -> None:
        """Give the caches and the merged buffer back to the allocator (between generation rounds)."""
        self.pool.release(keep_graphs=self.config.keep_graph)
        self.merged.release()

    def summary(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for key in ("_active", "last_sampling_logprobs", "pool", "merged"):
            d.pop(key, None)
        d["graph"] = dataclasses.asdict(self.graph)
        d["caches_built"] = self.pool.built
        d["merged_buffer"] = {"allocations": self.merged.allocations, "moves": self.merged.moves,
                              "refreshes": self.merged.refreshes}
        d["config"] = {k: (v if isinstance(v, str | int | float | bool | type(None)) else repr(v))
                       for k, v in dataclasses.asdict(self.config).items()}
        return d


def fast_generate(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                  generation_config: Any = None, config: FastGenerationConfig | None = None,
                  logits_processor: Any = None, **kwargs: Any) -> torch.Tensor:
    """``model.generate`` the way the trainer wrapper runs it (standalone: benchmarks, tests).

    ``generation_config`` defaults to the model's; the fast copy gets the static cache, compile
    settings and the bucketed cache length; sampling runs in eval mode, flags restored, from the
    merged-weight buffer (``merge_lora``). With ``config.decode_loop="graph"`` (and compiled
    decoding) the graph loop runs instead of ``model.generate`` where it supports the call
    (counters: ``GRAPH_STATS``). ``release_after_sampling`` frees the caches and the buffer after.
    """
    config = config or FastGenerationConfig()
    base = generation_config if generation_config is not None else model.generation_config
    device = next(model.parameters()).device
    compiled, reason = compile_decision(device, config, split=split_devices(model))
    if not compiled:
        warn_once(f"eager:{reason}", f"grpo_patches fast_generation: decoding runs eagerly ({reason}).")
    if config.pad_prompts:
        input_ids, attention_mask = left_pad(input_ids, attention_mask, config.bucket,
                                             pad_token_id=base.pad_token_id or 0)
    gc = build_generation_config(base, config, prompt_length=input_ids.shape[1], device=device, compiled=compiled)
    pool = _POOLS.setdefault(model, StaticCachePool()) if compiled else None
    if compiled:
        gc.max_cache_len = pool.grow(gc.max_cache_len)
        if config.reuse_cache or kwargs.get("past_key_values") is not None:
            gc.cache_implementation = None  # transformers refuses both a cache and an implementation
    merged = _MERGED.setdefault(model, MergedLoRAWeights())
    generate = call_generate(model, pool, config, GRAPH_STATS, graph=compiled and config.decode_loop == "graph")
    try:
        with sampling(model, config, compiled=compiled, merged=merged), torch.no_grad():
            return generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=gc,
                            logits_processor=logits_processor, **kwargs)
    finally:
        if config.release_after_sampling:
            merged.release()
            if pool is not None:
                pool.release(keep_graphs=config.keep_graph)
