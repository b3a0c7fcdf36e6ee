"""TRL adapter for the ``_calculate_rewards`` era (``RepeatSampler`` + ``steps_per_generation``).

Upstream in this era: ``_get_train_sampler(dataset)`` returns a ``RepeatSampler`` whose index
stream accelerate cuts into per-rank batches; ``_calculate_rewards(inputs, prompts, completions,
completion_ids_list)`` scores the rank's completions and all-gathers them; its caller,
``_generate_and_score_completions``, normalizes over every rank's rows and slices its own back
(``process_slice``). We wrap exactly those three points and ``__init__``:

* ``__init__``: reject a batch shape that would split a group, before TRL loads anything; under
  main placement keep reward models off the other ranks; attach the fail-fast group.
* ``_get_train_sampler``: :class:`~grpo_patches.grouping.RankLocalGroupSampler` (no row dropped,
  resume-stable order, same order as upstream where upstream drops nothing).
* ``_calculate_rewards``: score where the user chose, with whole-group kwargs, a watchdog and
  fail-fast error exchange, and return the layout the caller slices (see
  :func:`~grpo_patches.targets.trl_glue.trl_layout_rewards`). The advantage code itself is
  upstream's, untouched, which is what keeps advantages equal to upstream's (I3).
"""

from __future__ import annotations

import inspect
from typing import Any

from packaging.specifiers import SpecifierSet

from . import Adapter
from .common import STATE_ATTR
from .trl_generation import wrap_generate
from .trl_glue import GroupShape, init_wrapper, sampler_wrapper, train_wrapper, trl_layout_rewards


def _shape(config: Any) -> GroupShape:
    return GroupShape(
        per_device_train_batch_size=config.per_device_train_batch_size,
        steps_per_generation=config.steps_per_generation,
        num_generations=config.num_generations,
        per_device_eval_batch_size=config.per_device_eval_batch_size,
        num_generations_eval=getattr(config, "num_generations_eval", None) or config.num_generations,
        world_size=config.world_size,
    )


def _fast_generation_available() -> bool:
    return "_generate_single_turn" in ADAPTER.available()


def _warn_unscored(row: dict) -> None:
    """Upstream's warning for a row no reward function scored: ``warnings.warn`` until 0.23, the
    module's (accelerate, main-process) logger from 0.24, each with its own text."""
    import warnings

    from trl.trainer import grpo_trainer

    logger = getattr(grpo_trainer, "logger", None)
    if logger is None:
        warnings.warn(f"All reward functions returned None for the following kwargs: {row}. "
                      "Please ensure that at least one reward function returns a valid reward.", stacklevel=2)
    else:
        logger.warning(f"All reward functions returned None for the following kwargs:\n{row}\n"
                       "Please ensure that at least one reward function returns a valid reward.")


_init = init_wrapper(_shape, fast_generation_available=_fast_generation_available)


_get_train_sampler = sampler_wrapper(_shape, lambda t: t.num_iterations * t.args.steps_per_generation)


def _calculate_rewards(wrapped, instance, args, kwargs):
    if not hasattr(instance, STATE_ATTR):  # built before apply(): leave it as upstream built it
        return wrapped(*args, **kwargs)
    inputs, prompts, completions, completion_ids_list = inspect.signature(wrapped).bind(*args, **kwargs).args
    training = instance.model.training
    # num_generations_eval exists from TRL 0.26; before, eval used num_generations.
    num_generations = instance.num_generations if training else (
        getattr(instance, "num_generations_eval", None) or instance.num_generations)
    # scale_rewards is a bool before 0.22 (True = per-group std) and "group"/"batch"/"none" after;
    # multi_objective_aggregation exists from 0.27.
    global_stats = (
        getattr(instance, "scale_rewards", None) == "batch"
        or getattr(instance, "multi_objective_aggregation", "sum_then_normalize") == "normalize_then_sum"
    )
    from trl.extras.profiling import profiling_context

    hint = (f"Make per_device_train_batch_size x steps_per_generation a multiple of num_generations={num_generations}."
            if training else
            f"Make per_device_eval_batch_size a multiple of num_generations_eval={num_generations}.")
    return trl_layout_rewards(
        instance, inputs, prompts, completions, completion_ids_list,
        num_generations=num_generations, global_stats=global_stats,
        profile=lambda name: profiling_context(instance, name), warn_unscored=_warn_unscored,
        shape_hint=hint,
    )


ADAPTER = Adapter(
    key="v019",
    releases=SpecifierSet(">=0.19,<1.17"),
    module="trl.trainer.grpo_trainer",
    class_name="GRPOTrainer",
    wrappers={
        "__init__": _init,
        "_get_train_sampler": _get_train_sampler,
        "_calculate_rewards": _calculate_rewards,
        "train": train_wrapper,  # liveness: a vanished peer rank is named (liveness.py)
        "_generate_single_turn": wrap_generate,  # passes through unless fast_generation is on
    },
    signatures={
        "__init__": ("model", "reward_funcs", "args", "train_dataset", "eval_dataset", "processing_class",
                     "reward_processing_classes"),
        "_get_train_sampler": ("dataset",),
        "_calculate_rewards": ("inputs", "prompts", "completions", "completion_ids_list"),
        "_generate_single_turn": ("prompt_ids",),
    },
    anchors={
        "_calculate_rewards": ("gather(rewards_per_func)",),
        "_generate_and_score_completions": (
            "self._calculate_rewards(inputs, ",  # 0.20-0.23 pass a copy of the prompts second
            "advantages = advantages[process_slice]",
        ),
        "_get_train_sampler": ("RepeatSampler(",),
    },
    optional=frozenset({"_generate_single_turn"}),  # from TRL 0.29; fast_generation needs it
    summary="RepeatSampler + _calculate_rewards + steps_per_generation",
)
