"""Glue between TRL's GRPOTrainer and the kit's core, shared by the TRL adapters.

Only what is the same in every supported era lives here; what differs (where the group shape is
read from the config, which method computes rewards) stays in the era's adapter module.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..collectives import FailFastGroup
from ..generation import enable_fast_generation
from ..grouping import RankLocalGroupSampler, check_group_shape
from ..options import PatchOptions, active
from ..rewards import RewardBatch, Scored, compute_rewards, reward_column, validate_chunk_size

logger = logging.getLogger("grpo_patches")

STATE_ATTR = "_grpo_patches"
UNSCORED_KEYS = ("prompt", "completion", "completion_ids")


@dataclass(frozen=True)
class GroupShape:
    """The batch settings that decide whether groups stay on one rank."""

    per_device_train_batch_size: int
    steps_per_generation: int
    num_generations: int
    per_device_eval_batch_size: int
    num_generations_eval: int
    world_size: int


@dataclass
class TrainerPatchState:
    """What a patched trainer carries: its options and its fail-fast group."""

    options: PatchOptions
    group: FailFastGroup


def check_shape(shape: GroupShape, options: PatchOptions, *, evaluates: bool) -> None:
    """Everything about the batch shape that can be known before TRL builds anything."""
    check_group_shape(
        per_device_batch_size=shape.per_device_train_batch_size,
        steps_per_generation=shape.steps_per_generation,
        num_generations=shape.num_generations,
        world_size=shape.world_size,
    )
    validate_chunk_size(options.reward_chunk_size, shape.num_generations)
    if evaluates:
        check_group_shape(
            per_device_batch_size=shape.per_device_eval_batch_size,
            steps_per_generation=1,
            num_generations=shape.num_generations_eval,
            world_size=shape.world_size,
            mode="eval",
        )
        validate_chunk_size(options.reward_chunk_size, shape.num_generations_eval, name="num_generations_eval")


def init_wrapper(shape_of: Callable[[Any], GroupShape], *,
                 fast_generation_available: Callable[[], bool] = lambda: False) -> Callable:
    """The ``GRPOTrainer.__init__`` wrapper of every era; ``shape_of`` reads the era's config fields.

    Before TRL builds anything: reject a batch shape that would split a group; under main
    placement refuse what cannot work (environments, DeepSpeed) and keep reward models off the
    other ranks. After: attach the trainer's options and fail-fast group.
    """

    def _init(wrapped, instance, args, kwargs):
        options = active()
        if options is None:
            return wrapped(*args, **kwargs)
        bound = inspect.signature(wrapped).bind(*args, **kwargs)
        config = bound.arguments.get("args")
        evaluates = bound.arguments.get("eval_dataset") is not None
        if config is not None:
            check_shape(shape_of(config), options, evaluates=evaluates)
        if options.fast_generation is not None and not fast_generation_available():
            raise ValueError(
                "grpo_patches: fast_generation=True needs GRPOTrainer._generate_single_turn(prompt_ids, ...), which "
                "TRL has from 0.29 on; upgrade TRL or drop fast_generation."
            )
        if options.reward_placement == "main":
            from accelerate import PartialState
            from accelerate.utils import DistributedType

            state = PartialState()
            if bound.arguments.get("environment_factory") is not None:
                raise ValueError(
                    "grpo_patches: reward_placement='main' cannot be used with environment_factory: environments "
                    "are per-rank objects that cannot be sent to the main process. Use reward_placement='local'."
                )
            funcs = bound.arguments.get("reward_funcs")
            models = [f for f in (funcs if isinstance(funcs, list) else [funcs]) if isinstance(f, (str, nn.Module))]
            # GRPOConfig(deepspeed=...) turns DeepSpeed on inside Trainer.__init__, after this check runs
            deepspeed = (state.distributed_type == DistributedType.DEEPSPEED or bool(getattr(config, "deepspeed", None))
                         or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true")
            if deepspeed and models:
                # Rule-based functions need no engine, so main placement works for them under DeepSpeed.
                raise ValueError(
                    "grpo_patches: reward_placement='main' with a reward model cannot be used under DeepSpeed: "
                    "TRL wraps every reward model in deepspeed.initialize (and, under ZeRO-3, transformers loads a "
                    "named one inside zero.Init), collectives every rank must join, so a model kept on the main "
                    "process alone would hang the others. Use reward_placement='local' (under ZeRO-3 each rank then "
                    "holds 1/world of the reward model), or main placement under FSDP2 / DDP "
                    "(examples/accelerate/fsdp2.yaml, ddp.yaml). Rule-based reward functions may stay on 'main'."
                )
            bound.arguments["reward_funcs"] = main_only_reward_funcs(
                bound.arguments.get("reward_funcs"), state.is_main_process
            )
        wrapped(*bound.args, **bound.kwargs)
        if config is None:  # TRL built a default config: check it now
            check_shape(shape_of(instance.args), options, evaluates=evaluates)
        setattr(instance, STATE_ATTR, TrainerPatchState(options, FailFastGroup(options.collective_timeout)))
        if options.fast_generation is not None:
            enable_fast_generation(instance, options.fast_generation)

    return _init


def sampler_wrapper(shape_of: Callable[[Any], GroupShape], repeats: Callable[[Any], int]) -> Callable:
    """The ``_get_train_sampler`` wrapper of every era: :class:`RankLocalGroupSampler` sized like the
    era's own sampler (``repeats``: how often the era replays one generation round's prompts)."""
    def _get_train_sampler(wrapped, instance, args, kwargs):
        if not hasattr(instance, STATE_ATTR):
            return wrapped(*args, **kwargs)
        shape = shape_of(instance.args)
        dataset = (args[0] if args else kwargs.get("dataset")) or instance.train_dataset
        per_round = shape.per_device_train_batch_size * shape.steps_per_generation * shape.world_size
        return RankLocalGroupSampler(
            dataset,
            num_generations=shape.num_generations,
            prompts_per_batch=per_round // shape.num_generations,
            repeat_count=repeats(instance),
            shuffle=getattr(instance, "shuffle_dataset", True),
            seed=instance.args.seed,
        )

    return _get_train_sampler


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


def _accepts(func: Callable, name: str) -> bool:
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def score_batch(trainer: Any, batch: RewardBatch, group_ids: list[int], *, num_generations: int,
                with_environments: bool, progress: dict[str, str] | None = None,
                funcs: list[tuple[Any, Any, str]] | None = None) -> Scored:
    """TRL's reward loop for one chunk: every reward function / model on ``batch``.

    ``funcs``: ``(function or model, processing class, name)`` triples; default the trainer's.

    Same calls as upstream (``prompts``, ``completions``, ``completion_ids``, the dataset columns,
    ``trainer_state``, ``log_extra``, ``log_metric``), plus ``num_generations`` and ``group_ids``
    for functions that accept them (whole-group / listwise rewards: TRL #3896, #4707).
    """
    from transformers import Trainer

    device = trainer.accelerator.device
    # This runs in the watchdog's thread, whose current device is cuda:0. A single-process run's device
    # is plain "cuda" (no index: the current device, which set_device refuses), and needs nothing.
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    if funcs is None:
        funcs = list(zip(trainer.reward_funcs, trainer.reward_processing_classes, trainer.reward_func_names,
                         strict=True))
    n = len(batch)
    rewards = torch.zeros(n, len(funcs))
    extras: dict[str, list[Any]] = {}
    columns: dict[str, Any] = dict(batch.columns)  # upstream passes the dataset columns in every era
    # Passed only to functions that accept them: upstream added trainer_state (0.20), log_extra /
    # log_metric (1.0) and environments later, and a reward function written for an older release
    # (no **kwargs) must keep working; num_generations / group_ids are the kit's own.
    optional: dict[str, Any] = {
        "trainer_state": trainer.state,
        "log_extra": lambda column, values: extras.setdefault(column, []).extend(values),
        "log_metric": getattr(trainer, "_log_metric", lambda name, value: None),
        "num_generations": num_generations,
        "group_ids": group_ids,
    }
    if with_environments and getattr(trainer, "environments", None) is not None:
        optional["environments"] = trainer.environments
    for i, (func, processing_class, name) in enumerate(funcs):
        if progress is not None:
            progress["now"] = f"reward function '{name}'"
        try:
            if isinstance(func, nn.Module):
                rewards[:, i] = _score_with_model(trainer, Trainer, func, processing_class, batch)
                values = rewards[:, i]
                if not torch.isfinite(values).all():
                    bad = int((~torch.isfinite(values)).nonzero()[0, 0])
                    raise ValueError(f"reward model '{name}' gave {values[bad].item()} for completion {bad}")
                continue
            call_kwargs = dict(columns)
            call_kwargs.update({k: v for k, v in optional.items() if _accepts(func, k)})
            out = func(prompts=batch.prompts, completions=batch.completions,
                       completion_ids=batch.completion_ids, **call_kwargs)
            if inspect.isawaitable(out):
                # the loop is async_reward_loop in 0.27, async_loop from 0.28
                loop = getattr(trainer, "async_loop", None) or getattr(trainer, "async_reward_loop", None)
                out = (asyncio.run_coroutine_threadsafe(out, loop).result() if loop is not None
                       else asyncio.run(out))
            rewards[:, i] = torch.tensor(reward_column(out, n, name), dtype=torch.float32)
        except Exception as exc:
            exc.grpo_patches_where = f"reward function '{name}'"  # type: ignore[attr-defined]
            raise
    unscored = torch.isnan(rewards).all(dim=1)
    if unscored.any():
        first = int(unscored.nonzero()[0, 0])
        logger.warning("All reward functions returned None for completion %d: %r", first, batch.completions[first])
    return Scored(rewards, extras)


def _score_with_model(trainer: Any, trainer_cls: type, model: nn.Module, processing_class: Any,
                      batch: RewardBatch) -> torch.Tensor:
    from trl.data_utils import apply_chat_template, is_conversational

    if is_conversational({"prompt": batch.prompts[0]}):
        kwargs = getattr(trainer, "chat_template_kwargs", None) or {}
        texts = [apply_chat_template({"messages": p + c}, processing_class, **kwargs)["text"]
                 for p, c in zip(batch.prompts, batch.completions, strict=True)]
    else:
        texts = [p + c for p, c in zip(batch.prompts, batch.completions, strict=True)]
    inputs = processing_class(text=texts, return_tensors="pt", padding=True, padding_side="right",
                              add_special_tokens=False)
    inputs = trainer_cls._prepare_inputs(trainer, inputs)
    with torch.inference_mode():
        return model(**inputs).logits[:, 0].float().cpu()


def trl_layout_rewards(trainer: Any, inputs: list[dict], prompts: list, completions: list,
                       completion_ids_list: list, *, num_generations: int, global_stats: bool) -> torch.Tensor:
    """Rewards ``[world * n, F]`` in the layout TRL's caller expects, computed by the kit.

    TRL's caller normalizes over the rows of all ranks and then keeps rows ``rank*n:(rank+1)*n``.
    Groups are rank-local, so a rank's own rows are all its group statistics need: other ranks'
    rows are filled with NaN (TRL treats all-NaN rows as unscorable and zeroes their advantages,
    and they are sliced away). The main process gets every rank's rows, so the metrics it logs
    are upstream's; ``global_stats`` (batch-level std) sends every rank the full tensor.
    """
    state: TrainerPatchState = getattr(trainer, STATE_ATTR)
    options = state.options
    columns = {k: [ex[k] for ex in inputs] for k in inputs[0] if k not in UNSCORED_KEYS} if inputs else {}
    batch = RewardBatch(list(prompts), list(completions), list(completion_ids_list), columns)
    local_placement = options.reward_placement == "local"
    progress: dict[str, str] = {}
    result = compute_rewards(
        batch,
        lambda b, ids: score_batch(trainer, b, ids, num_generations=num_generations,
                                   with_environments=local_placement, progress=progress),
        group=state.group,
        placement=options.reward_placement,
        num_generations=num_generations,
        chunk_size=options.reward_chunk_size,
        timeout=options.reward_timeout,
        everywhere=global_stats,
        running=lambda: progress.get("now", ""),
    )
    log_extra = getattr(trainer, "_log_completion_extra", None)
    if log_extra is not None:
        for column, values in result.extras.items():
            log_extra(column, values)
    device = trainer.accelerator.device
    if result.all is not None:
        return result.all.to(device)
    n, world, rank = len(prompts), state.group.world_size, state.group.rank
    padded = torch.full((n * world, result.local.shape[1]), float("nan"))
    padded[rank * n : (rank + 1) * n] = result.local
    return padded.to(device)
