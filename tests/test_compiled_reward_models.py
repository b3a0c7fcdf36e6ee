"""``apply(compile_reward_models=True)``: the reward models' decoder layers compiled for scoring.

Each test first scores with the eager (stock) model on the same inputs, then with the compiled layers: the same
scores to fp32 rounding, one graph shared by every layer, batch size and length, the eager layer where
autograd is on, plain reward functions untouched.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import grpo_patches
from grpo_patches import compiled_reward_models
from grpo_patches.compiled_reward_models import enable_compiled_reward_models, scoring_layers
from tests.helpers import grpo_args, target_share, tiny_policy, tiny_reward_model, tiny_tokenizer
from tests.test_compiled_training import Accelerator, count_compiled_calls


def graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def batch(rows: int, length: int, seed: int) -> dict[str, torch.Tensor]:
    """Right-padded token ids, as TRL tokenizes a reward model's texts."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 19, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, length // 2:] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


def test_compiled_scoring_gives_eagers_scores_with_one_graph_for_every_layer_batch_and_length():
    eager = tiny_reward_model().eval()
    compiled = copy.deepcopy(eager)
    assert eager.config.use_cache, "stock's classifier fills a KV cache at each forward"
    assert enable_compiled_reward_models([target_share, compiled]) == 2 and len(scoring_layers(compiled)) == 2
    assert scoring_layers(eager) == [] and not compiled.config.use_cache
    torch._dynamo.reset()
    before = graphs()
    for n, (rows, length) in enumerate(((6, 9), (6, 13), (4, 17), (8, 11))):
        inputs = batch(rows, length, n)
        with torch.inference_mode():  # how TRL scores
            expected = eager(**inputs).logits
            got = compiled(**inputs).logits
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        if n == 0:
            assert graphs() == before + 1, "one graph for both layers"
    assert graphs() == before + 1, "no graph per layer, batch size or length"
    for length in (10, 12):  # no row padded: transformers passes no attention mask, one more graph for those
        inputs = {"input_ids": batch(5, length, length)["input_ids"].clamp(min=4)}
        with torch.inference_mode():
            torch.testing.assert_close(compiled(**inputs).logits, eager(**inputs).logits, rtol=1e-5, atol=1e-6)
    assert graphs() == before + 2


def test_autograd_on_runs_the_eager_layer_and_compiles_nothing():
    eager = tiny_reward_model().eval()
    compiled = copy.deepcopy(eager)
    enable_compiled_reward_models([compiled])
    before = graphs()
    inputs = batch(3, 7, 0)
    assert torch.equal(compiled(**inputs).logits, eager(**inputs).logits), "the eager layer's bits"
    assert graphs() == before


def test_plain_functions_are_left_alone_and_a_model_without_decoder_layers_warns():
    assert enable_compiled_reward_models([target_share, len]) == 0
    with pytest.warns(UserWarning, match="names no decoder layers"):
        assert enable_compiled_reward_models([nn.Sequential(nn.Linear(2, 2))]) == 0
    model = tiny_reward_model()
    assert enable_compiled_reward_models([model]) == enable_compiled_reward_models([model]) == 2, "switched once"
    layer = model.model.layers[0]
    assert type(layer).__mro__[1].__name__ == type(layer).__name__ == "LlamaDecoderLayer"


def test_the_option_must_be_a_bool_and_fsdp_or_deepspeed_are_refused_naming_it():
    with pytest.raises(TypeError, match="compile_reward_models='yes'"):
        grpo_patches.apply(compile_reward_models="yes")
    assert not grpo_patches.is_applied()
    for kind in ("FSDP", "DEEPSPEED"):
        with pytest.raises(ValueError, match=f"under {kind}.*Drop compile_reward_models"):
            enable_compiled_reward_models([tiny_reward_model()], Accelerator(kind))
    assert enable_compiled_reward_models([target_share], Accelerator("FSDP")) == 0, "no model, nothing to refuse"
    assert enable_compiled_reward_models([tiny_reward_model()], Accelerator("MULTI_GPU")) == 2


def _trl_trainer(**apply_kw):
    from trl import GRPOTrainer

    from tests.helpers import lora, prompt_dataset, quiet

    quiet()
    grpo_patches.revert()
    grpo_patches.apply(**apply_kw)
    try:
        return GRPOTrainer(model=tiny_policy(5), reward_funcs=[target_share, tiny_reward_model()],
                           reward_processing_classes=[None, tiny_tokenizer()], train_dataset=prompt_dataset(),
                           processing_class=tiny_tokenizer(), peft_config=lora(), args=grpo_args())
    finally:
        grpo_patches.revert()


def test_trl_trainer_scores_with_the_compiled_layers_as_stock_scores(monkeypatch):
    """TRL's reward path through the patched trainer: the stock-built trainer's reward model runs eager, the one
    built with the option runs the compiled function (without autograd) and gives stock's rewards."""
    calls = count_compiled_calls(monkeypatch, compiled_reward_models)
    n = 8
    completions = [f"a b {'a ' * (i % 3)}c" for i in range(n)]
    inputs = [{"prompt": "say the letter a please", "row": i // 4, "target": "a"} for i in range(n)]
    rewards = {}
    for name, kw in {"stock": {}, "compiled": {"compile_reward_models": True}}.items():
        trainer = _trl_trainer(**kw)
        assert len(scoring_layers(trainer.reward_funcs[1])) == (0 if name == "stock" else 2)
        assert len(scoring_layers(trainer.model)) == 0, "the policy is not the option's"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rewards[name] = trainer._calculate_rewards(inputs, [x["prompt"] for x in inputs], completions,
                                                       [[0]] * n).cpu()
        if name == "stock":
            assert calls == {True: 0, False: 0}
    assert calls[False] == 2 and calls[True] == 0, calls  # one forward of 8 rows, two layers
    assert rewards["stock"][:, 1].abs().sum() > 0, "the reward model scored"
    torch.testing.assert_close(rewards["compiled"], rewards["stock"], rtol=1e-5, atol=1e-6)


def test_vendored_trainer_switches_its_reward_models():
    from peft import get_peft_model

    from grpo_patches.vendored.dsm_grpo import DSMGRPOConfig, DSMGRPOTrainer
    from tests.helpers import lora

    grpo_patches.apply(targets=("vendored",), compile_reward_models=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reward_model = tiny_reward_model()
            DSMGRPOTrainer(get_peft_model(tiny_policy(), lora()), tiny_tokenizer(), [target_share, reward_model],
                           DSMGRPOConfig(max_new_tokens=4), reward_tokenizers=[None, tiny_tokenizer()])
    finally:
        grpo_patches.revert()
    assert len(scoring_layers(reward_model)) == 2
