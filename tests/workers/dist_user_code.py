"""Rank worker for the I7b / issue-12 multi-process tests: ``python -m tests.workers.dist_user_code OUTDIR SCENARIO ...``.

Scenarios: ``accuracy PLACEMENT`` (TRL's accuracy_reward, with a sample that trips math_verify's
timeout), ``partial_groups`` (main placement handed a per-rank batch that is not whole groups),
``eval`` (an eval shape that cuts groups, eval set passed to evaluate() later), ``reinit`` (the
kit's side group after destroy_process_group and a new default group; no TRL).
"""

from __future__ import annotations

import os
import sys
import time
import traceback

from tests.helpers import grpo_args, lora, prompt_dataset, quiet, tiny_policy, tiny_tokenizer
from tests.launch import end_rank

quiet()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import grpo_patches  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
SLOW = r"\boxed{9^{9^{9^{9}}}}"  # math_verify's verify() runs past its 5 s timeout on this one


def build(reward_funcs, **overrides):
    from trl import GRPOTrainer

    kw = {k: overrides.pop(k) for k in ("eval_dataset",) if k in overrides}
    args = grpo_args(**{"per_device_train_batch_size": 4, "num_generations": 2, **overrides})
    return GRPOTrainer(model=tiny_policy(), reward_funcs=reward_funcs, args=args, train_dataset=prompt_dataset(8),
                       processing_class=tiny_tokenizer(), peft_config=lora(), **kw)


def own_rows(rewards: torch.Tensor, n: int) -> list:
    return rewards[RANK * n:(RANK + 1) * n].cpu().tolist()


def scenario_accuracy(data):
    from trl.rewards import accuracy_reward

    placement = data["argv"][0]
    contents = [r"The answer is \boxed{3}", r"\boxed{4}", SLOW, "no idea"] if RANK == 0 else \
               [r"\boxed{\frac{1}{2}}", r"\boxed{0.5}", r"\boxed{7}", SLOW]
    solutions = ["3", "3", "1", "5"] if RANK == 0 else [r"\frac{1}{2}", r"\frac{1}{2}", "7", "2"]
    completions = [[{"role": "assistant", "content": c}] for c in contents]
    prompts = [[{"role": "user", "content": "solve"}]] * 4
    inputs = [{"prompt": p, "solution": s} for p, s in zip(prompts, solutions, strict=True)]
    for label in ("stock", "patched"):
        if label == "stock":
            grpo_patches.revert()
        else:
            grpo_patches.apply(reward_placement=placement, reward_timeout=60.0)
        trainer = build([accuracy_reward])
        trainer.model.train()
        start = time.monotonic()
        rewards = trainer._calculate_rewards(inputs, prompts, completions, [[0]] * 4)
        data[label] = {"rewards": own_rows(rewards, 4), "seconds": time.monotonic() - start}
    grpo_patches.revert()


def scenario_partial_groups(data):
    seen = []

    def reward(completions, **kwargs):
        seen.append(len(completions))
        return [1.0] * len(completions)

    n = 3  # not whole groups of num_generations=2 on each rank (6 in all: whole groups only when merged)
    inputs = [{"prompt": "say the letter a please", "row": RANK}] * n
    for label in ("stock", "patched"):
        if label == "stock":
            grpo_patches.revert()
        else:
            grpo_patches.apply(reward_placement="main", reward_timeout=20.0)
        trainer = build([reward])
        trainer.model.train()
        try:
            rewards = trainer._calculate_rewards(inputs, [x["prompt"] for x in inputs], ["a"] * n, [[0]] * n)
            data[label] = {"rows": rewards.shape[0], "calls": list(seen)}
        except Exception as exc:
            data[label] = {"error": f"{type(exc).__name__}: {exc}"}
        seen.clear()
    grpo_patches.revert()


def scenario_eval(data):
    calls = []

    def reward(completions, row, **kwargs):
        calls.append(list(row))
        return [1.0] * len(completions)

    shape = dict(per_device_eval_batch_size=2, num_generations=4, per_device_train_batch_size=4)
    # stock: evaluate() splits each eval group over the two ranks
    grpo_patches.revert()
    trainer = build([reward], **shape)
    trainer.evaluate(eval_dataset=prompt_dataset(4))
    data["stock_eval_calls"] = list(calls)
    calls.clear()
    grpo_patches.apply(reward_timeout=20.0)
    try:  # evaluation on a schedule: refused at construction
        build([reward], eval_strategy="steps", eval_steps=1, eval_dataset=prompt_dataset(4), **shape)
        data["scheduled"] = None
    except grpo_patches.GroupShapeError as exc:
        data["scheduled"] = str(exc)
    trainer = build([reward], **shape)  # eval_strategy="no": accepted, evaluation may never run
    try:
        trainer.evaluate(eval_dataset=prompt_dataset(4))
        data["late_eval"] = None
    except Exception as exc:
        data["late_eval"] = f"{type(exc).__name__}: {exc}"
    data["patched_eval_calls"] = list(calls)
    grpo_patches.revert()


def scenario_reinit(data):
    from grpo_patches.collectives import FailFastGroup

    dist.init_process_group("gloo")
    data["first"] = FailFastGroup(10.0).gather_to_main(RANK)
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = data["argv"][0]
    dist.init_process_group("gloo")
    try:
        data["second"] = FailFastGroup(10.0).gather_to_main(RANK * 10)
    except Exception as exc:
        data["second_error"] = f"{type(exc).__name__}: {exc}"


def main() -> None:
    outdir, scenario, *argv = sys.argv[1:]
    data: dict = {"rank": RANK, "argv": argv}
    code = 0
    try:
        globals()[f"scenario_{scenario}"](data)
    except Exception as exc:
        data["error"] = f"{type(exc).__name__}: {exc}"
        data["traceback"] = traceback.format_exc()[-3000:]
        code = 3
    end_rank(outdir, RANK, data, code)


if __name__ == "__main__":
    main()
