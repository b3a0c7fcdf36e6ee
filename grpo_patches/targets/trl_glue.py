"""Glue between TRL's GRPOTrainer and the kit's core, shared by the TRL adapters.

Only what is the same in every supported era lives here; what differs (where the group shape is
read from the config, which method computes rewards) stays in the era's adapter module.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..collectives import setup_agreed
from ..grouping import RankLocalGroupSampler, check_group_shape, epoch_of_state
from ..liveness import watching
from ..options import PatchOptions, active
from ..rewards import (
    RewardBatch,
    Scored,
    SoftFailures,
    chunk_slices,
    compute_rewards,
    model_chunk,
    reward_column,
    validate_chunk_size,
)
from ..watchdog import Progress
from .common import STATE_ATTR, TrainerPatchState, accepts, attach, main_only_reward_funcs
from .trl_generation import enable_fast_generation

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


def evaluates(config: Any) -> bool:
    """Whether the Trainer will evaluate on its own schedule. With ``eval_strategy="no"`` the eval
    shape is not refused at construction (evaluation may never run); a later ``evaluate()`` call
    with a shape that cuts groups still fails, at its first scoring call, on every rank."""
    return getattr(config, "eval_strategy", "no") != "no"  # a str enum in transformers


def _datasets(value: Any) -> list[Any]:
    """The datasets of a ``train_dataset`` / ``eval_dataset`` argument (one, or a dict of them)."""
    if value is None:
        return []
    return list(value.values()) if isinstance(value, dict) else [value]


@functools.cache
def _source_marks_unscorable(module_name: str) -> bool:
    import sys

    return "unscorable_mask" in inspect.getsource(sys.modules[module_name])


def marks_unscorable(init: Callable) -> bool:
    """Whether this TRL leaves a completion that no reward function scored (every column NaN) out of the
    advantage's normalization, as TRL 1.6+ does (``unscorable_mask``); earlier releases sum it to 0."""
    module = inspect.getmodule(init)
    return module is not None and _source_marks_unscorable(module.__name__)


def check_drop_group(options: PatchOptions, config: Any, unscorable_handled: bool) -> None:
    """``reward_failure="drop_group"`` leaves a dropped group's rows with no reward from any function. Under
    ``normalize_then_sum`` a release that sums such rows to 0 (before TRL 1.6) normalizes those zeros against
    the batch: the dropped group would get an advantage. Refused there, naming what works."""
    if (options.reward_failure == "drop_group" and not unscorable_handled
            and getattr(config, "multi_objective_aggregation", None) == "normalize_then_sum"):
        raise ValueError(
            "grpo_patches: reward_failure='drop_group' with multi_objective_aggregation='normalize_then_sum' needs "
            "TRL >= 1.6, which leaves completions no reward function scored out of the normalization; this "
            "release would give a dropped group an advantage. Use reward_failure='no_reward', "
            "multi_objective_aggregation='sum_then_normalize', or a newer TRL."
        )


def init_wrapper(shape_of: Callable[[Any], GroupShape], *,
                 fast_generation_available: Callable[[], bool] = lambda: False,
                 soft_failures: bool = True) -> Callable:
    """The ``GRPOTrainer.__init__`` wrapper of every era; ``shape_of`` reads the era's config fields.

    Before TRL builds anything: reject a batch shape that would split a group; under main
    placement refuse what cannot work (environments, DeepSpeed) and keep reward models off the
    other ranks. After: attach the trainer's options and fail-fast group.
    """

    def _init(wrapped, instance, args, kwargs):
        options = active()
        if options is None:
            return wrapped(*args, **kwargs)
        # a failure on any rank, before the side group is made, reaches every rank with its cause
        with setup_agreed(f"building {type(instance).__name__}"):
            _build(options, wrapped, instance, args, kwargs)
        attach(instance, options, fast_generation=enable_fast_generation)

    def _build(options, wrapped, instance, args, kwargs):
        bound = inspect.signature(wrapped).bind(*args, **kwargs)
        config = bound.arguments.get("args")
        if config is not None:
            check_shape(shape_of(config), options, evaluates=evaluates(config))
        for name in ("train_dataset", "eval_dataset"):
            for dataset in _datasets(bound.arguments.get(name)):
                check_columns(getattr(dataset, "column_names", None), name)
        if options.reward_failure != "raise" and not soft_failures:
            raise ValueError(
                f"grpo_patches: reward_failure={options.reward_failure!r} needs TRL >= 0.19 (one reward step for "
                f"every function: earlier releases call each function in a loop of their own, where a group cannot "
                f"be dropped for all of them); upgrade TRL or keep reward_failure='raise'."
            )
        check_drop_group(options, config, marks_unscorable(wrapped))
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
            check_shape(shape_of(instance.args), options, evaluates=evaluates(instance.args))

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
            epoch_source=lambda: epoch_of_state(instance.state),  # resume: see RankLocalGroupSampler
        )

    return _get_train_sampler


def train_wrapper(wrapped, instance, args, kwargs):
    """``train()`` with this rank's liveness monitor on: a peer that vanishes is named (liveness.py).

    A trainer built before ``apply()`` trains as stock TRL built it: said, since nothing else shows it."""
    if not hasattr(instance, STATE_ATTR):
        warnings.warn(
            f"grpo_patches: this {type(instance).__name__} was built before grpo_patches.apply(), so it trains "
            f"unpatched (stock TRL: groups may be split across ranks, no reward_timeout, no reward placement). "
            f"Call grpo_patches.apply() before building the trainer.", UserWarning, stacklevel=3)
        return wrapped(*args, **kwargs)
    with watching():
        return wrapped(*args, **kwargs)


KIT_KWARGS = ("num_generations", "group_ids")  # reward kwargs of the kit's own (listwise rewards)


def check_columns(columns: Any, where: str) -> None:
    """A dataset column named like one of the kit's reward kwargs would be overwritten silently."""
    clash = [c for c in KIT_KWARGS if c in (columns or ())]
    if clash:
        raise ValueError(
            f"grpo_patches: the {where} has a column named {clash[0]!r}, which is also the name of the reward "
            f"keyword argument the kit gives reward functions ({', '.join(KIT_KWARGS)}: whole-group rewards); "
            f"its values would be replaced. Rename the column (e.g. dataset.rename_column({clash[0]!r}, "
            f"'{clash[0]}_'))."
        )


def _is_async(func: Any) -> bool:
    """Whether calling ``func`` returns a coroutine (functions, partials, callable instances), as
    upstream's ``is_async_callable`` decides."""
    func = getattr(func, "func", func)  # functools.partial
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(getattr(type(func), "__call__", None))  # noqa: B004


def score_batch(trainer: Any, batch: RewardBatch, group_ids: list[int], *, num_generations: int,
                with_environments: bool, chunk_size: int | None = None, progress: dict[str, str] | None = None,
                funcs: list[tuple[Any, Any, str]] | None = None, profile: Callable[[str], Any] | None = None,
                warn_unscored: Callable[[dict], None] | None = None, on_failure: str = "raise",
                rank: int = 0) -> Scored:
    """TRL's reward loop on ``batch``: every reward function / model, each over chunks of whole groups.

    ``funcs``: ``(function or model, processing class, name)`` triples; default the trainer's.
    ``profile(name)``: the era's ``profiling_context`` around each function's whole share of the
    step (one timing per function per step, as upstream logs it, however many chunks; for a reward
    model that is its launch, as upstream's, which does not wait for the device either).
    ``warn_unscored(row)``: upstream's warning (its text, on its logger) for the first row no
    function scored, given that row's keyword arguments as upstream shows them.
    ``on_failure``: what a call (one function on one chunk) that raises does (:class:`SoftFailures`;
    ``rank`` names this rank in what it says).

    As upstream: on the calling thread, models and synchronous functions one after another, then
    the async functions concurrently on the trainer's event loop; but the reward models first, and their
    scores read back (and checked) only after every function has run (upstream keeps them on the device
    until its gather): a model's forward runs on the GPU while the host tokenizes its next chunk and runs
    the functions, which keep their listed order. The same keyword arguments
    (``prompts``, ``completions``, ``completion_ids``, the dataset columns, ``trainer_state``,
    ``log_extra``, ``log_metric``, ``environments``), plus ``num_generations`` and ``group_ids`` for
    functions that accept them (whole-group / listwise rewards: TRL #3896, #4707).
    """
    from transformers import Trainer

    check_columns(batch.columns, "dataset")
    if funcs is None:
        funcs = list(zip(trainer.reward_funcs, trainer.reward_processing_classes, trainer.reward_func_names,
                         strict=True))
    profile = profile or (lambda name: contextlib.nullcontext())
    n = len(batch)
    slices = chunk_slices(n, num_generations, chunk_size)
    model_slices = chunk_slices(n, num_generations, model_chunk(chunk_size, num_generations))
    rewards = torch.zeros(n, len(funcs))
    soft = SoftFailures(on_failure, rank)
    extras: dict[str, list[Any]] = {}
    environments = getattr(trainer, "environments", None) if with_environments else None
    # Passed only to functions that accept them: upstream added trainer_state (0.20), log_extra /
    # log_metric (1.0) and environments later, and a reward function written for an older release
    # (no **kwargs) must keep working; num_generations / group_ids are the kit's own.
    shared: dict[str, Any] = {
        "trainer_state": trainer.state,
        "log_extra": lambda column, values: extras.setdefault(column, []).extend(values),
        "log_metric": getattr(trainer, "_log_metric", lambda name, value: None),
        "num_generations": num_generations,
    }

    def call_kwargs(func: Any, rows: slice) -> dict[str, Any]:
        kwargs = {k: v[rows] for k, v in batch.columns.items()}
        per_row = {"group_ids": group_ids[rows]}
        if environments is not None:
            per_row["environments"] = environments[rows]
        for key, value in [*shared.items(), *per_row.items()]:
            if accepts(func, key):
                kwargs[key] = value
        return dict(prompts=batch.prompts[rows], completions=batch.completions[rows],
                    completion_ids=batch.completion_ids[rows], **kwargs)

    def per_call(name: str, call: Callable[[slice], list[float]]) -> list[float]:
        """One function over the chunks, each chunk one call; a failed call goes to ``soft``."""
        column: list[float] = []
        for r in slices:
            try:
                column += call(r)
            except Exception as exc:
                soft.absorb(exc, f"reward function '{name}'", r)
                column += [math.nan] * (r.stop - r.start)
        return column

    def launch_model(model: nn.Module, processing_class: Any, name: str) -> Callable[[], list[float]]:
        """Run the model on every chunk, not waiting for the device; the returned function reads
        the scores back (the wait) and checks them."""
        launched: list[tuple[slice, torch.Tensor | None]] = []
        for r in model_slices:
            try:
                launched.append((r, _score_with_model(trainer, Trainer, model, processing_class,
                                                      batch.slice(r.start, r.stop))))
            except Exception as exc:
                soft.absorb(exc, f"reward function '{name}'", r)
                launched.append((r, None))

        def read() -> list[float]:
            column: list[float] = []
            for r, scores in launched:
                try:
                    if scores is None:  # the launch failed, already absorbed
                        column += [math.nan] * (r.stop - r.start)
                        continue
                    values = scores.cpu()
                    if not torch.isfinite(values).all():
                        bad = int((~torch.isfinite(values)).nonzero()[0, 0])
                        raise ValueError(f"reward model '{name}' gave {values[bad].item()} for completion "
                                         f"{r.start + bad}")
                    column += values.tolist()
                except Exception as exc:
                    soft.absorb(exc, f"reward function '{name}'", r)
                    column += [math.nan] * (r.stop - r.start)
            return column

        return read

    def func_column(func: Any, name: str) -> list[float]:
        return per_call(name, lambda r: reward_column(func(**call_kwargs(func, r)), r.stop - r.start, name))

    async_funcs, reads = [], []
    # Reward models first (each kind stays in its listed order): their forwards run on the device while
    # the host runs the functions. Upstream runs a model where it is listed, after the functions before it.
    order = sorted(range(len(funcs)), key=lambda i: not isinstance(funcs[i][0], nn.Module))
    for i in order:
        func, processing_class, name = funcs[i]
        if progress is not None:
            progress["now"] = f"reward function '{name}'"
        if isinstance(func, nn.Module):
            with profile(name):
                reads.append((i, name, launch_model(func, processing_class, name)))
        elif _is_async(func):
            async_funcs.append((i, func, name))
        else:
            with profile(name):
                rewards[:, i] = torch.tensor(func_column(func, name), dtype=torch.float32)
    if async_funcs:
        if progress is not None:
            progress["now"] = "async reward functions " + ", ".join(f"'{name}'" for _, _, name in async_funcs)
        for i, column in _run_async(trainer, async_funcs, slices, call_kwargs, profile, soft):
            rewards[:, i] = torch.tensor(column, dtype=torch.float32)
    for i, name, read in reads:
        if progress is not None:
            progress["now"] = f"reward function '{name}'"
        rewards[:, i] = torch.tensor(read(), dtype=torch.float32)
    soft.finish(rewards)
    if warn_unscored is not None:
        _report_unscored(warn_unscored, rewards, batch, environments)
    return Scored(rewards, extras, soft.calls)


def _run_async(trainer: Any, async_funcs: list, slices: list[slice], call_kwargs: Callable, profile: Callable,
               soft: SoftFailures):
    """Upstream runs the async reward functions together (``asyncio.gather``) on its event loop."""

    async def one(i: int, func: Any, name: str) -> tuple[int, list[float]]:
        with profile(name):
            column: list[float] = []
            for r in slices:
                try:
                    column += reward_column(await func(**call_kwargs(func, r)), r.stop - r.start, name)
                except Exception as exc:
                    soft.absorb(exc, f"reward function '{name}'", r)
                    column += [math.nan] * (r.stop - r.start)
            return i, column

    async def together() -> list[tuple[int, list[float]]]:
        return await asyncio.gather(*(one(*f) for f in async_funcs))

    # the loop is async_reward_loop in 0.27, async_loop from 0.28; none before
    loop = getattr(trainer, "async_loop", None) or getattr(trainer, "async_reward_loop", None)
    if loop is None:
        return asyncio.run(together())
    future = asyncio.run_coroutine_threadsafe(together(), loop)
    try:
        return future.result()
    except BaseException:  # an error, the watchdog's interrupt, Ctrl-C: stop what still runs
        future.cancel()
        raise


def _report_unscored(warn: Callable[[dict], None], rewards: torch.Tensor, batch: RewardBatch,
                     environments: Any) -> None:
    """The first row no reward function scored, with the keyword arguments upstream shows for it."""
    unscored = torch.isnan(rewards).all(dim=1)
    if not unscored.any():
        return
    idx = int(unscored.nonzero()[0, 0])
    row = {key: values[idx] for key, values in batch.columns.items()}
    if environments is not None:
        row["environments"] = environments[idx]
    row["prompt"] = batch.prompts[idx]
    row["completion"] = batch.completions[idx]
    warn(row)


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
        return model(**inputs).logits[:, 0].float()  # on the model's device: read back later


def log_failed_calls(trainer: Any, count: int) -> None:
    """``rewards/failed_calls``: the step's reward calls absorbed by a fail-soft policy, over every rank
    (each rank has the same count), in TRL's per-mode metrics (a plain dict of lists before 0.16)."""
    metrics = getattr(trainer, "_metrics", None)
    if metrics is None:
        return
    if "train" in metrics and "eval" in metrics:
        metrics = metrics["train" if trainer.model.training else "eval"]
    metrics["rewards/failed_calls"].append(float(count))


def trl_layout_rewards(trainer: Any, inputs: list[dict], prompts: list, completions: list,
                       completion_ids_list: list, *, num_generations: int, global_stats: bool,
                       profile: Callable[[str], Any] | None = None,
                       warn_unscored: Callable[[dict], None] | None = None, shape_hint: str = "") -> torch.Tensor:
    """Rewards ``[world * n, F]`` in the layout TRL's caller expects, computed by the kit.

    TRL's caller normalizes over the rows of all ranks and then keeps rows ``rank*n:(rank+1)*n``.
    Groups are rank-local, so a rank's own rows are all its group statistics need: other ranks'
    rows are filled with NaN (TRL treats all-NaN rows as unscorable and zeroes their advantages,
    and they are sliced away). The main process gets every rank's rows, so the metrics it logs
    are upstream's; ``global_stats`` (batch-level std) sends every rank the full tensor.
    ``profile``, ``warn_unscored``: the era's profiling context and unscored-row warning (see
    :func:`score_batch`); ``shape_hint``: how to fix a batch that is not whole groups.
    """
    state: TrainerPatchState = getattr(trainer, STATE_ATTR)
    options = state.options
    columns = {k: [ex[k] for ex in inputs] for k in inputs[0] if k not in UNSCORED_KEYS} if inputs else {}
    batch = RewardBatch(list(prompts), list(completions), list(completion_ids_list), columns)
    local_placement = options.reward_placement == "local"
    progress: dict[str, str] = Progress()  # announced: peers can name it if this rank gets stuck
    result = compute_rewards(
        batch,
        # chunks are cut inside score_batch, per function, so that each function's profiling timing
        # covers its whole share of the step (as upstream's does)
        lambda b, ids: score_batch(trainer, b, ids, num_generations=num_generations,
                                   with_environments=local_placement, chunk_size=options.reward_chunk_size,
                                   progress=progress, profile=profile, warn_unscored=warn_unscored,
                                   on_failure=options.reward_failure, rank=state.group.rank),
        group=state.group,
        placement=options.reward_placement,
        num_generations=num_generations,
        chunk_size=None,
        timeout=options.reward_timeout,
        everywhere=global_stats,
        running=lambda: progress.get("now", ""),
        shape_hint=shape_hint,
        on_failure=options.reward_failure,
        num_funcs=len(trainer.reward_funcs),
    )
    if options.reward_failure != "raise":
        log_failed_calls(trainer, result.failed_calls)
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
