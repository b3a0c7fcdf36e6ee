"""Smoke test of a patched TRL fork, without the kit: 2 processes on CPU over gloo, a tiny random model.

    /path/to/fork-venv/bin/python examples/fork_smoke.py

Run it from a grpo-patches checkout with the interpreter whose TRL carries ``patches/grpo_rank_local.patch``
and the release's ``patches/trl-<release>.patch``. It imports nothing of grpo_patches: the tiny model,
tokenizer and prompts come from ``grpo_patches/testing.py``, loaded by its path (that file imports nothing
of the kit). On both ranks it checks that

1. the bundle is there (``trl.trainer.grpo_rank_local``, ``GRPOConfig.grpo_patches``) and the kit is not;
2. a per-rank batch that would split groups (2 completions per rank, groups of 4: stock TRL accepts it) is
   refused when the trainer is built, naming ``num_generations``;
3. a valid one trains 2 steps with ``reward_placement="main"``: rank 0 scores every completion, each
   reward call holding whole groups, and rank 1 scores none.

Prints ``fork smoke: OK`` and exits 0; otherwise names what failed and exits 1 (a rank that hangs is
stopped after ``--timeout`` seconds).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

G = 4  # completions per prompt


def _testing():
    path = Path(__file__).resolve().parents[1] / "grpo_patches" / "testing.py"
    spec = importlib.util.spec_from_file_location("tiny_components", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(timeout: float) -> int:
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port())}
    env.pop("PYTHONPATH", None)
    procs = [subprocess.Popen([sys.executable, __file__], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(2)]
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for p in procs:
        if p.poll() is None:
            p.kill()
    if codes == [0, 0]:
        print("fork smoke: OK")
        return 0
    hung = f"; None: still running after {timeout:g} s" if None in codes else ""
    print(f"fork smoke: FAILED (exit codes {codes}{hung})")
    return 1


def rank_main() -> int:
    rank = int(os.environ["RANK"])
    tiny = _testing()
    tiny.quiet()
    import torch.distributed as dist
    from trl import GRPOConfig, GRPOTrainer

    failures: list[str] = []
    if importlib.util.find_spec("trl.trainer.grpo_rank_local") is None:
        failures.append("trl.trainer.grpo_rank_local is missing: apply patches/grpo_rank_local.patch")
    if "grpo_patches" not in GRPOConfig.__dataclass_fields__:
        failures.append("GRPOConfig has no grpo_patches field: apply patches/trl-<release>.patch")
    if importlib.util.find_spec("grpo_patches") is not None:
        failures.append("grpo_patches is importable here: run this where only the patched TRL is installed")
    if failures:  # nothing else can be checked
        for failure in failures:
            print(f"rank {rank}: {failure}", flush=True)
        return 1

    calls: list[list[int]] = []

    def recording_reward(completions, row, **kwargs):
        calls.append(list(row))
        return [float(len(c)) for c in completions]

    def build(per_device: int, **settings):
        args = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="fork_smoke_"), use_cpu=True, bf16=False, report_to=[],
                          save_strategy="no", per_device_train_batch_size=per_device, num_generations=G,
                          max_completion_length=6, max_steps=2, learning_rate=1e-3, gradient_checkpointing=False,
                          disable_tqdm=True, dataloader_num_workers=0, ddp_find_unused_parameters=False, **settings)
        return GRPOTrainer(model=tiny.tiny_policy(), reward_funcs=[recording_reward], args=args,
                           train_dataset=tiny.prompt_dataset(16), processing_class=tiny.tiny_tokenizer(),
                           peft_config=tiny.tiny_lora())

    try:
        build(2)
        failures.append("2 completions per rank with num_generations=4 was accepted: groups would split")
    except ValueError as exc:
        if "num_generations" not in str(exc):
            failures.append(f"the split shape was refused for another reason: {exc}")
    build(G, reward_placement="main").train()
    whole = all(len(c) % G == 0 and all(len(set(c[i:i + G])) == 1 for i in range(0, len(c), G)) for c in calls)
    if rank == 0 and not (calls and whole):
        failures.append(f"rank 0's reward calls do not hold whole groups of {G}: {calls}")
    if rank == 1 and calls:
        failures.append(f"rank 1 scored completions under reward_placement='main': {calls}")
    for failure in failures:
        print(f"rank {rank}: {failure}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    if "RANK" in os.environ:
        sys.stdout.flush()
        os._exit(rank_main())  # gloo can hang a normal interpreter exit after training (torch 2.13)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a hung rank is stopped")
    sys.exit(launch(parser.parse_args().timeout))
