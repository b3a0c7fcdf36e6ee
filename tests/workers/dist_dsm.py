"""Worker for the vendored trainer's multi-process tests: ``python -m tests.workers.dist_dsm OUTDIR SCENARIO ...``.

Each rank writes ``OUTDIR/rank<r>.json``; the pytest side (test_dsm_distributed.py) asserts on them.
Scenarios: ``shape`` (split groups, reward model placement, advantages naive vs patched, coverage),
``naive_fault`` (a reward error on rank 1, unpatched), ``faults PLACEMENT LAST`` (raise / wrong
length / NaN, patched, one after another in the same processes, then LAST: hang / die),
``learn STEPS`` (patched training on the demo task).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

from tests.helpers import (
    lora,
    on_gpu,
    prompt_dataset,
    quiet,
    target_share,
    tiny_policy,
    tiny_reward_model,
    tiny_tokenizer,
)

quiet()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import grpo_patches  # noqa: E402
from grpo_patches.vendored.dsm_grpo import DSMGRPOConfig, DSMGRPOTrainer  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
G = 4
CALLS: list[dict] = []
FAULT: dict = {"kind": None, "rank": None}


def recording_reward(prompts, completions, row, target, num_generations=None, group_ids=None):
    """Records what each call holds (its rank, rows, group kwargs) and scores by the target letter."""
    CALLS.append({"rank": RANK, "rows": list(row), "num_generations": num_generations, "group_ids": group_ids})
    return target_share(completions, target=target)


def flaky_reward(completions, **kwargs):
    """Misbehaves as FAULT says, on FAULT's rank only (the rank that runs the call)."""
    n = len(completions)
    if FAULT["kind"] is not None and FAULT["rank"] == RANK:
        kind = FAULT["kind"]
        if kind == "raise":
            raise KeyError("injected failure in flaky_reward")
        if kind == "wronglen":
            return [0.0] * (n - 1)
        if kind == "nan":
            return [float("nan")] * n
        if kind == "hang":
            time.sleep(3600)
        if kind == "die":
            os._exit(17)
    return [len(c.split()) / 8.0 for c in completions]


def counted_reward_model():
    """The tiny reward model, counting the ``to()`` calls (placement) and forwards (scoring) it gets."""
    model = tiny_reward_model()
    stats = {"to": 0, "forward": 0}
    original_to = model.to

    def to(*args, **kwargs):
        stats["to"] += 1
        return original_to(*args, **kwargs)

    model.to = to
    model.register_forward_pre_hook(lambda module, args: stats.__setitem__("forward", stats["forward"] + 1))
    return model, stats


def build(reward_funcs, **config):
    from peft import get_peft_model

    torch.manual_seed(0)  # the same policy and LoRA init for every trainer built here
    model = get_peft_model(tiny_policy(), lora())
    fields = dict(num_generations=G, max_new_tokens=6, learning_rate=1e-3, per_device_batch_size=4, seed=5)
    fields.update(config)
    return DSMGRPOTrainer(model, tiny_tokenizer(), reward_funcs, DSMGRPOConfig(**fields), accelerator=accelerator())


def accelerator():
    from accelerate import Accelerator

    return Accelerator(cpu=not on_gpu())  # on CPU: gloo (accelerate picks NCCL only for GPUs)


def first_rollout(trainer, dataset):
    """The first step's rows for this rank, and its rollout, sampled with a fixed per-rank seed."""
    rows = next(trainer.create_groups(len(dataset)))
    mine = [dataset[j] for j in rows]
    torch.manual_seed(100 + RANK)
    ro = trainer.rollout([r["prompt"] for r in mine], row=[r["row"] for r in mine], target=[r["target"] for r in mine])
    return rows, ro


def deal(trainer, dataset_size, steps):
    stream = trainer.create_groups(dataset_size)
    return [next(stream) for _ in range(steps)]


def scenario_shape(data):
    dataset = list(prompt_dataset(16))
    # 1. Unpatched, 2 completions per rank with G=4: accepted, every group split over the two ranks,
    #    and the reward model moved to and run on every rank.
    grpo_patches.revert()
    model, stats = counted_reward_model()
    trainer = build([recording_reward, model], per_device_batch_size=2)
    trainer.train(dataset, steps=2)
    data["naive_split_calls"], data["naive_rm"] = list(CALLS), dict(stats)
    CALLS.clear()
    # 2. Patched: the same config is refused at construction, before the reward model is touched.
    grpo_patches.apply()
    model, stats = counted_reward_model()
    try:
        build([recording_reward, model], per_device_batch_size=2)
        data["patched_error"] = None
    except grpo_patches.GroupShapeError as exc:
        data["patched_error"] = str(exc)
    data["refused_rm"] = dict(stats)
    # 3. A shape that does not split: unpatched, then patched local, then patched main, same seeds.
    for name, placement in (("naive", None), ("local", "local"), ("main", "main")):
        grpo_patches.revert()
        if placement is not None:
            grpo_patches.apply(reward_placement=placement, reward_chunk_size=G)
        model, stats = counted_reward_model()
        trainer = build([recording_reward, model])
        rows, ro = first_rollout(trainer, dataset)
        metrics = trainer.optimize(ro)
        data[name] = {"rows": rows, "rewards": ro.rewards.tolist(), "advantages": ro.advantages.tolist(),
                      "all_rewards": ro.all_rewards.tolist(), "texts": ro.texts, "calls": list(CALLS),
                      "rm": dict(stats), "holds_model": any(isinstance(f, nn.Module) for f in trainer.reward_funcs),
                      "names": trainer.reward_func_names, "loss": metrics["loss"]}
        CALLS.clear()
    # This rank's rewards recomputed here, for its own rows, by a copy of the reward model of its own.
    mine = [dataset[j] for j in data["main"]["rows"]]
    reference = tiny_reward_model()
    scores = trainer.score_with_model(reference, trainer.tokenizer, [r["prompt"] for r in mine], data["main"]["texts"])
    share = target_share(data["main"]["texts"], target=[r["target"] for r in mine])
    data["main"]["expected"] = [s + float(m) for s, m in zip(share, scores, strict=True)]
    # 4. Coverage: 11 rows, 2 prompts per step: which rows each rank gets over 11 epochs of 5 steps.
    grpo_patches.revert()
    data["naive_deal"] = deal(build(recording_reward), 11, 55)
    grpo_patches.apply()
    data["patched_deal"] = deal(build(recording_reward), 11, 55)


def scenario_naive_fault(data):
    grpo_patches.revert()
    FAULT.update(kind="raise", rank=1)
    trainer = build([recording_reward, flaky_reward])
    data["t0"] = time.monotonic()
    trainer.train(list(prompt_dataset(16)), steps=1)


def scenario_faults(data, placement, last):
    """raise / wronglen / nan on the scoring rank, one after another, with one patched trainer; then
    ``last`` (hang / die), after which the processes cannot go on together."""
    grpo_patches.apply(reward_placement=placement, reward_timeout=3.0)
    trainer = build([recording_reward, flaky_reward])
    bad = 1 if placement == "local" else 0  # under "main" rank 0 runs every reward function
    dataset = list(prompt_dataset(16))
    data["cases"] = {}
    for kind in ("raise", "wronglen", "nan", None):
        FAULT.update(kind=kind, rank=bad)
        t0 = time.monotonic()
        try:
            trainer.train(dataset, steps=1)
            outcome = None
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        data["cases"][str(kind)] = {"error": outcome, "seconds": time.monotonic() - t0}
    FAULT.update(kind=last, rank=bad)
    data["t0"] = time.monotonic()
    trainer.train(dataset, steps=1)


def scenario_learn(data, steps):
    from peft import get_peft_model

    from examples.vendored_grpo import share_of_a

    grpo_patches.apply(reward_placement="main", reward_chunk_size=8)
    torch.manual_seed(0)
    model = get_peft_model(tiny_policy(initializer_range=0.3), lora(r=8))
    trainer = DSMGRPOTrainer(model, tiny_tokenizer(), share_of_a,
                             DSMGRPOConfig(num_generations=8, max_new_tokens=8, learning_rate=1e-2,
                                           per_device_batch_size=8, seed=0), accelerator=accelerator())
    torch.manual_seed(RANK)
    data["history"] = [h["reward_mean"] for h in trainer.train(list(prompt_dataset(64)), steps=steps)]


def main() -> int:
    outdir, scenario, *args = sys.argv[1:]
    data: dict = {"rank": RANK}
    code = 0
    try:
        if scenario == "shape":
            scenario_shape(data)
        elif scenario == "naive_fault":
            scenario_naive_fault(data)
        elif scenario == "faults":
            scenario_faults(data, args[0], args[1])
        elif scenario == "learn":
            scenario_learn(data, int(args[0]))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        data["error"] = f"{type(exc).__name__}: {exc}"
        data["error_time"] = time.monotonic()
        data["traceback"] = traceback.format_exc()
        code = 3
    finally:
        with open(os.path.join(outdir, f"rank{RANK}.json"), "w") as f:
            json.dump(data, f)
        sys.stdout.flush()
    if code == 0 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    os._exit(code)  # torch 2.13 + gloo can abort or hang at interpreter exit


if __name__ == "__main__":
    main()
