"""The vendored DeepSeekMath-style trainer in one process: its objective, a real step, learning on the demo task,
and apply() on it (fast generation, shape refusal, group kwargs, targets, exact revert)."""

from __future__ import annotations

import pytest
import torch

import grpo_patches
from grpo_patches import generation
from grpo_patches.generation import FAST_GEN_ATTR
from grpo_patches.vendored.dsm_grpo import DSMGRPOConfig, DSMGRPOTrainer, group_advantages, grpo_loss
from tests.fastgen_helpers import ALL_PROJ, Counting
from tests.helpers import quiet, target_share, tiny_policy, tiny_tokenizer

PROMPTS = ["say the letter a", "say a", "please say a now", "the letter a please"]


@pytest.fixture(autouse=True)
def _clean():
    quiet()
    grpo_patches.revert()
    torch._dynamo.reset()
    generation._warned.clear()
    yield
    grpo_patches.revert()
    torch._dynamo.reset()


def make_trainer(seed=0, **config):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_policy(seed), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05,
                                                         target_modules=ALL_PROJ, task_type="CAUSAL_LM"))
    fields = dict(num_generations=4, max_new_tokens=8, learning_rate=1e-3)
    fields.update(config)
    return DSMGRPOTrainer(model, tiny_tokenizer(), target_share, DSMGRPOConfig(**fields))


def test_group_advantages_normalize_within_each_group_only():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 7.0, 9.0, 11.0])
    adv = group_advantages(rewards, 4, eps=0.0)
    expected = torch.cat([(g - g.mean()) / g.std() for g in rewards.view(2, 4)])
    assert torch.allclose(adv, expected)
    shifted = rewards.clone()
    shifted[4:] += 100.0  # another group's scale does not leak into the first
    assert torch.allclose(group_advantages(shifted, 4, eps=0.0), adv)
    assert not torch.allclose(group_advantages(rewards, 8, eps=0.0), adv)  # a wrong group size would


def test_objective_ratio_one_is_the_mean_advantage_and_k3_kl_is_exact():
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.2, 0.4, 0.1]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([1.5, -0.5])
    loss, stats = grpo_loss(logp, logp, logp, adv, mask, beta=0.04, epsilon=0.2)
    assert loss.item() == pytest.approx(-(1.5 - 0.5) / 2) and stats["kl"] == 0.0
    ref = logp + 0.3
    loss_kl, stats = grpo_loss(logp, logp, ref, adv, mask, beta=0.04, epsilon=0.2)
    k3 = torch.exp(torch.tensor(0.3)) - 0.3 - 1  # exp(ref - logp) - (ref - logp) - 1, per token
    assert stats["kl"] == pytest.approx(k3.item(), rel=1e-5)
    assert loss_kl.item() == pytest.approx(loss.item() + 0.04 * k3.item(), rel=1e-5)


def test_objective_clips_the_ratio():
    old = torch.zeros(1, 2)
    adv = torch.tensor([1.0])
    mask = torch.ones(1, 2)
    inside = torch.full((1, 2), 0.1, requires_grad=True)  # ratio 1.105: inside [0.8, 1.2]
    outside = torch.full((1, 2), 0.3, requires_grad=True)  # ratio 1.35 with A > 0: clipped, no gradient
    grpo_loss(inside, old, None, adv, mask, beta=0.0, epsilon=0.2)[0].backward()
    loss, stats = grpo_loss(outside, old, None, adv, mask, beta=0.0, epsilon=0.2)
    loss.backward()
    assert inside.grad.abs().sum() > 0 and outside.grad.abs().sum() == 0
    assert loss.item() == pytest.approx(-1.2) and stats["clip_ratio"] == 1.0


def test_a_step_moves_probability_toward_the_better_completions():
    trainer = make_trainer(beta=0.04)
    seen = []
    original = trainer.sample
    trainer.sample = lambda ids, mask: (out := original(ids, mask), seen.append((out, ids.shape[1], mask)))[0]
    base_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    torch.manual_seed(3)
    metrics = trainer.step(PROMPTS)
    assert trainer.model.training, "the trainer samples and trains in training mode"
    assert metrics["kl"] == 0.0, "at init LoRA B = 0: the policy equals the reference (the adapter disabled)"
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    sequences, prompt_len, prompt_mask = seen[0]
    completions = sequences[:, prompt_len:]
    comp_mask = trainer.completion_mask(completions)
    texts = trainer.tokenizer.batch_decode(completions.masked_fill(comp_mask == 0, 0), skip_special_tokens=True)
    adv = group_advantages(torch.tensor(target_share(texts)), 4)
    assert adv.abs().sum() > 0, "the groups must differ in reward for the step to mean anything"
    mask = torch.cat([prompt_mask, comp_mask], 1)
    n = completions.shape[1]

    def seq_logp():
        trainer.model.eval()  # dropout off: compare the same function before and after
        with torch.no_grad():
            out = (trainer.token_logprobs(trainer.model, sequences, mask, n) * comp_mask).sum(1)
        trainer.model.train()
        return out

    after = seq_logp()
    # undo the step's effect on the adapter to read "before": B was 0, so the base policy is "before"
    with trainer.model.disable_adapter():
        before = seq_logp()
    assert (adv * (after - before)).sum() > 0, "log-probs rise with the advantage"
    for n_, p in trainer.model.named_parameters():
        if "lora_" not in n_:
            assert torch.equal(p, base_before[n_]), f"base weight {n_} changed"
    assert trainer.step(PROMPTS)["kl"] > 0, "after an update the policy has left the reference"


def test_apply_fast_generation_samples_through_the_compiled_graph_loop():
    from transformers import GenerationConfig

    counting = Counting()
    unpatched = make_trainer()
    assert not hasattr(unpatched, FAST_GEN_ATTR)
    grpo_patches.apply(fast_generation=counting.config())
    trainer = make_trainer()
    state = getattr(trainer, FAST_GEN_ATTR)
    assert state.config.decode_loop == "graph"
    greedy = GenerationConfig(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=1)
    for t in (trainer, unpatched):
        t.generation_config = greedy
    enc = trainer.tokenizer(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    fast = trainer.sample(enc["input_ids"], enc["attention_mask"])
    assert state.graph.calls == 1 and counting.compiles == 1 and counting.runs > 0
    assert trainer.model.training, "the model's mode is restored after sampling in eval mode"
    unpatched.model.eval()  # same weights (same seed), dropout off: what fast generation samples from
    eager = unpatched.sample(enc["input_ids"], enc["attention_mask"])
    assert torch.equal(fast, eager)
    # the whole step runs through it, and a trainer built before apply() stays unpatched
    trainer.generation_config = GenerationConfig(max_new_tokens=8, do_sample=True, pad_token_id=0, eos_token_id=1)
    trainer.step(PROMPTS)
    assert state.calls == 2 and state.graph.calls == 2
    assert not hasattr(unpatched, FAST_GEN_ATTR)


def test_fast_generation_on_the_vendored_trainer_counts_and_warns_of_recompilation_as_on_trl():
    """The vendored trainer's sampling goes through the same fast call as TRL's: its state reports
    the calls, their wall time, the graphs compiled, the cache length, and a recompilation after
    warm-up (an unbucketed cache meeting a longer prompt) is warned of."""
    from transformers import GenerationConfig

    counting = Counting()
    grpo_patches.apply(fast_generation=counting.config(bucket=1))
    trainer = make_trainer()
    state = getattr(trainer, FAST_GEN_ATTR)
    trainer.generation_config = GenerationConfig(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=1)
    lengths = []
    with pytest.warns(RuntimeWarning, match="recompiled after warm-up"):
        for prompt in ("say a", "please say the letter a now"):
            enc = trainer.tokenizer([prompt] * 4, return_tensors="pt", padding=True, padding_side="left")
            lengths.append(enc["input_ids"].shape[1])
            trainer.sample(enc["input_ids"], enc["attention_mask"])
    assert lengths[1] > lengths[0]
    assert state.compiled and state.calls == 2 and len(state.seconds) == 2 and state.graph.calls == 2
    assert state.cache_length == lengths[1] + 8 and state.merged_layers > 0
    assert state.graphs_compiled >= 2 and state.graphs_after_first_call >= 1
    assert state.graphs_compiled == counting.compiles


PATCHED = ("__init__", "create_groups", "compute_rewards", "sample")


def test_revert_restores_the_vendored_trainer():
    before = {name: DSMGRPOTrainer.__dict__[name] for name in PATCHED}
    grpo_patches.apply(fast_generation=True)
    wrapped = {name: DSMGRPOTrainer.__dict__[name] for name in PATCHED}
    assert all(wrapped[name].__wrapped__ is before[name] for name in PATCHED)
    grpo_patches.apply(reward_placement="main")  # a second apply() wraps nothing twice
    assert all(DSMGRPOTrainer.__dict__[name] is wrapped[name] for name in PATCHED)
    grpo_patches.revert()
    assert all(DSMGRPOTrainer.__dict__[name] is fn for name, fn in before.items())
    grpo_patches.revert()  # twice: a no-op
    assert all(DSMGRPOTrainer.__dict__[name] is fn for name, fn in before.items())
    grpo_patches.apply()  # without fast_generation the wrapper passes through
    trainer = make_trainer()
    assert not hasattr(trainer, FAST_GEN_ATTR)
    assert trainer.step(PROMPTS)["completion_length"] > 0


def test_adapter_matches_the_vendored_source():
    from grpo_patches.targets.dsm import ADAPTER

    assert ADAPTER.check() == []


def test_shape_refused_at_construction_only_when_patched_and_trainers_built_before_stay_unpatched():
    before = make_trainer(per_device_batch_size=6)  # unpatched: the global batch (6) is checked in train()
    with pytest.raises(ValueError, match="per_device_batch_size=6 x 1 processes is not a multiple"):
        next(before.create_groups(16))
    grpo_patches.apply()
    with pytest.raises(grpo_patches.GroupShapeError, match=r"Nearest valid settings: per_device_batch_size=4 or 8"):
        make_trainer(per_device_batch_size=6)
    with pytest.raises(ValueError, match="reward_chunk_size=6 is not a multiple of num_generations=4"):
        grpo_patches.apply(reward_chunk_size=6)
        make_trainer()
    grpo_patches.apply()
    ok = make_trainer(per_device_batch_size=8)
    assert next(ok.create_groups(16)) == next(make_trainer(per_device_batch_size=8).create_groups(16))
    with pytest.raises(ValueError, match="per_device_batch_size=6 x 1 processes"):  # still the unpatched sampler
        next(before.create_groups(16))


def test_patched_reward_functions_get_whole_group_kwargs_in_bounded_chunks():
    calls = []

    def listwise(completions, num_generations, group_ids, **kwargs):
        calls.append((len(completions), num_generations, group_ids))
        return [float(i == 0) for i in range(len(completions))]  # one winner per call

    grpo_patches.apply(reward_chunk_size=4)
    trainer = make_trainer()
    trainer.reward_funcs, trainer.reward_func_names = [listwise], ["listwise"]
    ro = trainer.rollout([p for p in PROMPTS[:2] for _ in range(4)])
    assert calls == [(4, 4, [0, 0, 0, 0]), (4, 4, [1, 1, 1, 1])]
    assert ro.rewards.tolist() == [1.0, 0, 0, 0, 1.0, 0, 0, 0]


def test_unpatched_trainer_learns_the_demo_task_in_one_process():
    from peft import get_peft_model

    from examples.vendored_grpo import share_of_a
    from tests.helpers import lora, prompt_dataset

    torch.manual_seed(0)
    model = get_peft_model(tiny_policy(initializer_range=0.3), lora(r=8))
    trainer = DSMGRPOTrainer(model, tiny_tokenizer(), share_of_a,
                             DSMGRPOConfig(num_generations=8, max_new_tokens=8, learning_rate=1e-2,
                                           per_device_batch_size=16, seed=0))
    assert trainer.accelerator.num_processes == 1 and trainer.model is model  # nothing wrapped in one process
    torch.manual_seed(0)
    history = [h["reward_mean"] for h in trainer.train(list(prompt_dataset(64)), steps=15)]
    first, last = sum(history[:3]) / 3, sum(history[-3:]) / 3
    assert last - first >= 0.4, history


def test_targets_pick_the_trainers_to_patch():
    from trl import GRPOTrainer

    def wrapped(cls):
        return hasattr(cls.__dict__["__init__"], "__wrapped__")

    assert grpo_patches.apply(targets=("vendored",)) and wrapped(DSMGRPOTrainer) and not wrapped(GRPOTrainer)
    with pytest.raises(ValueError, match=r"differ from the patched ones; call grpo_patches.revert\(\) first"):
        grpo_patches.apply(targets=("trl", "vendored"))
    grpo_patches.revert()
    assert grpo_patches.apply(targets=("trl",)) and wrapped(GRPOTrainer) and not wrapped(DSMGRPOTrainer)
    grpo_patches.revert()
    assert grpo_patches.apply() and wrapped(GRPOTrainer) and wrapped(DSMGRPOTrainer)  # both by default
    grpo_patches.revert()
    with pytest.raises(ValueError, match=r"targets=\('dsm',\); expected a non-empty tuple of \('trl', 'vendored'\)"):
        grpo_patches.apply(targets=("dsm",))
    assert not grpo_patches.is_applied()


def test_the_vendored_target_alone_needs_no_trl():
    import subprocess
    import sys
    from pathlib import Path

    script = """
import sys
sys.modules["trl"] = None  # any import of trl now raises ImportError
from tests.helpers import quiet, target_share, tiny_policy, tiny_tokenizer
quiet()
import grpo_patches
from grpo_patches.vendored.dsm_grpo import DSMGRPOConfig, DSMGRPOTrainer
assert grpo_patches.apply(targets=("vendored",), reward_placement="main")
t = DSMGRPOTrainer(tiny_policy(), tiny_tokenizer(), target_share, DSMGRPOConfig(max_new_tokens=4))
assert t.step(["say a", "say b"])["completion_length"] > 0
assert isinstance(t.reward_funcs[0], type(target_share)) and hasattr(t, "_grpo_patches")
print("vendored ok")
"""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0 and "vendored ok" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("reward_funcs", [[], None, ()])
def test_no_reward_function_is_refused_at_construction(reward_funcs):
    """Without one, every reward, advantage and loss would be 0: a run that learns nothing, silently."""
    with pytest.raises(ValueError, match=r"at least one reward function"):
        DSMGRPOTrainer(tiny_policy(), tiny_tokenizer(), reward_funcs, DSMGRPOConfig(num_generations=2))
