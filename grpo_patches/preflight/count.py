"""Count: the policy's parameters with its LoRA adapter, and the widths of its layers, on the meta device.

The second stage of the pipeline (see :mod:`grpo_patches.preflight`). Nothing is loaded: the model is
built with ``AutoModelForCausalLM.from_config`` under ``torch.device("meta")`` (then
``peft.get_peft_model`` where the LoRA config is not a plain one), so a 70B config is counted on a CPU
in a fraction of a second.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from grpo_patches.preflight.settings import RewardModelSpec, load_model_config

__all__ = ["Arch", "ParamCount", "architecture", "count_parameters", "count_reward_model", "count_reward_models"]


@dataclasses.dataclass(frozen=True)
class Arch:
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


def architecture(cfg: Any) -> Arch:
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    hidden = text.hidden_size
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    moe = any(getattr(text, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    inter = getattr(text, "intermediate_size", None) or 4 * hidden
    if moe:  # widths of the experts a token visits
        per_expert = getattr(text, "moe_intermediate_size", None) or inter
        inter = per_expert * (getattr(text, "num_experts_per_tok", None) or 2)
    return Arch(
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
    from grpo_patches.defaults import PINNED_LORA_SETTINGS

    return _lora_params(model, PINNED_LORA_SETTINGS["r"], PINNED_LORA_SETTINGS["target_modules"])


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


@contextlib.contextmanager
def _outside_zero3_init() -> Iterator[None]:
    """Build the meta model as a plain one, even where a ZeRO-3 ``HfDeepSpeedConfig`` is alive.

    transformers' ``from_config`` enters ``deepspeed.zero.Init`` whenever a live ``HfDeepSpeedConfig``
    says ZeRO-3 (accelerate's DeepSpeed plugin makes one before the training script runs), and
    partitioning a meta tensor fails ("Cannot copy out of meta tensor; no data!"). Preflight only reads
    shapes, so the config's weak reference is hidden from transformers while the model is built.
    """
    try:
        from transformers.integrations import deepspeed as hf_deepspeed
    except ImportError:  # a transformers without the integration: nothing to hide
        yield
        return
    saved = getattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", None)
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


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
        with _outside_zero3_init(), torch.device("meta"):
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


def count_reward_model(cfg: Any) -> int:
    d = cfg.to_dict()
    d.pop("model_type", None)
    return _count_rm_cached(json.dumps(d, sort_keys=True, default=str), cfg.model_type)


@functools.lru_cache(maxsize=32)
def _count_rm_cached(config_json: str, model_type: str) -> int:
    import transformers

    cfg = transformers.AutoConfig.for_model(model_type, **json.loads(config_json))
    cfg.num_labels = 1
    with _outside_zero3_init(), torch.device("meta"):
        try:
            model = transformers.AutoModelForSequenceClassification.from_config(cfg)
        except ValueError:  # no classification head registered for this type: count the backbone
            model = transformers.AutoModel.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


def count_reward_models(specs: Iterable[RewardModelSpec]) -> list[tuple[RewardModelSpec, Arch, int]]:
    """Each learned reward model with its widths and parameter count."""
    rewards = []
    for spec in specs:
        rm_cfg = load_model_config(spec.config)
        rewards.append((spec, architecture(rm_cfg), count_reward_model(rm_cfg)))
    return rewards
