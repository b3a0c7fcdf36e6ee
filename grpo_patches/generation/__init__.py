"""Fast generation: compiled decoding under a static KV cache, from merged LoRA weights, dropout off.

Stock TRL (1.16) builds its ``GenerationConfig`` with ``disable_compile=True`` and samples with the
policy in training mode, so every decode step runs eagerly (58-82 ms per step for a 1.5B LoRA policy
on an H200). This package makes one ``generate`` call fast and faithful; it imports nothing of TRL
(the TRL glue is ``grpo_patches.targets.trl_generation``, the vendored trainer's ``targets.dsm``).

* ``config``: :class:`FastGenerationConfig` (every field type-checked at construction) and the
  compile decision (CUDA/XPU; ``force_compile`` for CPU tests; eager under FSDP/DeepSpeed).
* ``cache``: :class:`StaticCachePool`, one static cache per (batch, bucketed length), reset in
  place, so the CUDA graph keeps its addresses; released between rounds on request. The cache
  length is ``round_up(prompt, bucket) + max_new_tokens`` and never shrinks, so new prompt lengths
  do not recompile (transformers sizes it per prompt: 77 s of recompilation per new length).
* ``merged``: :class:`MergedLoRAWeights`, ``W + s * B @ A`` of every plain LoRA linear layer in a
  buffer of its own, refreshed at every call (never stale), so decoding runs base-shaped matmuls
  only; the base weights are never written (merging in place and back is not bit-exact).
* ``decode``: the graph loop, one compiled step per token that runs the forward, transformers'
  temperature / top-k / top-p warping, the sample and the EOS bookkeeping (one CUDA-graph replay per
  token, the host checking for the end every ``check_every`` steps); anything it does not implement
  goes to transformers' compiled loop with one warning.
* ``modes``: sampling in eval mode (no dropout of any kind; flags restored exactly), gradient
  checkpointing's input hooks hidden while sampling (TRL adds one per step, a dynamo guard), prompt
  padding, the sampled-log-prob recorder.
* ``fast``: :func:`fast_generate` and :class:`FastGenerationState`.

Weights are graph inputs read at every call (dynamo lifts parameters; CUDA graphs see in-place
optimizer updates at the same addresses), so an optimizer step never leaves stale weights (tested).
"""

from __future__ import annotations

from .cache import StaticCachePool
from .config import (
    DECODE_LOOPS,
    FAST_GEN_ATTR,
    FastGenerationConfig,
    cache_length,
    compile_decision,
    split_devices,
)
from .config import _warned as _warned  # the set tests clear: the same object warn_once fills
from .decode import GRAPH_STATS, GraphDecodeStats, graph_decode_support
from .fast import _MERGED as _MERGED  # fast_generate's per-model state, inspected by tests
from .fast import _POOLS as _POOLS
from .fast import FastGenerationState, build_generation_config, fast_generate, sampling
from .merged import MergedLoRAWeights, mergeable_layers
from .modes import SampledLogprobs, hidden_require_grad_hooks, left_pad, sampling_mode

__all__ = [
    "DECODE_LOOPS",
    "FAST_GEN_ATTR",
    "GRAPH_STATS",
    "FastGenerationConfig",
    "FastGenerationState",
    "GraphDecodeStats",
    "MergedLoRAWeights",
    "SampledLogprobs",
    "StaticCachePool",
    "build_generation_config",
    "cache_length",
    "compile_decision",
    "split_devices",
    "fast_generate",
    "graph_decode_support",
    "hidden_require_grad_hooks",
    "left_pad",
    "mergeable_layers",
    "sampling",
    "sampling_mode",
]
