"""The public fast path: the per-call generation config, the sampling context, the state a trainer
carries, and :func:`fast_generate` (``model.generate`` the way the trainer adapters run it)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .cache import StaticCachePool, brought_cache
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
from .modes import SampledLogprobs, hidden_require_grad_hooks, left_pad, sampling_mode

__all__ = ["FastCall", "FastGenerationState", "build_generation_config", "fast_call", "fast_generate", "sampling"]

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


@dataclass
class FastCall:
    """What one fast sampling call runs with (yielded by :func:`fast_call`)."""

    generation_config: Any  # the fast copy of the trainer's / model's GenerationConfig
    generate: Callable  # ``model.generate`` for this call: the graph loop or transformers' loop
    recorder: SampledLogprobs | None  # the sampled-log-prob recorder (``record=True`` only)


@contextlib.contextmanager
def fast_call(state: FastGenerationState, model: nn.Module, base: Any, *, device: torch.device | str,
              prompt_length: int, sharded: str | None = None, eager_note: str = "",
              record: bool = False) -> Iterator[FastCall]:
    """The steps every fast sampling call takes, whoever calls ``generate`` inside it.

    Before: the compile decision (once per state; eager warned once), the fast generation config
    (``base`` is not modified), the static cache length from ``state.pool``, the recorder
    (``record`` and ``record_sampling_logprobs``; the graph loop falls back to transformers' loop
    then), the sampling context (``sampling``). After: the caches released (``release_after_sampling``),
    and the counters on ``state``: calls, seconds, graphs compiled, and recompilations after the
    first call (warned once per cache length).
    """
    config = state.config
    if state.compiled is None:
        state.compiled, state.reason = compile_decision(device, config, sharded=sharded,
                                                        split=split_devices(model))
    if not state.compiled:
        warn_once(f"eager:{state.reason}",
                  f"grpo_patches fast_generation: decoding runs eagerly ({state.reason}){eager_note}.")
    gen_config = build_generation_config(base, config, prompt_length=prompt_length, device=device,
                                         compiled=state.compiled)
    if state.compiled:
        state.cache_length = state.pool.grow(gen_config.max_cache_len)
        gen_config.max_cache_len = state.cache_length
        if config.reuse_cache:  # the pooled cache is fetched per call, in decode._pooled_generate
            gen_config.cache_implementation = None  # transformers refuses both a cache and an implementation
    recorder = SampledLogprobs(gen_config.temperature) if record and config.record_sampling_logprobs else None
    inject: dict[str, Any] = {}
    if recorder is not None:
        from transformers import LogitsProcessorList

        inject["logits_processor"] = LogitsProcessorList([recorder])
    graph = state.compiled and config.decode_loop == "graph"
    if graph and recorder is not None:
        graph = False
        state.graph.fallbacks += 1
        warn_once("graph-fallback:record", "grpo_patches fast_generation: decode_loop='graph' falls back to "
                  "transformers' loop (record_sampling_logprobs=True).")
    generate = call_generate(model, state.pool if state.compiled else None, config, state.graph, graph=graph,
                             **inject)
    stack = contextlib.ExitStack()
    with stack:
        if config.release_after_sampling:
            stack.callback(state.release)  # runs last: after the sampling context put the weights back
        state.merged_layers = stack.enter_context(sampling(model, config, compiled=state.compiled,
                                                           merged=state.merged))
        state._active = True
        stack.callback(setattr, state, "_active", False)
        before, start = graphs_compiled(), time.perf_counter()
        yield FastCall(gen_config, generate, recorder)
        new_graphs = graphs_compiled() - before
    state.seconds.append(time.perf_counter() - start)
    state.graphs_compiled += new_graphs
    if state.calls > 0 and new_graphs:
        state.graphs_after_first_call += new_graphs
        warn_once(
            f"recompile:{state.cache_length}",
            f"grpo_patches fast_generation: decoding was recompiled after warm-up (static cache length now "
            f"{state.cache_length}; a longer prompt or a new batch size). Set FastGenerationConfig("
            f"max_prompt_length=...) to size the cache once.",
        )
    state.calls += 1


def fast_generate(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                  generation_config: Any = None, config: FastGenerationConfig | None = None,
                  logits_processor: Any = None, state: FastGenerationState | None = None,
                  **kwargs: Any) -> torch.Tensor:
    """``model.generate`` through :func:`fast_call` (the vendored trainer's sampling; benchmarks, tests).

    ``generation_config`` defaults to the model's; the fast copy gets the static cache, compile
    settings and the bucketed cache length; sampling runs in eval mode, flags restored, from the
    merged-weight buffer (``merge_lora``). With ``config.decode_loop="graph"`` (and compiled
    decoding) the graph loop runs instead of ``model.generate`` where it supports the call.
    ``release_after_sampling`` frees the caches and the buffer after. ``state``: a trainer's
    (its caches, buffer and counters, ``config`` ignored); without it, the model's own caches and
    buffer, one compile decision per call, and the counters in ``GRAPH_STATS``.
    """
    if state is None:
        state = FastGenerationState(config or FastGenerationConfig(), pool=_POOLS.setdefault(model, StaticCachePool()),
                                    merged=_MERGED.setdefault(model, MergedLoRAWeights()), graph=GRAPH_STATS)
    config = state.config
    base = generation_config if generation_config is not None else model.generation_config
    if config.pad_prompts:
        input_ids, attention_mask = left_pad(input_ids, attention_mask, config.bucket,
                                             pad_token_id=base.pad_token_id or 0)
    with fast_call(state, model, base, device=next(model.parameters()).device,
                   prompt_length=input_ids.shape[1]) as call, torch.no_grad():
        if state.compiled and brought_cache(kwargs):
            call.generation_config.cache_implementation = None  # the call brings its own cache
        return call.generate(input_ids=input_ids, attention_mask=attention_mask,
                             generation_config=call.generation_config, logits_processor=logits_processor, **kwargs)
