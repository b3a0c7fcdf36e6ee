"""What every trainer adapter shares, TRL's and the vendored trainer's alike.

The state a patched trainer carries, the reward-model placeholders of main placement, the test of
whether a reward function takes a keyword, and what is attached once a trainer is built. Imports
only the mechanisms below the adapters.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..collectives import FailFastGroup
from ..compiled_reward_models import enable_compiled_reward_models
from ..compiled_training import enable_compiled_training
from ..frozen_gc import enable_frozen_gc
from ..generation import FAST_GEN_ATTR, FastGenerationState
from ..lean_lora import enable_lean_lora
from ..options import PatchOptions
from ..overlap import enable_overlap

__all__ = ["STATE_ATTR", "TrainerPatchState", "accepts", "attach", "main_only_reward_funcs"]

STATE_ATTR = "_grpo_patches"


@dataclass
class TrainerPatchState:
    """What a patched trainer carries: its options and its fail-fast group."""

    options: PatchOptions
    group: FailFastGroup


def _fast_generation_state(trainer: Any, config: Any) -> None:
    setattr(trainer, FAST_GEN_ATTR, FastGenerationState(config))


def attach(trainer: Any, options: PatchOptions, *,
           fast_generation: Callable[[Any, Any], Any] = _fast_generation_state) -> None:
    """Once the trainer is built: its options and fail-fast group (the mark every other wrapper
    reads), then the opt-in switches on its policy (``trainer.model``): fast generation
    (``fast_generation(trainer, config)``: the adapter's way in), lean LoRA, compiled training; and on its
    reward models (``trainer.reward_funcs``) compiled scoring; on the trainer, the collector's freeze and the
    micro-batches' overlap."""
    setattr(trainer, STATE_ATTR, TrainerPatchState(options, FailFastGroup(options.collective_timeout)))
    if options.fast_generation is not None:
        fast_generation(trainer, options.fast_generation)
    if options.lean_lora:
        enable_lean_lora(trainer.model)
    if options.compile_training:
        enable_compiled_training(trainer.model, trainer.accelerator)
    if options.compile_reward_models:
        enable_compiled_reward_models(trainer.reward_funcs, trainer.accelerator)
    if options.freeze_gc:
        enable_frozen_gc(trainer)
    if options.overlap_micro_batches:
        enable_overlap(trainer)


def _placeholder(name: str, index: int) -> Callable:
    def reward_model_on_main_process(*args: Any, **kwargs: Any) -> list[float]:
        raise RuntimeError(
            f"grpo_patches: reward model '{name}' lives on the main process only (reward_placement='main'); "
            f"it was called on another rank."
        )

    reward_model_on_main_process.__name__ = name
    reward_model_on_main_process.__qualname__ = name
    reward_model_on_main_process.grpo_patches_placeholder_for = index  # type: ignore[attr-defined]
    return reward_model_on_main_process


def main_only_reward_funcs(reward_funcs: Any, is_main: bool) -> Any:
    """Under reward_placement='main', non-main ranks get name-keeping placeholders for reward models.

    TRL loads a reward model given by name, and moves a given ``nn.Module`` to the rank's device, in
    ``__init__`` on every rank. A placeholder (a plain function with the model's display name) keeps
    TRL's bookkeeping (names, weights, metric keys) identical on every rank while the model itself
    is never loaded or moved on the other ranks.
    """
    if is_main or reward_funcs is None:
        return reward_funcs
    funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
    out = []
    for i, func in enumerate(funcs):
        if isinstance(func, str):
            out.append(_placeholder(func.split("/")[-1], i))
        elif isinstance(func, nn.Module):
            name = getattr(func.config, "_name_or_path", "") or ""
            out.append(_placeholder(name.split("/")[-1], i))
        else:
            out.append(func)
    return out


def accepts(func: Callable, name: str) -> bool:
    """Whether ``func`` takes keyword ``name`` (by name or through ``**kwargs``): the kit passes its
    own reward keywords, and those of newer TRL releases, only to functions that take them."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
