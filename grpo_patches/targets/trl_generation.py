"""Fast generation inside TRL's ``GRPOTrainer`` (TRL >= 0.29: ``_generate_single_turn``).

The only module that knows how TRL generates: it wraps ``_generate_single_turn`` so that, for that
call, TRL's ``generation_config`` is the fast copy, TRL's ``unwrapped_model.generate`` is the graph
loop (or transformers' loop on the pooled static cache), and the policy samples in the kit's
sampling context (eval mode, checkpointing hooks hidden, merged LoRA buffer); afterwards the caches
and the buffer are released for the training phase (``release_after_sampling``).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from typing import Any

from ..generation import (
    FAST_GEN_ATTR,
    FastGenerationConfig,
    FastGenerationState,
    SampledLogprobs,
    build_generation_config,
    compile_decision,
    split_devices,
)
from ..generation.config import round_up, warn_once
from ..generation.decode import call_generate
from ..generation.fast import graphs_compiled, sampling

__all__ = ["enable_fast_generation", "wrap_generate"]


def _sharding(trainer: Any) -> str | None:
    if getattr(trainer, "is_deepspeed_enabled", False):
        return "DeepSpeed"
    if getattr(trainer, "is_fsdp_enabled", False):
        return "FSDP"
    return None


def _prompt_length(prompt_ids: Any, multiple: int | None) -> int:
    longest = max((len(p) for p in prompt_ids), default=1)
    return round_up(longest, multiple) if multiple else longest


@contextlib.contextmanager
def _patched_attr(obj: Any, name: str, value: Any) -> Iterator[None]:
    had = name in vars(obj)
    old = vars(obj).get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, old)
        else:
            delattr(obj, name)


def wrap_generate(wrapped, instance, args, kwargs):
    """wrapt wrapper for ``GRPOTrainer._generate_single_turn`` (TRL 1.16).

    Signature there: ``(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False)``.
    Only the regular transformers path is changed; trainers without fast generation enabled, vLLM
    and continuous batching run upstream's code untouched. ``decode_loop="graph"`` replaces TRL's
    ``unwrapped_model.generate`` for the call (counters on ``state.graph``).
    """
    state: FastGenerationState | None = getattr(instance, FAST_GEN_ATTR, None)
    if (state is None or state._active or getattr(instance, "use_vllm", False)
            or getattr(instance, "use_transformers_continuous_batching", False)):
        return wrapped(*args, **kwargs)
    prompt_ids = args[0] if args else kwargs["prompt_ids"]
    config = state.config
    model = instance.accelerator.unwrap_model(instance.model_wrapped)
    device = instance.accelerator.device
    if state.compiled is None:
        state.compiled, state.reason = compile_decision(device, config, sharded=_sharding(instance),
                                                        split=split_devices(model))
    if not state.compiled:
        warn_once(
            f"eager:{state.reason}",
            f"grpo_patches fast_generation: decoding runs eagerly ({state.reason}); sampling still runs "
            f"with dropout off{' and bucketed prompts' if config.pad_prompts else ''}.",
        )
    trl_multiple = instance.pad_to_multiple_of
    multiple = trl_multiple
    if config.pad_prompts:
        multiple = math.lcm(trl_multiple or 1, config.bucket)
    prompt_length = _prompt_length(prompt_ids, multiple)
    gen_config = build_generation_config(instance.generation_config, config, prompt_length=prompt_length,
                                         device=device, compiled=state.compiled)
    inject: dict[str, Any] = {}
    if state.compiled:
        state.cache_length = state.pool.grow(gen_config.max_cache_len)
        gen_config.max_cache_len = state.cache_length
        if config.reuse_cache:  # the pooled cache is fetched per call, in decode._pooled_generate
            gen_config.cache_implementation = None  # transformers refuses both a cache and an implementation
    recorder = SampledLogprobs(gen_config.temperature) if config.record_sampling_logprobs else None
    if recorder is not None:
        from transformers import LogitsProcessorList

        inject["logits_processor"] = LogitsProcessorList([recorder])
    graph = state.compiled and config.decode_loop == "graph"
    if graph and recorder is not None:
        graph = False
        state.graph.fallbacks += 1
        warn_once("graph-fallback:record", "grpo_patches fast_generation: decode_loop='graph' falls back to "
                  "transformers' loop (record_sampling_logprobs=True).")

    stack = contextlib.ExitStack()
    with stack:
        if config.release_after_sampling:
            stack.callback(state.release)  # runs last: after the sampling context put the weights back
        stack.enter_context(_patched_attr(instance, "generation_config", gen_config))
        if multiple != trl_multiple:
            stack.enter_context(_patched_attr(instance, "pad_to_multiple_of", multiple))
        if state.compiled or inject:  # TRL's call is `generate(**inputs, generation_config=...)`: ours, this call
            generate = call_generate(model, state.pool if state.compiled else None, config, state.graph, graph=graph,
                                     **inject)
            stack.enter_context(_patched_attr(model, "generate", generate))
        state.merged_layers = stack.enter_context(sampling(model, config, compiled=state.compiled,
                                                           merged=state.merged))
        state._active = True
        stack.callback(setattr, state, "_active", False)
        before, start = graphs_compiled(), time.perf_counter()
        completion_ids, logprobs = wrapped(*args, **kwargs)
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
    if recorder is not None:
        state.last_sampling_logprobs = recorder.finish(completion_ids)
    return completion_ids, logprobs


def enable_fast_generation(trainer: Any, config: Any = True) -> FastGenerationState | None:
    """Turn fast generation on (or off, with ``False``) for one built ``GRPOTrainer``.

    Sets the state the wrapper reads; if the trainer's class is not already wrapped by
    ``grpo_patches.apply``, the instance's ``_generate_single_turn`` is wrapped (nesting is harmless:
    the wrapper passes through when it is already active).
    """
    cfg = FastGenerationConfig.coerce(config)
    if cfg is None:
        if hasattr(trainer, FAST_GEN_ATTR):
            delattr(trainer, FAST_GEN_ATTR)
        return None
    state = FastGenerationState(cfg)
    setattr(trainer, FAST_GEN_ATTR, state)
    if not class_wrapped(type(trainer)) and "_generate_single_turn" not in vars(trainer):
        import wrapt

        wrapt.wrap_function_wrapper(trainer, "_generate_single_turn", wrap_generate)
    return state


def class_wrapped(cls: type) -> bool:
    """Whether ``cls`` (or a base) already has :func:`wrap_generate` on ``_generate_single_turn``."""
    for klass in cls.__mro__:
        attr = vars(klass).get("_generate_single_turn")
        if attr is not None:
            return getattr(attr, "_self_wrapper", None) is wrap_generate
    return False
