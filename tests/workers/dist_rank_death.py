"""Worker for the rank-death tests: ``python -m tests.workers.dist_rank_death OUTDIR LABEL KIND VICTIM``.

LABEL: ``stock`` (unpatched TRL) or ``patched``. At the victim's 2nd reward call (step 2), KIND:

* ``kill``: the victim SIGKILLs itself, as the OOM killer does (no Python cleanup, no last words);
* ``stop``: the victim SIGSTOPs itself (frozen, sockets open: its peers get no connection error, as a
  rank hung in an NCCL kernel or a dead host would look); a helper process resumes it (SIGCONT)
  FREEZE seconds later;
* ``raise``: the victim raises a RuntimeError from a TrainerCallback at the start of step 2 (outside
  the reward path: as a CUDA out-of-memory error in the forward pass would) and exits;
* ``busy``: the victim spins in pure Python for BUSY seconds and then goes on (a slow reward, not a
  death); training must finish on every rank.

Each rank that gets to its end writes ``OUTDIR/rank<r>.json`` (error, time); the victim prints the
time it goes down (``VICTIM_DOWN <time>``) just before.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import traceback

from tests.helpers import grpo_args, lora, prompt_dataset, quiet, target_share, tiny_policy, tiny_tokenizer
from tests.launch import end_rank

quiet()


import grpo_patches  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
BUSY = float(os.environ.get("GRPO_PATCHES_TEST_BUSY", "0"))
FREEZE = float(os.environ.get("GRPO_PATCHES_TEST_FREEZE", "15"))


def main() -> None:
    outdir, label, kind, victim = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    data: dict = {"rank": RANK, "label": label, "kind": kind}
    calls = []

    def reward(completions, **kwargs):
        calls.append(len(completions))
        if victim == RANK and len(calls) == 2 and kind in ("kill", "stop", "busy"):
            print(f"VICTIM_DOWN {time.time()!r}", flush=True)  # when it went down (wall clock)
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif kind == "stop":
                subprocess.Popen(["sh", "-c", f"sleep {FREEZE}; kill -CONT {os.getpid()}"], start_new_session=True)
                os.kill(os.getpid(), signal.SIGSTOP)
            elif kind == "busy":
                end = time.monotonic() + BUSY
                while time.monotonic() < end:
                    sum(range(1000))
        return target_share(completions, target=kwargs.get("target"))

    code = 0
    try:
        if label == "stock":
            grpo_patches.revert()
        else:
            # a reward_timeout far past the test's bound: only the liveness monitor can end a frozen peer's wait
            grpo_patches.apply(reward_timeout=300.0)
        from transformers import TrainerCallback
        from trl import GRPOTrainer

        class RaiseAtStep2(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if kind == "raise" and victim == RANK and state.global_step == 1:
                    print(f"VICTIM_DOWN {time.time()!r}", flush=True)
                    raise RuntimeError("injected: CUDA out of memory in the forward pass")

        trainer = GRPOTrainer(model=tiny_policy(), reward_funcs=[reward], args=grpo_args(max_steps=4),
                              train_dataset=prompt_dataset(16), processing_class=tiny_tokenizer(),
                              peft_config=lora(), callbacks=[RaiseAtStep2()])
        trainer.train()
        data["steps"] = trainer.state.global_step
    except Exception as exc:
        data["error"] = f"{type(exc).__name__}: {exc}"
        data["error_type"] = type(exc).__name__
        data["traceback"] = traceback.format_exc()[-3000:]
        code = 3
    data["t_end"] = time.time()
    end_rank(outdir, RANK, data, code)


if __name__ == "__main__":
    main()
