"""generation.fused: the fused decode step (Llama / Qwen2): tokens equal eager decoding's with q/k/v
and gate/up as one matmul, and the step is not taken where it would be wrong."""

from __future__ import annotations

import warnings

import pytest
import torch

from grpo_patches import generation
from grpo_patches.generation import fast_generate
from tests.fastgen_helpers import (  # noqa: F401  (_fresh: autouse)
    ALL_PROJ,
    Counting,
    _fresh,
    batch,
    eager_generate,
    graph_config,
    greedy,
    lora_policy,
    qwen2_lora_policy,
)
from tests.helpers import tiny_policy


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


def test_fused_step_is_not_taken_where_peft_trains_a_copy_of_the_norms():
    """modules_to_save wraps the norms: the wrapper forwards .weight to the original, not the trained copy."""
    from peft import LoraConfig, get_peft_model


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
