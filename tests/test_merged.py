"""generation.merged: the merged-LoRA buffer (``merge_lora``): sampled without the adapter's
matmuls, never writing the base weights, refreshed every call, one block per decoder layer, and
left out where it cannot serve (live dropout, no room, another dtype)."""

from __future__ import annotations

import pytest
import torch

from grpo_patches import generation
from grpo_patches.generation import fast_generate, sampling_mode
from tests.fastgen_helpers import ALL_PROJ, Counting, _fresh, batch, eager_generate, greedy, lora_policy  # noqa: F401  (_fresh: autouse)


def test_a_lora_merge_round_trip_would_change_base_weights():
    """Why the fast path never merges: W + BA*s - BA*s is not W bit for bit."""
    model = lora_policy()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    model.merge_adapter()
    model.unmerge_adapter()
    after = dict(model.named_parameters())
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert changed, "the bit-identity check would not detect a merge"


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
