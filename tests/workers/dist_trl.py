"""Worker for multi-process tests through the real TRL GRPOTrainer: ``python -m tests.workers.dist_trl OUTDIR SCENARIO``.

Each rank writes ``OUTDIR/rank<r>.json``; the pytest side (test_trl_*.py) asserts on them.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import traceback

from tests.helpers import (
    grpo_args,
    lora,
    prompt_dataset,
    quiet,
    target_share,
    tiny_policy,
    tiny_reward_model,
    tiny_tokenizer,
)
from tests.launch import end_rank

quiet()

import torch  # noqa: E402

import grpo_patches  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
OUTDIR = {"dir": ""}
CALLS: list[dict] = []


def recording_reward(completions, row, group_ids=None, num_generations=None, **kwargs):
    """Records what each call holds (its rank, rows, group ids) and scores by the target letter."""
    CALLS.append({"rank": RANK, "rows": list(row), "group_ids": group_ids, "num_generations": num_generations})
    return target_share(completions, target=kwargs.get("target"))


def length_reward(completions, **kwargs):
    return [len(c.split()) / 6.0 for c in completions]


def build(args, reward_funcs=None, n_rows=16, **kw):
    from trl import GRPOTrainer

    return GRPOTrainer(model=tiny_policy(), reward_funcs=reward_funcs or [recording_reward], args=args,
                       train_dataset=prompt_dataset(n_rows), processing_class=tiny_tokenizer(),
                       peft_config=lora(), **kw)


def first_generation(trainer, seed=123):
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    torch.manual_seed(seed)
    # TRL 0.15 generates and scores inside _prepare_inputs; later releases in _generate_and_score_completions
    generate = getattr(trainer, "_generate_and_score_completions", None) or trainer._prepare_inputs
    out = generate(batch)
    return batch, out


MODES = [
    {"scale_rewards": "group"},
    {"scale_rewards": "none"},
    {"scale_rewards": "batch"},
    {"scale_rewards": "group", "multi_objective_aggregation": "normalize_then_sum"},
]


def scenario_equivalence(data):
    placement = data["argv"][0]
    results = []
    for mode in MODES:
        row = {"mode": mode}
        for label in ("stock", "patched"):
            if label == "stock":
                grpo_patches.revert()
            else:
                grpo_patches.apply(reward_placement=placement, reward_chunk_size=4)
            trainer = build(grpo_args(per_device_train_batch_size=4, num_generations=4, **mode),
                            reward_funcs=[recording_reward, length_reward])
            batch, out = first_generation(trainer)
            metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()
                       if k.startswith("reward") or k == "frac_reward_zero_std"}
            row[label] = {"rows": [b["row"] for b in batch], "completion_ids": out["completion_ids"].tolist(),
                          "advantages": out["advantages"].tolist(), "metrics": metrics}
        results.append(row)
    data["results"] = results


def scenario_main(data):
    from torch import nn

    grpo_patches.apply(reward_placement="main", reward_chunk_size=4)
    reward_model = tiny_reward_model()
    before = {k: v.clone() for k, v in reward_model.state_dict().items()}
    trainer = build(grpo_args(per_device_train_batch_size=8, num_generations=4, max_steps=2),
                    reward_funcs=[recording_reward, reward_model], reward_processing_classes=[None, tiny_tokenizer()])
    data["reward_func_names"] = trainer.reward_func_names
    data["holds_model"] = isinstance(trainer.reward_funcs[1], nn.Module)
    # Score fixed completions through the patched path; compare with scoring them here, locally.
    n = 8
    completions = [f"a b {'a ' * (RANK + i % 3)}c" for i in range(n)]
    inputs = [{"prompt": "say the letter a please", "row": RANK * 2 + i // 4, "target": "a"} for i in range(n)]
    trainer.model.train()
    rewards = trainer._calculate_rewards(inputs, [x["prompt"] for x in inputs], completions, [[0]] * n)
    own = rewards[RANK * n:(RANK + 1) * n].cpu()
    tok = tiny_tokenizer()
    enc = tok(text=[x["prompt"] + c for x, c in zip(inputs, completions, strict=True)], return_tensors="pt", padding=True,
              padding_side="right", add_special_tokens=False)
    with torch.inference_mode():  # the user's own object; TRL never touched it on rank > 0
        enc = enc.to(next(reward_model.parameters()).device)
        expected_model = reward_model(**enc).logits[:, 0].tolist()
    data["own"] = own.tolist()
    data["expected_func"] = target_share(completions, target=["a"] * n)
    data["expected_model"] = expected_model
    data["others_nan"] = bool(torch.isnan(torch.cat([rewards[: RANK * n], rewards[(RANK + 1) * n:]])).all()) if RANK else None
    data["model_untouched"] = all(torch.equal(before[k], v.cpu()) for k, v in reward_model.state_dict().items())
    forwards = []
    reward_model.register_forward_hook(lambda module, args, output: forwards.append(RANK))
    data["model_device"] = str(next(reward_model.parameters()).device)
    CALLS.clear()
    trainer.train()
    data["train_calls"] = list(CALLS)
    data["model_forwards"] = len(forwards)  # the user's reward model object, run by training on this rank


def scenario_faults(data):
    """Faults one after another in one world (``kinds``: comma-separated), each on ``bad_rank``: a reward
    model id that does not exist (the trainer's construction fails), a reward function that raises, one that sleeps past reward_timeout, one stuck in a regular expression that
    backtracks catastrophically (it holds the GIL in C: it ends its rank, so it comes last)."""
    kinds, bad_rank, placement = data["argv"][0].split(","), int(data["argv"][1]), data["argv"][2]
    data["faults"] = {}
    save = lambda: end_rank_data(data)  # noqa: E731 - what a rank ended by the hard stop leaves behind

    for kind in kinds:
        if kind == "load":
            misspelt_reward_model(data, bad_rank, placement)
            continue
        if kind == "soft":
            soft_failures(data, bad_rank, placement)
            continue

        def flaky_reward(completions, kind=kind, **kwargs):
            if bad_rank == RANK:
                if kind == "raise":
                    raise ZeroDivisionError("injected in flaky_reward")
                if kind == "sleep":
                    time.sleep(3600)
                if kind == "regex":
                    re.match(r"(a+)+$", "a" * 40 + "b")
            return [1.0] * len(completions)

        grpo_patches.apply(reward_placement=placement, reward_timeout=5.0)
        trainer = build(grpo_args(per_device_train_batch_size=4, num_generations=4, max_steps=1),
                        reward_funcs=[flaky_reward])
        got = data["faults"][kind] = {"t0": time.time()}
        save()
        try:
            trainer.train()
            got["error"] = None
        except Exception as exc:
            got["error"] = f"{type(exc).__name__}: {exc}"
            if kind == "regex":  # the peer is gone: no exit barrier
                got["seconds"] = time.time() - got["t0"]
                raise
        got["seconds"] = time.time() - got["t0"]
        save()


def misspelt_reward_model(data, bad_rank, placement):
    """A reward model id that names nothing (HF_HUB_OFFLINE=1: nothing reaches the network). Stock TRL loads it
    on every rank, so every rank raises the load error; the kit loads it where the placement says (rank 0 under
    main placement, ``bad_rank`` alone here under local), and the other rank must learn the cause."""
    misspelt = "grpo-patches/no-such-reward-model"
    for label in ("stock", "kit"):
        grpo_patches.revert()
        if label == "kit":
            grpo_patches.apply(reward_placement=placement, reward_timeout=5.0)
        funcs = [misspelt] if label == "stock" or placement == "main" or bad_rank == RANK else [length_reward]
        got = data["faults"][f"load/{label}"] = {"t0": time.time(), "error": None}
        try:
            build(grpo_args(per_device_train_batch_size=4, num_generations=4, max_steps=1), reward_funcs=funcs)
        except Exception as exc:
            got["error"] = f"{type(exc).__name__}: {exc}"
        got["seconds"] = time.time() - got["t0"]
    end_rank_data(data)


def soft_failures(data, bad_rank, placement):
    """apply(reward_failure=...) under both fail-soft policies, for a call that raises and one that sleeps past
    reward_timeout, on ``bad_rank`` (under main placement the main process scores every rank's rows): one
    generation each, its advantages and rewards/failed_calls on every rank."""
    for policy in ("no_reward", "drop_group"):
        for fault in ("raise", "sleep"):
            def flaky_reward(completions, fault=fault, **kwargs):
                if bad_rank == RANK:
                    if fault == "raise":
                        raise ZeroDivisionError("injected in flaky_reward")
                    time.sleep(3600)
                return [float(len(c) % 3) for c in completions]

            grpo_patches.apply(reward_placement=placement, reward_timeout=5.0, reward_failure=policy)
            trainer = build(grpo_args(per_device_train_batch_size=4, num_generations=4, max_steps=1),
                            reward_funcs=[flaky_reward, length_reward])
            got = data["faults"][f"soft/{policy}/{fault}"] = {"t0": time.time(), "error": None}
            try:
                _, out = first_generation(trainer)
                got["advantages"] = out["advantages"].tolist()
                got["failed_calls"] = trainer._metrics["train"]["rewards/failed_calls"]
            except Exception as exc:
                got["error"] = f"{type(exc).__name__}: {exc}"
            got["seconds"] = time.time() - got["t0"]
    grpo_patches.apply(reward_placement=placement, reward_timeout=5.0)
    end_rank_data(data)


def end_rank_data(data):
    """This rank's JSON so far (end_rank writes the final one)."""
    path = os.path.join(OUTDIR["dir"], f"rank{RANK}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def scenario_compiled(data):
    """Stock 2-rank DDP training, then the same with apply(compile_training=True): losses and LoRA weights."""
    from grpo_patches.compiled_training import compiled_layers

    for label, kw in (("stock", {}), ("compiled", {"compile_training": True})):
        grpo_patches.revert()
        grpo_patches.apply(**kw)
        trainer = build(grpo_args(per_device_train_batch_size=4, num_generations=4, max_steps=2,
                                  gradient_checkpointing=True))
        torch.manual_seed(0)
        trainer.train()
        weights = {n: p.detach().flatten()[:8].tolist() for n, p in trainer.model.named_parameters() if "lora_" in n}
        data[label] = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h], "weights": weights,
                       "compiled_layers": len(compiled_layers(trainer.model)),
                       "distributed": str(trainer.accelerator.distributed_type)}
    grpo_patches.revert()


def main() -> None:
    outdir, scenario, *argv = sys.argv[1:]
    OUTDIR["dir"] = outdir
    data: dict = {"rank": RANK, "argv": argv}
    code = 0
    try:
        globals()[f"scenario_{scenario}"](data)
    except Exception as exc:
        data["error"] = f"{type(exc).__name__}: {exc}"
        data["error_time"] = time.time()
        data["traceback"] = traceback.format_exc()[-3000:]
        code = 3
    end_rank(outdir, RANK, data, code)


if __name__ == "__main__":
    main()
