"""Estimate: each rank's bytes per component and per phase (the memory model of :mod:`grpo_patches.preflight`).

The fourth stage of the pipeline: it takes the resolved settings, the counts and the layout and
returns one :class:`~grpo_patches.preflight.report.RankEstimate` per rank.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from grpo_patches.preflight.count import Arch, ParamCount
from grpo_patches.preflight.layout import Layout
from grpo_patches.preflight.report import RankEstimate
from grpo_patches.preflight.settings import RewardModelSpec, RunSettings, dtype_bytes
from grpo_patches.rewards import model_chunk

__all__ = ["FastGenerationMemory", "activation_bytes", "estimate_inputs", "estimate_ranks", "layer_bytes_per_token",
           "lean_input_width"]

#: The measured coefficients (coefficients.json: what each number is and where it was measured).
_COEFFICIENTS = json.loads((Path(__file__).with_name("coefficients.json")).read_text())
#: Bytes saved for backward per token per decoder layer, per unit of width, per device kind, keyed by
#: (activation bytes, LoRA dropout > 0).
_ACT_COEF: dict[str, dict[tuple[int, bool], dict[str, float]]] = {
    device: {(act, dropout): table[f"{8 * act}-bit"]["dropout" if dropout else "no dropout"]
             for act in (2, 4) for dropout in (True, False)}
    for device, table in _COEFFICIENTS["activations"].items() if device != "about"
}
#: ``compile_training``: the compiled decoder layer's saved tensors and backward buffers over the eager one's
_COMPILED_LAYER_FACTOR = float(_COEFFICIENTS["compiled_training"]["layer_factor"])
_FUSED_TOKEN_CHUNK = int(_COEFFICIENTS["fused_logprob_chunks"]["tokens"])
_FUSED_VOCAB_CHUNK = int(_COEFFICIENTS["fused_logprob_chunks"]["vocab"])


_DDP = Layout()


# ------------------------------------------------------------------------------------- estimate


def layer_bytes_per_token(arch: Arch, act: int, dropout: bool, device: str = "cuda") -> float:
    """Bytes autograd saves per token in one decoder layer with the LoRA adapter (see ``_ACT_COEF``);
    preflight predicts GPU memory, so the CUDA table unless told otherwise."""
    coef = _ACT_COEF[device][(2 if act <= 2 else 4, dropout)]
    scale = act / (2 if act <= 2 else 4)
    return scale * (
        coef["hidden"] * arch.hidden + coef["intermediate"] * arch.intermediate + coef["q"] * arch.q
        + coef["kv"] * arch.kv + coef["heads"] * arch.heads
    )


def activation_bytes(arch: Arch, tokens: int, act: int, dropout: bool, checkpointing: bool, lean_input: int = 0,
                     compiled: bool = False) -> int:
    """``lean_input``: the width of the widest adapted input whose fp32 copy ``lean_lora`` removes (0: none).
    ``compiled``: ``compile_training``'s layers, whose per-layer tensors (what one layer saves and its
    backward's buffers; not the checkpointed layer inputs) are ``_COMPILED_LAYER_FACTOR`` x the eager ones."""
    per_layer = layer_bytes_per_token(arch, act, dropout)
    workspace = tokens * (3 * arch.intermediate + 2 * arch.hidden) * act
    if lean_input and act == 2:  # PEFT's fp32 copy of the input (4 bytes), and the fp32 dropout output (4)
        workspace -= tokens * lean_input * (8 if dropout else 4)
    if compiled:
        per_layer, workspace = per_layer * _COMPILED_LAYER_FACTOR, workspace * _COMPILED_LAYER_FACTOR
    if checkpointing:
        saved = arch.layers * tokens * arch.hidden * act + tokens * per_layer
    else:
        saved = arch.layers * tokens * per_layer
    return int(saved + workspace)


def lean_input_width(arch: Arch, lora: Any, layout: Layout) -> int:
    """The widest input ``lean_lora`` keeps from being copied to fp32: the down projection's when it is
    adapted, else the hidden size; 0 where the adapter is 16-bit (DeepSpeed casts the module, TRL casts a
    quantized model's adapter to bf16), so stock PEFT makes no copy either."""
    if layout.deepspeed or layout.quantization is not None:
        return 0
    targets = getattr(lora, "target_modules", None) or ()
    targets = [targets] if isinstance(targets, str) else list(targets)
    return arch.intermediate if any(t == "all-linear" or "down" in t for t in targets) else arch.hidden


def prefill_transient(arch: Arch, tokens: int, act: int) -> int:
    return tokens * (arch.q + 2 * arch.kv + 2 * arch.hidden + 3 * arch.intermediate) * act


def sampling_bytes(arch: Arch, rows: int, act: int, sampler: tuple[float, int, float], fused: bool) -> int:
    """The last-token logits' temporaries while a token is sampled for ``rows`` sequences.

    transformers' loop (stock, and fast generation's ``decode_loop="transformers"``) keeps the model's
    logits (act) and their fp32 copy while its warpers run: temperature and top-k each return a new fp32
    tensor, and top-p sorts every row, its fp32 values and int64 indices beside the sort's own scratch of the
    same 12 bytes an element (the 1.74 GiB allocation a 1024 x 151,936 sort ran out of memory on); without
    top-p, the probabilities and ``multinomial``'s noise. The kit's graph loop (``fused``) keeps its fp32 scores, the
    weights and order keys of its top-p search and the sample's noise, within three fp32 copies (measured:
    18.4 GiB at 1024 rows against 18.9 predicted).
    """
    temperature, top_k, top_p = sampler
    if fused:
        return rows * arch.vocab * 4 * 3
    per = act + 4 + (4 if temperature != 1.0 or top_k > 0 else 0)
    per += 24 if top_p < 1.0 else 8
    return rows * arch.vocab * per


def logits_bytes(arch: Arch, batch: int, completion: int, act: int, mode: str) -> int:
    if mode == "fused":
        n = batch * completion
        tile = min(n, _FUSED_TOKEN_CHUNK) * min(arch.vocab, _FUSED_VOCAB_CHUNK) * act
        return tile + n * arch.hidden * (4 + 2 * act) + n * 8 * 4
    return 3 * batch * (completion + 1) * arch.vocab * act


def autocast_copies(params: ParamCount, arch: Arch, w_bytes: int, act: int, checkpointing: bool) -> int:
    """16-bit copies of fp32 frozen weights that autograd keeps for backward under autocast.

    Autocast caches casts of trainable leaves only; a frozen weight is cast per matmul and the copy is
    saved for the input gradient: every layer's copy without checkpointing, one layer's with it.
    """
    if w_bytes <= act:
        return 0
    matmul_weights = params.frozen - params.embedding - params.output_embedding  # TRL's fused head saves fp32
    return matmul_weights * act if not checkpointing else matmul_weights * act // max(arch.layers, 1)


def optimizer_bytes_per_param(optim: str) -> float:
    name = str(optim).lower()
    if "8bit" in name:
        return 2.0
    if name.startswith("sgd"):
        return 0.0
    if "adafactor" in name:
        return 0.5
    return 8.0


@dataclasses.dataclass(frozen=True)
class FastGenerationMemory:
    """What ``apply(fast_generation=...)`` adds to a rank: its static KV cache and merged-LoRA buffer."""

    cache_length: int  # tokens per row of the static cache
    merged_bytes: int  # the merged buffer (0 without merge_lora)
    released: bool  # release_after_sampling: both exist only while sampling
    graph_kept: bool = False  # the fused loop's CUDA graph stays allocated between rounds
    kit_sampler: bool = True  # the graph loop samples in its compiled step (generation/sampler.py)

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
                   graph and (config.keep_graph or not config.release_after_sampling),
                   config.decode_loop == "graph")


def estimate_ranks(
    arch: Arch,
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
    rewards: list[tuple[RewardModelSpec, Arch, int]],
    placement: str,
    capacity: int | None,
    overhead: int,
    fragmentation: float,
    fast: FastGenerationMemory | None = None,
    layout: Layout = _DDP,
    lean_input: int = 0,
    compiled: bool = False,
    sampler: tuple[float, int, float] = (1.0, 0, 1.0),
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
        optimizer_state = int((optimizer_bytes_per_param(optim) + 4) * trainable / w)
    elif layout.sharding == "fsdp2":  # LoRA weights sharded like the rest, fp32; gradients reduce-scattered
        lora_params, grad_copy = 4 * trainable // w, 0
        lora_grads = 4 * trainable // w
        optimizer_state = int(optimizer_bytes_per_param(optim) * trainable / w)
    elif layout.quantization is not None:
        # TRL (1.x) casts the adapter of a quantized model to bf16 (QLoRA paper): bf16 weights, gradients and
        # AdamW moments (torch keeps the moments in the parameter's dtype).
        lora_params, grad_copy = 2 * trainable, (2 * trainable if w > 1 else 0)
        lora_grads = 2 * trainable + grad_copy
        optimizer_state = int(optimizer_bytes_per_param(optim) / 2 * trainable)
    else:
        lora_params, grad_copy = 4 * trainable, (4 * trainable if w > 1 else 0)  # DDP's gradient buckets
        lora_grads = 4 * trainable + grad_copy
        optimizer_state = int(optimizer_bytes_per_param(optim) * trainable)
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
        "activations": activation_bytes(arch, tokens, act, dropout, checkpointing, lean_input, compiled),
        "logits_logps": logits_bytes(arch, batch, completion, act, logits_mode),
        "autocast_cache": 0 if quantized else autocast_copies(params, arch, w_bytes, act, checkpointing),
        "kv_cache": (kv_layer * arch.layers + kv_layer if fast is None
                     else 2 * arch.kv * fast.cache_length * n_gen * act * arch.layers),
        "merged_buffer": fast.merged_bytes if fast is not None else 0,
        "generation_transient": prefill_transient(arch, n_gen * prompt, act)
        + sampling_bytes(arch, n_gen, act, sampler, fused=fast is not None and fast.kit_sampler),
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
                rm_bytes = dtype_bytes(spec.dtype)
                rm_weights += rm_params * rm_bytes
                chunk = spec.batch_size or (n_gen if placement == "local" else n_gen * world_size)
                chunk = model_chunk(min(chunk, n_gen * (world_size if placement == "main" else 1)), 1)
                seq = prompt + completion
                rm_scoring = max(
                    rm_scoring,
                    prefill_transient(rm_arch, chunk * seq, rm_bytes) + chunk * seq * rm_arch.hidden * rm_bytes,
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


def estimate_inputs(s: RunSettings, arch: Arch, params: ParamCount, layout: Layout,
                    rewards: list[tuple[RewardModelSpec, Arch, int]], *, capacity: int | None, overhead: int,
                    fragmentation: float, fast_generation: Any, lean_lora: bool,
                    compile_training: bool = False) -> tuple[dict[str, Any], int]:
    """The keyword arguments of :func:`estimate_ranks` but ``checkpointing`` (the advice re-estimates with
    one of them changed), and the input width whose fp32 copy ``lean_lora`` removes (0: stock PEFT makes
    no copy in this setup)."""
    lean_width = lean_input_width(arch, s.lora, layout) if s.act == 2 else 0
    common = dict(world_size=s.world_size, batch=s.batch, steps=s.steps, prompt=s.prompt, completion=s.completion,
                  w_bytes=s.w_bytes, act=s.act, dropout=s.dropout, optim=s.optim,
                  logits_mode=s.logits_mode, rewards=rewards, placement=s.reward_placement, capacity=capacity,
                  overhead=overhead, fragmentation=fragmentation,
                  fast=(FastGenerationMemory.of(fast_generation, prompt=s.prompt, completion=s.completion,
                                                params=params, weight_bytes=s.w_bytes,
                                                quantized=layout.quantization is not None)
                        if fast_generation and layout.sharding == "ddp" else None),
                  layout=layout, lean_input=lean_width if lean_lora else 0, compiled=compile_training,
                  sampler=s.sampler)
    return common, lean_width
