"""Worker for the resume test: ``python -m tests.workers.dist_resume OUTDIR LABEL``, LABEL ``stock`` or ``patched``.

Each rank trains a real GRPOTrainer for 2 epochs of 18 rows (4 prompts per step, 4 steps per epoch:
8 steps), saving a checkpoint at step 6 (epoch 1, its 2nd step), and records the dataset ``row``
column its reward function sees at every call (one call per step). Then a fresh trainer with the same
arguments resumes from that checkpoint with ``trainer.train(resume_from_checkpoint=...)`` and records
the same for steps 7-8. The pytest side (test_resume.py) compares the two.
"""

from __future__ import annotations

import os
import sys
import traceback

from tests.helpers import grpo_args, lora, prompt_dataset, quiet, target_share, tiny_policy, tiny_tokenizer
from tests.launch import end_rank

quiet()


import grpo_patches  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
N_ROWS, EPOCHS, RESUME_AT = 18, 2, 6
CALLS: list[list[int]] = []


def recording_reward(completions, row, **kwargs):
    CALLS.append(list(row))
    return target_share(completions, target=kwargs.get("target"))


def cpu_map_location_shim() -> None:
    """transformers < 4.50 loads the optimizer state of a multi-rank run with ``map_location=args.device``,
    ``cpu:0`` on CPU, which torch 2.13 refuses ("don't know how to restore data location ... cpu:0");
    on GPUs it is ``cuda:N`` and works. Test-only: read ``cpu:N`` as ``cpu``."""
    import torch

    load = torch.load

    def patched_load(*args, map_location=None, **kwargs):
        if isinstance(map_location, torch.device | str) and str(map_location).startswith("cpu:"):
            map_location = "cpu"
        return load(*args, map_location=map_location, **kwargs)

    torch.load = patched_load


def train(output_dir: str, resume: str | None) -> tuple[list[list[int]], int]:
    from trl import GRPOTrainer

    args = grpo_args(output_dir, per_device_train_batch_size=4, num_generations=2, max_steps=-1,
                     num_train_epochs=EPOCHS, save_strategy="steps", save_steps=RESUME_AT)
    trainer = GRPOTrainer(model=tiny_policy(), reward_funcs=[recording_reward], args=args,
                          train_dataset=prompt_dataset(N_ROWS), processing_class=tiny_tokenizer(),
                          peft_config=lora())
    CALLS.clear()
    trainer.train(resume_from_checkpoint=resume)
    return list(CALLS), trainer.state.global_step


def main() -> None:
    outdir, label = sys.argv[1:3]
    data: dict = {"rank": RANK, "label": label}
    code = 0
    try:
        cpu_map_location_shim()
        if label == "stock":
            grpo_patches.revert()
        else:
            grpo_patches.apply()
        run_dir = os.path.join(outdir, "run")  # the same folder on every rank, as in a real job
        data["full"], data["full_steps"] = train(run_dir, None)
        data["resumed"], data["resumed_steps"] = train(run_dir, os.path.join(run_dir, f"checkpoint-{RESUME_AT}"))
    except Exception as exc:
        data["error"] = f"{type(exc).__name__}: {exc}"
        data["traceback"] = traceback.format_exc()[-3000:]
        code = 3
    end_rank(outdir, RANK, data, code)


if __name__ == "__main__":
    main()
