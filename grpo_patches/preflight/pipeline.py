"""The preflight pipeline: resolve settings -> count parameters -> layout -> estimate -> advise -> report."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from grpo_patches.grouping import GroupShapeError, check_group_shape, resolve_steps_per_generation
from grpo_patches.preflight.advise import (
    _LARGE_MODEL_PARAMS,
    _MIN_DATASET_SIZE,
    _MIN_FREE_GB,
    _MIN_TOTAL_VRAM_GB,
    no_fit_message,
    share_advice,
)
from grpo_patches.preflight.count import architecture, count_parameters, count_reward_model
from grpo_patches.preflight.estimate import (
    FastGenerationMemory,
    activation_bytes,
    estimate_ranks,
    lean_input_width,
)
from grpo_patches.preflight.layout import DeepSpeedSettings, Layout, layout_from_environment
from grpo_patches.preflight.report import GiB, PreflightError, PreflightReport, PreflightWarning
from grpo_patches.preflight.settings import (
    check_setting_names,
    detect_logits_mode,
    dtype_bytes,
    dtype_name,
    load_model_config,
    reward_specs,
    setting,
)

__all__ = ["preflight"]

# ------------------------------------------------------------------------------------- preflight


def preflight(
    model_config: Any,
    *,
    grpo_config: Any = None,
    lora_config: Any = None,
    world_size: int = 1,
    gpu_memory_gb: float | None = None,
    reward_models: Sequence[Any] = (),
    reward_placement: str = "local",
    dataset_size: int | None = None,
    prompt_length: int | None = None,
    dtype: Any = None,
    logits_mode: str = "auto",
    overhead_gb: float = 1.0,
    fragmentation: float = 0.05,
    raise_on_error: bool = True,
    warn: bool = True,
    fast_generation: Any = False,
    lean_lora: bool = False,
    sharding: str = "auto",
    quantization: str | None = None,
    double_quant: bool = True,
    offload_base: bool | None = None,
    deepspeed_config: Any = None,
) -> PreflightReport:
    """Predict each rank's peak memory by component and check the run's shape before it starts.

    ``grpo_config``: a ``trl.GRPOConfig``, dict or namespace (missing settings take the pinned
    defaults of :mod:`grpo_patches.defaults`); ``lora_config``: a ``peft.LoraConfig`` (pinned when
    None); ``gpu_memory_gb``: GiB per GPU; ``reward_models``: configs / paths / presets /
    :class:`RewardModelSpec` (callables count as rule-based functions); ``reward_placement``: "local"
    (every rank) or "main" (rank 0); ``prompt_length``: tokens (default: the config's
    ``max_prompt_length``, else 256); ``dtype``: the frozen weights' dtype (default: the config's
    ``model_init_kwargs`` dtype, else bf16 when bf16 is on); ``fast_generation``: the run uses
    ``apply(fast_generation=...)`` (``True``, a dict of ``FastGenerationConfig`` fields or such a
    config): its static KV cache (prompt rounded up to ``bucket`` + completion) and merged-LoRA
    buffer (``merge_lora``: the adapted base weights once more) are counted in the generation phase,
    and in every phase with ``release_after_sampling=False``. ``lean_lora``: the run uses
    ``apply(lean_lora=True)``: under 16-bit autocast with fp32 adapters, no fp32 copy of the widest
    adapted input and its dropout output (8 bytes per element with dropout, 4 without) in the
    training forward (measured on the H200: -3.7 GiB at batch 192 of the 1.5B policy). ``sharding`` ("ddp", "zero2", "fsdp2", "zero3"; "auto":
    what ``accelerate launch`` set up, else ddp),
    ``quantization`` (None, "nf4", "int8": a bitsandbytes base, ``double_quant`` for nf4) and
    ``offload_base`` (frozen shards in host memory, fsdp2 / zero3; None: from accelerate's
    environment under "auto", else False) place the frozen base
    (:class:`~grpo_patches.preflight.layout.Layout`); under ZeRO-3 the config's
    ``ds3_gather_for_generation`` (TRL's default True) decides whether generation gathers the whole
    model; ``deepspeed_config`` (a DeepSpeed config dict or JSON path; default: accelerate's
    ``ACCELERATE_DEEPSPEED_CONFIG_FILE``, else DeepSpeed's defaults) gives ZeRO's bucket, prefetch,
    live / reuse and persistence sizes (:class:`~grpo_patches.preflight.layout.DeepSpeedSettings`).
    Unknown GRPO setting names raise ``TypeError`` with close matches.

    Errors (a group split across ranks, a predicted peak over ``gpu_memory_gb``) raise
    ``ValueError`` (:class:`GroupShapeError` / :class:`PreflightError`) with the fix when
    ``raise_on_error``; otherwise they are in ``report.errors``. Advice (S4 trainable share, S8
    headroom, S9) is issued as :class:`PreflightWarning` and kept in ``report.warnings``.
    """
    from grpo_patches.defaults import ARTICLE_TRAINING_SETTINGS

    if reward_placement not in ("local", "main"):
        raise ValueError(f"reward_placement={reward_placement!r} must be 'local' or 'main'.")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an integer >= 1.")
    if gpu_memory_gb is not None and not gpu_memory_gb > 0:
        raise ValueError(f"gpu_memory_gb={gpu_memory_gb!r} must be > 0.")
    if logits_mode not in ("auto", "fused", "full"):
        raise ValueError(f"logits_mode={logits_mode!r} must be 'auto', 'fused' or 'full'.")

    g = grpo_config
    check_setting_names(g)
    if sharding == "auto":
        detected = layout_from_environment()
        sharding = detected["sharding"]
        offload_base = detected["offload_base"] if offload_base is None else offload_base
    cfg = load_model_config(model_config)
    arch = architecture(cfg)
    if deepspeed_config is None and sharding.startswith("zero"):
        deepspeed_config = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or None
    ds = DeepSpeedSettings.from_config(deepspeed_config, arch.hidden)
    if offload_base is None and sharding == "zero3" and ds.offload_param in ("cpu", "nvme"):
        offload_base = True
    layout = Layout(sharding=sharding, quantization=quantization, double_quant=double_quant,
                    offload_base=bool(offload_base),
                    gather_for_generation=bool(setting(g, "ds3_gather_for_generation", True)), ds=ds)
    art = ARTICLE_TRAINING_SETTINGS
    batch = int(setting(g, "per_device_train_batch_size", art["per_device_train_batch_size"]))
    accum = int(setting(g, "gradient_accumulation_steps", art["gradient_accumulation_steps"]))
    if g is not None and not isinstance(g, Mapping) and not hasattr(g, "steps_per_generation"):
        steps = 1  # a TRL < 0.19 config: every micro-batch generates its own groups
    else:
        steps = resolve_steps_per_generation(
            {"per_device_train_batch_size": batch, "gradient_accumulation_steps": accum,
             "steps_per_generation": setting(g, "steps_per_generation", None),
             "generation_batch_size": setting(g, "generation_batch_size", None)}
            if isinstance(g, Mapping) or g is None else g,
            world_size=world_size)
    num_gen = int(setting(g, "num_generations", art["group_size"]))
    completion = int(setting(g, "max_completion_length", art["max_length"] // 2))
    prompt = int(prompt_length if prompt_length is not None else setting(g, "max_prompt_length", art["max_length"] // 2))
    checkpointing = bool(setting(g, "gradient_checkpointing", art["gradient_checkpointing"]))
    bf16 = bool(setting(g, "bf16", True)) if g is not None else True
    fp16 = bool(setting(g, "fp16", False))
    compute_dtype = "bfloat16" if bf16 else ("float16" if fp16 else "float32")
    init_kwargs = setting(g, "model_init_kwargs", {}) or {}
    if dtype is None:
        dtype = init_kwargs.get("dtype") or init_kwargs.get("torch_dtype")
        if dtype in (None, "auto"):
            dtype = compute_dtype
    optim = setting(g, "optim", art["optim"])
    optim = str(getattr(optim, "value", optim))  # OptimizerNames is a str enum
    mode = detect_logits_mode() if logits_mode == "auto" else logits_mode

    from grpo_patches.defaults import lora_config as default_lora

    lora = default_lora() if lora_config is None else lora_config
    params = count_parameters(cfg, lora)
    dropout = float(getattr(lora, "lora_dropout", 0.0) or 0.0) > 0

    specs, n_functions = reward_specs(reward_models)
    rewards = []
    for spec in specs:
        rm_cfg = load_model_config(spec.config)
        rewards.append((spec, architecture(rm_cfg), count_reward_model(rm_cfg)))

    errors: list[str] = []
    advice: list[str] = []
    group_error: GroupShapeError | None = None
    try:
        check_group_shape(per_device_batch_size=batch, steps_per_generation=steps, num_generations=num_gen,
                          world_size=world_size, mode="train")
    except GroupShapeError as e:
        group_error = e
        errors.append(str(e))
    if setting(g, "eval_strategy", "no") != "no":  # IntervalStrategy is a str enum: compares by value
        try:
            check_group_shape(per_device_batch_size=int(setting(g, "per_device_eval_batch_size", 8)),
                              steps_per_generation=1,
                              num_generations=int(setting(g, "num_generations_eval", num_gen)),
                              world_size=world_size, mode="eval")
        except GroupShapeError as e:
            group_error = group_error or e
            errors.append(str(e))

    capacity = int(gpu_memory_gb * GiB) if gpu_memory_gb is not None else None
    # the input width whose fp32 copy lean_lora removes (0: stock PEFT makes no copy in this setup)
    lean_width = lean_input_width(arch, lora, layout) if dtype_bytes(compute_dtype) == 2 else 0
    common = dict(world_size=world_size, batch=batch, steps=steps, prompt=prompt, completion=completion,
                  w_bytes=dtype_bytes(dtype), act=dtype_bytes(compute_dtype), dropout=dropout, optim=optim,
                  logits_mode=mode, rewards=rewards, placement=reward_placement, capacity=capacity,
                  overhead=int(overhead_gb * GiB), fragmentation=fragmentation,
                  fast=(FastGenerationMemory.of(fast_generation, prompt=prompt, completion=completion,
                                                params=params, weight_bytes=dtype_bytes(dtype),
                                                quantized=layout.quantization is not None)
                        if fast_generation and layout.sharding == "ddp" else None),
                  layout=layout, lean_input=lean_width if lean_lora else 0)
    ranks = estimate_ranks(arch, params, checkpointing=checkpointing, **common)
    act_ckpt = activation_bytes(arch, batch * (prompt + completion), common["act"], dropout, True)
    act_full = activation_bytes(arch, batch * (prompt + completion), common["act"], dropout, False)

    fit_error: PreflightError | None = None
    over = [r for r in ranks if r.fits is False]
    if over:
        fit_error = PreflightError(no_fit_message(arch, params, over, checkpointing, common, lean_width))
        errors.append(str(fit_error))
    elif capacity is not None:
        tight = [r.rank for r in ranks if r.headroom is not None and r.headroom < _MIN_FREE_GB * GiB]
        if tight:
            advice.append(
                f"ranks {tight} are predicted to keep under {_MIN_FREE_GB:g} GiB free (S8 keeps >= 2 GiB per GPU "
                f"for peaks); lower per_device_train_batch_size or max_completion_length."
            )

    advice += share_advice(params, lora_config is None)
    total_vram = world_size * gpu_memory_gb if gpu_memory_gb is not None else None
    if params.total >= _LARGE_MODEL_PARAMS and total_vram is not None and total_vram < _MIN_TOTAL_VRAM_GB:
        advice.append(
            f"{params.total / 1e9:.0f}B parameters on {total_vram:g} GiB of VRAM in all (under {_MIN_TOTAL_VRAM_GB:g}): "
            f"S9 says multi-GPU GRPO + LoRA is not worth it here; use more GPUs or a 4-bit single-GPU setup."
        )
    if dataset_size is not None and dataset_size < _MIN_DATASET_SIZE:
        advice.append(
            f"dataset_size={dataset_size} is under {_MIN_DATASET_SIZE} examples: S9 says GRPO is not worth it on so "
            f"little data; collect more prompts or use supervised fine-tuning."
        )
    if not specs:
        what = f"only {n_functions} rule-based reward function(s)" if n_functions else "no reward model"
        advice.append(
            f"{what}: S9 advises GRPO with a learned reward model of the policy's family; pass it in reward_models "
            f"so its memory is counted."
        )
    elif arch.model_type and not any(a.model_type == arch.model_type for _, a, _ in rewards):
        advice.append(
            f"no reward model shares the policy's family ({arch.model_type}); S9 advises one of the same family."
        )
    if fast_generation and layout.sharding != "ddp":
        advice.append(f"fast_generation under {layout.sharding}: the kit samples eagerly there (parameters are "
                      f"gathered per call), so no static cache is counted.")
    if bool(setting(g, "use_vllm", False)):
        advice.append("use_vllm=True: vLLM's memory pool is not modelled; the generation figures assume transformers.")
    if arch.moe:
        advice.append("mixture-of-experts config: activations use the routed experts' width; treat them as rough.")

    settings = dict(world_size=world_size, per_device_train_batch_size=batch, steps_per_generation=steps,
                    num_generations=num_gen, prompt_length=prompt, completion_length=completion,
                    gradient_checkpointing=checkpointing, dtype=dtype_name(dtype), compute_dtype=compute_dtype,
                    logits_mode=mode, reward_placement=reward_placement, optim=optim, layout=layout.label(),
                    host_weights_gb=(layout.base_bytes(params, dtype_bytes(dtype))["total"] / world_size / GiB
                                     if layout.offload_base else 0.0))
    report = PreflightReport(ranks, params, settings, act_ckpt, act_full, errors, advice)
    if warn:
        for message in advice:
            warnings.warn(f"grpo_patches.preflight: {message}", PreflightWarning, stacklevel=2)
    if raise_on_error:
        if group_error is not None:
            raise group_error
        if fit_error is not None:
            raise fit_error
    return report
