"""A rank of a fork-mode (or monkeypatch-mode) scenario: ``python tests/fork/worker.py OUTDIR SCENARIO``.

Run as a script, not ``-m tests...``: the repository root must not be on sys.path, so that in fork
mode nothing of grpo_patches can be imported (kit.py checks). Each rank writes OUTDIR/rank<r>.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers.py, and kit.py's folder
sys.path.insert(0, str(Path(__file__).resolve().parent))

import helpers  # noqa: E402

helpers.quiet()

import kit  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
CALLS: list[dict] = []


def recording_reward(completions, row, group_ids=None, num_generations=None, **kwargs):
    CALLS.append({"rank": RANK, "rows": list(row), "group_ids": group_ids, "num_generations": num_generations})
    return helpers.target_share(completions, target=kwargs.get("target"))


def length_reward(completions, **kwargs):
    return [len(c.split()) / 6.0 for c in completions]


def build(args, reward_funcs=None, n_rows=16, **kw):
    from trl import GRPOTrainer

    return GRPOTrainer(model=helpers.tiny_policy(), reward_funcs=reward_funcs or [recording_reward], args=args,
                       train_dataset=helpers.prompt_dataset(n_rows), processing_class=helpers.tiny_tokenizer(),
                       peft_config=helpers.lora(), **kw)


def first_generation(trainer, seed=123):
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    torch.manual_seed(seed)
    generate = getattr(trainer, "_generate_and_score_completions", None) or trainer._prepare_inputs
    return batch, generate(batch)


def summary(batch, out):
    return {"rows": [b["row"] for b in batch], "completion_ids": out["completion_ids"].tolist(),
            "advantages": out["advantages"].tolist()}


def scenario_invariants(data):
    """I1 (split shape refused), I3 (advantages equal upstream's), I4 (main placement, chunks), I5
    (a raising reward fails every rank with its message), each first shown upstream (kit off)."""
    bad_rank = {"rank": 1}

    def flaky_reward(completions, **kwargs):
        if bad_rank["rank"] == RANK:
            raise ZeroDivisionError("injected in flaky_reward")
        return [1.0] * len(completions)

    kit.disable()
    split = build(kit.grpo_args(per_device_train_batch_size=2, num_generations=4))  # upstream accepts it
    CALLS.clear()
    first_generation(split)
    data["stock_split_rows"] = [row for call in CALLS for row in call["rows"]]
    stock = build(kit.grpo_args(per_device_train_batch_size=4, num_generations=4),
                  reward_funcs=[recording_reward, length_reward])
    data["stock"] = summary(*first_generation(stock))
    kit.disable()
    for label, options in (("default", {}),
                           ("local", {"reward_placement": "local", "reward_chunk_size": 4, "reward_timeout": 5.0}),
                           ("main", {"reward_placement": "main", "reward_chunk_size": 4, "reward_timeout": 5.0})):
        kit.enable(**options)
        try:  # I1: refused at construction, naming the nearest valid settings
            build(kit.grpo_args(per_device_train_batch_size=2, num_generations=4))
            data[f"{label}_refusal"] = None
        except kit.GroupShapeError as exc:
            data[f"{label}_refusal"] = str(exc)
        trainer = build(kit.grpo_args(per_device_train_batch_size=4, num_generations=4),
                        reward_funcs=[recording_reward, length_reward])
        CALLS.clear()
        data[label] = {**summary(*first_generation(trainer)), "calls": list(CALLS)}
        if label == "default":
            continue
        # I5: under "local" rank 1 raises; under "main" only rank 0 scores, so rank 0 raises
        bad_rank["rank"] = 1 if label == "local" else 0
        faulty = build(kit.grpo_args(per_device_train_batch_size=4, num_generations=4), reward_funcs=[flaky_reward])
        t0 = time.time()
        try:
            first_generation(faulty)
            data[f"{label}_fault"] = None
        except Exception as exc:
            data[f"{label}_fault"] = f"{type(exc).__name__}: {exc}"
        data[f"{label}_bad_rank"] = bad_rank["rank"]
        data[f"{label}_fault_s"] = time.time() - t0
    kit.disable()
    data["wrapt_imported"] = "wrapt" in sys.modules


def _load(spec: str):
    """``module:function`` under tests/ (e.g. ``matrix.fork_scenario:lean``): a scenario kept elsewhere,
    written against :mod:`kit` instead of grpo_patches."""
    import importlib

    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def main() -> None:
    outdir, scenario, *argv = sys.argv[1:]
    data: dict = {"rank": RANK, "argv": argv, "mode": kit.MODE}
    import trl

    data["trl"] = trl.__version__
    code = 0
    try:
        globals()[f"scenario_{scenario}"](data) if ":" not in scenario else _load(scenario)(data)
    except Exception as exc:
        data["error"] = f"{type(exc).__name__}: {exc}"
        data["traceback"] = traceback.format_exc()[-3000:]
        code = 3
    with open(os.path.join(outdir, f"rank{RANK}.json"), "w") as f:
        json.dump(data, f)
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 0 and dist.is_initialized():  # FACTS.md: barrier, destroy, os._exit at the end
        dist.barrier()
        dist.destroy_process_group()
    os._exit(code)


if __name__ == "__main__":
    main()
