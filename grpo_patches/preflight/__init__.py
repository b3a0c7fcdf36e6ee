"""Preflight: predict each rank's peak GPU memory for GRPO + LoRA, and check the shape rules, before a run.

Nothing is loaded: parameters are counted on the meta device (``AutoModelForCausalLM.from_config``
under ``torch.device("meta")``, then ``peft.get_peft_model``), so a 70B config is checked on a CPU in
seconds. TRL is optional: the GRPO settings may be a ``trl.GRPOConfig``, a dict or a namespace.

Memory model (bytes; "act" = the autocast compute dtype: 2 for bf16/fp16, 4 for fp32; "w" = the
dtype the frozen policy weights are loaded in; T = training micro-batch tokens = B * (P + C);
N_c = completion tokens = B * C; N_gen = completions a rank generates at once = B * S; B =
per_device_train_batch_size, S = steps_per_generation, P / C = prompt / completion length):

- ``weights``: frozen policy parameters * w. DDP keeps a full copy per rank.
- ``lora_params`` / ``lora_grads`` / ``optimizer_state``: trainable parameters * 4 each (PEFT keeps
  adapters in fp32), AdamW two fp32 moments (8 bytes; 8-bit optimizers 2); with world_size > 1 DDP
  adds a gradient bucket copy (4 bytes) to ``lora_grads``.
- ``activations``: per layer per token ``_ACT_COEF`` (measured, see below) times the layer's widths;
  with gradient checkpointing: L * T * hidden * act (the saved layer inputs) plus one layer
  recomputed; plus a backward workspace of T * (3 * intermediate + 2 * hidden) * act, less, with
  ``lean_lora`` under 16-bit autocast and fp32 adapters, PEFT's fp32 copy of the widest adapted input
  and its fp32 dropout output (T * width * 8; * 4 without dropout; measured on the H200: -3.7 GiB).
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
  + 3 intermediate) * act, and the last-token logits N_gen * V * 4 * 3 (fp32 scores, processed
  scores, probabilities).
- ``decode_graph``: with ``fast_generation``'s fused loop, its captured CUDA graph's private pool (one
  decode step's logits and MLP temporaries, N_gen * (V + 2 * intermediate) * act), kept in every phase
  (``keep_graph``, or no ``release_after_sampling``).
- ``reward_weights``: each reward model's parameters in its dtype, on every rank ("local") or on
  rank 0 only ("main"). ``reward_scoring``: one no-grad forward over a chunk of completions (the
  prefill formula with the reward model's widths). Rule-based reward functions cost nothing here.
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

``_ACT_COEF`` holds one table per device kind, each measured on that device by summing the unique
storages of the tensors autograd saves (``torch.autograd.graph.saved_tensors_hooks``) for decoder
layers with the pinned LoRA adapter over several shapes, least squares
(``benchmarks/calibrate_activations.py``). Predictions use the CUDA table (H200: residual <= 1.7%;
peaks within -4.6% to +8.9% of measured runs, docs/defaults_preflight_monitor.md);
``tests/test_preflight.py`` re-measures the CPU table. With ``fast_generation`` the static KV cache
and the merged-LoRA buffer are counted while sampling (every phase without ``release_after_sampling``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import types
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from grpo_patches.grouping import GroupShapeError, check_group_shape, resolve_steps_per_generation
from grpo_patches.preflight.layout import DeepSpeedSettings, Layout, layout_from_environment

_DDP = Layout()

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

GiB = 2**30

#: Bytes saved for backward per token per decoder layer, per unit of width, keyed by (activation
#: bytes, LoRA dropout > 0). Widths: hidden, intermediate, q = heads * head_dim, kv = kv_heads *
#: head_dim, and per attention head (the attention kernel's log-sum-exp and friends).
#: One table per device kind: the attention kernel and the dropout implementation differ between the
#: CPU and CUDA, so each table is measured on its device (benchmarks/calibrate_activations.py).
_ACT_COEF: dict[str, dict[tuple[int, bool], dict[str, float]]] = {
    "cpu": {
        (2, True): {"hidden": 37.96, "intermediate": 12.23, "q": 10.12, "kv": 4.05, "heads": 13.9},
        (2, False): {"hidden": 17.96, "intermediate": 8.23, "q": 6.12, "kv": 4.05, "heads": 13.9},
        (4, True): {"hidden": 47.92, "intermediate": 20.45, "q": 16.23, "kv": 8.10, "heads": 23.5},
        (4, False): {"hidden": 15.92, "intermediate": 16.45, "q": 8.23, "kv": 8.10, "heads": 23.5},
    },
}
#: H200, torch 2.11 + CUDA 13, transformers 5.17, peft 0.21, SDPA (flash) attention; 9 Qwen2 layer shapes
#: (0.5B-7B-like and off-grid) x seq 128 / 288, max residual 1.7% (benchmarks/results/2026-11-29-h200-x4/
#: act_cuda.jsonl). q = hidden in every measured shape, so the two share one coefficient.
_ACT_COEF["cuda"] = {
    (2, True): {"hidden": 17.0, "intermediate": 9.36, "q": 17.0, "kv": 0.64, "heads": 69.1},
    (2, False): {"hidden": 14.0, "intermediate": 8.36, "q": 14.0, "kv": 0.64, "heads": 69.1},
    (4, True): {"hidden": 26.18, "intermediate": 17.18, "q": 26.18, "kv": 0.92, "heads": 133.39},
    (4, False): {"hidden": 15.18, "intermediate": 16.18, "q": 15.18, "kv": 0.92, "heads": 133.39},
}
_FUSED_TOKEN_CHUNK = 4096  # trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE
_FUSED_VOCAB_CHUNK = 32768  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE

#: The article's trainable-share band (S4: 0.1-0.5%) holds for a 70B model, where the pinned LoRA
#: gives 0.2927% (counted on the meta device for the Llama-3.1-70B config). For other sizes the band
#: is scaled by the share the pinned LoRA gives on that architecture (0.52% at 8B, 1.2% at 1.5B).
_ARTICLE_SHARE_BAND = (0.001, 0.005)
_ARTICLE_SHARE_REFERENCE = 0.002927
_LARGE_MODEL_PARAMS = 65e9  # S9's "70B+": Llama 65B / 70B class
_MIN_TOTAL_VRAM_GB = 40.0
_MIN_DATASET_SIZE = 1000
_MIN_FREE_GB = 2.0  # S8

_DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2, "float64": 8}

#: Public architecture numbers, so `grpo-patches doctor --model llama-3.1-70b` needs no file.
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.1-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                          max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=False),
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=False),
    "qwen2-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                       max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True),
}


class PreflightWarning(UserWarning):
    """A setting that will run but that the article (S4, S8, S9) advises against."""


class PreflightError(ValueError):
    """The predicted peak exceeds the memory given; the message lists settings that fit."""


@dataclasses.dataclass
class RewardModelSpec:
    """A learned reward model: its config (object, dict, config.json path or preset name), dtype and
    scoring chunk (completions per forward; None = one rank's generation batch)."""

    config: Any
    dtype: str = "bfloat16"
    batch_size: int | None = None
    name: str | None = None


@dataclasses.dataclass(frozen=True)
class ParamCount:
    total: int
    trainable: int
    embedding: int
    reference_trainable: int  # what the pinned LoRA would train on this architecture
    output_embedding: int = 0  # an untied LM head's parameters (0 when tied to the input embedding)
    linear_frozen: int = 0  # frozen weights of the decoder's Linear modules (what bitsandbytes quantizes)
    linear_rows: int = 0  # their output features (int8 keeps one fp32 scale per row)
    largest_linear: int = 0  # the widest such Linear (dequantized one at a time)
    layers: int = 0  # decoder layers (FSDP2 / ZeRO-3 gather one at a time)
    layer_other: int = 0  # non-Linear parameters of one decoder layer (norms)
    linear_sizes: tuple[int, ...] = ()  # each such Linear's weight numel (bitsandbytes' per-tensor blocks)
    frozen_sizes: tuple[int, ...] = ()  # every base parameter's numel, named_parameters order (ZeRO-3 persistence)
    adapted: int = 0  # base weights of the LoRA-adapted Linears (fast generation's merged buffer holds them once more)

    @property
    def frozen(self) -> int:
        return self.total - self.trainable

    @property
    def share(self) -> float:
        return self.trainable / self.total if self.total else 0.0

    @property
    def reference_share(self) -> float:
        return self.reference_trainable / self.total if self.total else 0.0


@dataclasses.dataclass
class RankEstimate:
    """One rank's predicted memory: bytes per component, per phase, the peak and whether it fits."""

    rank: int
    components: dict[str, int]
    phases: dict[str, int]
    capacity: int | None = None
    overhead: int = 0
    fragmentation: float = 0.0

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda k: self.phases[k])

    @property
    def required(self) -> int:
        """Peak plus allocator slack and the memory torch does not count (CUDA context)."""
        return int(self.peak * (1 + self.fragmentation)) + self.overhead

    @property
    def fits(self) -> bool | None:
        return None if self.capacity is None else self.required <= self.capacity

    @property
    def headroom(self) -> int | None:
        return None if self.capacity is None else self.capacity - self.required

    def __str__(self) -> str:
        return _render([self], title=f"rank {self.rank}")


@dataclasses.dataclass
class PreflightReport:
    """Everything the preflight found: per-rank estimates, parameter counts, errors and warnings."""

    ranks: list[RankEstimate]
    params: ParamCount
    settings: dict[str, Any]
    activations_checkpointed: int
    activations_full: int
    errors: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)

    @property
    def peak(self) -> int:
        return max(r.peak for r in self.ranks)

    @property
    def fits(self) -> bool | None:
        flags = [r.fits for r in self.ranks]
        return None if any(f is None for f in flags) else all(flags)

    @property
    def ok(self) -> bool:
        return not self.errors

    def table(self) -> str:
        return _render(self.ranks)

    def __str__(self) -> str:
        s = self.settings
        lines = [
            f"policy: {self.params.total / 1e9:.2f}B params, trainable {self.params.trainable / 1e6:.2f}M "
            f"({100 * self.params.share:.3f}%); weights {s['dtype']}, compute {s['compute_dtype']}",
            f"shape: world_size={s['world_size']} per_device_train_batch_size={s['per_device_train_batch_size']} "
            f"steps_per_generation={s['steps_per_generation']} num_generations={s['num_generations']} "
            f"prompt={s['prompt_length']} completion={s['completion_length']} tokens; "
            f"gradient_checkpointing={s['gradient_checkpointing']}; logits={s['logits_mode']}; "
            f"rewards={s['reward_placement']}; layout={s['layout']}"
            + (f" (host memory per rank: {s['host_weights_gb']:.2f} GiB of frozen shards)" if s["host_weights_gb"] else ""),
            self.table(),
            f"activations: {_gib(self.activations_checkpointed)} with gradient checkpointing, "
            f"{_gib(self.activations_full)} without (per rank)",
        ]
        lines += [f"ERROR: {e}" for e in self.errors]
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


# ----------------------------------------------------------------------------------- inputs


def load_model_config(model_config: Any) -> Any:
    """A transformers config from a config object, a dict, a config.json path / folder or a preset name."""
    import transformers

    if isinstance(model_config, transformers.PretrainedConfig):
        return model_config
    if isinstance(model_config, str) and model_config.lower() in PRESETS:
        model_config = PRESETS[model_config.lower()]
    if isinstance(model_config, (str, os.PathLike)):
        path = Path(model_config)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"grpo_patches.preflight: no config at {str(model_config)!r}; give a config.json path, a folder "
                f"holding one, a transformers config object, or a preset ({', '.join(PRESETS)})."
            )
        model_config = json.loads(path.read_text())
    if isinstance(model_config, Mapping):
        d = dict(model_config)
        model_type = d.pop("model_type", None)
        if model_type is None:
            raise ValueError("grpo_patches.preflight: a config dict needs a 'model_type' (e.g. 'llama').")
        return transformers.AutoConfig.for_model(model_type, **d)
    raise TypeError(f"grpo_patches.preflight: cannot read a model config from {type(model_config).__name__}.")


def _setting(cfg: Any, name: str, default: Any) -> Any:
    if cfg is None:
        return default
    value = cfg.get(name, default) if isinstance(cfg, Mapping) else getattr(cfg, name, default)
    return default if value is None else value


#: The GRPO settings preflight reads (also valid where the installed TRL lacks them, e.g. an older
#: release's max_prompt_length); any field of the installed ``trl.GRPOConfig`` is valid too.
_READ_SETTINGS = frozenset({
    "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation", "generation_batch_size",
    "num_generations", "num_generations_eval", "max_completion_length", "max_prompt_length",
    "gradient_checkpointing", "bf16", "fp16", "model_init_kwargs", "optim", "eval_strategy",
    "per_device_eval_batch_size", "use_vllm", "ds3_gather_for_generation", "beta",
})


def valid_setting_names() -> frozenset[str]:
    """GRPO setting names preflight and ``grpo-patches doctor --set`` accept."""
    try:
        import trl

        fields = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    except Exception:  # TRL absent or broken: the names preflight reads
        fields = set()
    return _READ_SETTINGS | fields


def check_setting_names(settings: Any) -> None:
    """Refuse a misspelt GRPO setting (a dict's keys or a namespace's attributes) with close matches.

    A built ``GRPOConfig`` (a dataclass) cannot carry unknown names, so it is not checked.
    """
    if settings is None or dataclasses.is_dataclass(settings):
        return
    names = list(settings) if isinstance(settings, Mapping) else list(vars(settings))
    valid = valid_setting_names()
    unknown = [n for n in names if n not in valid]
    if not unknown:
        return
    import difflib

    hints = []
    for name in unknown:
        close = difflib.get_close_matches(str(name), sorted(valid), n=3, cutoff=0.6)
        hints.append(f"{name!r}" + (f" (did you mean {' or '.join(close)}?)" if close else ""))
    raise TypeError(
        f"grpo_patches.preflight: unknown GRPO setting(s) {', '.join(hints)}; use trl.GRPOConfig field names."
    )


def _dtype_bytes(dtype: Any) -> int:
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    key = str(dtype).replace("torch.", "").lower()
    if key not in _DTYPE_BYTES:
        raise ValueError(f"grpo_patches.preflight: unknown dtype {dtype!r}; use one of {sorted(_DTYPE_BYTES)}.")
    return _DTYPE_BYTES[key]


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


@dataclasses.dataclass(frozen=True)
class _Arch:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    model_type: str
    moe: bool

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim


def _arch(cfg: Any) -> _Arch:
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    hidden = text.hidden_size
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    moe = any(getattr(text, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    inter = getattr(text, "intermediate_size", None) or 4 * hidden
    if moe:  # widths of the experts a token visits
        per_expert = getattr(text, "moe_intermediate_size", None) or inter
        inter = per_expert * (getattr(text, "num_experts_per_tok", None) or 2)
    return _Arch(
        layers=text.num_hidden_layers,
        hidden=hidden,
        intermediate=inter,
        heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        vocab=text.vocab_size,
        model_type=getattr(cfg, "model_type", "") or "",
        moe=bool(moe),
    )


# ----------------------------------------------------------------------------- parameter count


def _lora_params(model: torch.nn.Module, r: int, targets: Iterable[str]) -> int:
    """Parameters a plain LoRA adds: r * (in + out) for each Linear whose last name part is targeted."""
    names = set(targets)
    return sum(
        r * (m.in_features + m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in names
    )


def _reference_lora_params(model: torch.nn.Module) -> int:
    """Parameters the pinned LoRA adds on this architecture."""
    from grpo_patches.defaults import ARTICLE_LORA_SETTINGS

    return _lora_params(model, ARTICLE_LORA_SETTINGS["r"], ARTICLE_LORA_SETTINGS["target_modules"])


def _is_plain_lora(lora: Any) -> bool:
    """A LoraConfig whose parameter count is r * (in + out) per targeted Linear, and nothing else.

    For these the count is done by hand (a 70B model in a tenth of a second); anything else
    (regex / "all-linear" targets, modules_to_save, DoRA, rank patterns, ...) goes through PEFT.
    """
    targets = getattr(lora, "target_modules", None)
    if type(lora).__name__ != "LoraConfig" or not targets or isinstance(targets, str):
        return False
    empty = ("modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform", "layer_replication",
             "trainable_token_indices", "target_parameters", "exclude_modules")
    return (
        all(not getattr(lora, k, None) for k in empty)
        and getattr(lora, "bias", "none") == "none"
        and not getattr(lora, "use_dora", False)
        and not getattr(lora, "lora_bias", False)
    )


_COUNT_CACHE: dict[tuple[str, str, bool], ParamCount] = {}


def count_parameters(model_config: Any, lora_config: Any = None, *, peft_always: bool = False) -> ParamCount:
    """Count the policy's parameters with ``lora_config`` (pinned LoRA when None), on the meta device.

    Plain LoRA configs are counted by hand from the meta model's Linear shapes; others (and all, with
    ``peft_always``) through ``peft.get_peft_model`` on the meta model. Cached per (config, LoRA).
    """
    import peft
    import transformers

    from grpo_patches.defaults import lora_config as default_lora

    cfg = load_model_config(model_config)
    lora = default_lora() if lora_config is None else lora_config
    key = (cfg.to_json_string(use_diff=False), repr(lora), peft_always)
    if key not in _COUNT_CACHE:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        embedding = sum(p.numel() for p in model.get_input_embeddings().parameters())
        head = model.get_output_embeddings()
        tied = head is None or head.weight is model.get_input_embeddings().weight
        output_embedding = 0 if tied else head.weight.numel()
        reference = _reference_lora_params(model)
        layout = _base_layout(model, head)
        if _is_plain_lora(lora) and not peft_always:
            trainable = _lora_params(model, lora.r, lora.target_modules)
            total = sum(p.numel() for p in model.parameters()) + trainable
            names = set(lora.target_modules)
            adapted = sum(m.weight.numel() for name, m in model.named_modules()
                          if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in names)
        else:
            from peft.tuners.lora.layer import LoraLayer

            peft_model = peft.get_peft_model(model, lora)
            total = sum(p.numel() for p in peft_model.parameters())
            trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
            adapted = sum(m.get_base_layer().weight.numel() for m in peft_model.modules()
                          if isinstance(m, LoraLayer) and isinstance(m.get_base_layer(), torch.nn.Linear))
        _COUNT_CACHE[key] = ParamCount(total=total, trainable=trainable, embedding=embedding,
                                       reference_trainable=reference, output_embedding=output_embedding,
                                       adapted=adapted, **layout)
    return _COUNT_CACHE[key]


def _base_layout(model: torch.nn.Module, head: Any) -> dict[str, int]:
    """The counts the sharded / quantized layouts need: the decoder's Linears and its layer list."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    blocks = max((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), key=len, default=[])
    in_linears = {id(p) for m in linears for p in m.parameters()}
    other = sum(p.numel() for p in blocks[0].parameters() if id(p) not in in_linears) if len(blocks) else 0
    return dict(linear_frozen=sum(m.weight.numel() + (m.bias.numel() if m.bias is not None else 0) for m in linears),
                linear_rows=sum(m.out_features for m in linears),
                largest_linear=max((m.weight.numel() for m in linears), default=0),
                layers=len(blocks), layer_other=other, linear_sizes=tuple(m.weight.numel() for m in linears),
                frozen_sizes=tuple(p.numel() for p in model.parameters()))


def _count_reward_model(cfg: Any) -> int:
    d = cfg.to_dict()
    d.pop("model_type", None)
    return _count_rm_cached(json.dumps(d, sort_keys=True, default=str), cfg.model_type)


@functools.lru_cache(maxsize=32)
def _count_rm_cached(config_json: str, model_type: str) -> int:
    import transformers

    cfg = transformers.AutoConfig.for_model(model_type, **json.loads(config_json))
    cfg.num_labels = 1
    with torch.device("meta"):
        try:
            model = transformers.AutoModelForSequenceClassification.from_config(cfg)
        except ValueError:  # no classification head registered for this type: count the backbone
            model = transformers.AutoModel.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------- estimate


def _layer_bytes_per_token(arch: _Arch, act: int, dropout: bool, device: str = "cuda") -> float:
    """Bytes autograd saves per token in one decoder layer with the LoRA adapter (see ``_ACT_COEF``);
    preflight predicts GPU memory, so the CUDA table unless told otherwise."""
    coef = _ACT_COEF[device][(2 if act <= 2 else 4, dropout)]
    scale = act / (2 if act <= 2 else 4)
    return scale * (
        coef["hidden"] * arch.hidden + coef["intermediate"] * arch.intermediate + coef["q"] * arch.q
        + coef["kv"] * arch.kv + coef["heads"] * arch.heads
    )


def _activations(arch: _Arch, tokens: int, act: int, dropout: bool, checkpointing: bool, lean_input: int = 0) -> int:
    """``lean_input``: the width of the widest adapted input whose fp32 copy ``lean_lora`` removes (0: none)."""
    per_layer = _layer_bytes_per_token(arch, act, dropout)
    workspace = tokens * (3 * arch.intermediate + 2 * arch.hidden) * act
    if lean_input and act == 2:  # PEFT's fp32 copy of the input (4 bytes), and the fp32 dropout output (4)
        workspace -= tokens * lean_input * (8 if dropout else 4)
    if checkpointing:
        saved = arch.layers * tokens * arch.hidden * act + tokens * per_layer
    else:
        saved = arch.layers * tokens * per_layer
    return int(saved + workspace)


def _lean_input(arch: _Arch, lora: Any, layout: Layout) -> int:
    """The widest input ``lean_lora`` keeps from being copied to fp32: the down projection's when it is
    adapted, else the hidden size; 0 where the adapter is 16-bit (DeepSpeed casts the module, TRL casts a
    quantized model's adapter to bf16), so stock PEFT makes no copy either."""
    if layout.deepspeed or layout.quantization is not None:
        return 0
    targets = getattr(lora, "target_modules", None) or ()
    targets = [targets] if isinstance(targets, str) else list(targets)
    return arch.intermediate if any(t == "all-linear" or "down" in t for t in targets) else arch.hidden


def _prefill_transient(arch: _Arch, tokens: int, act: int) -> int:
    return tokens * (arch.q + 2 * arch.kv + 2 * arch.hidden + 3 * arch.intermediate) * act


def _logits(arch: _Arch, batch: int, completion: int, act: int, mode: str) -> int:
    if mode == "fused":
        n = batch * completion
        tile = min(n, _FUSED_TOKEN_CHUNK) * min(arch.vocab, _FUSED_VOCAB_CHUNK) * act
        return tile + n * arch.hidden * (4 + 2 * act) + n * 8 * 4
    return 3 * batch * (completion + 1) * arch.vocab * act


def _autocast_copies(params: ParamCount, arch: _Arch, w_bytes: int, act: int, checkpointing: bool) -> int:
    """16-bit copies of fp32 frozen weights that autograd keeps for backward under autocast.

    Autocast caches casts of trainable leaves only; a frozen weight is cast per matmul and the copy is
    saved for the input gradient: every layer's copy without checkpointing, one layer's with it.
    """
    if w_bytes <= act:
        return 0
    matmul_weights = params.frozen - params.embedding - params.output_embedding  # TRL's fused head saves fp32
    return matmul_weights * act if not checkpointing else matmul_weights * act // max(arch.layers, 1)


def _detect_logits_mode() -> str:
    try:
        from trl.trainer import utils as trl_utils
    except Exception:  # TRL absent or broken: assume the older, heavier path
        return "full"
    return "fused" if hasattr(trl_utils, "add_fused_lm_head") else "full"


def _optimizer_bytes_per_param(optim: str) -> float:
    name = str(optim).lower()
    if "8bit" in name:
        return 2.0
    if name.startswith("sgd"):
        return 0.0
    if "adafactor" in name:
        return 0.5
    return 8.0


def _reward_specs(reward_models: Iterable[Any]) -> tuple[list[RewardModelSpec], int]:
    specs: list[RewardModelSpec] = []
    functions = 0
    for item in reward_models:
        if isinstance(item, RewardModelSpec):
            specs.append(item)
        elif isinstance(item, torch.nn.Module) and hasattr(item, "config"):  # a loaded model: its config, dtype
            dtype = next((p.dtype for p in item.parameters()), torch.bfloat16)
            specs.append(RewardModelSpec(config=item.config, dtype=_dtype_name(dtype)))
        elif callable(item) and not isinstance(item, (str, os.PathLike, Mapping)) and not hasattr(item, "to_dict"):
            functions += 1  # a rule-based reward function: no GPU memory
        else:
            specs.append(RewardModelSpec(config=item))
    return specs, functions


@dataclasses.dataclass(frozen=True)
class FastGenerationMemory:
    """What ``apply(fast_generation=...)`` adds to a rank: its static KV cache and merged-LoRA buffer."""

    cache_length: int  # tokens per row of the static cache
    merged_bytes: int  # the merged buffer (0 without merge_lora)
    released: bool  # release_after_sampling: both exist only while sampling
    graph_kept: bool = False  # the fused loop's CUDA graph stays allocated between rounds

    @classmethod
    def of(cls, option: Any, *, prompt: int, completion: int, params: ParamCount, weight_bytes: int,
           quantized: bool = False) -> FastGenerationMemory:
        """``quantized``: a bitsandbytes base, whose adapters are never merged (no buffer)."""
        from grpo_patches.generation import FastGenerationConfig, cache_length

        config = FastGenerationConfig.coerce(option) or FastGenerationConfig()
        length = cache_length(prompt, completion, config)  # the length the pool will allocate
        merged = params.adapted * weight_bytes if config.merge_lora and not quantized else 0
        graph = config.decode_loop == "graph" and config.fused_decode and config.compile
        return cls(length, merged, config.release_after_sampling,
                   graph and (config.keep_graph or not config.release_after_sampling))


def _estimate(
    arch: _Arch,
    params: ParamCount,
    *,
    world_size: int,
    batch: int,
    steps: int,
    prompt: int,
    completion: int,
    checkpointing: bool,
    w_bytes: int,
    act: int,
    dropout: bool,
    optim: str,
    logits_mode: str,
    rewards: list[tuple[RewardModelSpec, _Arch, int]],
    placement: str,
    capacity: int | None,
    overhead: int,
    fragmentation: float,
    fast: FastGenerationMemory | None = None,
    layout: Layout = _DDP,
    lean_input: int = 0,
) -> list[RankEstimate]:
    tokens = batch * (prompt + completion)
    n_gen = batch * steps
    trainable = params.trainable
    w = world_size
    if layout.deepspeed:
        # The engine casts the module to bf16 (the LoRA weights too) and keeps fp32 master weights, Adam
        # moments and gradients partitioned over the ranks, with a bf16 gradient per parameter.
        lora_params, grad_copy = 2 * trainable, 0
        lora_grads = 2 * trainable + 4 * trainable // w
        optimizer_state = int((_optimizer_bytes_per_param(optim) + 4) * trainable / w)
    elif layout.sharding == "fsdp2":  # LoRA weights sharded like the rest, fp32; gradients reduce-scattered
        lora_params, grad_copy = 4 * trainable // w, 0
        lora_grads = 4 * trainable // w
        optimizer_state = int(_optimizer_bytes_per_param(optim) * trainable / w)
    elif layout.quantization is not None:
        # TRL (1.x) casts the adapter of a quantized model to bf16 (QLoRA paper): bf16 weights, gradients and
        # AdamW moments (torch keeps the moments in the parameter's dtype).
        lora_params, grad_copy = 2 * trainable, (2 * trainable if w > 1 else 0)
        lora_grads = 2 * trainable + grad_copy
        optimizer_state = int(_optimizer_bytes_per_param(optim) / 2 * trainable)
    else:
        lora_params, grad_copy = 4 * trainable, (4 * trainable if w > 1 else 0)  # DDP's gradient buckets
        lora_grads = 4 * trainable + grad_copy
        optimizer_state = int(_optimizer_bytes_per_param(optim) * trainable)
    kv_layer = 2 * arch.kv * (prompt + completion) * n_gen * act
    quantized = layout.quantization is not None
    common = {
        "weights": layout.gpu_weights(params, w_bytes, w),
        "gathered_weights": layout.gathered(params, w_bytes, w, arch.hidden, "training", checkpointing),
        "grad_bucket": layout.grad_bucket_bytes(act),
        "dequant_transient": layout.dequant_transient(params, act),
        "lora_params": lora_params,
        "lora_grads": lora_grads,
        "optimizer_state": optimizer_state,
        "activations": _activations(arch, tokens, act, dropout, checkpointing, lean_input),
        "logits_logps": _logits(arch, batch, completion, act, logits_mode),
        "autocast_cache": 0 if quantized else _autocast_copies(params, arch, w_bytes, act, checkpointing),
        "kv_cache": (kv_layer * arch.layers + kv_layer if fast is None
                     else 2 * arch.kv * fast.cache_length * n_gen * act * arch.layers),
        "merged_buffer": fast.merged_bytes if fast is not None else 0,
        "generation_transient": _prefill_transient(arch, n_gen * prompt, act) + n_gen * arch.vocab * 4 * 3,
        "decode_graph": n_gen * (arch.vocab + 2 * arch.intermediate) * act if fast is not None and fast.graph_kept else 0,
    }
    gen_gathered = layout.gathered(params, w_bytes, w, arch.hidden, "generation", checkpointing)
    # The optimizer step: foreach AdamW's temporaries, about one fp32 copy of the (local) trainable weights.
    step_temp = 4 * trainable // (w if layout.sharded or layout.deepspeed else 1)
    estimates = []
    for rank in range(world_size):
        comp = dict(common)
        hosts = placement == "local" or rank == 0
        rm_weights = 0
        rm_scoring = 0
        if hosts:
            for spec, rm_arch, rm_params in rewards:
                rm_bytes = _dtype_bytes(spec.dtype)
                rm_weights += rm_params * rm_bytes
                chunk = spec.batch_size or (n_gen if placement == "local" else n_gen * world_size)
                chunk = min(chunk, n_gen * (world_size if placement == "main" else 1))
                seq = prompt + completion
                rm_scoring = max(
                    rm_scoring,
                    _prefill_transient(rm_arch, chunk * seq, rm_bytes) + chunk * seq * rm_arch.hidden * rm_bytes,
                )
        comp["reward_weights"] = rm_weights
        comp["reward_scoring"] = rm_scoring
        resident = (comp["weights"] + comp["lora_params"] + comp["optimizer_state"] + rm_weights + grad_copy
                    + comp["grad_bucket"] + comp["decode_graph"])
        # Fast generation's static cache and merged-LoRA buffer exist while sampling; with
        # release_after_sampling=False they stay allocated through every phase.
        fast_resident = comp["kv_cache"] + comp["merged_buffer"] if fast is not None and not fast.released else 0
        resident += fast_resident
        phases = {
            "generation": resident - fast_resident + comp["kv_cache"] + comp["merged_buffer"]
            + comp["generation_transient"] + gen_gathered + comp["dequant_transient"],
            "scoring": resident + rm_scoring,
            "training": resident + comp["lora_grads"] - grad_copy + comp["activations"] + comp["logits_logps"]
            + comp["autocast_cache"] + comp["gathered_weights"] + comp["dequant_transient"],
            "optimizer": resident + comp["lora_grads"] - grad_copy + step_temp,
        }
        comp["gathered_weights"] = max(comp["gathered_weights"], gen_gathered)
        estimates.append(RankEstimate(rank, comp, phases, capacity, overhead, fragmentation))
    return estimates


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
    arch = _arch(cfg)
    if deepspeed_config is None and sharding.startswith("zero"):
        deepspeed_config = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or None
    ds = DeepSpeedSettings.from_config(deepspeed_config, arch.hidden)
    if offload_base is None and sharding == "zero3" and ds.offload_param in ("cpu", "nvme"):
        offload_base = True
    layout = Layout(sharding=sharding, quantization=quantization, double_quant=double_quant,
                    offload_base=bool(offload_base),
                    gather_for_generation=bool(_setting(g, "ds3_gather_for_generation", True)), ds=ds)
    art = ARTICLE_TRAINING_SETTINGS
    batch = int(_setting(g, "per_device_train_batch_size", art["per_device_train_batch_size"]))
    accum = int(_setting(g, "gradient_accumulation_steps", art["gradient_accumulation_steps"]))
    if g is not None and not isinstance(g, Mapping) and not hasattr(g, "steps_per_generation"):
        steps = 1  # a TRL < 0.19 config: every micro-batch generates its own groups
    else:
        steps = resolve_steps_per_generation(
            {"per_device_train_batch_size": batch, "gradient_accumulation_steps": accum,
             "steps_per_generation": _setting(g, "steps_per_generation", None),
             "generation_batch_size": _setting(g, "generation_batch_size", None)}
            if isinstance(g, Mapping) or g is None else g,
            world_size=world_size)
    num_gen = int(_setting(g, "num_generations", art["group_size"]))
    completion = int(_setting(g, "max_completion_length", art["max_length"] // 2))
    prompt = int(prompt_length if prompt_length is not None else _setting(g, "max_prompt_length", art["max_length"] // 2))
    checkpointing = bool(_setting(g, "gradient_checkpointing", art["gradient_checkpointing"]))
    bf16 = bool(_setting(g, "bf16", True)) if g is not None else True
    fp16 = bool(_setting(g, "fp16", False))
    compute_dtype = "bfloat16" if bf16 else ("float16" if fp16 else "float32")
    init_kwargs = _setting(g, "model_init_kwargs", {}) or {}
    if dtype is None:
        dtype = init_kwargs.get("dtype") or init_kwargs.get("torch_dtype")
        if dtype in (None, "auto"):
            dtype = compute_dtype
    optim = _setting(g, "optim", art["optim"])
    optim = str(getattr(optim, "value", optim))  # OptimizerNames is a str enum
    mode = _detect_logits_mode() if logits_mode == "auto" else logits_mode

    from grpo_patches.defaults import lora_config as default_lora

    lora = default_lora() if lora_config is None else lora_config
    params = count_parameters(cfg, lora)
    dropout = float(getattr(lora, "lora_dropout", 0.0) or 0.0) > 0

    specs, n_functions = _reward_specs(reward_models)
    rewards = []
    for spec in specs:
        rm_cfg = load_model_config(spec.config)
        rewards.append((spec, _arch(rm_cfg), _count_reward_model(rm_cfg)))

    errors: list[str] = []
    advice: list[str] = []
    group_error: GroupShapeError | None = None
    try:
        check_group_shape(per_device_batch_size=batch, steps_per_generation=steps, num_generations=num_gen,
                          world_size=world_size, mode="train")
    except GroupShapeError as e:
        group_error = e
        errors.append(str(e))
    if _setting(g, "eval_strategy", "no") != "no":  # IntervalStrategy is a str enum: compares by value
        try:
            check_group_shape(per_device_batch_size=int(_setting(g, "per_device_eval_batch_size", 8)),
                              steps_per_generation=1,
                              num_generations=int(_setting(g, "num_generations_eval", num_gen)),
                              world_size=world_size, mode="eval")
        except GroupShapeError as e:
            group_error = group_error or e
            errors.append(str(e))

    capacity = int(gpu_memory_gb * GiB) if gpu_memory_gb is not None else None
    # the input width whose fp32 copy lean_lora removes (0: stock PEFT makes no copy in this setup)
    lean_width = _lean_input(arch, lora, layout) if _dtype_bytes(compute_dtype) == 2 else 0
    common = dict(world_size=world_size, batch=batch, steps=steps, prompt=prompt, completion=completion,
                  w_bytes=_dtype_bytes(dtype), act=_dtype_bytes(compute_dtype), dropout=dropout, optim=optim,
                  logits_mode=mode, rewards=rewards, placement=reward_placement, capacity=capacity,
                  overhead=int(overhead_gb * GiB), fragmentation=fragmentation,
                  fast=(FastGenerationMemory.of(fast_generation, prompt=prompt, completion=completion,
                                                params=params, weight_bytes=_dtype_bytes(dtype),
                                                quantized=layout.quantization is not None)
                        if fast_generation and layout.sharding == "ddp" else None),
                  layout=layout, lean_input=lean_width if lean_lora else 0)
    ranks = _estimate(arch, params, checkpointing=checkpointing, **common)
    act_ckpt = _activations(arch, batch * (prompt + completion), common["act"], dropout, True)
    act_full = _activations(arch, batch * (prompt + completion), common["act"], dropout, False)

    fit_error: PreflightError | None = None
    over = [r for r in ranks if r.fits is False]
    if over:
        fit_error = PreflightError(_no_fit_message(arch, params, over, checkpointing, common, lean_width))
        errors.append(str(fit_error))
    elif capacity is not None:
        tight = [r.rank for r in ranks if r.headroom is not None and r.headroom < _MIN_FREE_GB * GiB]
        if tight:
            advice.append(
                f"ranks {tight} are predicted to keep under {_MIN_FREE_GB:g} GiB free (S8 keeps >= 2 GiB per GPU "
                f"for peaks); lower per_device_train_batch_size or max_completion_length."
            )

    advice += _share_advice(params, lora_config is None)
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
    if bool(_setting(g, "use_vllm", False)):
        advice.append("use_vllm=True: vLLM's memory pool is not modelled; the generation figures assume transformers.")
    if arch.moe:
        advice.append("mixture-of-experts config: activations use the routed experts' width; treat them as rough.")

    settings = dict(world_size=world_size, per_device_train_batch_size=batch, steps_per_generation=steps,
                    num_generations=num_gen, prompt_length=prompt, completion_length=completion,
                    gradient_checkpointing=checkpointing, dtype=_dtype_name(dtype), compute_dtype=compute_dtype,
                    logits_mode=mode, reward_placement=reward_placement, optim=optim, layout=layout.label(),
                    host_weights_gb=(layout.base_bytes(params, _dtype_bytes(dtype))["total"] / world_size / GiB
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


def _share_advice(params: ParamCount, pinned: bool) -> list[str]:
    scale = params.reference_share / _ARTICLE_SHARE_REFERENCE
    low, high = (b * scale for b in _ARTICLE_SHARE_BAND)
    share = params.share
    if low <= share <= high:
        return []
    hint = ("more weights than the adapter are trainable (modules_to_save, an unfrozen layer?) or r is too large"
            if share > high else "r is small or few modules are targeted")
    return [
        f"trainable share {100 * share:.3f}% is outside {100 * low:.3f}-{100 * high:.3f}% (S4's 0.1-0.5% for 70B, "
        f"scaled to this architecture, where the pinned r=16 on q/k/v/o/gate/up/down gives "
        f"{100 * params.reference_share:.3f}%): {hint}."
        + ("" if not pinned else " (pinned LoRA)")
    ]


def _no_fit_message(arch: _Arch, params: ParamCount, over: list[RankEstimate], checkpointing: bool,
                    common: dict[str, Any], lean_width: int = 0) -> str:
    worst = max(over, key=lambda r: r.required)
    top = sorted(worst.components.items(), key=lambda kv: -kv[1])[:3]
    cap = worst.capacity or 0
    msg = (
        f"grpo_patches.preflight: rank {worst.rank} needs {_gib(worst.required)} (peak {_gib(worst.peak)} in "
        f"{worst.peak_phase} + overhead) but has {_gib(cap)}; largest parts: "
        + ", ".join(f"{k} {_gib(v)}" for k, v in top)
        + "."
    )
    fixes = []

    def try_fix(label: str, **change: Any) -> None:
        c = {**common, **change}
        ck = c.pop("checkpointing", checkpointing)
        est = _estimate(arch, params, checkpointing=ck, **c)
        need = max(r.required for r in est)
        fixes.append(f"{label} -> {_gib(need)}{' (fits)' if need <= cap else ''}")

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
            f"the frozen weights alone ({_gib(worst.components['weights'])}) exceed one GPU: shard them across the "
            f"ranks (sharding='fsdp2' / 'zero3', ~{_gib(worst.components['weights'] / n)} each at world_size={n}), "
            f"offload them (offload_base=True) or load them in 4-bit (quantization='nf4'); "
            f"`grpo-patches doctor ... --plan` ranks the combinations that fit"
        )
    return msg + (" Options: " + "; ".join(fixes) + "." if fixes else " Use GPUs with more memory.")


# ------------------------------------------------------------------------------------------ table


def _gib(n: int | float) -> str:
    return f"{n / GiB:.2f} GiB"


_ROWS = ("weights", "gathered_weights", "grad_bucket", "dequant_transient", "lora_params", "lora_grads", "optimizer_state", "activations", "logits_logps", "autocast_cache",
         "kv_cache", "generation_transient", "decode_graph", "reward_weights", "reward_scoring")


_OPTIONAL_ROWS = frozenset({"grad_bucket", "decode_graph"})  # left out of tables where they are 0


def _render(ranks: list[RankEstimate], title: str | None = None) -> str:
    """Component x rank table in GiB; ranks with identical figures share a column."""
    groups: list[list[RankEstimate]] = []
    for r in ranks:
        if groups and groups[-1][0].components == r.components and groups[-1][0].phases == r.phases:
            groups[-1].append(r)
        else:
            groups.append([r])
    heads = [title or (f"rank {g[0].rank}" if len(g) == 1 else f"ranks {g[0].rank}-{g[-1].rank}") for g in groups]
    rows: list[tuple[str, list[str]]] = []
    for name in _ROWS:
        if name in _OPTIONAL_ROWS and not any(g[0].components.get(name, 0) for g in groups):
            continue
        rows.append((name, [f"{g[0].components.get(name, 0) / GiB:.2f}" for g in groups]))
    for phase in ("generation", "scoring", "training", "optimizer"):
        rows.append((f"= {phase}", [f"{g[0].phases[phase] / GiB:.2f}" for g in groups]))
    rows.append(("peak", [f"{g[0].peak / GiB:.2f} ({g[0].peak_phase})" for g in groups]))
    if any(g[0].capacity is not None for g in groups):
        rows.append(("needed (+overhead)", [f"{g[0].required / GiB:.2f}" for g in groups]))
        rows.append(("capacity", [f"{(g[0].capacity or 0) / GiB:.2f}" for g in groups]))
        rows.append(("fits", ["yes" if g[0].fits else "NO" for g in groups]))
    width0 = max(len(r[0]) for r in rows) + 2
    widths = [max(len(h), *(len(r[1][i]) for r in rows)) + 2 for i, h in enumerate(heads)]
    out = ["GiB".ljust(width0) + "".join(h.rjust(w) for h, w in zip(heads, widths, strict=True))]
    for name, cells in rows:
        out.append(name.ljust(width0) + "".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)))
    return "\n".join(out)


class _CallableModule(types.ModuleType):
    """This module, callable as :func:`preflight`.

    ``grpo_patches.preflight`` names both the function and this module; importing the module
    rebinds the package attribute to it (the import system does that), so a lazy attribute that
    returned the function would turn into the module on the next import (issue 12: "module is not
    callable" on the second call). Making the module itself callable keeps ``grpo_patches.preflight(...)``
    right whatever was imported first.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> PreflightReport:
        return preflight(*args, **kwargs)


__wrapped__ = preflight  # inspect.signature(grpo_patches.preflight) shows preflight's parameters
sys.modules[__name__].__class__ = _CallableModule
