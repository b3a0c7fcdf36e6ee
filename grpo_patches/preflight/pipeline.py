"""The preflight pipeline: resolve settings -> count parameters -> layout -> estimate -> advise -> report."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from grpo_patches.preflight.advise import check_fit, check_shapes, pinned_advice
from grpo_patches.preflight.count import ParamCount, architecture, count_parameters, count_reward_models
from grpo_patches.preflight.estimate import activation_bytes, estimate_inputs, estimate_ranks
from grpo_patches.preflight.layout import QUANTIZATIONS, SHARDINGS, Layout, resolve_layout
from grpo_patches.preflight.report import GiB, PreflightReport, PreflightWarning
from grpo_patches.preflight.settings import (
    RunSettings,
    as_bool,
    as_choice,
    as_number,
    as_whole,
    dtype_name,
    load_model_config,
    resolve_settings,
    reward_specs,
)

__all__ = ["preflight"]


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
    compile_training: bool = False,
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
    training forward (measured on the H200: -3.7 GiB at batch 192 of the 1.5B policy). ``compile_training``:
    the run uses ``apply(compile_training=True)``, whose compiled layers hold more per token in the
    training phase (``coefficients.json``, ``compiled_training``). ``sharding`` ("ddp", "zero2", "fsdp2", "zero3"; "auto":
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
    ``raise_on_error``; otherwise they are in ``report.errors``. Advice (trainable share, memory
    headroom, data and rewards) is issued as :class:`PreflightWarning` and kept in ``report.warnings``.
    """
    # Arguments as a user may pass them (numpy scalars, "false" from a command line) mean what they say;
    # a bad one is refused here, with its name and what it may be.
    if gpu_memory_gb is not None:
        gpu_memory_gb = as_number("gpu_memory_gb", gpu_memory_gb, minimum=0, inclusive=False)
    dataset_size = None if dataset_size is None else as_whole("dataset_size", dataset_size, 0)
    overhead_gb = as_number("overhead_gb", overhead_gb, minimum=0)
    fragmentation = as_number("fragmentation", fragmentation, minimum=0)
    lean_lora, double_quant = as_bool("lean_lora", lean_lora), as_bool("double_quant", double_quant)
    compile_training = as_bool("compile_training", compile_training)
    raise_on_error, warn = as_bool("raise_on_error", raise_on_error), as_bool("warn", warn)
    offload_base = None if offload_base is None else as_bool("offload_base", offload_base)
    sharding = as_choice("sharding", sharding, ("auto", *SHARDINGS))
    quantization = as_choice("quantization", quantization, QUANTIZATIONS)
    s = resolve_settings(grpo_config, lora_config=lora_config, world_size=world_size, gpu_memory_gb=gpu_memory_gb,
                         reward_placement=reward_placement, prompt_length=prompt_length, dtype=dtype,
                         logits_mode=logits_mode)
    cfg = load_model_config(model_config)
    arch = architecture(cfg)
    layout = resolve_layout(sharding, quantization=quantization, double_quant=double_quant, offload_base=offload_base,
                            deepspeed_config=deepspeed_config, hidden_size=arch.hidden,
                            gather_for_generation=s.gather_for_generation)
    params = count_parameters(cfg, s.lora)
    specs, n_functions = reward_specs(reward_models)
    rewards = count_reward_models(specs)

    capacity = int(gpu_memory_gb * GiB) if gpu_memory_gb is not None else None
    common, lean_width = estimate_inputs(s, arch, params, layout, rewards, capacity=capacity,
                                         overhead=int(overhead_gb * GiB), fragmentation=fragmentation,
                                         fast_generation=fast_generation, lean_lora=lean_lora,
                                         compile_training=compile_training)
    ranks = estimate_ranks(arch, params, checkpointing=s.checkpointing, **common)
    tokens = s.batch * (s.prompt + s.completion)
    # with and without checkpointing, as the run's layers hold them (lean_lora, compile_training)
    act_ckpt = activation_bytes(arch, tokens, s.act, s.dropout, True, common["lean_input"], compile_training)
    act_full = activation_bytes(arch, tokens, s.act, s.dropout, False, common["lean_input"], compile_training)

    shape_errors = check_shapes(s)
    fit_error, advice = check_fit(arch, params, ranks, s, common, lean_width, capacity)
    advice += pinned_advice(arch, params, s, layout, pinned_lora=lora_config is None, gpu_memory_gb=gpu_memory_gb,
                             dataset_size=dataset_size, reward_specs=specs, reward_functions=n_functions,
                             rewards=rewards, fast_generation=fast_generation)
    errors = [str(e) for e in shape_errors] + ([str(fit_error)] if fit_error is not None else [])
    report = PreflightReport(ranks, params, _report_settings(s, layout, params), act_ckpt, act_full, errors, advice)
    if warn:
        for message in advice:
            warnings.warn(f"grpo_patches.preflight: {message}", PreflightWarning, stacklevel=2)
    if raise_on_error:
        if shape_errors:
            raise shape_errors[0]
        if fit_error is not None:
            raise fit_error
    return report


def _report_settings(s: RunSettings, layout: Layout, params: ParamCount) -> dict[str, Any]:
    """The settings the report prints (and ``--plan`` reads back)."""
    return dict(world_size=s.world_size, per_device_train_batch_size=s.batch, steps_per_generation=s.steps,
                num_generations=s.num_generations, prompt_length=s.prompt, completion_length=s.completion,
                gradient_checkpointing=s.checkpointing, dtype=dtype_name(s.dtype), compute_dtype=s.compute_dtype,
                logits_mode=s.logits_mode, reward_placement=s.reward_placement, optim=s.optim, layout=layout.label(),
                host_weights_gb=(layout.base_bytes(params, s.w_bytes)["total"] / s.world_size / GiB
                                 if layout.offload_base else 0.0))
