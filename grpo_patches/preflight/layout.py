"""How the frozen base is laid out over the ranks: sharding, base precision, CPU offload.

Each :class:`Layout` says what one rank keeps of the frozen policy on its GPU, what it gathers while
a layer runs, and what it moves per generation round (the cost model of ``--plan``). The byte
formulas are the libraries' own layouts (each checked against the library on CPU in
``tests/test_preflight_layouts.py``):

- **nf4** (bitsandbytes ``Linear4bit``, QLoRA): 4 bits per weight of every decoder ``Linear`` plus
  an absmax per block of 64; with double quantization the absmax is itself 8-bit, blocks of 256, with
  one fp32 scale per block: 0.5 + 1/64 + 4/16384 bytes per weight (0.5 + 4/64 without). Embeddings,
  the LM head and norms stay in the compute dtype (transformers skips the output embedding).
- **int8** (``Linear8bitLt``, LLM.int8): 1 byte per weight plus an fp32 scale per output row.
- **ddp** / **zero2**: every rank holds the whole base (ZeRO-2 partitions gradients and optimizer
  state only, and a LoRA run has few of either).
- **fsdp2** (``fully_shard`` per decoder layer and on the root, as accelerate's transformer-based
  wrap does): each rank keeps 1/world of every parameter; a layer is all-gathered before its forward
  and again before its backward, and a group's all-gather buffer lives until the next group's
  copy-out, so two layers' worth is unsharded at once; the root's own parameters (embeddings, LM
  head, final norm) are gathered at the first forward and stay until backward ends, and the first
  layer's gather overlaps the root's buffer: max(2 root + layer, root + 2 layers) (measured with
  torch's ``FSDPMemTracker`` over gloo). Generation runs the sharded model: every decoding step
  gathers every layer again (TRL's ``summon_full_params`` is a no-op for FSDP2).
- **zero3**: 1/world of every parameter; a module's parameters are gathered when it runs plus a
  prefetch bucket (accelerate's ``auto``: 0.9 x hidden^2 elements). TRL's default
  ``ds3_gather_for_generation=True`` gathers the WHOLE model for generation; ``False`` gathers
  module by module at every decoding step.
- **offload** (FSDP2 ``CPUOffloadPolicy`` / ZeRO-3 ``offload_param``): the shards live in host memory
  and are copied to the GPU before each gather (plus one layer's shard of staging).
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["QUANTIZATIONS", "SHARDINGS", "Layout", "RoundCost", "quantized_bytes_per_weight"]

SHARDINGS = ("ddp", "zero2", "fsdp2", "zero3")
QUANTIZATIONS = (None, "int8", "nf4")
_NF4_BLOCK, _NESTED_BLOCK = 64, 256


def _nf4_tensor_bytes(n: int, double_quant: bool) -> int:
    """One ``Params4bit`` as bitsandbytes stores it: packed 4-bit data, the absmax per block of 64, the
    16-entry code; with double quantization the absmax in 8 bits, an fp32 scale per 256 blocks and the
    256-entry nested code."""
    blocks = -(-n // _NF4_BLOCK)
    if not double_quant:
        return -(-n // 2) + 4 * blocks + 4 * 16
    return -(-n // 2) + blocks + 4 * -(-blocks // _NESTED_BLOCK) + 4 * 16 + 4 * 256


def quantized_bytes_per_weight(quantization: str | None, double_quant: bool = True) -> float | None:
    """Bytes per weight of a quantized ``Linear`` (without int8's per-row scales); None if not quantized."""
    if quantization is None:
        return None
    if quantization == "nf4":
        if double_quant:
            return 0.5 + 1 / _NF4_BLOCK + 4 / (_NF4_BLOCK * _NESTED_BLOCK)
        return 0.5 + 4 / _NF4_BLOCK
    if quantization == "int8":
        return 1.0
    raise ValueError(f"quantization={quantization!r} must be None, 'nf4' or 'int8'.")


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to place the frozen base: ``sharding`` in ddp / zero2 / fsdp2 / zero3, ``quantization``
    None / "nf4" / "int8" (bitsandbytes), ``offload_base`` (frozen shards in host memory; fsdp2 / zero3
    only), ``gather_for_generation`` (ZeRO-3: TRL's ``ds3_gather_for_generation``)."""

    sharding: str = "ddp"
    quantization: str | None = None
    double_quant: bool = True
    offload_base: bool = False
    gather_for_generation: bool = True

    def __post_init__(self) -> None:
        if self.sharding not in SHARDINGS:
            raise ValueError(f"sharding={self.sharding!r} must be one of {', '.join(SHARDINGS)}.")
        quantized_bytes_per_weight(self.quantization)
        if self.offload_base and self.sharding not in ("fsdp2", "zero3"):
            raise ValueError(
                f"offload_base=True needs sharding='fsdp2' (CPUOffloadPolicy) or 'zero3' (offload_param); "
                f"{self.sharding} keeps the base on the GPU (ZeRO-2 offloads only optimizer state)."
            )
        if self.offload_base and self.quantization is not None:
            raise ValueError(
                "offload_base=True with a quantized base: bitsandbytes runs quantized weights on the GPU only "
                "(offloaded modules stay unquantized); choose one."
            )

    @property
    def sharded(self) -> bool:
        return self.sharding in ("fsdp2", "zero3")

    @property
    def deepspeed(self) -> bool:
        return self.sharding.startswith("zero")

    def label(self) -> str:
        parts = [self.sharding]
        if self.quantization:
            parts.append(self.quantization + ("+dq" if self.quantization == "nf4" and self.double_quant else ""))
        if self.offload_base:
            parts.append("offload")
        if self.sharding == "zero3" and not self.gather_for_generation:
            parts.append("layerwise-generation")
        return " ".join(parts)

    # ------------------------------------------------------------------------------ bytes

    def base_bytes(self, params: Any, w_bytes: int) -> dict[str, float]:
        """The whole frozen base in this precision: decoder Linears, one layer, the root's own parameters."""
        per_weight = quantized_bytes_per_weight(self.quantization, self.double_quant)
        other = params.frozen - params.linear_frozen
        weights = sum(params.linear_sizes)
        biases = params.linear_frozen - weights  # stay in the compute dtype
        if per_weight is None:
            linear = params.linear_frozen * w_bytes
        elif self.quantization == "int8":
            linear = weights + 4 * params.linear_rows + biases * w_bytes
        elif params.linear_sizes:
            linear = sum(_nf4_tensor_bytes(n, self.double_quant) for n in params.linear_sizes) + biases * w_bytes
        else:
            linear = params.linear_frozen * per_weight
        layers = max(params.layers, 1)
        root = other - layers * params.layer_other  # embeddings, LM head, final norm
        layer = linear / layers + params.layer_other * w_bytes
        return {"total": linear + other * w_bytes, "layer": layer, "root": root * w_bytes,
                "embedding": params.embedding * w_bytes, "head": params.output_embedding * w_bytes}

    def gpu_weights(self, params: Any, w_bytes: int, world_size: int) -> int:
        """The frozen base resident on one GPU between gathers."""
        if self.offload_base:
            return 0
        total = self.base_bytes(params, w_bytes)["total"]
        return int(total / world_size) if self.sharded else int(total)

    def gathered(self, params: Any, w_bytes: int, world_size: int, hidden: int, phase: str) -> int:
        """Unsharded copies alive at once while the base runs (0 when nothing is sharded)."""
        if not self.sharded:
            return 0
        b = self.base_bytes(params, w_bytes)
        staging = b["layer"] / world_size if self.offload_base else 0
        if self.sharding == "fsdp2":
            # A group's all-gather buffer lives until the next group's copy-out (FSDP2's all_gather_state),
            # so the first layer's gather overlaps the root's buffer: 2 roots + a layer, else root + 2 layers.
            # The LoRA weights of a layer (fp32) are gathered with it.
            layer = b["layer"] + 4 * params.trainable / max(params.layers, 1)
            return int(max(2 * b["root"] + layer, b["root"] + 2 * layer) + staging)
        if phase == "generation" and self.gather_for_generation:
            return int(b["total"])  # GatheredParameters(model.parameters()) around generate
        prefetch = min(0.9 * hidden * hidden * w_bytes, b["layer"])
        return int(max(b["layer"], b["embedding"], b["head"]) + prefetch + staging)

    def dequant_transient(self, params: Any, act: int) -> int:
        """bitsandbytes dequantizes one Linear's weight to the compute dtype per matmul (forward and backward)."""
        return 0 if self.quantization is None else params.largest_linear * act

    # ------------------------------------------------------------------------------- cost

    def round_cost(self, params: Any, w_bytes: int, world_size: int, *, base_forwards: int,
                   generation_forwards: int, act: int) -> RoundCost:
        """What this layout moves per generation round beyond keeping the base resident.

        ``base_forwards``: passes over the base in training (forward, backward, reference forward);
        ``generation_forwards``: prefill + one per decoding step.
        """
        total = self.base_bytes(params, w_bytes)["total"]
        link = host = 0.0
        if self.sharded:
            passes = base_forwards
            passes += 1 if (self.sharding == "zero3" and self.gather_for_generation) else generation_forwards
            link = passes * total * (world_size - 1) / world_size
            if self.offload_base:
                host = passes * total / world_size
        dequant = 0.0
        if self.quantization is not None:  # write + read a compute-dtype copy of every Linear per pass
            dequant = (base_forwards + generation_forwards) * 2 * params.linear_frozen * act
        return RoundCost(gather_bytes=link, host_bytes=host, dequant_bytes=dequant)


@dataclasses.dataclass(frozen=True)
class RoundCost:
    """Bytes moved per generation round by the layout (the LoRA gradient all-reduce, equal for every
    layout, is left out), turned into seconds with stated bandwidths."""

    gather_bytes: float = 0.0  # all-gathers received by one rank over the GPU interconnect
    host_bytes: float = 0.0  # host -> GPU copies of offloaded shards
    dequant_bytes: float = 0.0  # HBM traffic of bitsandbytes' dequantization
    recompute_flops: float = 0.0  # gradient checkpointing's second forward

    def seconds(self, *, link_gbps: float, host_gbps: float, hbm_gbps: float, tflops: float) -> float:
        return (self.gather_bytes / (link_gbps * 1e9) + self.host_bytes / (host_gbps * 1e9)
                + self.dequant_bytes / (hbm_gbps * 1e9) + self.recompute_flops / (tflops * 1e12))


def layout_from_environment(environ: Any = None) -> dict[str, Any]:
    """``sharding`` and ``offload_base`` from the variables ``accelerate launch`` sets for its config
    (ACCELERATE_USE_FSDP + FSDP_VERSION + FSDP_OFFLOAD_PARAMS; ACCELERATE_USE_DEEPSPEED +
    ACCELERATE_DEEPSPEED_ZERO_STAGE + ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE); ddp otherwise.
    FSDP1 and ZeRO stages 0/1 are reported as the nearest modelled layout (fsdp2 / ddp)."""
    import os

    env = os.environ if environ is None else environ
    on = lambda name: str(env.get(name, "false")).lower() in ("1", "true", "yes")  # noqa: E731
    if on("ACCELERATE_USE_DEEPSPEED"):
        stage = int(env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2") or 2)
        sharding = "zero3" if stage == 3 else ("zero2" if stage == 2 else "ddp")
        offload = sharding == "zero3" and env.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none") == "cpu"
        return {"sharding": sharding, "offload_base": offload}
    if on("ACCELERATE_USE_FSDP"):
        return {"sharding": "fsdp2", "offload_base": on("FSDP_OFFLOAD_PARAMS")}
    return {"sharding": "ddp", "offload_base": False}
