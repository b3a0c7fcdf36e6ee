"""The graph decode loop (``decode_loop="graph"``): an eager prefill into a pooled static cache (once per run
of repeated prompts, as TRL lays out a prompt's G copies: ``repeated_rows``), then one compiled step per token
that runs the forward, transformers' temperature / top-k / top-p warping, the sample (inverse CDF, one uniform
per row) or greedy pick and the EOS bookkeeping on fixed shapes, the host checking for the end only every
``check_every`` steps. For Llama / Qwen2 / Mistral-shaped policies the step is the kit's fused one, captured
as CUDA graphs of ``graph_steps`` steps (``fused``, ``fused_loop``); otherwise the model's own forward runs in
the step, one CUDA-graph replay per token. A config it does not implement goes to transformers' loop with one
warning: a silently different sampler would be worse than a slower one."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .cache import CACHE_ARGS, StaticCachePool, brought_cache
from .config import FastGenerationConfig, cache_length, warn_once
from .fused import FusedDecoder
from .fused_loop import FusedLoopStats, fused_decode, make_room
from .sampler import Sampler as _Sampler
from .sampler import eos_hit as _eos_hit
from .sampler import pick as _pick
from .sampler import warp as _warp

__all__ = ["GRAPH_STATS", "GraphDecodeStats", "call_generate", "graph_decode_support"]

# generate() arguments the graph loop accepts only when unset (None / False)
_GENERATE_ARGS = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "synced_gpus",
                  "assistant_model", "streamer", "negative_prompt_ids", "negative_prompt_attention_mask",
                  "use_model_defaults", "custom_generate", "assistant_tokenizer", "tokenizer")
# generation-config fields the graph loop does not implement: each must hold one of its neutral values
_NEUTRAL: dict[str, tuple] = {
    "min_length": (None, 0), "min_new_tokens": (None, 0), "max_time": (None,), "stop_strings": (None,),
    "num_beams": (None, 1), "use_mtp": (None, False), "use_cache": (None, True), "min_p": (None,),
    "top_h": (None,), "typical_p": (None, 1.0), "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0),
    "repetition_penalty": (None, 1.0), "encoder_repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0), "bad_words_ids": (None,), "renormalize_logits": (None, False),
    "forced_bos_token_id": (None,), "forced_eos_token_id": (None,), "remove_invalid_values": (None, False),
    "exponential_decay_length_penalty": (None,), "suppress_tokens": (None,), "begin_suppress_tokens": (None,),
    "sequence_bias": (None,), "token_healing": (None, False), "guidance_scale": (None, 1.0),
    "watermarking_config": (None,), "num_return_sequences": (None, 1), "output_attentions": (None, False),
    "output_hidden_states": (None, False), "output_scores": (None, False), "output_logits": (None, False),
    "return_dict_in_generate": (None, False), "encoder_no_repeat_ngram_size": (None, 0),
    "prompt_lookup_num_tokens": (None,), "assistant_early_exit": (None,), "penalty_alpha": (None,),
    "dola_layers": (None,), "diversity_penalty": (None, 0.0), "num_beam_groups": (None, 1),
    "constraints": (None,), "force_words_ids": (None,), "prefill_chunk_size": (None,),
    "speculation_type": (None,), "is_assistant": (None, False),
}


def _make_step(s: _Sampler, name: str) -> Callable:
    def graph_decode_step(model, cache, tokens, position_ids, cache_position, attention_mask, unfinished):
        out = model(input_ids=tokens, attention_mask=attention_mask, position_ids=position_ids,
                    cache_position=cache_position, use_cache=True, **{name: cache})
        nxt = _pick(_warp(out.logits[:, -1, :], s), s)
        nxt = torch.where(unfinished, nxt, torch.full_like(nxt, s.pad))
        return nxt, unfinished & ~_eos_hit(nxt, s)

    return graph_decode_step


_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(sampler, compile key): step}


def _uses_cudagraphs(config: FastGenerationConfig) -> bool:
    if config.backend != "inductor":
        return False
    if config.options:
        return bool(config.options.get("triton.cudagraphs"))
    return config.mode in ("reduce-overhead", "max-autotune")


def _compiled_step(model: nn.Module, s: _Sampler, config: FastGenerationConfig) -> Callable:
    kwargs: dict[str, Any] = dict(backend=config.backend, fullgraph=config.fullgraph, dynamic=config.dynamic)
    if config.backend == "inductor":  # torch.compile takes a mode or options, not both
        if config.options:
            kwargs["options"] = config.options
        elif config.mode:
            kwargs["mode"] = config.mode
    key = (s, config.backend, kwargs.get("mode"), repr(kwargs.get("options")), config.fullgraph, config.dynamic)
    steps = _STEPS.setdefault(model, {})
    if key not in steps:
        steps[key] = torch.compile(_make_step(s, cache_arg(model)), **kwargs)
    return steps[key]


def _as_ints(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        return tuple(int(v) for v in value.flatten().tolist())
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def graph_decode_support(model: nn.Module, generation_config: Any, prompt_length: int,
                         kwargs: dict[str, Any]) -> tuple[_Sampler | None, int, str]:
    """``(sampler, max_new_tokens, "")`` if the graph loop implements this ``generate`` call exactly,
    else ``(None, 0, why)``. ``kwargs``: the call's other arguments (model inputs, processors...)."""
    kwargs = dict(kwargs)
    for name in _GENERATE_ARGS:
        value = kwargs.pop(name, None)
        if value is not None and value is not False and not (hasattr(value, "__len__") and len(value) == 0):
            return None, 0, f"generate(..., {name}=...) is not supported"
    try:
        gc, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    except Exception as exc:  # noqa: BLE001 - whatever transformers refuses, its own path reports
        return None, 0, f"the generation config could not be resolved ({exc})"
    model_kwargs = {k: v for k, v in model_kwargs.items() if v is not None and k != "use_cache"}
    if model_kwargs:
        return None, 0, f"generate arguments {sorted(model_kwargs)} are not supported"
    for name, neutral in _NEUTRAL.items():
        value = getattr(gc, name, None)
        if not any(value is n or (n is not None and value == n) for n in neutral):
            return None, 0, f"generation_config.{name}={value!r} is not supported"
    if gc.max_new_tokens is not None:
        max_new = int(gc.max_new_tokens)
    elif gc.max_length is not None:
        max_new = int(gc.max_length) - prompt_length
    else:
        return None, 0, "no max_new_tokens / max_length"
    if max_new < 1:
        return None, 0, f"max_new_tokens={max_new}"
    eos = _as_ints(gc.eos_token_id)
    pad = gc.pad_token_id
    if pad is None:
        if not eos:
            return None, 0, "neither pad_token_id nor eos_token_id is set"
        pad = eos[0]
    do_sample = bool(gc.do_sample)
    temperature = float(gc.temperature) if do_sample and gc.temperature is not None else 1.0
    top_k = int(gc.top_k) if do_sample and gc.top_k else 0
    top_p = float(gc.top_p) if do_sample and gc.top_p is not None else 1.0
    if do_sample and temperature <= 0:
        return None, 0, f"temperature={temperature}"
    return _Sampler(do_sample, temperature, top_k, top_p, eos, int(pad)), max_new, ""


@dataclass
class GraphDecodeStats:
    """Counters of the graph decode loop (per trainer state, or module-wide for ``fast_generate``)."""

    calls: int = 0  # generate calls the graph loop ran
    fallbacks: int = 0  # calls sent to the transformers loop (unsupported config)
    steps: int = 0  # compiled decode steps run
    last_reason: str = ""
    fused: FusedLoopStats = field(default_factory=FusedLoopStats)  # the fused step's loop (fused_decode)


GRAPH_STATS = GraphDecodeStats()  # fast_generate's counters


def _forward_params(model: nn.Module) -> Mapping[str, Any]:
    """The parameters of ``model``'s forward (a PEFT model's base model's)."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        return inspect.signature(base.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return {}


def cache_arg(model: nn.Module) -> str:
    """The name ``model``'s forward and its ``generate`` take the KV cache by (see ``CACHE_ARGS``)."""
    return "cache" if "cache" in _forward_params(model) else "past_key_values"


def _prefill(model: nn.Module, cache: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
             s: _Sampler, max_new: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The eager prefill into ``cache``: ``(first sampled token [B], key mask [B, L], the first new
    token's position [B, 1], source)``; ``source[b]``: the first row of row ``b``'s prompt, whose prompt slots
    row ``b``'s equal (each distinct prompt prefilled once and copied), or None where every row was prefilled
    on its own."""
    batch, prompt = input_ids.shape
    device = input_ids.device
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    length = cache.layers[0].max_cache_len if getattr(cache, "layers", None) else None
    if length is None or length < prompt + max_new - 1:
        raise ValueError(f"static cache of length {length} for {prompt} + {max_new} tokens")
    mask = torch.ones(batch, length, dtype=attention_mask.dtype, device=device)
    mask[:, :prompt] = attention_mask
    positions = attention_mask.long().cumsum(-1) - 1
    positions = positions.masked_fill(attention_mask == 0, 1)
    # the last position as an index tensor, not ``1``: transformers slices ``hidden[:, -1:, :]``, a strided view
    # that the LM head's matmul runs as a batched one, every row reading the whole head weight (155 ms at 1024
    # rows of a 152k vocabulary on an H100, against 0.7 ms); an index tensor gathers a contiguous copy instead
    extra = {"logits_to_keep": torch.tensor([prompt - 1], device=device)} if "logits_to_keep" in _forward_params(model) else {}
    cache_position = torch.arange(prompt, device=device)
    rows = repeated_rows(input_ids, attention_mask)
    logits = None if rows is None else _prefill_distinct(model, cache, input_ids, attention_mask, positions,
                                                         cache_position, rows, extra)
    source = None if logits is None else rows[0][rows[1]]
    if logits is None:
        logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, cache_position=cache_position,
                       use_cache=True, **{cache_arg(model): cache}, **extra).logits[:, -1, :]
    return _pick(_warp(logits, s), s), mask, attention_mask.long().sum(-1, keepdim=True), source


def repeated_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(first, group)`` where rows repeat the row before them (ids and mask), as TRL's sampler lays out a
    prompt's G copies: ``first`` the index of each run's first row, ``group[i]`` the run of row ``i``; None
    where no row repeats. Waits for the device once (the number of distinct prompts sizes the prefill)."""
    starts = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    starts[1:] = (input_ids[1:] != input_ids[:-1]).any(-1) | (attention_mask[1:] != attention_mask[:-1]).any(-1)
    first = starts.nonzero().squeeze(1)
    if first.numel() == input_ids.shape[0]:
        return None
    return first, starts.long().cumsum(0) - 1


def _prefill_distinct(model: nn.Module, cache: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      positions: torch.Tensor, cache_position: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor],
                      extra: dict) -> torch.Tensor | None:
    """The prefill of each distinct prompt once (GRPO samples G completions per prompt: 1/G of the prefill's
    work), its keys and values then written to every row of ``cache`` that repeats it, through the cache's own
    ``update`` as the attention layers write them; returns the last position's logits of every row, or None
    (nothing written) where the model cached other layers than the static cache holds."""
    from transformers import DynamicCache

    first, group = rows
    distinct = DynamicCache()
    logits = model(input_ids=input_ids[first], attention_mask=attention_mask[first], position_ids=positions[first],
                   cache_position=cache_position, use_cache=True, **{cache_arg(model): distinct}, **extra).logits[:, -1, :]
    if len(distinct.layers) != len(cache.layers):
        return None
    for i, layer in enumerate(distinct.layers):
        cache.update(layer.keys[group], layer.values[group], i, {"cache_position": cache_position})
    return logits[group]


def _finish(input_ids: torch.Tensor, out: torch.Tensor, s: _Sampler, max_new: int,
            stats: GraphDecodeStats) -> torch.Tensor:
    """What ``generate`` returns: up to the step at which the last row ended (or max_new_tokens)."""
    out = out[:, :max_new]
    ended = _eos_hit(out, s)
    first_end = torch.where(ended.any(-1), ended.int().argmax(-1), max_new - 1)
    new = int(first_end.max()) + 1 if s.eos else max_new
    stats.calls += 1
    return torch.cat([input_ids, out[:, :new]], dim=1)


def _graph_decode(model: nn.Module, cache: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                  s: _Sampler, max_new: int, config: FastGenerationConfig, stats: GraphDecodeStats) -> torch.Tensor:
    """Prefill eagerly, then one compiled step of the model's own forward per token."""
    batch, prompt = input_ids.shape
    device = input_ids.device
    first, mask, position_ids, _ = _prefill(model, cache, input_ids, attention_mask, s, max_new)
    out = torch.full((batch, max_new), s.pad, dtype=input_ids.dtype, device=device)
    out[:, 0] = first
    tokens = first.view(batch, 1).to(input_ids.dtype)
    unfinished = ~_eos_hit(first, s)
    cache_position = torch.tensor([prompt], dtype=torch.long, device=device)
    step = _compiled_step(model, s, config)
    mark = torch.compiler.cudagraph_mark_step_begin if _uses_cudagraphs(config) else None
    for t in range(1, max_new):
        if mark is not None:
            mark()
        nxt, unf = step(model, cache, tokens, position_ids, cache_position, mask, unfinished)
        out[:, t].copy_(nxt)  # CUDA-graph outputs are overwritten by the next replay: copy now
        tokens.copy_(nxt.view(batch, 1))
        unfinished.copy_(unf)
        position_ids.add_(1)
        cache_position.add_(1)
        stats.steps += 1
        if t % config.check_every == 0 and not bool(unfinished.any()):
            break
    return _finish(input_ids, out, s, max_new, stats)


def _pooled_generate(model: nn.Module, pool: StaticCachePool | None, **kwargs: Any) -> Any:
    """``model.generate`` on the pool's cache for this batch (reset here, once per call), or on
    whatever cache the call brings or transformers builds (``pool=None``)."""
    if pool is not None and not brought_cache(kwargs):
        kwargs[cache_arg(model)] = pool.get(model, kwargs["input_ids"].shape[0])
    return type(model).generate(model, **kwargs)


def call_generate(model: nn.Module, pool: StaticCachePool | None, config: FastGenerationConfig,
                   stats: GraphDecodeStats, *, graph: bool, **inject: Any) -> Callable:
    """The ``generate`` one fast sampling call runs (``pool`` is None when decoding is not compiled):
    the graph loop, falling back to transformers' loop, or transformers' loop alone; transformers'
    loop decodes on the pooled cache when ``reuse_cache``."""
    plain = functools.partial(_pooled_generate, model, pool if pool is not None and config.reuse_cache else None,
                              **inject)
    if graph:
        return functools.partial(_graph_generate, model, pool=pool, config=config, stats=stats, fallback=plain)
    return plain


def _graph_generate(model: nn.Module, *, pool: StaticCachePool, config: FastGenerationConfig,
                    stats: GraphDecodeStats, fallback: Callable, input_ids: torch.Tensor | None = None,
                    attention_mask: torch.Tensor | None = None, generation_config: Any = None,
                    **kwargs: Any) -> Any:
    """``model.generate`` replacement for one call: the graph loop, or ``fallback`` (warned once).

    The loop prefills from position 0, so a call that brings its own cache (which may
    hold a prefix) goes to ``fallback``. Its cache is the pool's (``reuse_cache``: one reset per
    call) or a new static cache.
    """
    reason = ""
    if input_ids is None:
        reason = "no input_ids"
    elif brought := brought_cache(kwargs):
        reason = f"generate(..., {brought}=...) is not supported"
    else:
        s, max_new, reason = graph_decode_support(model, generation_config, input_ids.shape[1], kwargs)
    if reason:
        stats.fallbacks += 1
        stats.last_reason = reason
        warn_once(f"graph-fallback:{reason}",
                   f"grpo_patches fast_generation: decode_loop='graph' falls back to transformers' loop ({reason}).")
        return fallback(input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config,
                        **kwargs)
    for name in CACHE_ARGS:
        kwargs.pop(name, None)
    length = pool.grow(cache_length(input_ids.shape[1], max_new, config))
    if config.reuse_cache:
        cache = pool.get(model, input_ids.shape[0])
    else:
        from transformers import StaticCache

        cache = StaticCache(config=model.config, max_cache_len=length)
    with torch.no_grad():
        decoder, why = FusedDecoder.bind(model) if config.fused_decode else (None, "fused_decode=False")
        stats.fused.last_reason = why
        if decoder is None:
            if config.fused_decode:
                warn_once(f"unfused:{why}", "grpo_patches fast_generation: the fused decode step does not apply "
                          f"({why}); decoding with the model's own forward (slower, same tokens).")
            return _graph_decode(model, cache, input_ids, attention_mask, s, max_new, config, stats)
        return _fused_generate(model, decoder, cache, input_ids, attention_mask, s, max_new, config, stats,
                               pool.graphs if config.reuse_cache else None)


def _fused_generate(model: nn.Module, decoder: FusedDecoder, cache: Any, input_ids: torch.Tensor,
                    attention_mask: torch.Tensor | None, s: _Sampler, max_new: int, config: FastGenerationConfig,
                    stats: GraphDecodeStats, graphs: dict | None) -> torch.Tensor:
    """The prefill, then the fused step's loop (``fused_loop``); CUDA graphs only on the pool's cache."""
    make_room(graphs, input_ids.device, stats.fused)
    first, mask, positions, source = _prefill(model, cache, input_ids, attention_mask, s, max_new)
    out, steps = fused_decode(model, decoder, cache, first, mask, positions, input_ids.shape[1], s, max_new, config,
                              stats.fused, graphs, source)
    stats.steps += steps
    return _finish(input_ids, out, s, max_new, stats)
