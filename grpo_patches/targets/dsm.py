"""Adapter for the vendored DeepSeekMath-style trainer (``grpo_patches.vendored.dsm_grpo``).

The same mechanisms as TRL's adapters, on the vendored trainer's four points:

* ``__init__``: before the trainer builds anything, refuse a per-rank batch that would split a
  group (nearest valid settings in the message) and a chunk size that would cut one; under
  ``reward_placement="main"`` give the other ranks name-keeping placeholders for reward models, so
  they are never moved to a device or run there; attach the options and the fail-fast group.
* ``create_groups``: :class:`~grpo_patches.grouping.RankLocalGroupSampler`'s stream (whole groups
  per rank, every row once per epoch, seed-determined), cut per rank.
* ``compute_rewards``: :func:`~grpo_patches.rewards.compute_rewards` (local or main placement,
  bounded chunks of whole groups, exact per-rank scatter, fail fast on every rank), with
  ``num_generations`` and ``group_ids`` given to reward functions that accept them.
* ``sample``: fast generation when ``apply(fast_generation=...)`` asks for it.

``apply(lean_lora=True)`` switches the policy's LoRA layers once the trainer is built;
``apply(compile_training=True)`` switches its decoder layers to the compiled training forward.

The trainer's advantage code (all-gather, per-group normalization) is its own, untouched: with
groups rank-local it gives the same advantages as a per-rank normalization would.
"""

from __future__ import annotations

import inspect
from typing import Any

from packaging.specifiers import SpecifierSet
from torch import nn

from .. import options as _options
from ..collectives import setup_agreed
from ..generation import FAST_GEN_ATTR, FastGenerationState, fast_generate
from ..grouping import GroupShapeError, RankLocalGroupSampler, check_group_shape, nearest_valid_settings
from ..rewards import RewardBatch, Scored, SoftFailures, compute_rewards, reward_column, validate_chunk_size
from ..watchdog import Progress
from . import Adapter
from .common import STATE_ATTR, TrainerPatchState, accepts, attach, main_only_reward_funcs

__all__ = ["ADAPTER"]


def check_shape(per_device_batch_size: int, num_generations: int, world_size: int, chunk_size: int | None) -> None:
    """Each rank must generate whole groups per step; a reward chunk must hold whole groups."""
    try:
        check_group_shape(per_device_batch_size=per_device_batch_size, steps_per_generation=1,
                          num_generations=num_generations, world_size=world_size)
    except GroupShapeError:
        # The vendored trainer has no steps_per_generation: suggest only its own two settings.
        fixes = [f.replace("per_device_train_batch_size", "per_device_batch_size")
                 for f in nearest_valid_settings(per_device_batch_size, 1, num_generations)
                 if not f.startswith("steps_per_generation")]
        raise GroupShapeError(
            f"grpo_patches: DSMGRPOConfig(per_device_batch_size={per_device_batch_size}) is not a multiple of "
            f"num_generations={num_generations}, so with world_size={world_size} some group of {num_generations} "
            f"completions would not be generated and scored on one rank (the unpatched trainer checks only the "
            f"global batch and splits such groups across ranks). Nearest valid settings: "
            f"{'; '.join(fixes)}."
        ) from None
    validate_chunk_size(chunk_size, num_generations)


def wrap_init(wrapped, instance, args, kwargs):
    opts = _options.active()
    if opts is None:
        return wrapped(*args, **kwargs)
    with setup_agreed(f"building {type(instance).__name__}"):  # a failure reaches every rank, with its cause
        _build(opts, wrapped, instance, args, kwargs)
    attach(instance, opts)


def _build(opts, wrapped, instance, args, kwargs) -> None:
    from ..vendored.dsm_grpo import DSMGRPOConfig, DSMGRPOTrainer

    bound = inspect.signature(wrapped).bind(*args, **kwargs)
    config = bound.arguments.get("config") or DSMGRPOConfig()
    bound.arguments["config"] = config
    if bound.arguments.get("accelerator") is None:  # the one the trainer would build, built here to read the world
        from accelerate import Accelerator

        bound.arguments["accelerator"] = Accelerator()
    accelerator = bound.arguments["accelerator"]
    world_size, is_main = accelerator.num_processes, accelerator.is_main_process
    check_shape(config.per_device_batch_size, config.num_generations, world_size, opts.reward_chunk_size)
    funcs = bound.arguments["reward_funcs"]
    if opts.reward_placement == "main":
        bound.arguments["reward_funcs"] = main_only_reward_funcs(funcs, is_main)
    wrapped(*bound.args, **bound.kwargs)
    if opts.reward_placement == "main":  # every rank names the functions as the main process does
        instance.reward_func_names = DSMGRPOTrainer.reward_names(funcs)


def wrap_create_groups(wrapped, instance, args, kwargs):
    if not hasattr(instance, STATE_ATTR):  # built before apply(): as upstream built it
        return wrapped(*args, **kwargs)
    (dataset_size,) = inspect.signature(wrapped).bind(*args, **kwargs).args
    return _rank_local_groups(instance, dataset_size)


def _rank_local_groups(trainer: Any, dataset_size: int):
    cfg, G = trainer.config, trainer.config.num_generations
    rank, world = trainer.accelerator.process_index, trainer.accelerator.num_processes
    b = cfg.per_device_batch_size
    sampler = RankLocalGroupSampler(range(dataset_size), num_generations=G, prompts_per_batch=b * world // G,
                                    seed=cfg.seed)
    while True:
        stream = list(sampler)  # one epoch; the sampler moves to the next epoch by itself
        for start in range(0, len(stream), b * world):
            yield stream[start + rank * b:start + (rank + 1) * b]


def _score(trainer: Any, batch: RewardBatch, group_ids: list[int], progress: dict[str, str]) -> Scored:
    """Every reward function and model on one chunk of whole groups, as the trainer calls them,
    each function's output checked (one finite value, or None, per completion)."""
    import torch

    n, G = len(batch), trainer.config.num_generations
    rewards = torch.zeros(n, len(trainer.reward_funcs))
    optional = {"num_generations": G, "group_ids": group_ids}
    funcs = zip(trainer.reward_funcs, trainer.reward_tokenizers, trainer.reward_func_names, strict=True)
    soft = SoftFailures(getattr(trainer, STATE_ATTR).options.reward_failure, trainer.accelerator.process_index)
    for i, (func, tokenizer, name) in enumerate(funcs):
        progress["now"] = f"reward function '{name}'"
        try:
            if isinstance(func, nn.Module):
                values = trainer.score_with_model(func, tokenizer, batch.prompts, batch.completions).tolist()
            else:
                values = func(prompts=list(batch.prompts), completions=list(batch.completions), **batch.columns,
                              **{k: v for k, v in optional.items() if accepts(func, k)})
            rewards[:, i] = torch.tensor(reward_column(values, n, name), dtype=torch.float32)
        except Exception as exc:
            soft.absorb(exc, f"reward function '{name}'", slice(0, n))
            rewards[:, i] = float("nan")
    return Scored(soft.finish(rewards), failed_calls=soft.calls)


def wrap_compute_rewards(wrapped, instance, args, kwargs):
    state: TrainerPatchState | None = getattr(instance, STATE_ATTR, None)
    if state is None:
        return wrapped(*args, **kwargs)
    bound = inspect.signature(wrapped).bind(*args, **kwargs)
    responses, prompts = bound.arguments["responses"], bound.arguments["prompts"]
    columns = {k: list(v) for k, v in bound.arguments.get("columns", {}).items()}
    opts, progress = state.options, Progress()  # announced: peers can name it if this rank gets stuck
    result = compute_rewards(
        RewardBatch(list(prompts), list(responses), [None] * len(responses), columns),
        lambda b, ids: _score(instance, b, ids, progress),
        group=state.group, placement=opts.reward_placement, num_generations=instance.config.num_generations,
        chunk_size=opts.reward_chunk_size, timeout=opts.reward_timeout, running=lambda: progress.get("now", ""),
        on_failure=opts.reward_failure, num_funcs=len(instance.reward_funcs),
    )
    # reward calls absorbed by a fail-soft policy so far, on every rank together (the same on each)
    instance.failed_reward_calls = getattr(instance, "failed_reward_calls", 0) + result.failed_calls
    # None ("no reward") is NaN in the column; the unpatched sum would turn it into NaN too, so a
    # completion's NaN functions are left out of its sum (TRL's nansum).
    return result.local.nansum(1).to(instance.accelerator.device)


def wrap_sample(wrapped, instance, args, kwargs):
    state: FastGenerationState | None = getattr(instance, FAST_GEN_ATTR, None)
    if state is None:
        return wrapped(*args, **kwargs)
    # sample(input_ids, attention_mask): fast_generate's own first parameters; the trainer's state
    # holds the caches, the merged buffer and the counters, as TRL's adapter's does
    return fast_generate(instance.policy, *args, generation_config=instance.generation_config, state=state,
                         **kwargs)


ADAPTER = Adapter(
    key="dsm",
    releases=SpecifierSet(),  # vendored: every version of the kit carries its own copy
    module="grpo_patches.vendored.dsm_grpo",
    class_name="DSMGRPOTrainer",
    wrappers={"__init__": wrap_init, "create_groups": wrap_create_groups, "compute_rewards": wrap_compute_rewards,
              "sample": wrap_sample},
    signatures={"__init__": ("model", "tokenizer", "reward_funcs", "config"),
                "create_groups": ("dataset_size",),
                "compute_rewards": ("responses", "prompts", "columns"),
                "sample": ("input_ids", "attention_mask")},
    summary="vendored DeepSeekMath-style trainer: rank-local groups, reward placement, fail-fast, fast generation",
)
