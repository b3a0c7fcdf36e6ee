"""The vendored DeepSeekMath-style GRPO trainer with the kit, 2 processes on CPU (gloo), in about 10 s.

    python examples/vendored_grpo.py [--steps 30] [--world-size 2] [--placement main|local]
                                     [--per-device-batch-size 16] [--unpatched] [--out demo_output/vendored]

The policy is a random-init tiny Llama with LoRA and a word-level tokenizer built here (no hub);
the reward is the share of the word "a" in the completion. ``grpo_patches.apply()`` replaces the
trainer's ``create_groups`` (rank-local whole groups) and ``compute_rewards`` (scored on the main
process in chunks of whole groups, each rank gets its own rewards back). The loop below is the
trainer's ``train()`` spelled out, so that every step records which rows each rank generated: at
the end the example checks that each group of G completions was generated on one rank. With
``--unpatched`` (and a per-rank batch that is not a multiple of G, e.g. 4) it shows the split
groups of the unpatched trainer instead. Writes ``reward_curve.png`` (``reward_curve_unpatched.png``
with ``--unpatched``) under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGET = "a"
G = 8  # num_generations


def launch(argv: list[str], world_size: int) -> int:
    """Start the ranks (RANK/WORLD_SIZE/MASTER_* env: accelerate picks them up, gloo) and wait for them."""
    from grpo_patches.testing import free_port

    port = str(free_port())
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                   LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        procs.append(subprocess.Popen([sys.executable, __file__, *argv], env=env))
    return max(p.wait() for p in procs)


def share_of_a(completions, **kwargs):
    """Reward: share of the word "a" among the completion's words."""
    return [sum(w == TARGET for w in c.split()) / max(len(c.split()), 1) for c in completions]


def split_groups(dealt: list[list[list[int]]]) -> tuple[int, int]:
    """(groups, groups split across ranks) from ``dealt[rank][step]``: the rows each rank generated."""
    groups = split = 0
    for step in range(len(dealt[0])):
        owners: dict[int, list[int]] = {}
        for rank, steps in enumerate(dealt):
            for row in steps[step]:
                owners.setdefault(row, []).append(rank)
        for ranks in owners.values():  # a prompt's G completions: on how many ranks?
            groups += 1
            split += len(set(ranks)) > 1
    return groups, split


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--placement", default="main", choices=["main", "local"])
    parser.add_argument("--per-device-batch-size", type=int, default=16)
    parser.add_argument("--unpatched", action="store_true", help="run the trainer as vendored, without the kit")
    parser.add_argument("--out", default=str(ROOT / "demo_output" / "vendored"))
    args = parser.parse_args()
    if "RANK" not in os.environ:
        print(f"vendored DeepSeekMath-style GRPO: {args.world_size} ranks on CPU (gloo), {args.steps} steps, "
              + ("unpatched" if args.unpatched else f"patched, reward_placement={args.placement!r}"), flush=True)
        t0 = time.time()
        code = launch(sys.argv[1:], args.world_size)
        print(f"finished in {time.time() - t0:.0f} s with exit code {code}")
        return code

    from grpo_patches.testing import prompt_dataset, quiet, tiny_lora, tiny_policy, tiny_tokenizer

    quiet()
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from peft import get_peft_model

    import grpo_patches
    from grpo_patches.vendored.dsm_grpo import DSMGRPOConfig, DSMGRPOTrainer

    if not args.unpatched:
        grpo_patches.apply(reward_placement=args.placement, reward_chunk_size=2 * G, targets=("vendored",))
    torch.manual_seed(0)
    model = get_peft_model(tiny_policy(initializer_range=0.3), tiny_lora(r=8))
    config = DSMGRPOConfig(num_generations=G, max_new_tokens=8, learning_rate=1e-2,
                           per_device_batch_size=args.per_device_batch_size, seed=0)
    # the kit checks the shape here, before anything is built; cpu=True: gloo processes on CPU
    try:
        trainer = DSMGRPOTrainer(model, tiny_tokenizer(), share_of_a, config, accelerator=Accelerator(cpu=True))
    except grpo_patches.GroupShapeError as exc:  # every rank refuses the same shape, before any step
        if os.environ["RANK"] == "0":
            print(exc, flush=True)
        os._exit(2)  # torch 2.13 + gloo can hang at interpreter exit with the group alive
    rank, is_main = trainer.accelerator.process_index, trainer.accelerator.is_main_process
    torch.manual_seed(rank)  # each rank samples its own completions

    rows = list(prompt_dataset(64))
    groups = trainer.create_groups(len(rows))
    dealt: list[list[int]] = []  # the rows this rank generated, per step
    history: list[float] = []
    for step in range(args.steps):  # trainer.train(rows, steps=...), spelled out
        mine = [rows[j] for j in next(groups)]
        dealt.append([r["row"] for r in mine])
        rollout = trainer.rollout([r["prompt"] for r in mine], row=[r["row"] for r in mine])
        metrics = trainer.optimize(rollout)
        history.append(metrics["reward_mean"])
        if is_main:
            print(f"step {step:3d}  reward mean {metrics['reward_mean']:.3f}  "
                  f"(std in group {metrics['reward_std_in_group']:.3f}, kl {metrics['kl']:.4f})", flush=True)

    everyone = [None] * dist.get_world_size() if is_main else None
    dist.gather_object(dealt, everyone, dst=0)
    code = 0
    if is_main:
        n_groups, split = split_groups(everyone)
        print(f"group locality: {n_groups} groups of {G} generated, {split} split across ranks -> "
              f"{'OK' if split == 0 else 'SPLIT'}")
        code = int(split != 0 and not args.unpatched)
        last = sum(history[-5:]) / min(5, len(history))
        print(f"reward mean: first step {history[0]:.3f}, last 5 steps {last:.3f}")
        write_plot(history, Path(args.out) / f"reward_curve{'_unpatched' if args.unpatched else ''}.png",
                   args.unpatched, split, n_groups)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(code)  # torch 2.13 + gloo can abort or hang at interpreter exit


def write_plot(history: list[float], path: Path, unpatched: bool, split: int, groups: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(len(history)), history, marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel('reward mean (share of "a")')
    ax.set_title(f"vendored DeepSeekMath-style GRPO + LoRA, 2 CPU ranks\n"
                 f"{'unpatched' if unpatched else 'with grpo-patches'}: {split} of {groups} groups split across ranks",
                 fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"reward curve written to {path}")


if __name__ == "__main__":
    sys.exit(main())
