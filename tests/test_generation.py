"""Fast generation (compiled decoding, static cache, dropout off): correctness on CPU, fp32.

The compiled path is exercised on CPU with ``force_compile=True`` and ``backend="aot_eager"``
(dynamo capture + AOT functionalization, as on GPU; inductor's CPU code generation takes ~70 s for
a 2-layer model, too slow here). Every compiled run counts its compilations and calls through a
counting backend, so a silently eager "compiled" path cannot pass. Each equality is paired with
the check that makes it meaningful (the adapter changes the tokens; the optimizer step changes the
tokens; a new cache length does recompile; dropout does change the log-probs; a merge round trip
does change the base weights).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from grpo_patches import generation
from grpo_patches.generation import (
    FAST_GEN_ATTR,
    FastGenerationConfig,
    fast_generate,
    sampling_mode,
)
from grpo_patches.targets import trl_generation
from grpo_patches.targets.trl_generation import enable_fast_generation
from tests.helpers import grpo_args, quiet, target_share, tiny_policy, tiny_tokenizer

ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(autouse=True)
def _fresh():
    quiet()
    torch._dynamo.reset()
    generation._warned.clear()
    yield
    torch._dynamo.reset()


class Counting:
    """A dynamo backend (aot_eager underneath) that counts compilations and compiled calls."""

    def __init__(self):
        self.compiles = 0
        self.runs = 0

    def backend(self):
        def counting_backend(gm, example_inputs):
            self.compiles += 1
            compiled = torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

            def run(*args):
                self.runs += 1
                return compiled(*args)

            return run

        return counting_backend  # a function: CompileConfig deep-copies it as itself

    def config(self, **kw):
        return FastGenerationConfig(force_compile=True, backend=self.backend(), **kw)


def lora_policy(seed=0, dropout=0.0, dtype=torch.float32):
    from peft import LoraConfig, get_peft_model

    model = tiny_policy(seed, max_position_embeddings=256)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=ALL_PROJ,
                                            task_type="CAUSAL_LM"))
    torch.manual_seed(seed + 1)
    for name, p in peft.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)  # nonzero B: the adapter changes the output
    return peft.to(dtype)


def batch(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):  # left-padded, like TRL
        ids[i, width - n:] = torch.randint(4, 19, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids, mask


def greedy(new=12):
    from transformers import GenerationConfig

    # TRL's config shape (disable_compile=True), greedy; the model's EOS (1) still ends rows
    return GenerationConfig(max_new_tokens=new, do_sample=False, pad_token_id=0, bos_token_id=2, eos_token_id=None,
                            disable_compile=True)


def eager_generate(model, ids, mask, **kw):
    with torch.no_grad(), sampling_mode(model):
        return model.generate(input_ids=ids, attention_mask=mask, generation_config=greedy(), **kw)


# (1) compiled vs eager on the same weights ---------------------------------------------------------


def test_compiled_greedy_equals_eager_fp32_tokens():
    model = lora_policy()
    counting = Counting()
    config = counting.config()
    for lengths in ([5, 9, 7, 3], [11, 4, 8, 6]):
        ids, mask = batch(lengths, seed=sum(lengths))
        eager = eager_generate(model, ids, mask)
        fast = fast_generate(model, ids, mask, generation_config=greedy(), config=config)
        assert torch.equal(fast, eager), lengths
    assert counting.compiles == 1, "one compiled decode graph for both prompt lengths"
    assert counting.runs >= 2 * 11, "every decode step after the prefill ran compiled"
    # meaningful: the tokens depend on the LoRA adapter and are not degenerate
    with model.disable_adapter():
        base = eager_generate(model, ids, mask)
    assert not torch.equal(base, eager)
    assert len(set(eager[:, ids.shape[1]:].flatten().tolist())) > 3


def test_compiled_bf16_logits_match_eager_within_tolerance():
    model = lora_policy(dtype=torch.bfloat16)
    ids, mask = batch([6, 9, 4, 8])
    counting = Counting()
    kw = dict(output_logits=True, return_dict_in_generate=True)
    eager = eager_generate(model, ids, mask, **kw)
    fast = fast_generate(model, ids, mask, generation_config=greedy(), config=counting.config(), **kw)
    assert counting.compiles == 1 and counting.runs > 0
    width = ids.shape[1]

    def worst(a, b, seqs_a, seqs_b):
        """Largest logit difference over the steps where both runs decoded the same prefix."""
        diffs, compared = [], 0
        for t in range(min(len(a.logits), len(b.logits))):
            same = (seqs_a[:, width:width + t] == seqs_b[:, width:width + t]).all(dim=1)
            if same.any():
                diffs.append((a.logits[t][same].float() - b.logits[t][same].float()).abs().max())
                compared += int(same.sum())
        return max(diffs), compared

    scale = max(lg.float().abs().max() for lg in eager.logits)
    tol = 0.05 * scale + 2e-2  # bf16: a few ulps of the logits (measured: 0.008 at scale 0.4)
    err, compared = worst(fast, eager, fast.sequences, eager.sequences)
    assert compared >= 4 and err <= tol, (err, tol)
    # meaningful: the adapter moves the logits by far more than the tolerance
    with model.disable_adapter():
        base = eager_generate(model, ids, mask, **kw)
    err_base, _ = worst(base, eager, base.sequences, eager.sequences)
    assert err_base > 5 * tol, (err_base, tol)


def test_presized_cache_without_reuse_is_correct_and_compiles_once():
    """max_prompt_length sizes the cache up front (bucket 1 would otherwise grow it per length);
    reuse_cache=False lets transformers allocate a new static cache per call."""
    model = lora_policy()
    counting = Counting()
    config = counting.config(bucket=1, max_prompt_length=16, reuse_cache=False)
    for lengths in ([5, 9, 7, 3], [11, 4, 8, 13]):
        ids, mask = batch(lengths, seed=len(lengths) + max(lengths))
        fast = fast_generate(model, ids, mask, generation_config=greedy(), config=config)
        assert torch.equal(fast, eager_generate(model, ids, mask)), lengths
    assert counting.compiles == 1 and counting.runs > 0


# (2) no stale weights after an optimizer step --------------------------------------------------------


@pytest.mark.parametrize("decode_loop", ["transformers", "graph"])
def test_compiled_path_uses_weights_changed_by_an_optimizer_step(decode_loop):
    model = lora_policy()
    ids, mask = batch([5, 9, 7, 3])
    counting = Counting()
    config = counting.config(decode_loop=decode_loop)
    before = fast_generate(model, ids, mask, generation_config=greedy(), config=config)
    assert torch.equal(before, eager_generate(model, ids, mask))
    compiles = counting.compiles

    # a real optimizer step on the LoRA weights (the base weights are frozen)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=0.05)
    model.train()
    targets = torch.randint(4, 19, before.shape, generator=torch.Generator().manual_seed(3))
    full_mask = torch.cat([mask, torch.ones_like(before[:, ids.shape[1]:])], dim=1)
    model(input_ids=before, attention_mask=full_mask, labels=targets).loss.backward()
    opt.step()
    opt.zero_grad()

    after_eager = eager_generate(model, ids, mask)
    assert not torch.equal(after_eager, before), "the step must change greedy output, or staleness is invisible"
    after_fast = fast_generate(model, ids, mask, generation_config=greedy(), config=config)
    assert torch.equal(after_fast, after_eager)
    assert counting.compiles == compiles, "the same compiled graph ran with the new weights"


# Trainer-level tests ------------------------------------------------------------------------------


def make_trainer(prompts, *, lora_dropout=0.05, **overrides):
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOTrainer

    fields = dict(max_steps=1, max_completion_length=8, shuffle_dataset=False)
    fields.update(overrides)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=lora_dropout, target_modules=ALL_PROJ, task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=tiny_policy(max_position_embeddings=256), reward_funcs=[target_share],
                          args=grpo_args(**fields), train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
                          processing_class=tiny_tokenizer(), peft_config=lora)
    torch.manual_seed(11)
    for name, p in trainer.model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    return trainer


WORDS = ["a", "b", "c", "d", "e", "f", "g", "h", "say", "the", "letter", "please", "now", "and", "or"]
# one prompt per step (batch 4 = one group of 4); lengths 3, 6, 9, 5 tokens
VARIED = [" ".join(WORDS[:n]) for n in (3, 6, 9, 5)]


# (3) no recompilation after warm-up over steps with different prompt lengths ----------------------


def _train_and_count(bucket, **config):
    counting = Counting()
    trainer = make_trainer(VARIED, max_steps=4, gradient_checkpointing=True)  # TRL's default is on
    state = enable_fast_generation(trainer, counting.config(bucket=bucket, **config))
    seen, caches = [], []
    original = trainer._tokenize_prompts
    trainer._tokenize_prompts = lambda prompts: (out := original(prompts), seen.append(len(out[0][0])))[0]
    get = state.pool.get
    state.pool.get = lambda *a: (cache := get(*a), caches.append(cache))[0]
    trainer.train()
    return trainer, state, counting, seen, caches


@pytest.mark.parametrize("release", [False, True])
def test_no_recompilation_across_steps_with_different_prompt_lengths(release):
    trainer, state, counting, seen, caches = _train_and_count(bucket=16, release_after_sampling=release)
    assert seen == [3, 6, 9, 5], "the steps must see different prompt lengths"
    assert state.calls == 4 and state.compiled
    assert counting.compiles == 1 and state.graphs_after_first_call == 0
    assert counting.runs >= 4 * 6, "decoding ran compiled at every step"
    assert len(caches) >= 4 and all(c.layers[0].max_cache_len == 16 + 8 for c in caches)
    if release:  # the cache is freed after every round (training gets the memory) and built again, same shape
        assert len({id(c) for c in caches}) == len(caches) and not state.pool.caches
        assert state.merged.flat is None and state.merged.allocations == 4
    else:  # one static cache, reset in place at every step: stable addresses for CUDA graphs
        assert all(c is caches[0] for c in caches) and len(state.pool.caches) == 1
        assert state.merged.flat is not None and state.merged.allocations == 1 and state.merged.refreshes == 4
    # the run did contain the upstream condition that would otherwise recompile at every step:
    # gradient checkpointing's input hooks pile up on the embeddings (TRL toggles it per generation)
    embeddings = trainer.model.get_input_embeddings()
    assert len(embeddings._forward_hooks) >= 4
    # meaningful: an unbucketed cache (length = prompt + new tokens, as transformers sizes it)
    # recompiles when a longer prompt arrives
    _, state1, counting1, _, _ = _train_and_count(bucket=1)
    assert counting1.compiles == 3 and state1.graphs_after_first_call == 2  # 3 -> 6 -> 9 tokens


# (4) + (5): sampling log-probs vs TRL's recomputation; base weights untouched ----------------------


@pytest.fixture(scope="module")
def recorded():
    """A trainer (LoRA dropout 0.05, temperature 0.7) sampling once through the compiled wrapper."""
    quiet()
    torch._dynamo.reset()
    counting = Counting()
    trainer = make_trainer(VARIED, temperature=0.7, max_completion_length=10)
    state = enable_fast_generation(trainer, counting.config(record_sampling_logprobs=True))
    model = trainer.model
    model.train()
    flags = {name: m.training for name, m in model.named_modules()}
    snapshot = {name: p.detach().clone() for name, p in model.named_parameters()}
    generation_config = trainer.generation_config
    torch.manual_seed(5)
    out = trainer._generate([VARIED[1]] * 4)
    return dict(trainer=trainer, state=state, counting=counting, out=out, flags=flags, snapshot=snapshot,
                generation_config=generation_config)


def _trl_logps(trainer, prompt_ids_list, completion_ids_list):
    from trl.trainer.utils import pad

    pad_id = trainer.processing_class.pad_token_id
    prompt = pad([torch.tensor(x) for x in prompt_ids_list], padding_value=pad_id, padding_side="left")
    pmask = pad([torch.ones(len(x), dtype=torch.long) for x in prompt_ids_list], padding_value=0, padding_side="left")
    completion = pad([torch.tensor(x) for x in completion_ids_list], padding_value=pad_id, padding_side="right")
    cmask = pad([torch.ones(len(x), dtype=torch.long) for x in completion_ids_list], padding_value=0,
                padding_side="right")
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([prompt, completion], 1), torch.cat([pmask, cmask], 1), completion.size(1))
    return logps, cmask.bool()


def test_sampling_logprobs_agree_with_trl_recomputed_logprobs(recorded):
    trainer, state = recorded["trainer"], recorded["state"]
    prompt_ids_list, completion_ids_list = recorded["out"][0], recorded["out"][1]
    assert state.compiled and recorded["counting"].runs > 0
    sampled = state.last_sampling_logprobs
    assert [len(r) for r in sampled] == [len(c) for c in completion_ids_list]
    assert sum(len(c) for c in completion_ids_list) >= 8
    rec = torch.zeros(len(sampled), max(len(r) for r in sampled))
    for i, row in enumerate(sampled):
        rec[i, :len(row)] = torch.tensor(row)

    model = trainer.model
    with sampling_mode(model):  # TRL's recomputation with dropout off: the sampling policy
        logps_eval, mask = _trl_logps(trainer, prompt_ids_list, completion_ids_list)
    err = (logps_eval - rec)[mask].abs().max().item()
    assert err < 1e-4, err
    # meaningful: the same recomputation with LoRA dropout on (training mode) differs, so the test
    # would catch sampling with dropout, and temperature / position errors move it further still
    model.train()
    torch.manual_seed(0)
    logps_train, _ = _trl_logps(trainer, prompt_ids_list, completion_ids_list)
    assert (logps_train - rec)[mask].abs().max().item() > 1e-3


def test_generation_leaves_weights_and_trainer_state_as_they_were(recorded):
    trainer, snapshot = recorded["trainer"], recorded["snapshot"]
    params = dict(trainer.model.named_parameters())
    base = [n for n in snapshot if "lora_" not in n]
    assert base and all(torch.equal(params[n], snapshot[n]) for n in snapshot)  # bit-identical, LoRA too
    assert trainer.generation_config is recorded["generation_config"]  # TRL's own object, unchanged
    assert trainer.generation_config.disable_compile is True
    assert trainer.pad_to_multiple_of is None
    assert {n: m.training for n, m in trainer.model.named_modules()} == recorded["flags"]


def test_a_lora_merge_round_trip_would_change_base_weights():
    """Why the fast path never merges: W + BA*s - BA*s is not W bit for bit."""
    model = lora_policy()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    model.merge_adapter()
    model.unmerge_adapter()
    after = dict(model.named_parameters())
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert changed, "the bit-identity check would not detect a merge"


# Bucketing, dropout, CPU fallback ---------------------------------------------------------------


def test_left_padding_to_a_bucket_gives_identical_greedy_tokens_fp32():
    model = lora_policy()
    ids, mask = batch([5, 9, 7, 3])
    eager = eager_generate(model, ids, mask)
    padded = fast_generate(model, ids, mask, generation_config=greedy(),
                           config=FastGenerationConfig(compile=False, pad_prompts=True, bucket=16))
    assert padded.shape[1] == 16 + 12
    assert torch.equal(padded[:, 16:], eager[:, ids.shape[1]:])
    # meaningful: the same pads, attended (mask 1), change the tokens
    wide = torch.cat([torch.zeros(4, 16 - ids.shape[1], dtype=torch.long), ids], 1)
    attended = eager_generate(model, wide, torch.ones_like(wide))
    assert not torch.equal(attended[:, 16:], eager[:, ids.shape[1]:])


def test_trainer_with_bucketed_prompts_compiled_matches_upstream_greedy():
    """pad_prompts through TRL's own pad_to_multiple_of, compiled, vs stock TRL eager (greedy)."""
    prompts = [VARIED[0], VARIED[2], VARIED[3], VARIED[1]]
    stock = make_trainer(VARIED, lora_dropout=0.0, generation_kwargs={"do_sample": False})
    stock.model.eval()  # dropout is 0 here; eval only so stock and fast see the same modules
    expected = stock._generate(prompts)[1]
    fast = make_trainer(VARIED, lora_dropout=0.0, generation_kwargs={"do_sample": False})
    counting = Counting()
    enable_fast_generation(fast, counting.config(pad_prompts=True, bucket=16))
    fast.model.eval()
    assert fast._generate(prompts)[1] == expected
    assert counting.compiles == 1 and counting.runs > 0
    assert any(len(c) > 1 for c in expected), "completions long enough to compare"


@pytest.mark.parametrize("merge", [False, True])
def test_cpu_without_force_warns_once_runs_eager_with_dropout_off(merge):
    trainer = make_trainer(VARIED)
    state = enable_fast_generation(trainer, {"merge_lora": merge})
    model = trainer.model
    model.train()
    seen = []
    dropout = next(m for n, m in model.named_modules() if n.endswith("lora_dropout.default"))
    dropout.register_forward_pre_hook(lambda m, a: seen.append(m.training))
    with pytest.warns(RuntimeWarning, match="runs eagerly"):
        trainer._generate([VARIED[0]] * 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer._generate([VARIED[1]] * 4)
    assert state.compiled is False and state.calls == 2 and "cpu" in state.reason
    if merge:  # sampled from the merged buffer: the adapter's dropout is not even on the path
        with sampling_mode(model):
            mergeable = len(generation.mergeable_layers(model))
        assert seen == [] and state.merged_layers == mergeable > 0
    else:
        assert seen and not any(seen), "LoRA dropout was on while sampling"
    assert dropout.training and model.training, "training flags restored"
    seen.clear()
    model(input_ids=torch.tensor([[5, 6, 7]]))
    assert seen == [True], "the loss's forward keeps LoRA dropout"


def test_disabled_and_config_coercion():
    assert FastGenerationConfig.coerce(False) is None and FastGenerationConfig.coerce(None) is None
    assert FastGenerationConfig.coerce(True) == FastGenerationConfig()
    assert FastGenerationConfig.coerce({"bucket": 32}).bucket == 32
    with pytest.raises(ValueError):
        FastGenerationConfig(bucket=0)
    with pytest.raises(TypeError):
        FastGenerationConfig.coerce("fast")
    trainer = make_trainer(VARIED)
    enable_fast_generation(trainer, True)
    enable_fast_generation(trainer, False)
    assert not hasattr(trainer, FAST_GEN_ATTR)
    trainer._generate([VARIED[0]] * 4)  # wrapper present, state gone: upstream path


def test_class_level_wrap_as_apply_installs_it():
    """What the adapter does: wrap GRPOTrainer._generate_single_turn once; enable per trainer."""
    import wrapt
    from trl import GRPOTrainer

    original = GRPOTrainer.__dict__["_generate_single_turn"]
    wrapt.wrap_function_wrapper(GRPOTrainer, "_generate_single_turn", trl_generation.wrap_generate)
    try:
        assert trl_generation.class_wrapped(GRPOTrainer)
        trainer = make_trainer(VARIED)
        counting = Counting()
        state = enable_fast_generation(trainer, counting.config())
        assert "_generate_single_turn" not in vars(trainer), "no second, instance-level wrapper"
        trainer._generate([VARIED[2]] * 4)
        assert state.calls == 1 and counting.compiles == 1 and counting.runs > 0
        plain = make_trainer(VARIED)  # built without fast generation: upstream path, no state
        plain._generate([VARIED[2]] * 4)
        assert not hasattr(plain, FAST_GEN_ATTR) and counting.compiles == 1
    finally:
        GRPOTrainer._generate_single_turn = original
    assert GRPOTrainer.__dict__["_generate_single_turn"] is original


# GPU: the real backend (inductor + CUDA graphs), skipped without CUDA ---------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (inductor + CUDA graphs path)")


def _counts():
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], counters["inductor"]["cudagraph_skips"]


@gpu
@pytest.mark.slow
@pytest.mark.parametrize("decode_loop", ["transformers", "graph"])
def test_gpu_default_config_equals_eager_no_stale_weights_no_recompile(decode_loop):
    # the graph loop on an EOS-prone policy: early stops, pads after EOS and the trim are checked too
    model = (lora_policy() if decode_loop == "transformers" else eos_prone_policy()).cuda()
    # inductor, reduce-overhead (CUDA graphs), static, bucket 64
    config = FastGenerationConfig(decode_loop=decode_loop, check_every=4)
    graphs0, skips0 = _counts()
    warm = None
    for step, lengths in enumerate(([5, 9, 7, 3], [11, 4, 8, 6], [2, 13, 9, 9])):
        ids, mask = (t.cuda() for t in batch(lengths, seed=step))
        fast = fast_generate(model, ids, mask, generation_config=greedy(), config=config)
        assert torch.equal(fast, eager_generate(model, ids, mask)), lengths
        warm = warm if warm is not None else _counts()[0]
    assert _counts()[0] == warm > graphs0, "no recompilation after the first call"
    # optimizer step, then the same graph must use the new weights
    before = fast_generate(model, ids, mask, generation_config=greedy(), config=config)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    model.train()
    model(input_ids=before, labels=torch.randint(4, 19, before.shape, device="cuda")).loss.backward()
    opt.step()
    after_eager = eager_generate(model, ids, mask)
    assert not torch.equal(after_eager, before)
    assert torch.equal(fast_generate(model, ids, mask, generation_config=greedy(), config=config), after_eager)
    assert _counts() == (warm, skips0), "no recompilation, no CUDA-graph skip"


@gpu
@pytest.mark.slow
def test_gpu_trainer_steps_compile_once():
    trainer = make_trainer(VARIED, max_steps=4, gradient_checkpointing=True, use_cpu=False)
    state = enable_fast_generation(trainer, True)
    _, skips0 = _counts()
    trainer.train()
    assert state.compiled and state.calls == 4
    assert state.graphs_compiled >= 1 and state.graphs_after_first_call == 0
    assert state.pool.built == 4 and not state.pool.caches, "the cache is released after every round"
    assert state.merged_layers > 0 and state.merged.refreshes == 4 and state.merged.flat is None
    assert _counts()[1] == skips0, "no CUDA-graph skip"


# decode_loop="graph": one compiled step per token (forward + sampling + EOS bookkeeping) --------------


def eos_prone_policy(seed=0, scale=1.5):
    """The LoRA policy with the EOS row of the lm_head scaled up: some rows end early, others not."""
    model = lora_policy(seed)
    with torch.no_grad():
        model.get_base_model().lm_head.weight[1] *= scale
    return model


def graph_config(counting, **kw):
    return counting.config(decode_loop="graph", **kw)


def test_graph_loop_greedy_equals_eager_generate_with_eos_pads_and_trim():
    model = eos_prone_policy()
    counting = Counting()
    config = graph_config(counting, check_every=4)
    stats0 = generation.GRAPH_STATS.calls
    ended_early = trimmed = full = 0
    for seed, lengths in enumerate(([5, 9, 7, 3], [11, 4, 8, 6], [2, 13, 9, 9], [6, 6, 10, 12])):
        ids, mask = batch(lengths, seed=seed)
        eager = eager_generate(model, ids, mask)
        fast = fast_generate(model, ids, mask, generation_config=greedy(), config=config)
        assert fast.shape == eager.shape and torch.equal(fast, eager), (lengths, fast, eager)
        completion = eager[:, ids.shape[1]:]
        has_eos = (completion == 1).any(1)
        ended_early += int(has_eos.sum())
        full += int((~has_eos).sum())
        trimmed += completion.shape[1] < 12
    assert generation.GRAPH_STATS.calls == stats0 + 4, "the graph loop ran (no fallback)"
    # meaningful: rows ended with EOS then pads, rows ran to max_new_tokens, and a batch ended early (trim)
    assert ended_early >= 2 and full >= 2 and trimmed >= 1, (ended_early, full, trimmed)
    assert counting.compiles == 1, "one compiled decode step for every prompt length"
    assert counting.runs >= 4 * 3, "the decode steps ran compiled"


def test_graph_loop_no_recompilation_across_prompt_lengths_in_a_bucket():
    model = lora_policy()
    counting = Counting()
    config = graph_config(counting, bucket=16)
    for lengths in ([3, 5, 2, 4], [9, 4, 8, 6], [14, 13, 16, 1], [7, 7, 7, 7]):
        ids, mask = batch(lengths, seed=len(lengths) + max(lengths))
        fast_generate(model, ids, mask, generation_config=greedy(), config=config)
    assert counting.compiles == 1 and counting.runs >= 4 * 11
    # meaningful: a prompt above the bucket grows the cache, which recompiles the step
    ids, mask = batch([17, 3, 5, 9])
    assert torch.equal(fast_generate(model, ids, mask, generation_config=greedy(), config=config),
                       eager_generate(model, ids, mask))
    assert counting.compiles == 2


def _warped_probs(logits, temperature, top_k, top_p):
    """transformers' own warpers (Temperature -> TopK -> TopP), as generate builds them."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    scores = logits.float()
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(-1)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.6, 6, 1.0), (1.4, 0, 0.7), (0.8, 10, 0.85)])
def test_graph_loop_sampling_distribution_matches_transformers_warpers(temperature, top_k, top_p):
    from transformers import GenerationConfig

    model = lora_policy()
    with torch.no_grad():
        model.get_base_model().lm_head.weight.mul_(8.0)  # peaked logits: temperature / truncation matter
    n = 6000
    prompt = torch.tensor([[5, 9, 4, 12, 7]])
    ids, mask = prompt.expand(n, -1).contiguous(), torch.ones(n, 5, dtype=torch.long)
    gc = GenerationConfig(max_new_tokens=2, do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p,
                          pad_token_id=0, eos_token_id=[], disable_compile=True)
    counting = Counting()
    torch.manual_seed(0)
    out = fast_generate(model, ids, mask, generation_config=gc, config=graph_config(counting))
    assert counting.compiles == 1 and counting.runs == 1, "the second token came from the compiled step"
    assert out.shape == (n, 7)
    vocab = model.config.vocab_size

    def check(tokens, logits, meaningful=True):
        probs = _warped_probs(logits, temperature, top_k, top_p)[0].double()
        freq = torch.bincount(tokens, minlength=vocab).double() / len(tokens)
        bound = 4.5 * ((probs * (1 - probs)).max().item() / len(tokens)) ** 0.5 + 1e-3  # 4.5 sigma
        dev = (freq - probs).abs().max().item()
        assert dev < bound, (dev, bound)
        assert freq[probs == 0].sum() == 0, "a token outside top-k / top-p was sampled"
        assert (probs > 0).sum() >= 2, "a real sample, not a forced token"
        if not meaningful:
            return probs
        # meaningful: a wrong temperature, or no truncation, is far outside the bound
        wrong_t = _warped_probs(logits, 1.0, top_k, top_p)[0].double()
        assert (wrong_t - probs).abs().max().item() > 2 * bound
        assert logits.float().softmax(-1)[0][probs == 0].sum().item() > 2 * bound
        return probs

    with torch.no_grad(), sampling_mode(model):
        first_logits = model(input_ids=prompt).logits[:, -1]
    check(out[:, 5], first_logits)  # prefill sample
    first = torch.bincount(out[:, 5], minlength=vocab).argmax()  # second token, given the likeliest first one
    rows = out[:, 5] == first
    assert rows.sum() >= 1000
    with torch.no_grad(), sampling_mode(model):
        second_logits = model(input_ids=torch.cat([prompt, first.view(1, 1)], 1)).logits[:, -1]
    check(out[rows, 6], second_logits, meaningful=False)  # fewer rows: checked by the first token


def test_graph_loop_unsupported_config_falls_back_and_warns_once():
    from transformers import GenerationConfig

    model = lora_policy()
    ids, mask = batch([5, 9, 7, 3])
    gc = GenerationConfig(max_new_tokens=8, do_sample=False, repetition_penalty=1.2, pad_token_id=0,
                          disable_compile=True)
    counting = Counting()
    config = graph_config(counting)
    fallbacks = generation.GRAPH_STATS.fallbacks
    with pytest.warns(RuntimeWarning, match="falls back.*repetition_penalty"):
        fast = fast_generate(model, ids, mask, generation_config=gc, config=config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = fast_generate(model, ids, mask, generation_config=gc, config=config)
    assert generation.GRAPH_STATS.fallbacks == fallbacks + 2 and torch.equal(fast, again)
    assert counting.compiles == 1 and counting.runs > 0, "transformers' compiled loop ran"
    with torch.no_grad(), sampling_mode(model):
        eager = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
    assert torch.equal(fast, eager)
    # meaningful: the penalty changes the tokens, so running the graph loop would have been wrong
    assert not torch.equal(eager, eager_generate(model, ids, mask)[:, :eager.shape[1]])


def test_graph_loop_trainer_step_through_apply():
    import grpo_patches

    grpo_patches.apply(fast_generation={"decode_loop": "graph", "force_compile": True, "backend": "aot_eager"})
    try:
        trainer = make_trainer(VARIED, max_steps=2, gradient_checkpointing=True, max_completion_length=8)
        state = getattr(trainer, FAST_GEN_ATTR)
        assert state.config.decode_loop == "graph"
        seen = []
        original = trainer._generate_single_turn

        def spy(*a, **k):
            out = original(*a, **k)
            seen.append(out)
            return out

        trainer._generate_single_turn = spy
        trainer.train()
    finally:
        grpo_patches.revert()
    assert state.compiled and state.calls == 2
    assert state.graph.calls == 2 and state.graph.fallbacks == 0 and state.graph.steps > 0
    assert state.graphs_after_first_call == 0
    for completion_ids, logprobs in seen:
        assert len(completion_ids) == 4 and logprobs is None
        assert all(1 <= len(c) <= 8 for c in completion_ids)
        assert all(1 not in c[:-1] for c in completion_ids), "nothing after a row's EOS"
    assert trainer.state.global_step == 2


@gpu
@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_k,top_p", [(0.6, 6, 1.0), (1.4, 0, 0.7)])
def test_gpu_graph_loop_sampling_distribution(temperature, top_k, top_p):
    from transformers import GenerationConfig

    model = lora_policy().cuda()
    with torch.no_grad():
        model.get_base_model().lm_head.weight.mul_(8.0)
    n = 8000
    prompt = torch.tensor([[5, 9, 4, 12, 7]], device="cuda")
    ids, mask = prompt.expand(n, -1).contiguous(), torch.ones(n, 5, dtype=torch.long, device="cuda")
    gc = GenerationConfig(max_new_tokens=3, do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p,
                          pad_token_id=0, eos_token_id=[], disable_compile=True)
    config = FastGenerationConfig(decode_loop="graph")
    torch.manual_seed(0)
    fast_generate(model, ids, mask, generation_config=gc, config=config)  # warm-up (records the graph)
    out = fast_generate(model, ids, mask, generation_config=gc, config=config).cpu()
    vocab = model.config.vocab_size
    first = torch.bincount(out[:, 5], minlength=vocab).argmax()
    rows = out[:, 5] == first
    with torch.no_grad(), sampling_mode(model):
        logits = model(input_ids=torch.cat([prompt, first.view(1, 1).cuda()], 1)).logits[:, -1].cpu()
    probs = _warped_probs(logits, temperature, top_k, top_p)[0].double()
    freq = torch.bincount(out[rows, 6], minlength=vocab).double() / int(rows.sum())
    bound = 4.5 * ((probs * (1 - probs)).max().item() / int(rows.sum())) ** 0.5 + 1e-3
    assert (freq - probs).abs().max().item() < bound
    assert freq[probs == 0].sum() == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[gpu, pytest.mark.slow])])
def test_graph_loop_draws_fresh_noise_at_every_step(device):
    """Uniform logits (a zero lm_head): every step samples uniformly over the vocabulary. A compiled
    step (or a CUDA-graph replay) that reused its random numbers would repeat the previous token in
    every row; fresh noise repeats it with probability 1 / vocab."""
    from transformers import GenerationConfig

    model = lora_policy().to(device)
    with torch.no_grad():
        model.get_base_model().lm_head.weight.zero_()
    vocab = model.config.vocab_size
    ids, mask = batch([5, 9, 7, 3] * 16)
    gc = GenerationConfig(max_new_tokens=24, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                          pad_token_id=0, eos_token_id=[], disable_compile=True)
    config = (FastGenerationConfig(decode_loop="graph") if device == "cuda"
              else FastGenerationConfig(decode_loop="graph", force_compile=True, backend="aot_eager"))
    outs = [fast_generate(model, ids.to(device), mask.to(device), generation_config=gc, config=config).cpu()
            for _ in range(2)]  # the second call replays what the first recorded
    for out in outs:
        new = out[:, ids.shape[1]:]
        repeats = (new[:, 2:] == new[:, 1:-1]).double().mean().item()  # compiled steps only
        assert repeats < 4 / vocab + 0.02, f"adjacent tokens equal in {repeats:.1%} of steps"
        assert len(set(new[:, -1].tolist())) > vocab // 4, "rows must draw independently"
    assert not torch.equal(outs[0], outs[1]), "two calls must not replay the same samples"


@gpu
@pytest.mark.slow
def test_gpu_graph_loop_trainer_steps_compile_once():
    trainer = make_trainer(VARIED, max_steps=4, gradient_checkpointing=True, use_cpu=False)
    state = enable_fast_generation(trainer, FastGenerationConfig(decode_loop="graph"))
    _, skips0 = _counts()
    trainer.train()
    assert state.compiled and state.calls == 4
    assert state.graph.calls == 4 and state.graph.fallbacks == 0
    assert state.graphs_compiled >= 1 and state.graphs_after_first_call == 0
    assert state.pool.built == 4 and not state.pool.caches, "the cache is released after every round"
    assert state.merged_layers > 0 and state.merged.refreshes == 4 and state.merged.flat is None
    assert _counts()[1] == skips0, "no CUDA-graph skip"


def test_decode_loop_config_validation():
    assert FastGenerationConfig().decode_loop == "graph" and FastGenerationConfig().check_every == 16
    assert FastGenerationConfig.coerce({"decode_loop": "graph"}).decode_loop == "graph"
    with pytest.raises(ValueError):
        FastGenerationConfig(decode_loop="cuda")
    with pytest.raises(ValueError):
        FastGenerationConfig(check_every=0)


def test_graph_loop_greedy_with_a_list_of_eos_ids_and_no_pad_id():
    from transformers import GenerationConfig

    model = eos_prone_policy()
    ids, mask = batch([5, 9, 7, 3], seed=1)
    # pad_token_id unset: generate pads with the first EOS id (transformers' rule), as the graph loop does
    gc = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=[18, 1], disable_compile=True)
    with torch.no_grad(), sampling_mode(model):
        eager = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
    counting = Counting()
    calls = generation.GRAPH_STATS.calls
    fast = fast_generate(model, ids, mask, generation_config=gc, config=graph_config(counting, check_every=2))
    assert generation.GRAPH_STATS.calls == calls + 1 and counting.runs > 0
    assert torch.equal(fast, eager)
    completion = eager[:, ids.shape[1]:]
    assert (completion == 18).any() and completion.shape[1] < 12, "the second EOS id ended rows early"


def _count_resets(monkeypatch):
    from transformers import StaticCache

    resets = []
    original = StaticCache.reset
    monkeypatch.setattr(StaticCache, "reset", lambda self: (resets.append(self), original(self))[1])
    return resets


def test_graph_loop_resets_the_pooled_cache_once_per_call(monkeypatch):
    """A reset writes the whole cache (1.3 GiB at batch 144 of the 1.5B policy): one per call. The
    trainer path used to fetch the pooled cache for the fallback and again for the graph loop."""
    resets = _count_resets(monkeypatch)
    counting = Counting()
    trainer = make_trainer(VARIED, max_steps=3, max_completion_length=8)
    state = enable_fast_generation(trainer, graph_config(counting, release_after_sampling=False))
    trainer.train()
    assert state.graph.calls == 3 and state.graph.fallbacks == 0
    # a new cache is built, not reset, at the first call: one reset at each later call
    assert len(resets) == 2 and all(c is resets[0] for c in resets), len(resets)
    assert state.pool.built == 1
    model = lora_policy()
    ids, mask = batch([5, 9, 7, 3])
    del resets[:]
    for _ in range(3):
        assert torch.equal(fast_generate(model, ids, mask, generation_config=greedy(),
                                         config=graph_config(counting, release_after_sampling=False)),
                           eager_generate(model, ids, mask))
    assert len(resets) == 2
    # released after every call (the default): built anew each time, never reset
    del resets[:]
    released = make_trainer(VARIED, max_steps=3, max_completion_length=8)
    state = enable_fast_generation(released, graph_config(counting))
    released.train()
    assert state.pool.built == 3 and resets == [] and not state.pool.caches


def test_graph_loop_without_cache_reuse_builds_a_cache_per_call(monkeypatch):
    from transformers import StaticCache

    built = []
    original = StaticCache.__init__
    monkeypatch.setattr(StaticCache, "__init__", lambda self, *a, **k: (built.append(self), original(self, *a, **k))[1])
    model = lora_policy()
    ids, mask = batch([5, 9, 7, 3])
    counting = Counting()
    for _ in range(2):
        fast = fast_generate(model, ids, mask, generation_config=greedy(),
                             config=graph_config(counting, reuse_cache=False))
        assert torch.equal(fast, eager_generate(model, ids, mask))
    assert len(built) == 2 and built[0] is not built[1]
    assert not generation._POOLS[model].caches, "reuse_cache=False keeps no pooled cache"


def test_graph_loop_leaves_a_call_with_its_own_cache_to_transformers():
    """The graph loop prefills from position 0, so it must not run on a caller's cache (which may
    hold a prefix): such a call falls back to transformers' loop, on that cache."""
    from transformers import StaticCache

    model = lora_policy()
    ids, mask = batch([5, 9, 7, 3])
    counting = Counting()
    own = StaticCache(config=model.config, max_cache_len=64)
    fallbacks, calls = generation.GRAPH_STATS.fallbacks, generation.GRAPH_STATS.calls
    with pytest.warns(RuntimeWarning, match="past_key_values"):
        fast = fast_generate(model, ids, mask, generation_config=greedy(), config=graph_config(counting),
                             past_key_values=own)
    assert generation.GRAPH_STATS.fallbacks == fallbacks + 1 and generation.GRAPH_STATS.calls == calls
    assert torch.equal(fast, eager_generate(model, ids, mask))
    assert own.get_seq_length() > 0, "transformers' loop decoded into the caller's cache"


# merged LoRA weights in a separate buffer (merge_lora) ---------------------------------------------


def _lora_a_calls(model):
    """Count forward calls of every lora_A module (the unmerged adapter path)."""
    calls = []
    handles = [m.register_forward_hook(lambda *_: calls.append(1)) for n, m in model.named_modules()
               if n.endswith("lora_A.default")]
    return calls, handles


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_merged_buffer_samples_the_adapter_without_its_matmuls_and_never_writes_the_base(dtype):
    from grpo_patches.generation import mergeable_layers

    model = lora_policy(dtype=dtype)
    ids, mask = batch([5, 9, 7, 3])
    snapshot = {n: p.detach().clone() for n, p in model.named_parameters()}
    eager = eager_generate(model, ids, mask)  # PEFT's unmerged path
    counting = Counting()
    calls, handles = _lora_a_calls(model)
    merged = fast_generate(model, ids, mask, generation_config=greedy(), config=counting.config())
    merged_calls = len(calls)
    unmerged = fast_generate(model, ids, mask, generation_config=greedy(), config=counting.config(merge_lora=False))
    for h in handles:
        h.remove()
    assert torch.equal(merged, eager) and torch.equal(unmerged, eager)
    assert merged_calls == 0, "sampled from the buffer: no adapter matmul ran"
    assert len(calls) > 0, "meaningful: the unmerged path does run the adapter's matmuls"
    assert len(mergeable_layers(model)) == 2 * len(ALL_PROJ)
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n], p) for n, p in snapshot.items()), "base and adapter bit-identical"
    assert all(p is params[n] for n, p in model.named_parameters())
    assert not any(m.merged for m in model.modules() if hasattr(m, "merged_adapters")), "PEFT's flags restored"
    # meaningful: the adapter changes the tokens, so a buffer without the delta would fail above
    with model.disable_adapter():
        assert not torch.equal(eager_generate(model, ids, mask), eager)


def test_merged_buffer_is_refreshed_at_every_call_and_reused_without_release():
    from grpo_patches import generation as gen

    model = lora_policy()
    ids, mask = batch([5, 9, 7, 3])
    counting = Counting()
    config = counting.config(release_after_sampling=False)
    first = fast_generate(model, ids, mask, generation_config=greedy(), config=config)
    buffer = gen._MERGED[model]
    address = buffer.flat.data_ptr()
    with torch.no_grad():  # an in-place change of the adapter, as an optimizer step makes
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(-1.0)
    second = fast_generate(model, ids, mask, generation_config=greedy(), config=config)
    assert torch.equal(second, eager_generate(model, ids, mask)) and not torch.equal(first, second)
    assert buffer.refreshes == 2 and buffer.allocations == 1 and buffer.flat.data_ptr() == address
    released = counting.config()  # the default frees the buffer after the call
    fast_generate(model, ids, mask, generation_config=greedy(), config=released)
    assert buffer.flat is None and buffer.allocations == 1
    again = fast_generate(model, ids, mask, generation_config=greedy(), config=released)
    assert buffer.flat is None and buffer.allocations == 2 and buffer.refreshes == 4 and torch.equal(again, second)


def test_merged_buffer_is_not_used_where_dropout_is_live():
    """dropout_off_while_sampling=False samples in training mode: merging would drop the LoRA dropout."""
    from grpo_patches.generation import mergeable_layers

    model = lora_policy(dropout=0.5)
    model.train()
    assert mergeable_layers(model) == []
    model.eval()
    assert len(mergeable_layers(model)) == 2 * len(ALL_PROJ)
    model.train()
    calls, handles = _lora_a_calls(model)
    ids, mask = batch([5, 9])
    fast_generate(model, ids, mask, generation_config=greedy(), config=Counting().config(dropout_off_while_sampling=False))
    for h in handles:
        h.remove()
    assert calls, "the adapter (and its dropout) ran unmerged"


@pytest.mark.parametrize("name", ["pad_prompts", "dropout_off_while_sampling", "compile", "force_compile", "fullgraph",
                                  "reuse_cache", "record_sampling_logprobs", "merge_lora", "release_after_sampling",
                                  "fused_decode", "keep_graph"])
def test_config_bool_fields_refuse_non_bools_naming_field_value_and_fix(name):
    for bad in ("no", 0, 1, None):
        with pytest.raises(TypeError) as err:
            FastGenerationConfig(**{name: bad})
        text = str(err.value)
        assert f"{name}={bad!r}" in text and f"{name}=False" in text, text
    with pytest.raises(TypeError, match=name):  # through apply()'s dict form too
        FastGenerationConfig.coerce({name: "no"})
    assert getattr(FastGenerationConfig(**{name: False}), name) is False


def test_config_other_fields_are_type_checked():
    with pytest.raises(TypeError, match=r"dropout_of_while_sampling.*Did you mean dropout_off_while_sampling"):
        FastGenerationConfig.coerce({"dropout_of_while_sampling": False})
    for field, bad in (("mode", 3), ("dynamic", "no"), ("options", "x"), ("backend", 3)):
        with pytest.raises(TypeError, match=f"{field}={bad!r}"):
            FastGenerationConfig(**{field: bad})
    for field, bad in (("bucket", "64"), ("check_every", True), ("max_prompt_length", 0), ("decode_loop", None)):
        with pytest.raises(ValueError, match=field):
            FastGenerationConfig(**{field: bad})


def test_merged_buffer_that_does_not_fit_samples_unmerged_with_one_warning(monkeypatch):
    from grpo_patches.generation import MergedLoRAWeights

    model = lora_policy()
    ids, mask = batch([5, 9, 7, 3])

    def no_memory(self, model, layers):
        raise torch.OutOfMemoryError("simulated: no room for the buffer")

    monkeypatch.setattr(MergedLoRAWeights, "_allocate", no_memory)
    calls, handles = _lora_a_calls(model)
    counting = Counting()
    with pytest.warns(RuntimeWarning, match="merged LoRA buffer"):
        out = fast_generate(model, ids, mask, generation_config=greedy(), config=counting.config())
    for h in handles:
        h.remove()
    buffer = generation._MERGED[model]
    assert torch.equal(out, eager_generate(model, ids, mask)) and calls, "sampled correctly, unmerged"
    assert buffer.skipped == 1 and buffer.flat is None and buffer.allocations == 0


def test_merged_buffer_leaves_layers_of_another_dtype_on_peft_path():
    """The buffer holds one dtype: a layer in another dtype keeps PEFT's own (unmerged) path."""
    model = lora_policy()
    odd = next(m for n, m in model.named_modules() if n.endswith("layers.1.mlp.down_proj"))
    odd.get_base_layer().to(torch.float64)
    weight = odd.get_base_layer().weight
    with sampling_mode(model):
        others = [m for m, _ in generation.mergeable_layers(model) if m is not odd]
        with generation.MergedLoRAWeights().applied(model) as merged:
            assert merged == len(others) == 2 * len(ALL_PROJ) - 1
            assert not odd.merged and odd.get_base_layer().weight is weight
            assert all(m.merged for m in others)
    assert not any(m.merged for m in others)


# the fused decode step (fused_decode=True, the default): the kit's own forward for Llama / Qwen2 ------


def qwen2_lora_policy(seed=0):
    """A Qwen2 (q/k/v biases, set nonzero) with LoRA on all seven projections, GQA 4 heads on 2."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.helpers import tiny_config

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2", max_position_embeddings=256))
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=ALL_PROJ,
                                            task_type="CAUSAL_LM"))
    for name, p in peft.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    return peft


@pytest.mark.parametrize("make", [lora_policy, qwen2_lora_policy], ids=["llama", "qwen2-bias"])
def test_fused_step_equals_eager_generate_and_runs_q_k_v_and_gate_up_as_one_matmul(make):
    from grpo_patches.generation.fused import FusedDecoder

    model = make()
    fused0 = generation.GRAPH_STATS.fused.calls
    counting = Counting()
    config = graph_config(counting, check_every=4)
    for seed, lengths in enumerate(([5, 9, 7, 3], [11, 4, 8, 6])):
        ids, mask = batch(lengths, seed=seed)
        assert torch.equal(fast_generate(model, ids, mask, generation_config=greedy(), config=config),
                           eager_generate(model, ids, mask)), lengths
    assert generation.GRAPH_STATS.fused.calls == fused0 + 2 and generation.GRAPH_STATS.fused.last_reason == ""
    assert counting.compiles == 1 and counting.runs >= 2 * 11
    # the fused q/k/v and gate/up matrices are views of the merged buffer, not copies
    model.eval()
    with generation.MergedLoRAWeights().applied(model):
        decoder, why = FusedDecoder.bind(model)
        assert why == "" and decoder.fused_groups == 2 * model.config.num_hidden_layers
        ln1, qkv, o, ln2, gate_up, down = decoder.args[1][0]
        q = model.get_base_model().model.layers[0].self_attn.q_proj.get_base_layer().weight
        assert len(qkv) == 1 and qkv[0][0].data_ptr() == q.data_ptr() and qkv[0][0].shape[0] > q.shape[0]
    # meaningful: the adapter changes the tokens (a step that dropped it would fail above)
    with_adapter = eager_generate(model, ids, mask)
    with model.disable_adapter():
        assert not torch.equal(eager_generate(model, ids, mask), with_adapter)


def test_fused_step_is_not_taken_over_an_unmerged_adapter_and_the_model_forward_gives_the_same_tokens():
    model = lora_policy()
    ids, mask = batch([5, 9, 7, 3])
    eager = eager_generate(model, ids, mask)
    fused0 = generation.GRAPH_STATS.fused.calls
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        unmerged = fast_generate(model, ids, mask, generation_config=greedy(),
                                 config=graph_config(Counting(), merge_lora=False))
    assert torch.equal(unmerged, eager)
    assert generation.GRAPH_STATS.fused.calls == fused0, "an unmerged adapter keeps the model's forward"
    assert "not a plain linear map" in generation.GRAPH_STATS.fused.last_reason
    assert any("fused decode step does not apply" in str(w.message) for w in caught)
    off = fast_generate(model, ids, mask, generation_config=greedy(), config=graph_config(Counting(), fused_decode=False))
    assert torch.equal(off, eager) and generation.GRAPH_STATS.fused.calls == fused0
    assert generation.GRAPH_STATS.fused.last_reason == "fused_decode=False"


def test_merged_buffer_is_one_block_per_decoder_layer_in_module_order():
    model = lora_policy()
    model.eval()
    buffer = generation.MergedLoRAWeights()
    with buffer.applied(model) as merged:
        assert merged == 2 * len(ALL_PROJ)
        assert len(buffer.chunks) == model.config.num_hidden_layers
        for layer, chunk in zip(model.get_base_model().model.layers, buffer.chunks, strict=True):
            w = [getattr(layer.self_attn if n.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else layer.mlp,
                         n).get_base_layer().weight for n in ALL_PROJ]
            assert w[0].data_ptr() == chunk.data_ptr()
            assert all(a.data_ptr() + a.numel() * a.element_size() == b.data_ptr() for a, b in zip(w, w[1:], strict=False))
    assert buffer.nbytes == sum(c.numel() * c.element_size() for c in buffer.chunks) > 0


@gpu
@pytest.mark.slow
def test_gpu_fused_loop_is_one_cuda_graph_per_check_every_tokens_captured_once_and_equal_to_eager():
    model = eos_prone_policy().cuda()
    kept = FastGenerationConfig(decode_loop="graph", check_every=4, release_after_sampling=False)
    stats = generation.GRAPH_STATS.fused
    captures0, replays0 = stats.captures, stats.replays
    for seed, lengths in enumerate(([5, 9, 7, 3], [11, 4, 8, 6], [2, 13, 9, 9])):
        ids, mask = (t.cuda() for t in batch(lengths, seed=seed))
        assert torch.equal(fast_generate(model, ids, mask, generation_config=greedy(), config=kept),
                           eager_generate(model, ids, mask)), lengths
    assert stats.capture_errors == [] and stats.captures == captures0 + 1, "captured once, replayed after"
    assert stats.replays - replays0 >= 3 * 2, "12 new tokens in replays of 4"
    dropped = FastGenerationConfig(decode_loop="graph", check_every=4)  # the default: the graph goes with the cache
    for expected in (1, 2):  # the first still replays the kept graph, then frees it; the second captures anew
        assert torch.equal(fast_generate(model, ids, mask, generation_config=greedy(), config=dropped),
                           eager_generate(model, ids, mask))
        assert stats.captures == captures0 + expected and not generation._MERGED[model].chunks


def test_capture_keeps_the_allocator_cache_unless_short_of_room_and_tries_once_more_after_running_out(monkeypatch):
    """The fused loop's capture (CUDA only: its torch.cuda calls recorded here with stand-ins). The cache is
    emptied only where less than the pool the last capture took, or a quarter of the memory the process may
    use, is left (``torch.cuda.graph`` empties it at every capture, so the next round's caches moved), and
    after a capture that ran out of memory, which is tried once more; every capture begun is ended."""
    from contextlib import nullcontext

    from grpo_patches.generation import fused_loop

    log, reserved, free, fraction, fail = [], [0], [10_000], [1.0], []

    class Graph:
        def capture_begin(self, capture_error_mode):
            log.append("begin")

        def capture_end(self):
            log.append("end")

    class Stream:
        def wait_stream(self, other):
            pass

    for name, value in {"Stream": Stream, "current_stream": Stream, "stream": lambda s: nullcontext(),
                        "synchronize": lambda: None, "CUDAGraph": Graph, "memory_reserved": lambda: reserved[0],
                        "empty_cache": lambda: log.append("empty_cache"), "mem_get_info": lambda: (free[0], 10_000),
                        "get_per_process_memory_fraction": lambda: fraction[0]}.items():
        monkeypatch.setattr(torch.cuda, name, value, raising=False)

    def step():
        if log[-1:] == ["begin"] and fail:  # inside a capture (its steps log nothing)
            fail.pop()
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (stand-in)")
        reserved[0] += 10

    def capture(need):
        log.clear()
        reserved[0] = 0
        return fused_loop._capture(step, (), 4, need)[1], list(log)

    assert capture(0) == (40, ["begin", "end"]), "no need known: the cache stays"
    assert capture(40) == (40, ["begin", "end"]), "room for the pool beside the cache"
    free[0] = 30
    assert capture(40) == (40, ["empty_cache", "begin", "end"]), "short of free memory"
    free[0] = 2_600
    assert capture(40) == (40, ["begin", "end"]), "over a quarter of the device free"
    free[0] = 2_400
    assert capture(0) == (40, ["empty_cache", "begin", "end"]), "under a quarter free: defragmented"
    free[0], fraction[0] = 10_000, 0.5  # within the process's fraction: 5000 - 10 (the warm-up step's) left
    assert capture(40) == (40, ["begin", "end"]), "room within the memory fraction"
    fraction[0] = 0.004  # 40 - 10
    assert capture(40) == (40, ["empty_cache", "begin", "end"]), "short within the memory fraction"
    fraction[0], fail[:] = 1.0, [True]
    assert capture(0) == (40, ["begin", "end", "empty_cache", "begin", "end"]), "out of memory: emptied, again"
    fail[:] = [True, True]
    with pytest.raises(torch.cuda.OutOfMemoryError):
        capture(0)
    assert log == ["begin", "end", "empty_cache", "begin", "end"]


@gpu
@pytest.mark.slow
def test_gpu_kept_graph_is_replayed_exactly_while_caches_and_buffer_are_back_at_its_addresses(monkeypatch):
    """keep_graph with release_after_sampling: caches and merged buffer freed after every call, the graph
    kept. Each call's addresses (weights, merged buffer, K/V caches) decide: those the graph was recorded
    over -> replay, else capture. A graph replayed over moved caches reads freed memory: after the weight
    change its tokens would be the old weights' (the allocator decides where the blocks land, so the test
    follows the addresses each call saw)."""
    from grpo_patches.generation import fused_loop

    model = eos_prone_policy().cuda()
    config = FastGenerationConfig(decode_loop="graph", check_every=4, keep_graph=True)
    stats = generation.GRAPH_STATS.fused
    ids, mask = (t.cuda() for t in batch([5, 9, 7, 3]))
    # Everything the calls are compared with is computed first, so nothing else allocates between the calls.
    noise = {n: torch.randn_like(p) * 0.05 for n, p in model.named_parameters() if p.requires_grad}
    stepped = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in stepped.named_parameters():
            if n in noise:
                p.add_(noise[n])
    expected, expected_stepped = eager_generate(model, ids, mask), eager_generate(stepped, ids, mask)
    assert not torch.equal(expected, expected_stepped), "a vacuous weight change"
    seen, addresses = [], fused_loop._addresses
    monkeypatch.setattr(fused_loop, "_addresses", lambda tensors: seen.append(addresses(tensors)) or seen[-1])
    captured = []
    for call in range(6):
        if call == 4:  # an optimizer step in between: the replay reads the refreshed buffer
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if n in noise:
                        p.add_(noise[n])
        before = stats.captures
        got = fast_generate(model, ids, mask, generation_config=greedy(), config=config)
        assert torch.equal(got, expected_stepped if call >= 4 else expected), call
        assert not generation._MERGED[model].chunks and not generation._POOLS[model].caches, "released"
        assert len(seen) == call + 1
        captured.append(stats.captures - before)
        assert captured[-1] == int(call == 0 or seen[-1] != seen[-2]), (call, captured)
    assert stats.capture_errors == [] and 0 in captured, f"the kept graph was never replayed: {captured}"
    assert stats.graph_pool_bytes > 0
    # Keep the released tensors alive, so the next call's caches and buffer land elsewhere.
    merged, pool, held = generation._MERGED[model], generation._POOLS[model], []
    release_merged, release_pool = merged.release, pool.release
    merged.release = lambda: (held.extend(merged.chunks), release_merged())
    pool.release = lambda keep_graphs=False: (held.extend(pool.caches.values()), release_pool(keep_graphs))
    try:
        captures = stats.captures
        assert torch.equal(fast_generate(model, ids, mask, generation_config=greedy(), config=config), expected_stepped)
        assert held and stats.captures == captures + int(seen[-1] != seen[-2])
        captures, moves = stats.captures, merged.moves
        assert torch.equal(fast_generate(model, ids, mask, generation_config=greedy(), config=config), expected_stepped)
        assert merged.moves == moves + 1 and seen[-1] != seen[-2]
        assert stats.captures == captures + 1, "moved: captured anew, not replayed"
    finally:
        del merged.release, pool.release


def test_fused_step_is_not_taken_where_peft_trains_a_copy_of_the_norms():
    """modules_to_save wraps the norms: the wrapper forwards .weight to the original, not the trained copy."""
    from peft import LoraConfig, get_peft_model

    from tests.helpers import tiny_policy

    model = get_peft_model(tiny_policy(0, max_position_embeddings=256),
                           LoraConfig(r=4, target_modules=ALL_PROJ, modules_to_save=["norm"], task_type="CAUSAL_LM"))
    with torch.no_grad():  # the trained copy differs from the original: reading the original would be wrong
        for name, p in model.named_parameters():
            if "modules_to_save" in name:
                p.mul_(3.0)
    ids, mask = batch([5, 9, 7, 3])
    fused0 = generation.GRAPH_STATS.fused.calls
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = fast_generate(model, ids, mask, generation_config=greedy(), config=graph_config(Counting()))
    assert torch.equal(out, eager_generate(model, ids, mask))
    assert generation.GRAPH_STATS.fused.calls == fused0 and "RMSNorm" in generation.GRAPH_STATS.fused.last_reason


def test_fused_loop_whose_graph_capture_fails_decodes_step_by_step_after_the_warm_up_step(monkeypatch):
    """The fallback path: a capture that fails after its real warm-up step leaves the loop to finish
    step by step from there (same tokens, no step run twice), warns once and does not try again over
    the same caches."""
    from grpo_patches.generation import fused_loop

    model = eos_prone_policy()
    ids, mask = batch([5, 9, 7, 3])
    eager = eager_generate(model, ids, mask)
    attempts = []

    def failing_capture(step, args, chunk, need):
        step(*args)  # the real warm-up step, as _capture runs it
        attempts.append(chunk)
        raise RuntimeError("simulated: operation not permitted when stream is capturing")

    stats = generation.GRAPH_STATS.fused
    errors0 = len(stats.capture_errors)
    reference = Counting()  # no graphs at all: step by step from the first token
    plain = fast_generate(model, ids, mask, generation_config=greedy(),
                          config=graph_config(reference, check_every=4, release_after_sampling=False))
    monkeypatch.setattr(fused_loop, "_graphs_on", lambda device: True)
    monkeypatch.setattr(fused_loop, "_capture", failing_capture)
    fallback = Counting()
    with pytest.warns(RuntimeWarning, match="could not be captured"):
        first = fast_generate(model, ids, mask, generation_config=greedy(),
                              config=graph_config(fallback, check_every=4, release_after_sampling=False))
    assert torch.equal(plain, eager) and torch.equal(first, eager)
    assert fallback.runs == reference.runs, "the warm-up step counts: none is run twice, none skipped"
    second = fast_generate(model, ids, mask, generation_config=greedy(),
                           config=graph_config(fallback, check_every=4, release_after_sampling=False))
    assert torch.equal(second, eager)
    assert attempts == [4] and len(stats.capture_errors) == errors0 + 1, "one attempt over the same caches"


def test_fused_q_k_v_bias_is_one_tensor_across_calls_and_follows_an_in_place_change():
    """A captured graph is replayed only while every address it read is unchanged: the concatenated
    q/k/v bias must not be a new tensor at every call (Qwen2), yet must follow a changed bias."""
    from grpo_patches.generation.fused import FusedDecoder

    model = qwen2_lora_policy()
    model.eval()

    def qkv_bias():
        with generation.MergedLoRAWeights().applied(model):
            return FusedDecoder.bind(model)[0].args[1][0][1][0][1]

    first, second = qkv_bias(), qkv_bias()
    assert first is second
    attn = model.get_base_model().model.layers[0].self_attn
    with torch.no_grad():
        attn.q_proj.get_base_layer().bias.add_(1.0)
    changed = qkv_bias()
    assert changed is not first and torch.equal(changed[: first.shape[0] - 2 * attn.k_proj.out_features],
                                                attn.q_proj.get_base_layer().bias)


def test_pool_release_keeps_captured_graphs_only_when_asked_and_forgets_a_failed_capture():
    from grpo_patches.generation.cache import StaticCachePool
    from grpo_patches.generation.fused_loop import _FAILED, _Captured

    pool = StaticCachePool()
    pool.grow(32)
    pool.get(lora_policy(), 2)
    captured, uncaptured = _Captured(state=(), graph=object()), _Captured(state=())
    graphs = {(2, 32): captured, (4, 32): uncaptured, _FAILED: True}
    pool.graphs = dict(graphs)
    pool.release(keep_graphs=True)
    assert pool.caches == {} and pool.graphs == {(2, 32): captured}, "the graph stays; a failure is forgotten"
    pool.graphs = dict(graphs)
    pool.release()
    assert pool.graphs == {}
    pool.graphs = {(2, 32): captured}
    pool.grow(64)  # a longer cache: no graph recorded over the old length replays
    assert pool.graphs == {}
