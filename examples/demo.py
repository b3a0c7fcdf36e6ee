"""GRPO + LoRA on a tiny built-in model, 2 processes on CPU (gloo), with and without the kit.

    python examples/demo.py                 # patched: every group of completions stays on one rank
    python examples/demo.py --unpatched     # stock TRL, same settings: its split groups, counted
    options: [--steps 60] [--world-size 2] [--placement main|local] [--out demo_output]

The policy is a random-init tiny Llama with a word-level tokenizer built here (no hub). The reward
is the share of the word "a" in the completion, something such a model learns in a few dozen
steps. The settings are ones stock TRL gets wrong: 4 completions per micro-batch, one micro-batch
per generation round, groups of 8 on 2 ranks. Stock TRL accepts them and deals each group's 8
completions to both ranks, 4 each (its sampler repeats a prompt 8 times; accelerate hands the
micro-batches to alternate ranks), so reward functions see half groups. The kit refuses them when
the trainer is built, naming the nearest valid settings; the demo prints that refusal and goes on
with the suggested ``steps_per_generation=2`` (8 completions per rank per round: one whole group).
Each process tags its dataset rows with its rank, so every reward call, wherever it runs
(``reward_placement="main"``: the main process), sees which rank generated each completion; at the
end the demo counts the groups whose completions came from more than one rank. Each run writes its
reward curve to ``--out``; the picture (``reward_curve.png``) shows every run found there, patched
and stock, with their split counts. Each run takes under 30 s on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGET = "a"
G = 8  # num_generations
SEEN: list[tuple[int, int, int]] = []  # (step, row, rank that generated it) per completion, in reward calls


def launch(argv: list[str], world_size: int) -> int:
    """Start the ranks (RANK/WORLD_SIZE/MASTER_* env, gloo) and wait for them all."""
    from grpo_patches.testing import free_port

    port = str(free_port())
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                   LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        procs.append(subprocess.Popen([sys.executable, __file__, *argv], env=env))
    codes = [p.wait() for p in procs]
    return max(codes)


def share_of_a(completions, row, generated_on, trainer_state=None, **kwargs):
    """Reward: share of the word "a" among the completion's words (and a note of who generated what)."""
    step = trainer_state.global_step if trainer_state is not None else -1
    SEEN.extend((step, r, k) for r, k in zip(row, generated_on, strict=True))
    return [sum(w == TARGET for w in c.split()) / max(len(c.split()), 1) for c in completions]


def split_groups(seen: list[tuple[int, int, int]]) -> tuple[int, int]:
    """(groups, groups whose completions were generated on more than one rank): a group is a prompt row
    within one generation round (the step its rewards were computed at)."""
    ranks: dict[tuple[int, int], set[int]] = {}
    for step, row, rank in seen:
        ranks.setdefault((step, row), set()).add(rank)
    return len(ranks), sum(len(r) > 1 for r in ranks.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--placement", default="main", choices=["main", "local"],
                        help="where the kit scores rewards (not used with --unpatched)")
    parser.add_argument("--unpatched", action="store_true", help="stock TRL on the same settings, without the kit")
    parser.add_argument("--out", default=str(ROOT / "demo_output"))
    args = parser.parse_args()
    run = "unpatched" if args.unpatched else "patched"
    if "RANK" not in os.environ:
        print(f"grpo-patches demo: {args.world_size} ranks on CPU (gloo), {args.steps} steps, "
              + ("stock TRL (unpatched)" if args.unpatched else f"patched, reward_placement={args.placement!r}"),
              flush=True)
        t0 = time.time()
        code = launch(sys.argv[1:], args.world_size)
        print(f"demo finished in {time.time() - t0:.0f} s with exit code {code}")
        return code

    from grpo_patches.testing import prompt_dataset, quiet, tiny_lora, tiny_policy, tiny_tokenizer

    quiet()
    import torch.distributed as dist
    from transformers import ProgressCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import grpo_patches

    rank = int(os.environ["RANK"])
    if not args.unpatched:
        grpo_patches.apply(reward_placement=args.placement, reward_chunk_size=2 * G)

    class QuietProgress(ProgressCallback):
        def on_log(self, *args, **kwargs):
            pass

    class PrintRewards(TrainerCallback):
        def on_log(self, targs, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs and "reward" in logs:
                print(f"\nstep {state.global_step:3d}  reward mean {logs['reward']:.3f}  "
                      f"(std {logs.get('reward_std', float('nan')):.3f})", flush=True)

    def build(steps_per_generation: int):
        config = GRPOConfig(
            str(Path(args.out) / f"trainer-{run}"), max_steps=args.steps, per_device_train_batch_size=4,
            steps_per_generation=steps_per_generation, num_generations=G, max_completion_length=8,
            learning_rate=1e-2, lr_scheduler_type="constant", seed=0, logging_steps=1, disable_tqdm=rank != 0,
            temperature=1.0, beta=0.0, gradient_checkpointing=False, save_strategy="no", report_to=[],
            use_cpu=True, bf16=False,
            ddp_find_unused_parameters=False,  # as grpo_patches.defaults pins it: every LoRA weight is used
        )
        dataset = prompt_dataset(64)
        dataset = dataset.add_column("generated_on", [rank] * len(dataset))  # this process's rank, on every row
        return GRPOTrainer(model=tiny_policy(initializer_range=0.3), reward_funcs=[share_of_a], args=config,
                           train_dataset=dataset, processing_class=tiny_tokenizer(),
                           peft_config=tiny_lora(r=8), callbacks=[PrintRewards()])

    try:
        trainer = build(steps_per_generation=1)  # 4 completions per rank per round: half a group of 8
    except grpo_patches.GroupShapeError as refusal:  # the kit's check; stock TRL accepts these settings
        if rank == 0:
            print(f"the kit refuses the demo's settings: {refusal}\n-> going on with steps_per_generation=2",
                  flush=True)
        trainer = build(steps_per_generation=2)
    trainer.remove_callback(ProgressCallback)  # keep the bar, drop its dump of every log dict
    trainer.add_callback(QuietProgress())
    trainer.train()

    seen = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(SEEN, seen, dst=0)
    code = 0
    if rank == 0:
        groups, split = split_groups([s for part in seen for s in part])
        verdict = ("stock TRL splits groups" if args.unpatched else "FAILED") if split else "OK"
        print(f"group locality: {groups} groups of {G} generated, {split} split across ranks -> {verdict}")
        code = int(split != 0 and not args.unpatched)
        history = [(h["step"], h["reward"]) for h in trainer.state.log_history if "reward" in h]
        first, last = history[0][1], sum(r for _, r in history[-5:]) / min(5, len(history))
        print(f"reward mean: first step {first:.3f}, last 5 steps {last:.3f}")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"history-{run}.json").write_text(json.dumps({"run": run, "groups": groups, "split": split,
                                                             "history": history}))
        write_plot(out, out / "reward_curve.png")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(code)


def write_plot(out: Path, path: Path) -> None:
    """Every run's reward curve found in ``out`` (patched and unpatched), labelled with its split groups."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for run in ("patched", "unpatched"):
        f = out / f"history-{run}.json"
        if not f.is_file():
            continue
        data = json.loads(f.read_text())
        steps, rewards = zip(*data["history"], strict=True)
        label = ("with grpo-patches" if run == "patched" else "stock TRL") + \
            f": {data['split']} of {data['groups']} groups split across ranks"
        ax.plot(steps, rewards, marker=".", label=label)
    ax.set_xlabel("step")
    ax.set_ylabel('reward mean (share of "a")')
    ax.set_title("GRPO + LoRA on 2 CPU ranks, groups of 8", wrap=True)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"reward curve written to {path}")


if __name__ == "__main__":
    sys.exit(main())
