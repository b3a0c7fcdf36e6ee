"""Pinned LoRA and memory defaults as real config objects.

Why real objects: a dict of settings silently keeps a misspelt key or a field that the installed TRL
release renamed; a ``peft.LoraConfig`` / ``trl.GRPOConfig`` built here is checked by the library
itself, and the mapping below is decided by looking at ``dataclasses.fields(trl.GRPOConfig)`` at call
time (no version checks), so one code path serves every release.

The pinned training settings (in their common names) and where each lands:

=====================  ===========================================================================
article                here
=====================  ===========================================================================
group_size=4           ``num_generations=4`` (``group_size`` is accepted as an alias)
max_length=512         prompt + completion budget: ``max_prompt_length=256`` where the release has
                       it (gone from TRL 0.28), ``max_completion_length=256`` everywhere
bf16, tf32             bf16 only where the device supports it; tf32 only on CUDA compute >= 8.0
gradient_checkpointing on, ``use_reentrant=False`` (PEFT-safe); ``True`` for PEFT + DeepSpeed
                       ZeRO-3 (TRL PR #6356, transformers#47254)
entropy_coef=0.01      ``entropy_coef`` where the release has it
reward_baseline=0.0    no TRL field: GRPO's baseline is the group mean, and an extra baseline of 0
                       changes nothing; a non-zero value is named in a warning and not applied
=====================  ===========================================================================

A pinned setting the installed release has no field for is left out silently (the defaults fit every
supported release without a warning); a setting the *caller* passed that the release lacks is named
in a :class:`DefaultsWarning` and not applied.

The model-side half of the memory settings (input gradients for PEFT + checkpointing, TRL issues
#3089 / #3150) cannot live in a config object: :func:`apply_lora` does it.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from grpo_patches.grouping import check_group_shape, resolve_steps_per_generation

__all__ = [
    "ARTICLE_LORA_SETTINGS",
    "ARTICLE_TRAINING_SETTINGS",
    "DefaultsWarning",
    "apply_lora",
    "grpo_config",
    "lora_config",
]

LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

#: LoRA: r=16 (not 32, not 8); alpha = 2r; every attention and MLP projection.
ARTICLE_LORA_SETTINGS: dict[str, Any] = {
    "r": 16,
    "lora_alpha": 32,
    "lora_dropout": 0.05,
    "target_modules": list(LORA_TARGET_MODULES),
    "bias": "none",
    "task_type": "CAUSAL_LM",
    "inference_mode": False,
}

#: The pinned training settings, in their common names; see the module docstring for how each maps onto GRPOConfig.
ARTICLE_TRAINING_SETTINGS: dict[str, Any] = {
    "per_device_train_batch_size": 1,
    "gradient_accumulation_steps": 4,
    "num_train_epochs": 3,
    "learning_rate": 1e-5,
    "warmup_steps": 50,
    "logging_steps": 10,
    "save_steps": 100,
    "eval_steps": 100,
    "optim": "adamw_torch",
    "lr_scheduler_type": "cosine",
    "gradient_checkpointing": True,
    "group_size": 4,
    "temperature": 0.7,
    "top_p": 0.9,
    "max_length": 512,
    "reward_baseline": 0.0,
    "entropy_coef": 0.01,
}

# Article / kit names handled by hand below (max_prompt_length: a field only before TRL 0.28).
_ALIASES = ("group_size", "max_length", "max_prompt_length", "reward_baseline")


class DefaultsWarning(UserWarning):
    """A pinned setting the installed TRL release cannot express; named, never faked."""


# --------------------------------------------------------------------------------------------- LoRA


def lora_config(**overrides: Any) -> Any:
    """The pinned LoRA settings as a ``peft.LoraConfig``; any LoraConfig field can be overridden.

    Raises ``TypeError`` for a name LoraConfig does not have (listing the valid ones) and ``ValueError``
    for a value out of range, before PEFT sees it, so the message names the setting and its range.
    """
    import peft

    valid = sorted(f.name for f in dataclasses.fields(peft.LoraConfig) if f.init)
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise TypeError(f"lora_config() got unknown setting(s) {_suggest(unknown, valid)}; valid names: {', '.join(valid)}.")
    settings = {**ARTICLE_LORA_SETTINGS, **overrides}
    _check_lora_values(settings)
    return peft.LoraConfig(**settings)


def _suggest(unknown: list[str], valid: list[str]) -> str:
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name, valid, n=2)
        parts.append(f"{name!r}" + (f" (did you mean {' or '.join(close)}?)" if close else ""))
    return ", ".join(parts)


def _check_lora_values(s: Mapping[str, Any]) -> None:
    r = s["r"]
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise ValueError(f"lora_config: r={r!r} is out of range; it must be an integer >= 1 (pinned: 16).")
    alpha = s["lora_alpha"]
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ValueError(f"lora_config: lora_alpha={alpha!r} is out of range; it must be > 0 (pinned: 2 * r).")
    p = s["lora_dropout"]
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise ValueError(f"lora_config: lora_dropout={p!r} is out of range; it must be in [0, 1) (pinned: 0.05).")
    targets = s["target_modules"]
    if targets is not None and not isinstance(targets, str) and len(list(targets)) == 0:
        raise ValueError("lora_config: target_modules=[] selects no module; give at least one (pinned: q/k/v/o/gate/up/down_proj).")
    if s["bias"] not in ("none", "all", "lora_only"):
        raise ValueError(f"lora_config: bias={s['bias']!r} is out of range; it must be one of 'none', 'all', 'lora_only'.")


def apply_lora(model: Any, config: Any = None, *, args: Any = None) -> Any:
    """Wrap ``model`` with a LoRA adapter (pinned settings unless ``config`` is given), ready for GRPO.

    Freezes every non-LoRA weight (``get_peft_model`` does) and, when ``args`` (a GRPOConfig or anything
    with ``gradient_checkpointing``) turns checkpointing on, enables input gradients: with frozen
    embeddings, *reentrant* checkpointing recomputes a segment whose inputs need no gradient, so the
    LoRA weights get none ("element 0 of tensors does not require grad", TRL issues #3089 / #3150).
    TRL >= 0.26 does this itself for a PEFT model; older releases and hand-built loops do not.
    """
    import peft

    config = lora_config() if config is None else config
    model = peft.get_peft_model(model, config)
    if args is None or getattr(args, "gradient_checkpointing", False):
        model.enable_input_require_grads()
    return model


# --------------------------------------------------------------------------------------- GRPOConfig


def _bf16_supported() -> bool:
    return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())


def _tf32_supported() -> bool:
    return bool(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8)


def _zero_stage(deepspeed: Any) -> int | None:
    """The ZeRO stage of a ``deepspeed`` setting (dict or JSON path), else of ``accelerate launch``'s env."""
    cfg = None
    if isinstance(deepspeed, Mapping):
        cfg = deepspeed
    elif isinstance(deepspeed, (str, os.PathLike)) and Path(deepspeed).is_file():
        try:
            cfg = json.loads(Path(deepspeed).read_text())
        except (OSError, ValueError):
            cfg = None
    if cfg is not None:
        stage = cfg.get("zero_optimization", {}).get("stage")
        return int(stage) if stage is not None else None
    env = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    if env is not None and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("1", "true", "yes"):
        return int(env)
    return None


def _check_training_values(s: Mapping[str, Any]) -> None:
    def bad(name: str, rng: str) -> ValueError:
        return ValueError(f"grpo_config: {name}={s[name]!r} is out of range; it must be {rng}.")

    def is_num(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    checks = {
        "num_generations": (lambda v: isinstance(v, int) and v >= 2, "an integer >= 2 (GRPO needs a group to normalize)"),
        "per_device_train_batch_size": (lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
        "gradient_accumulation_steps": (lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
        "learning_rate": (lambda v: is_num(v) and v > 0, "> 0"),
        "temperature": (lambda v: is_num(v) and v > 0, "> 0"),
        "top_p": (lambda v: is_num(v) and 0 < v <= 1, "in (0, 1]"),
        "max_length": (lambda v: isinstance(v, int) and v >= 2, "an integer >= 2 (prompt + completion tokens)"),
        "max_prompt_length": (lambda v: v is None or (isinstance(v, int) and v >= 1), "an integer >= 1 or None"),
        "max_completion_length": (lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
        "num_train_epochs": (lambda v: is_num(v) and v > 0, "> 0"),
        "warmup_steps": (lambda v: is_num(v) and v >= 0, ">= 0"),
        "entropy_coef": (lambda v: is_num(v) and v >= 0, ">= 0"),
        "reward_baseline": (lambda v: is_num(v), "a finite number"),
    }
    for name, (ok, rng) in checks.items():
        if name in s and not ok(s[name]):
            raise bad(name, rng)


def grpo_config(output_dir: str, **overrides: Any) -> Any:
    """The pinned training and memory settings as a ``trl.GRPOConfig`` of the installed release.

    ``overrides`` may name any GRPOConfig field or one of the article's names (``group_size``,
    ``max_length``, ``reward_baseline``). Unknown names raise ``TypeError`` listing the valid ones;
    values out of range raise ``ValueError``; a per-rank batch that would split a group across ranks
    raises :class:`~grpo_patches.grouping.GroupShapeError` with the nearest valid settings. Settings
    the caller passed that the release lacks are named in a :class:`DefaultsWarning` and left out; pinned
    ones it lacks are left out silently.
    """
    import trl

    fields = {f.name for f in dataclasses.fields(trl.GRPOConfig) if f.init}
    valid = sorted(fields | set(_ALIASES))
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise TypeError(f"grpo_config() got unknown setting(s) {_suggest(unknown, valid)}; valid names: {', '.join(valid)}.")
    if "group_size" in overrides and "num_generations" in overrides:
        raise TypeError("grpo_config(): give group_size or num_generations (the same setting), not both.")

    settings = dict(ARTICLE_TRAINING_SETTINGS)
    settings["num_generations"] = settings.pop("group_size")
    ov = dict(overrides)
    if "group_size" in ov:
        ov["num_generations"] = ov.pop("group_size")
    # max_length is the article's prompt + completion budget: split it unless the parts are given.
    max_length = ov.pop("max_length", settings.pop("max_length"))
    settings["max_length"] = max_length
    _check_training_values({"max_length": max_length})
    prompt_len = ov.pop("max_prompt_length", max_length // 2)
    settings["max_prompt_length"] = prompt_len
    settings["max_completion_length"] = ov.pop(
        "max_completion_length", max_length - (prompt_len if prompt_len is not None else max_length // 2)
    )
    settings.update(ov)
    _check_training_values(settings)
    adapted: list[str] = []
    if "steps_per_generation" not in fields and "per_device_train_batch_size" not in ov:
        # TRL < 0.19 generates per micro-batch, so the article's batch of 1 cannot hold a group there:
        # the smallest batch that can is one group.
        batch, group = settings["per_device_train_batch_size"], settings["num_generations"]
        if batch % group:
            settings["per_device_train_batch_size"] = group * math.ceil(batch / group)
            adapted.append(
                f"per_device_train_batch_size={settings['per_device_train_batch_size']} instead of {batch}: this "
                f"release has no steps_per_generation, so each micro-batch must hold whole groups of {group}"
            )

    lacking: list[str] = []
    kwargs: dict[str, Any] = {"output_dir": output_dir}
    baseline = settings.pop("reward_baseline")
    settings.pop("max_length")
    if baseline != 0.0:
        lacking.append(f"reward_baseline={baseline} (no TRL release has it; GRPO's baseline is the group mean)")
    chosen = set(overrides) | ({"max_prompt_length"} if "max_length" in overrides else set())
    for name, value in settings.items():
        if name in fields:
            kwargs[name] = value
        elif name not in chosen:
            continue  # a pinned default this release cannot express: left out, silently
        elif name == "max_prompt_length":
            if value is not None:
                lacking.append(
                    f"max_prompt_length={value} (this release does not truncate prompts; truncate them in the "
                    f"dataset to keep prompt + completion within {max_length} tokens)"
                )
        else:
            lacking.append(f"{name}={value}")

    # Memory settings for the combination in use, unless the caller chose them.
    if "bf16" not in ov and "fp16" not in ov and "bf16" in fields:
        # TRL >= 0.19 defaults to True, which fails on CPU / pre-Ampere. Under `accelerate launch` the
        # config's mixed_precision decides: DeepSpeed refuses a bf16 that differs from its own.
        launched = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
        deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("1", "true", "yes")
        kwargs["bf16"] = launched == "bf16" if launched in ("bf16", "fp16") or deepspeed else _bf16_supported()
        if launched == "fp16" and "fp16" in fields:
            kwargs["fp16"] = True
    if "tf32" not in ov and "tf32" in fields and _tf32_supported():
        kwargs["tf32"] = True
    if kwargs.get("gradient_checkpointing") and "gradient_checkpointing_kwargs" not in ov:
        # Non-reentrant works for PEFT without input grads; PEFT + ZeRO-3 needs reentrant (TRL PR #6356).
        reentrant = _zero_stage(ov.get("deepspeed")) == 3
        kwargs["gradient_checkpointing_kwargs"] = {"use_reentrant": reentrant}
    if "ddp_find_unused_parameters" in fields and "ddp_find_unused_parameters" not in ov:
        # A PeftModel is not a PreTrainedModel, so Trainer asks DDP to look for unused parameters: a graph
        # walk every step (0.974x step time with the pin on 2 H200s, benchmarks/results/), a PyTorch
        # warning on every rank, and with checkpointing a failure ("mark a variable ready only once",
        # TRL 0.23 / 0.26 + transformers 4.x). Every LoRA weight is used in every forward, so there are
        # none to look for, with checkpointing or without.
        kwargs["ddp_find_unused_parameters"] = False

    _check_settings_group_shape(settings, fields)
    if adapted:
        warnings.warn(f"grpo_patches: TRL {trl.__version__}: {'; '.join(adapted)}.", DefaultsWarning, stacklevel=2)
    if lacking:
        warnings.warn(
            f"grpo_patches: TRL {trl.__version__} has no field for: {'; '.join(lacking)}. Not applied.",
            DefaultsWarning,
            stacklevel=2,
        )
    config = trl.GRPOConfig(**kwargs)
    _check_config_group_shape(config)
    return config


def _check_settings_group_shape(s: Mapping[str, Any], fields: set[str]) -> None:
    """Whole groups per rank (I1), before TRL sees the settings: TRL checks only the global batch, and
    its message does not say which settings would work. World size from ``WORLD_SIZE`` (set by
    ``accelerate launch`` / ``torchrun``)."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    batch = s["per_device_train_batch_size"]
    # TRL < 0.19 has no steps_per_generation: each micro-batch generates its own groups.
    steps = resolve_steps_per_generation(s, world_size=world) if "steps_per_generation" in fields else 1
    check_group_shape(per_device_batch_size=batch, steps_per_generation=steps,
                      num_generations=s["num_generations"], world_size=world, mode="train")


def _check_config_group_shape(config: Any) -> None:
    """Whole groups per rank (I1), on the world size the config was built for."""
    # Before steps_per_generation existed (TRL < 0.19) each micro-batch generated its own groups.
    steps = getattr(config, "steps_per_generation", None) or 1
    check_group_shape(
        per_device_batch_size=config.per_device_train_batch_size,
        steps_per_generation=steps,
        num_generations=config.num_generations,
        world_size=getattr(config, "world_size", 1),
        mode="train",
    )
