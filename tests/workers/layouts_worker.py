"""One rank of the layout checks: FSDP2 (``fully_shard`` over gloo) or DeepSpeed ZeRO (CPU
accelerator) on a small Llama with the pinned LoRA; writes the libraries' own byte counts per rank.

    python -m tests.workers.layouts_worker OUTDIR fsdp2|zero2|zero3
"""

from __future__ import annotations

import json
import os
import sys

import torch

CONFIG = dict(model_type="llama", vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=64)


def build(adapter_dtype_fp32: bool = True):
    import peft
    from transformers import AutoModelForCausalLM

    from grpo_patches.defaults import lora_config
    from grpo_patches.preflight import load_model_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(load_model_config(CONFIG), dtype=torch.bfloat16)
    return peft.get_peft_model(model, lora_config(), autocast_adapter_dtype=adapter_dtype_fp32)


def fsdp2(rank: int, world: int) -> dict:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build()
    layers = model.base_model.model.model.layers
    mesh = init_device_mesh("cpu", (world,))
    for layer in layers:  # accelerate's TRANSFORMER_BASED_WRAP: each decoder layer, then the root
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    local = {name: p.to_local() for name, p in model.named_parameters()}
    frozen = sum(t.numel() * t.element_size() for n, t in local.items() if "lora_" not in n)
    lora = sum(t.numel() * t.element_size() for n, t in local.items() if "lora_" in n)
    layer_lora = sum(p.numel() * 4 for n, p in layers[1].named_parameters() if "lora_" in n)  # fp32, unsharded
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    tracker = FSDPMemTracker(model, opt)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 16))
    with tracker:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    cpu = torch.device("cpu")
    gathered = {}
    for phase in ("Peak Forward", "Peak Backward"):
        seen = []
        for layer in layers:
            for state, snaps in tracker.memory_tracking[layer].snapshots.items():
                if state.value == phase:
                    seen += [s[cpu].get("Unsharded Param", 0) + s[cpu].get("All Gather", 0) for s in snaps]
        gathered[phase] = max(seen)
    return dict(frozen_shard_bytes=frozen, lora_shard_bytes=lora, layer_lora_bytes=layer_lora,
                gathered_forward=gathered["Peak Forward"], gathered_backward=gathered["Peak Backward"])


def zero(rank: int, world: int, stage: int) -> dict:
    import deepspeed
    import peft  # noqa: F401 - imported before zero.Init patches the tensor constructors
    import torch._dynamo  # noqa: F401
    import transformers.generation.utils  # noqa: F401

    hidden = CONFIG["hidden_size"]
    # the values transformers' "auto" fills in for ZeRO-3 (accelerate's zero3.yaml)
    zero = {"stage": stage, "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden}
    ds_config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": zero,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    if stage == 3:  # as transformers does under ZeRO-3; the adapter in bf16 like the base (one dtype per partition)
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = build(adapter_dtype_fp32=False)
    else:
        model = build()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=ds_config)
    params = list(engine.module.named_parameters())
    persistent = 0
    if stage == 3:
        frozen = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for n, p in params if "lora_" not in n)
        persistent = sum(p.ds_numel * p.element_size() for n, p in params if "lora_" not in n and p.ds_persist)
    else:
        frozen = sum(p.numel() * p.element_size() for n, p in params if "lora_" not in n)
    ids = torch.randint(0, CONFIG["vocab_size"], (1, 16))
    live: list[int] = []
    if stage == 3:  # DeepSpeed's own view: frozen parameters gathered (AVAILABLE) inside each matmul / lookup
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        frozen_params = [p for n, p in params if "lora_" not in n]
        available = ZeroParamStatus.AVAILABLE

        def count(fn):
            def wrapped(*a, **k):
                live.append(sum(p.numel() * p.element_size() for p in frozen_params if p.ds_status == available))
                return fn(*a, **k)
            return wrapped

        linear, embedding = torch.nn.functional.linear, torch.nn.functional.embedding
        torch.nn.functional.linear, torch.nn.functional.embedding = count(linear), count(embedding)
    try:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
    finally:
        if stage == 3:
            torch.nn.functional.linear, torch.nn.functional.embedding = linear, embedding
    engine.step()
    return dict(frozen_shard_bytes=frozen, persistent_bytes=persistent, loss=float(loss), gathered=max(live, default=0),
                ds_config=ds_config)


def main() -> int:
    outdir, mode = sys.argv[1], sys.argv[2]
    import torch.distributed as dist

    if mode == "fsdp2":
        dist.init_process_group("gloo")
        data = fsdp2(dist.get_rank(), dist.get_world_size())
    else:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        data = zero(dist.get_rank(), dist.get_world_size(), int(mode[-1]))
    rank = dist.get_rank()
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(data, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # a normal return after destroy can hang on gloo


if __name__ == "__main__":
    main()
