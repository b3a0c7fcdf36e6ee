"""Advise: what to change when a run does not fit, and advice on a run that fits (trainable share,
memory headroom, when GRPO + LoRA on several GPUs is not worth it).

The fifth stage of the pipeline (see :mod:`grpo_patches.preflight`): it reads the estimates and
re-estimates the run with one setting changed to show what each fix would need.
"""

from __future__ import annotations

from typing import Any

from grpo_patches.grouping import GroupShapeError, check_group_shape
from grpo_patches.preflight.count import Arch, ParamCount
from grpo_patches.preflight.estimate import estimate_ranks
from grpo_patches.preflight.layout import Layout
from grpo_patches.preflight.report import GiB, PreflightError, RankEstimate, gib
from grpo_patches.preflight.settings import RewardModelSpec, RunSettings

__all__ = ["article_advice", "check_fit", "check_shapes", "no_fit_message", "share_advice"]

#: The advised trainable-share band (0.1-0.5%) holds for a 70B model, where the pinned LoRA
#: gives 0.2927% (counted on the meta device for the Llama-3.1-70B config). For other sizes the band
#: is scaled by the share the pinned LoRA gives on that architecture (0.52% at 8B, 1.2% at 1.5B).
_ARTICLE_SHARE_BAND = (0.001, 0.005)
_ARTICLE_SHARE_REFERENCE = 0.002927
_LARGE_MODEL_PARAMS = 65e9  # "70B+": Llama 65B / 70B class
_MIN_TOTAL_VRAM_GB = 40.0
_MIN_DATASET_SIZE = 1000
_MIN_FREE_GB = 2.0  # free memory per GPU kept for peaks the model does not see


def share_advice(params: ParamCount, pinned: bool) -> list[str]:
    scale = params.reference_share / _ARTICLE_SHARE_REFERENCE
    low, high = (b * scale for b in _ARTICLE_SHARE_BAND)
    share = params.share
    if low <= share <= high:
        return []
    hint = ("more weights than the adapter are trainable (modules_to_save, an unfrozen layer?) or r is too large"
            if share > high else "r is small or few modules are targeted")
    return [
        f"trainable share {100 * share:.3f}% is outside {100 * low:.3f}-{100 * high:.3f}% (0.1-0.5% is advised for 70B, "
        f"scaled to this architecture, where the pinned r=16 on q/k/v/o/gate/up/down gives "
        f"{100 * params.reference_share:.3f}%): {hint}."
        + ("" if not pinned else " (pinned LoRA)")
    ]


def no_fit_message(arch: Arch, params: ParamCount, over: list[RankEstimate], checkpointing: bool,
                    common: dict[str, Any], lean_width: int = 0) -> str:
    worst = max(over, key=lambda r: r.required)
    top = sorted(worst.components.items(), key=lambda kv: -kv[1])[:3]
    cap = worst.capacity or 0
    msg = (
        f"grpo_patches.preflight: rank {worst.rank} needs {gib(worst.required)} (peak {gib(worst.peak)} in "
        f"{worst.peak_phase} + overhead) but has {gib(cap)}; largest parts: "
        + ", ".join(f"{k} {gib(v)}" for k, v in top)
        + "."
    )
    fixes = []

    def try_fix(label: str, **change: Any) -> None:
        c = {**common, **change}
        ck = c.pop("checkpointing", checkpointing)
        est = estimate_ranks(arch, params, checkpointing=ck, **c)
        need = max(r.required for r in est)
        fixes.append(f"{label} -> {gib(need)}{' (fits)' if need <= cap else ''}")

    if not checkpointing:
        try_fix("gradient_checkpointing=True", checkpointing=True)
    if common["batch"] > 1 and common["batch"] % 2 == 0:
        try_fix(f"per_device_train_batch_size={common['batch'] // 2} with steps_per_generation={common['steps'] * 2}",
                batch=common["batch"] // 2, steps=common["steps"] * 2)
    if common["completion"] >= 64:
        try_fix(f"max_completion_length={common['completion'] // 2}", completion=common["completion"] // 2)
    if common["rewards"] and common["placement"] == "local" and common["world_size"] > 1:
        try_fix("reward_placement='main'", placement="main")
    if lean_width and not common["lean_input"]:
        try_fix("grpo_patches.apply(lean_lora=True) (and preflight(..., lean_lora=True))", lean_input=lean_width)
    if common["w_bytes"] > common["act"]:
        try_fix("load the policy in bf16 (model_init_kwargs={'dtype': 'bfloat16'})", w_bytes=common["act"])
    if worst.components["weights"] + worst.overhead > cap:
        n = common["world_size"]
        fixes.append(
            f"the frozen weights alone ({gib(worst.components['weights'])}) exceed one GPU: shard them across the "
            f"ranks (sharding='fsdp2' / 'zero3', ~{gib(worst.components['weights'] / n)} each at world_size={n}), "
            f"offload them (offload_base=True) or load them in 4-bit (quantization='nf4'); "
            f"`grpo-patches doctor ... --plan` ranks the combinations that fit"
        )
    return msg + (" Options: " + "; ".join(fixes) + "." if fixes else " Use GPUs with more memory.")


def check_shapes(s: RunSettings) -> list[GroupShapeError]:
    """The rank-local group rule for training, and for evaluation when the run evaluates."""
    found: list[GroupShapeError] = []
    try:
        check_group_shape(per_device_batch_size=s.batch, steps_per_generation=s.steps, num_generations=s.num_generations,
                          world_size=s.world_size, mode="train")
    except GroupShapeError as e:
        found.append(e)
    if s.eval_shape is not None:
        try:
            check_group_shape(per_device_batch_size=s.eval_shape[0], steps_per_generation=1,
                              num_generations=s.eval_shape[1], world_size=s.world_size, mode="eval")
        except GroupShapeError as e:
            found.append(e)
    return found


def check_fit(arch: Arch, params: ParamCount, ranks: list[RankEstimate], s: RunSettings, common: dict[str, Any],
              lean_width: int, capacity: int | None) -> tuple[PreflightError | None, list[str]]:
    """A :class:`PreflightError` naming the fixes when a rank does not fit; else headroom advice."""
    over = [r for r in ranks if r.fits is False]
    if over:
        return PreflightError(no_fit_message(arch, params, over, s.checkpointing, common, lean_width)), []
    if capacity is not None:
        tight = [r.rank for r in ranks if r.headroom is not None and r.headroom < _MIN_FREE_GB * GiB]
        if tight:
            return None, [
                f"ranks {tight} are predicted to keep under {_MIN_FREE_GB:g} GiB free (keep >= 2 GiB per GPU "
                f"for peaks the estimate does not see: fragmentation, other processes); lower per_device_train_batch_size or max_completion_length."
            ]
    return None, []


def article_advice(arch: Arch, params: ParamCount, s: RunSettings, layout: Layout, *, pinned_lora: bool,
                   gpu_memory_gb: float | None, dataset_size: int | None, reward_specs: list[RewardModelSpec],
                   reward_functions: int, rewards: list[tuple[RewardModelSpec, Arch, int]],
                   fast_generation: Any) -> list[str]:
    """Trainable share, when GRPO + LoRA is not worth it, and what the model leaves out for this run."""
    advice = share_advice(params, pinned_lora)
    total_vram = s.world_size * gpu_memory_gb if gpu_memory_gb is not None else None
    if params.total >= _LARGE_MODEL_PARAMS and total_vram is not None and total_vram < _MIN_TOTAL_VRAM_GB:
        advice.append(
            f"{params.total / 1e9:.0f}B parameters on {total_vram:g} GiB of VRAM in all (under {_MIN_TOTAL_VRAM_GB:g}): "
            f"multi-GPU GRPO + LoRA is not worth it here; use more GPUs or a 4-bit single-GPU setup."
        )
    if dataset_size is not None and dataset_size < _MIN_DATASET_SIZE:
        advice.append(
            f"dataset_size={dataset_size} is under {_MIN_DATASET_SIZE} prompts: GRPO learns little from so few; "
            f"collect more prompts or use supervised fine-tuning."
        )
    if not reward_specs and not reward_functions:
        advice.append(
            "no reward model or function given: if the run scores with a reward model, pass it in reward_models "
            "(doctor: --reward-model) so its memory is counted."
        )
    elif reward_specs and arch.model_type and not any(a.model_type == arch.model_type for _, a, _ in rewards):
        advice.append(
            f"no reward model shares the policy's family ({arch.model_type}); one of the same family (same "
            f"tokenizer) scores the policy's text as it was written."
        )
    if fast_generation and layout.sharding != "ddp":
        advice.append(f"fast_generation under {layout.sharding}: the kit samples eagerly there (parameters are "
                      f"gathered per call), so no static cache is counted.")
    if s.use_vllm:
        advice.append("use_vllm=True: vLLM's memory pool is not modelled; the generation figures assume transformers.")
    if arch.moe:
        advice.append("mixture-of-experts config: activations use the routed experts' width; treat them as rough.")
    return advice
