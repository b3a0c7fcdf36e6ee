"""TRL adapters for the eras that compute rewards inline (0.15-0.18): one module, a row per era.

Upstream in these eras: the reward loop sits inside ``_prepare_inputs`` (0.15) or
``_generate_and_score_completions`` (0.16-0.18), calling each entry of ``self.reward_funcs``
directly, then all-gathers the rewards, normalizes over every rank's rows and slices its own back.
There is no reward method to replace, so the kit wraps the method holding the loop and, for the
duration of that call only, swaps each reward function or model for a *guard*: a plain function
(so upstream's loop calls it as a custom reward function) that scores the rank's completions
through the kit's placement / chunking / fail-fast machinery with the real function or model, and
returns the rank's own rewards. Every rank calls the guards in the same order, so the exchanges
line up; an error or timeout on any rank raises on every rank from inside the guard.
What stays upstream's here: the all-gather of rewards before normalization (the kit cannot remove
it without rewriting the method), and the advantage code itself (so advantages equal upstream's).

The samplers differ per era in how many prompts one generation round takes and how often it is
repeated; :class:`~grpo_patches.grouping.RankLocalGroupSampler` takes both as parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from packaging.specifiers import SpecifierSet

from ..rewards import RewardBatch, compute_rewards
from . import Adapter
from .common import STATE_ATTR, TrainerPatchState
from .trl_glue import GroupShape, init_wrapper, sampler_wrapper, score_batch, train_wrapper


def _shape(spg: Callable[[Any], int]) -> Callable[[Any], GroupShape]:
    def shape_of(config: Any) -> GroupShape:
        return GroupShape(
            per_device_train_batch_size=config.per_device_train_batch_size,
            steps_per_generation=spg(config),
            num_generations=config.num_generations,
            per_device_eval_batch_size=config.per_device_eval_batch_size,
            num_generations_eval=config.num_generations,
            world_size=config.world_size,
        )

    return shape_of


# completions one rank generates per round: per micro-step (0.15, 0.16), per accumulation cycle
# (0.17), per steps_per_generation (0.18)
_PER_STEP = _shape(lambda c: 1)
_PER_ACCUMULATION = _shape(lambda c: c.gradient_accumulation_steps)
_PER_GENERATION = _shape(lambda c: c.steps_per_generation)


def _guard(trainer: Any, state: TrainerPatchState, func: Any, processing_class: Any, name: str) -> Callable:
    options = state.options

    def guard(prompts, completions, completion_ids=None, **columns):
        batch = RewardBatch(list(prompts), list(completions),
                            list(completion_ids) if completion_ids is not None else [None] * len(prompts),
                            {k: list(v) for k, v in columns.items()})
        result = compute_rewards(
            batch,
            # upstream's loop times each call of this guard (profiling) and warns about unscored rows itself
            lambda b, ids: score_batch(trainer, b, ids, num_generations=trainer.num_generations,
                                       with_environments=False, chunk_size=options.reward_chunk_size,
                                       funcs=[(func, processing_class, name)]),
            group=state.group,
            placement=options.reward_placement,
            num_generations=trainer.num_generations,
            chunk_size=None,
            timeout=options.reward_timeout,
            running=lambda: f"reward function '{name}'",
        )
        return result.local[:, 0].tolist()

    guard.__name__ = guard.__qualname__ = name
    return guard


def _guarded_rewards(wrapped, instance, args, kwargs):
    """Run the method that holds upstream's inline reward loop with guarded reward functions."""
    state: TrainerPatchState | None = getattr(instance, STATE_ATTR, None)
    if state is None:
        return wrapped(*args, **kwargs)
    originals = instance.reward_funcs
    names = getattr(instance, "reward_func_names", None) or [
        getattr(getattr(f, "config", None), "_name_or_path", "").split("/")[-1] or getattr(f, "__name__", "reward")
        for f in originals
    ]
    instance.reward_funcs = [
        _guard(instance, state, f, p, n)
        for f, p, n in zip(originals, instance.reward_processing_classes, names, strict=True)
    ]
    try:
        return wrapped(*args, **kwargs)
    finally:
        instance.reward_funcs = originals


_INIT_SIGNATURE = ("model", "reward_funcs", "args", "train_dataset", "eval_dataset", "processing_class",
                   "reward_processing_classes")


def _adapter(key: str, releases: str, shape_of, repeats, reward_site: str, sampler_params: tuple[str, ...],
             sampler_anchor: str) -> Adapter:
    return Adapter(
        key=key,
        releases=SpecifierSet(releases),
        module="trl.trainer.grpo_trainer",
        class_name="GRPOTrainer",
        wrappers={
            "__init__": init_wrapper(shape_of, soft_failures=False),
            "_get_train_sampler": sampler_wrapper(shape_of, repeats),
            reward_site: _guarded_rewards,
            "train": train_wrapper,  # liveness: a vanished peer rank is named (liveness.py)
        },
        signatures={"__init__": _INIT_SIGNATURE, "_get_train_sampler": sampler_params},
        anchors={
            reward_site: ("rewards_per_func = gather(rewards_per_func)", "advantages = advantages[process_slice]",
                          "for i, (reward_func, reward_processing_class"),
            "_get_train_sampler": (sampler_anchor,),
        },
        summary=f"rewards inline in {reward_site}",
    )


V015 = _adapter("v015", ">=0.15,<0.16", _PER_STEP, lambda t: 1, "_prepare_inputs", (), "RepeatRandomSampler(")
V016 = _adapter("v016", ">=0.16,<0.17", _PER_STEP, lambda t: t.num_iterations,
                "_generate_and_score_completions", (), "RepeatRandomSampler(")
V017 = _adapter("v017", ">=0.17,<0.18", _PER_ACCUMULATION,
                lambda t: t.num_iterations * t.args.gradient_accumulation_steps,
                "_generate_and_score_completions", (), "RepeatSampler(")
V018 = _adapter("v018", ">=0.18,<0.19", _PER_GENERATION,
                lambda t: t.num_iterations * t.args.steps_per_generation,
                "_generate_and_score_completions", ("dataset",), "RepeatSampler(")
