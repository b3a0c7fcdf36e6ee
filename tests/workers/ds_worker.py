"""One rank of a TRL GRPO run under DeepSpeed (CPU accelerator, gloo) with the kit applied:
``python -m tests.workers.ds_worker OUTDIR STAGE PLACEMENT [model]``. Writes what each reward call held;
with ``model`` a tiny reward model is passed too (main placement then has to be refused)."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

from tests.helpers import grpo_args, quiet

quiet()

import torch.distributed as dist  # noqa: E402

import grpo_patches  # noqa: E402
from tests.helpers import tiny_reward_model, tiny_tokenizer  # noqa: E402
from tests.workers.dist_trl import CALLS, build, recording_reward  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))


def ds_config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "zero_optimization": {"stage": stage}, "bf16": {"enabled": False},
            # torch's AdamW: DeepSpeed's fused / CPU Adam would compile a C++ op first
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}}}


def main() -> None:
    outdir, stage, placement = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    with_model = sys.argv[4:] == ["model"]
    data: dict = {"rank": RANK}
    code = 0
    try:
        grpo_patches.apply(reward_placement=placement, reward_timeout=120)
        args = grpo_args(per_device_train_batch_size=4, num_generations=4, max_steps=2, deepspeed=ds_config(stage))
        t0 = time.time()
        extra = dict(reward_processing_classes=[None, tiny_tokenizer()]) if with_model else {}
        trainer = build(args, reward_funcs=[recording_reward] + ([tiny_reward_model()] if with_model else []), **extra)
        data["distributed_type"] = str(trainer.accelerator.distributed_type)
        data["patched"] = hasattr(trainer, "_grpo_patches")
        trainer.train()
        data["calls"] = list(CALLS)
        data["steps"] = trainer.state.global_step
        data["seconds"] = time.time() - t0
    except Exception as exc:
        data["error"] = f"{type(exc).__name__}: {exc}"
        data["traceback"] = traceback.format_exc()[-3000:]
        code = 3
    with open(os.path.join(outdir, f"rank{RANK}.json"), "w") as f:
        json.dump(data, f)
    sys.stdout.flush()
    if code == 0 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    os._exit(code)


if __name__ == "__main__":
    main()
