"""Rank worker: TRL's vLLM generation path (``use_vllm=True``) with a stand-in vLLM, stock first, then the kit.

``python -m tests.workers.dist_vllm OUTDIR`` as each rank (tests/launch.py starts them); tests/test_vllm_path.py
asserts on ``OUTDIR/rank<r>.json``, written after every scenario (a rank that dies still reports what it saw).

vLLM is not installed here. As TRL's own tests do (tests/test_vllm_generation.py), the stand-in replaces
``trl.generation.vllm_generation.is_vllm_available`` and ``VLLMClient`` (server mode), and ``LLM`` /
``SamplingParams`` there (colocate mode). Everything else is TRL's code: the prompts gathered to the main
process, one request of ``n=G`` per unique prompt, the broadcast and each rank's ``process_slice`` (server),
each rank generating for its own prompts (colocate), the weight sync into the client after each step.
The stand-in's completions are a function of (prompt token ids, index within the group), so stock and the
kit can be compared on the same completions.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import traceback
from types import SimpleNamespace

from tests.helpers import grpo_args, lora, prompt_dataset, quiet, target_share, tiny_policy, tiny_tokenizer
from tests.launch import end_rank

quiet()

import torch  # noqa: E402
import trl.generation.vllm_generation as vllm_generation  # noqa: E402

import grpo_patches  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
CALLS: list[dict] = []
SERVER: dict = {"clients": 0, "communicators": 0, "requests": [], "weight_syncs": 0, "tensors": 0,
                "prefix_resets": 0}
COLOCATE: dict = {"engines": 0, "requests": [], "weight_loads": 0}
FAULT: dict = {"rank": None}
WORDS_FROM = 4  # token ids below are <pad> <eos> <bos> <unk>


def stand_in_completion(prompt_ids: list[int], index: int, length: int) -> list[int]:
    """The completion ``index`` of a prompt: drawn from the prompt's own words (so its target letter) and
    "a" / "b", seeded by both (the same on every process and for stock and the kit)."""
    rng = random.Random(f"{list(prompt_ids)}:{index}")
    words = [t for t in prompt_ids if t >= WORDS_FROM] + [WORDS_FROM, WORDS_FROM + 1]
    return [rng.choice(words) for _ in range(length)]


class StandInClient:
    """What ``VLLMGeneration`` calls on ``trl.generation.vllm_client.VLLMClient`` in server mode (TRL 1.16),
    answered here: no server, no NCCL communicator."""

    def __init__(self, base_url: str | None = None, group_port: int = 0, connection_timeout: float = 0.0, **kw):
        SERVER["clients"] += 1

    def init_communicator(self, device=None):
        SERVER["communicators"] += 1

    def get_server_info(self) -> dict:
        return {"model_config": {"logprobs_mode": "processed_logprobs"}}

    def generate(self, prompts, features=None, n=1, max_tokens=16, logprobs=0, **sampling):
        SERVER["requests"].append({"prompts": len(prompts), "n": n})
        completions = [stand_in_completion(p, j, max_tokens) for p in prompts for j in range(n)]
        return {"prompt_ids": [list(p) for p in prompts], "completion_ids": completions,
                "logprobs": [[[-1.0] for _ in c] for c in completions],
                "logprob_token_ids": [[[t] for t in c] for c in completions]}

    def update_named_params(self, metadata, params):
        SERVER["weight_syncs"] += 1
        for _ in params:  # TRL's generator merges the LoRA adapter first and unmerges it at the end
            SERVER["tensors"] += 1

    def reset_prefix_cache(self):
        SERVER["prefix_resets"] += 1


class StandInLLM:
    """What ``VLLMGeneration`` calls on ``vllm.LLM`` in colocate mode (TRL 1.16): ``generate`` with one
    request per completion (``n=1``), ``reset_prefix_cache``, and the engine's ``load_weights``."""

    def __init__(self, **kwargs):
        COLOCATE["engines"] += 1
        model = SimpleNamespace(load_weights=self._load_weights)
        runner = SimpleNamespace(model=model)
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner)),
                                          model_config=SimpleNamespace(max_model_len=kwargs.get("max_model_len") or 128))

    @staticmethod
    def _load_weights(weights):
        COLOCATE["weight_loads"] += len(list(weights))

    def generate(self, prompts, sampling_params=None, use_tqdm=False):
        COLOCATE["requests"].append({"prompts": len(prompts), "n": sampling_params.n})
        seen: dict[tuple, int] = {}
        outputs = []
        for request in prompts:
            ids = list(request["prompt_token_ids"])
            index = seen.get(tuple(ids), 0)  # the k-th copy of a prompt in this call: completion k of its group
            seen[tuple(ids)] = index + 1
            tokens = stand_in_completion(ids, index, sampling_params.max_tokens)
            lps = [{t: SimpleNamespace(logprob=-1.0, rank=1)} for t in tokens]
            outputs.append(SimpleNamespace(prompt_token_ids=ids,
                                           outputs=[SimpleNamespace(token_ids=tokens, logprobs=lps)]))
        return outputs

    def reset_prefix_cache(self):
        pass


# TRL's own tests patch these two names of trl.generation.vllm_generation; colocate also needs LLM / SamplingParams
vllm_generation.is_vllm_available = lambda *args, **kwargs: True
vllm_generation.VLLMClient = StandInClient
vllm_generation.LLM = StandInLLM
vllm_generation.SamplingParams = lambda **kwargs: SimpleNamespace(**kwargs)


def recording_reward(completions, row, **kwargs):
    """Records the rows of every call on this rank; raises on ``FAULT["rank"]`` when armed."""
    CALLS.append({"rank": RANK, "rows": list(row)})
    if FAULT["rank"] == RANK:
        raise ZeroDivisionError("injected in recording_reward")
    return target_share(completions, target=kwargs.get("target"))


def build(mode: str = "server", **config):
    from trl import GRPOTrainer

    fields = dict(use_vllm=True, vllm_mode=mode, per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=4)
    fields.update(config)
    return GRPOTrainer(model=tiny_policy(), reward_funcs=[recording_reward], args=grpo_args(**fields),
                       train_dataset=prompt_dataset(16), processing_class=tiny_tokenizer(), peft_config=lora())


def observe(trainer) -> dict:
    """One generation round through TRL's ``_generate_and_score_completions``: rows, samples, advantages, calls."""
    CALLS.clear()
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    torch.manual_seed(123)
    out = trainer._generate_and_score_completions(batch)
    return {"rows": [b["row"] for b in batch], "completion_ids": out["completion_ids"].tolist(),
            "advantages": out["advantages"].tolist(), "calls": list(CALLS)}


def try_fault(trainer, bad_rank: int) -> dict:
    FAULT["rank"] = bad_rank
    t0 = time.monotonic()
    try:
        observe(trainer)
        out: dict = {"raised": None}
    except Exception as exc:
        out = {"raised": f"{type(exc).__name__}: {exc}", "remote": isinstance(exc, grpo_patches.RemoteFailureError)}
    finally:
        FAULT["rank"] = None
    out["seconds"] = time.monotonic() - t0
    return out


def merged_lora_layers(trainer) -> int:
    return sum(bool(getattr(m, "merged", False)) for m in trainer.model.modules() if hasattr(m, "lora_A"))


CHUNK = 4  # reward_chunk_size: one group of G=4 per call, two per rank's batch of 8
SPLIT = dict(per_device_train_batch_size=2, num_generations=4)  # 2 completions per rank, G=4: every group split


def scenario(data: dict, save) -> None:
    for mode in ("server", "colocate"):
        got: dict = data.setdefault(mode, {})
        # upstream first: the same stand-in, stock TRL
        grpo_patches.revert()
        got["stock_split"] = observe(build(mode, **SPLIT))
        got["stock"] = observe(build(mode))
        save()
        grpo_patches.apply(reward_timeout=60.0)
        try:
            build(mode, **SPLIT)
            got["refusal"] = None
        except grpo_patches.GroupShapeError as exc:
            got["refusal"] = str(exc)
        for placement in ("local", "main"):
            grpo_patches.apply(reward_placement=placement, reward_chunk_size=CHUNK, reward_timeout=60.0)
            got[placement] = observe(build(mode))
        save()
    data["server_requests"], data["colocate_requests"] = list(SERVER["requests"]), list(COLOCATE["requests"])

    # training through the vLLM server path: the weights go to the client at every step, the adapter unmerged after
    grpo_patches.apply(reward_placement="main", reward_chunk_size=CHUNK, reward_timeout=60.0)
    trainer = build(max_steps=2)
    syncs, CALLS[:] = SERVER["weight_syncs"], []
    trainer.train()
    data["train"] = {"steps": trainer.state.global_step, "weight_syncs": SERVER["weight_syncs"] - syncs,
                     "tensors": SERVER["tensors"], "merged_after": merged_lora_layers(trainer), "calls": list(CALLS)}
    save()

    # fast_generation with use_vllm: vLLM's generation is left alone
    grpo_patches.apply(fast_generation=True, reward_timeout=60.0)
    requests = len(SERVER["requests"])
    try:
        trainer = build()
        seen = observe(trainer)
        state = getattr(trainer, "_grpo_patches_fast_generation", None)
        data["fast"] = {"completion_ids": seen["completion_ids"], "rows": seen["rows"],
                        "state": None if state is None else state.summary().get("calls"),
                        "server_requests": len(SERVER["requests"]) - requests}
    except Exception as exc:
        data["fast"] = {"refusal": f"{type(exc).__name__}: {exc}"}
    save()

    # fail fast through the vLLM path: a reward function raising on the rank that scores
    data["faults"] = {}
    for placement, bad in (("local", 1), ("main", 0)):
        grpo_patches.apply(reward_placement=placement, reward_chunk_size=CHUNK, reward_timeout=60.0)
        data["faults"][placement] = try_fault(build(), bad)
        save()
    data["server_stats"], data["colocate_stats"] = dict(SERVER), dict(COLOCATE)
    grpo_patches.revert()


def main() -> None:
    outdir = sys.argv[1]
    data: dict = {"rank": RANK}

    def save():
        path = os.path.join(outdir, f"rank{RANK}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(data, f)
        os.replace(path + ".tmp", path)

    code = 0
    try:
        scenario(data, save)
    except Exception as exc:
        data["error"] = f"{type(exc).__name__}: {exc}"
        data["traceback"] = traceback.format_exc()[-3000:]
        code = 3
    end_rank(outdir, RANK, data, code)


if __name__ == "__main__":
    main()
