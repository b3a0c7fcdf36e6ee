"""Shared pieces of the fast-generation tests (test_fast_generate, test_trl_generation, test_decode,
test_merged, test_fused, test_fused_loop, test_generation_config).

The compiled path is exercised on CPU with ``force_compile=True`` and ``backend="aot_eager"``
(dynamo capture + AOT functionalization, as on GPU; inductor's CPU code generation takes ~70 s for
a 2-layer model, too slow here). Every compiled run counts its compilations and calls through a
counting backend (:class:`Counting`), so a silently eager "compiled" path cannot pass. Each
equality is paired with the check that makes it meaningful (the adapter changes the tokens; the
optimizer step changes the tokens; a new cache length does recompile; dropout does change the
log-probs; a merge round trip does change the base weights). GPU tests (``gpu``) run the real
backend (inductor + CUDA graphs) and are skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from grpo_patches import generation
from grpo_patches.generation import FastGenerationConfig, sampling_mode
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


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (inductor + CUDA graphs path)")


def _counts():
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], counters["inductor"]["cudagraph_skips"]


def eos_prone_policy(seed=0, scale=1.5):
    """The LoRA policy with the EOS row of the lm_head scaled up: some rows end early, others not."""
    model = lora_policy(seed)
    with torch.no_grad():
        model.get_base_model().lm_head.weight[1] *= scale
    return model


def graph_config(counting, **kw):
    return counting.config(decode_loop="graph", **kw)


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


def transformers_warped(logits, temperature, top_k, top_p):
    """The scores after transformers' own warpers (Temperature -> TopK -> TopP), as generate builds them."""
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
    return scores
