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
from collections.abc import Iterator
from typing import Any

from ..generation import FAST_GEN_ATTR, FastGenerationConfig, FastGenerationState
from ..generation.config import round_up
from ..generation.fast import fast_call

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
    trl_multiple = instance.pad_to_multiple_of
    multiple = trl_multiple
    if config.pad_prompts:
        multiple = math.lcm(trl_multiple or 1, config.bucket)
    with fast_call(state, model, instance.generation_config, device=instance.accelerator.device,
                   prompt_length=_prompt_length(prompt_ids, multiple), sharded=_sharding(instance),
                   eager_note=f"; sampling still runs with dropout off{' and bucketed prompts' if config.pad_prompts else ''}",
                   record=True) as call, contextlib.ExitStack() as stack:
        stack.enter_context(_patched_attr(instance, "generation_config", call.generation_config))
        if multiple != trl_multiple:
            stack.enter_context(_patched_attr(instance, "pad_to_multiple_of", multiple))
        if state.compiled or call.recorder is not None:  # TRL's call is `generate(**inputs, generation_config=...)`
            stack.enter_context(_patched_attr(model, "generate", call.generate))
        completion_ids, logprobs = wrapped(*args, **kwargs)
    if call.recorder is not None:
        state.last_sampling_logprobs = call.recorder.finish(completion_ids)
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
