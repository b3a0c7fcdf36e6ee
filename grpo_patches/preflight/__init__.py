"""Preflight: predict each rank's peak GPU memory for GRPO + LoRA, and check the shape rules, before a run.

Nothing is loaded: parameters are counted on the meta device (``AutoModelForCausalLM.from_config``
under ``torch.device("meta")``, then ``peft.get_peft_model``), so a 70B config is checked on a CPU in
seconds. TRL is optional: the GRPO settings may be a ``trl.GRPOConfig``, a dict or a namespace.

The pipeline, one module per stage, each value computed once and passed down (:mod:`.pipeline`):
resolve the settings (:mod:`.settings`) -> count the parameters (:mod:`.count`) -> place the frozen
base (:mod:`.layout`) -> estimate each rank (:mod:`.estimate`, with the measured coefficients of
``coefficients.json``) -> advise (:mod:`.advise`) -> the report (:mod:`.report`). :mod:`.plan` runs the
pipeline once per layout for ``doctor --plan``, :mod:`.tune` once per micro-batch x generation batch at the
user's completions per step for ``doctor --tune``.

Memory model (bytes; "act" = the autocast compute dtype: 2 for bf16/fp16, 4 for fp32; "w" = the
dtype the frozen policy weights are loaded in; T = training micro-batch tokens = B * (P + C);
N_c = completion tokens = B * C; N_gen = completions a rank generates at once = B * S; B =
per_device_train_batch_size, S = steps_per_generation, P / C = prompt / completion length):

- ``weights``: frozen policy parameters * w. DDP keeps a full copy per rank.
- ``lora_params`` / ``lora_grads`` / ``optimizer_state``: trainable parameters * 4 each (PEFT keeps
  adapters in fp32), AdamW two fp32 moments (8 bytes; 8-bit optimizers 2); with world_size > 1 DDP
  adds a gradient bucket copy (4 bytes) to ``lora_grads``.
- ``activations``: per layer per token the activation coefficients (measured, see below) times the layer's widths;
  with gradient checkpointing: L * T * hidden * act (the saved layer inputs) plus one layer
  recomputed; plus a backward workspace of T * (3 * intermediate + 2 * hidden) * act, less, with
  ``lean_lora`` under 16-bit autocast and fp32 adapters, PEFT's fp32 copy of the widest adapted input
  and its fp32 dropout output (T * width * 8; * 4 without dropout; measured on the H200: -3.7 GiB).
  With ``compile_training`` the recomputed layer and the workspace are 1.35x (measured on the H200).
- ``logits_logps``: TRL >= 1.x with a fused LM head (``add_fused_lm_head``) never materializes the
  logits: one [min(N_c, 4096), 32768] tile in act, plus an fp32 gradient of the hidden states and
  an act copy of them (N_c * hidden * (4 + 2 * act)). Older releases ("full"): the [B, C + 1, V]
  logits, the temperature-scaled copy and the per-row log-softmax saved for backward: 3 * B * (C + 1)
  * V * act.
- ``autocast_cache``: fp32 frozen weights under bf16/fp16 autocast are cast per matmul and autograd
  keeps the copy for the input gradient: (frozen params - embeddings - untied LM head) * act, / L with
  gradient checkpointing (one layer's copies at a time).
- ``kv_cache``: 2 * L * kv_heads * head_dim * (P + C) * N_gen * act, plus one layer's worth for the
  ``torch.cat`` growth of the dynamic cache.
- ``generation_transient``: the prefill's widest layer temporaries, N_gen * P * (q + 2 kv + 2 hidden
  + 3 intermediate) * act, and the last-token logits while a token is sampled (``estimate.sampling_bytes``):
  with transformers' warpers N_gen * V * (act + 12), + 4 with temperature or top-k, + 16 more with top-p
  (a sort of every row); with the kit's graph loop N_gen * V * 4 * 3 whatever the sampler. The sampler is
  the config's ``temperature`` / ``top_k`` / ``top_p`` (missing ones: the pinned 0.7 / 0 / 0.9).
- ``decode_graph``: with ``fast_generation``'s fused loop, its captured CUDA graph's private pool (one
  decode step's logits and MLP temporaries, N_gen * (V + 2 * intermediate) * act), kept in every phase
  (``keep_graph``, or no ``release_after_sampling``).
- ``reward_weights``: each reward model's parameters in its dtype, on every rank ("local") or on
  rank 0 only ("main"). ``reward_scoring``: one no-grad forward over a chunk of completions (the
  prefill formula with the reward model's widths; at most ``rewards.REWARD_MODEL_ROWS`` completions).
  Rule-based reward functions cost nothing here.
- No reference model: with PEFT, TRL gets reference log-probs by disabling the adapter (beta > 0),
  and beta defaults to 0.0 in recent TRL.

Per rank, the peak is the largest of four phases, each on top of the resident memory (weights,
LoRA params, optimizer state, reward weights on that rank): generation (+ KV cache + generation
transient), scoring (+ reward scoring), training, i.e. loss / backward (+ LoRA grads + activations
+ logits + autocast cache), optimizer (+ LoRA grads + AdamW temporaries). How the frozen base is
laid out past one GPU (FSDP2, ZeRO-2/3, CPU offload, nf4 / int8 bases) is :mod:`.layout`: it sets
``weights`` (what stays on the GPU), ``gathered_weights`` (unsharded while the base runs, per
phase) and ``dequant_transient``; :mod:`.plan` ranks every layout for ``doctor --plan``. ``peak`` is comparable with ``torch.cuda.max_memory_allocated()``; ``fits`` also adds
``overhead_gb`` (CUDA context, NCCL buffers) and ``fragmentation`` (allocator slack) on top.

The activation coefficients hold one table per device kind, each measured on that device by summing the unique
storages of the tensors autograd saves (``torch.autograd.graph.saved_tensors_hooks``) for decoder
layers with the pinned LoRA adapter over several shapes, least squares
(``benchmarks/calibrate_activations.py``). Predictions use the CUDA table (H200: residual <= 1.7%;
peaks within -4.6% to +8.9% of measured runs, docs/defaults_preflight_monitor.md);
``tests/test_preflight.py`` re-measures the CPU table. With ``fast_generation`` the static KV cache
and the merged-LoRA buffer are counted while sampling (every phase without ``release_after_sampling``).
"""

from __future__ import annotations

import sys
import types
from typing import Any

from grpo_patches.preflight.count import ParamCount, count_parameters
from grpo_patches.preflight.layout import DeepSpeedSettings, Layout
from grpo_patches.preflight.pipeline import preflight
from grpo_patches.preflight.report import PreflightError, PreflightReport, PreflightWarning, RankEstimate
from grpo_patches.preflight.settings import (
    PRESETS,
    RewardModelSpec,
    check_setting_names,
    load_model_config,
    valid_setting_names,
)

__all__ = [
    "PRESETS",
    "ParamCount",
    "PreflightError",
    "PreflightReport",
    "PreflightWarning",
    "RankEstimate",
    "RewardModelSpec",
    "DeepSpeedSettings",
    "Layout",
    "check_setting_names",
    "count_parameters",
    "load_model_config",
    "preflight",
    "valid_setting_names",
]


class _CallableModule(types.ModuleType):
    """This module, callable as :func:`preflight`.

    ``grpo_patches.preflight`` names both the function and this module; importing the module
    rebinds the package attribute to it (the import system does that), so a lazy attribute that
    returned the function would turn into the module on the next import ("module is not callable" on
    the second call). Making the module itself callable keeps ``grpo_patches.preflight(...)``
    right whatever was imported first.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> PreflightReport:
        return preflight(*args, **kwargs)


__wrapped__ = preflight  # inspect.signature(grpo_patches.preflight) shows preflight's parameters
sys.modules[__name__].__class__ = _CallableModule
