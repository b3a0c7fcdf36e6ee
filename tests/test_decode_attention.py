"""generation.decode_attention: the fused step's Triton attention kernel, run on CPU in Triton's interpreter.

The kernel equals the matmul path's arithmetic (``reference``: QK, fp32 softmax under the key mask and the
causal bound, probabilities cast to the value dtype, PV) in fp32 over GQA shapes, head sizes, cache lengths
that are no multiple of the block, positions at the first, middle and last slot and per-row left padding;
it reads no slot after ``cache_position`` (NaN and huge values there change nothing); rows of one prompt read
its slots from the prompt's first row, with the same result; a tiny Llama and a tiny Qwen2 decode the same
tokens and logits through the fused step with the kernel as with the matmuls, repeated prompts included.

``TRITON_INTERPRET=1`` must be set before Triton is first imported, and this process may have imported it
already (``torch._inductor`` does), so each kernel test runs itself again in a fresh interpreter with the
variable set (:func:`interpreted`); setting it for the whole process would also turn a GPU run's inductor
kernels into interpreted ones.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo_patches import generation
from grpo_patches.generation import FastGenerationConfig, fast_generate
from grpo_patches.generation.fused import attention_bias, matmul_attention
from tests.fastgen_helpers import (  # noqa: F401  (_fresh: autouse)
    Counting,
    _fresh,
    batch,
    eager_generate,
    graph_config,
    greedy,
    lora_policy,
    qwen2_lora_policy,
)
from tests.interpreted import interpreted

ROOT = Path(__file__).resolve().parents[1]


def reference(q, keys, values, key_mask, cache_position, scale):
    """The fused step's matmul path (grpo_patches/generation/fused.py) on q ``[B, heads * D]``."""
    return matmul_attention(q, keys, values, attention_bias(key_mask, cache_position, q.dtype), scale)


def inputs(rows, kv_heads, groups, dim, length, pos, seed=0):
    """Random q / K / V, each row left-padded by 0 .. pos // 2 slots; the slots after ``pos`` count as real
    tokens in ``key_mask`` (as in the fused loop, where only the causal bound hides them)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, kv_heads * groups * dim, generator=g)
    keys = torch.randn(rows, kv_heads, length, dim, generator=g)
    values = torch.randn(rows, kv_heads, length, dim, generator=g)
    pad = torch.randint(0, max(pos // 2, 1), (rows,), generator=g)
    pad[0] = 0
    key_mask = torch.arange(length)[None, :] >= pad[:, None]
    return q, keys, values, key_mask, torch.tensor([pos]), dim ** -0.5


# (rows, kv_heads, groups, head_dim, cache slots, position): groups 1..6, head sizes 16..128 (and 8, 24: padded),
# lengths off the 16 / 64 blocks, the new token at the first, a middle, a block's last and the last slot
SHAPES = [(2, 2, 1, 16, 48, 0), (3, 2, 2, 32, 70, 33), (2, 1, 3, 64, 37, 36), (1, 2, 6, 128, 96, 95),
          (2, 3, 4, 24, 50, 15), (2, 2, 5, 8, 20, 19), (4, 1, 6, 16, 130, 64)]


@interpreted
def test_kernel_equals_the_matmul_path_in_fp32_over_gqa_shapes_positions_and_left_padding():
    from grpo_patches.generation.decode_attention import decode_attention

    for shape in SHAPES:
        for block in (16, 64):
            args = inputs(*shape)
            got = decode_attention(*args, block_l=block)
            want = reference(*args)
            assert got.shape == want.shape and got.dtype == torch.float32
            err = (got - want).abs().max().item()
            assert err <= 1e-4, (shape, block, err)
    # meaningful: the key mask and the query-head order matter (a kernel ignoring either would differ)
    q, keys, values, key_mask, pos, scale = inputs(2, 2, 3, 16, 40, 30)
    unpadded = decode_attention(q, keys, values, torch.ones_like(key_mask), pos, scale)
    assert (unpadded - decode_attention(q, keys, values, key_mask, pos, scale)).abs().max() > 1e-3
    swapped = q.view(2, 2, 3, 16).transpose(1, 2).reshape(2, -1)
    assert (reference(swapped, keys, values, key_mask, pos, scale) - reference(q, keys, values, key_mask, pos, scale)
            ).abs().max() > 1e-3
    # the fused step's q layout ([B, heads, 1, D], a transposed view's product) gives the same result
    q4 = q.view(2, 1, 6, 16).transpose(1, 2) * 1.0
    assert torch.equal(decode_attention(q4, keys, values, key_mask, pos, scale),
                       decode_attention(q, keys, values, key_mask, pos, scale))


@interpreted
def test_kernel_reads_no_cache_slot_after_cache_position():
    """Length-awareness: whatever lies in the slots after the new token's (NaN, huge values; the key mask
    says real tokens) leaves the output unchanged, bit for bit, at positions inside and at the end of a block."""
    from grpo_patches.generation.decode_attention import decode_attention

    for shape in [(2, 2, 2, 16, 64, 20), (3, 1, 4, 32, 70, 40), (2, 2, 3, 16, 48, 0), (1, 2, 2, 16, 48, 47)]:
        for block in (16, 32):
            q, keys, values, key_mask, pos, scale = inputs(*shape)
            clean = decode_attention(q, keys, values, key_mask, pos, scale, block_l=block)
            assert (clean - reference(q, keys, values, key_mask, pos, scale)).abs().max() <= 1e-4
            after = int(pos) + 1
            for junk in (float("nan"), 1e30, -1e30):
                k2, v2 = keys.clone(), values.clone()
                k2[:, :, after:] = junk
                v2[:, :, after:] = junk
                got = decode_attention(q, k2, v2, key_mask, pos, scale, block_l=block)
                assert torch.equal(got, clean), (shape, block, junk)


def grouped(rows, group, kv_heads, groups, dim, length, prompt, pos, seed=0):
    """``inputs`` where each run of ``group`` rows repeats its first row's ``prompt`` slots (keys, values and
    key mask: one prompt prefilled once, as the prefill copies it), their later slots their own; and the
    ``source`` of each row (its run's first row)."""
    q, keys, values, key_mask, position, scale = inputs(rows, kv_heads, groups, dim, length, pos, seed=seed)
    source = torch.arange(rows) // group * group
    keys[:, :, :prompt] = keys[source, :, :prompt]
    values[:, :, :prompt] = values[source, :, :prompt]
    key_mask[:, :prompt] = key_mask[source, :prompt]
    return (q, keys, values, key_mask, position, scale), source


@interpreted
def test_rows_of_one_prompt_read_its_slots_from_its_first_row_with_the_same_result():
    """With ``source`` / ``shared_slots`` a row reads the prompt's slots from its run's first row and every
    later slot from its own: bit for bit the result of reading its own copy, whatever the other copies hold
    (NaN there changes nothing with sharing and everything without), and the slots after the prompt still its own."""
    from grpo_patches.generation.decode_attention import decode_attention

    for rows, group, kv_heads, groups, dim, length, prompt, pos in [(8, 4, 2, 3, 16, 48, 20, 33),
                                                                    (6, 3, 1, 4, 32, 70, 16, 16),
                                                                    (4, 2, 2, 2, 16, 40, 17, 39)]:
        for block in (16, 32):
            args, source = grouped(rows, group, kv_heads, groups, dim, length, prompt, pos)
            slots = torch.tensor([prompt])
            own = decode_attention(*args, block_l=block)
            assert (own - reference(*args)).abs().max() <= 1e-4
            assert torch.equal(decode_attention(*args, block_l=block, source=source, shared_slots=slots), own)
            assert torch.equal(decode_attention(*args, block_l=block, source=source,
                                                shared_slots=torch.tensor([0])), own)
            q, keys, values, key_mask, position, scale = args
            copies = source != torch.arange(rows)
            k2, v2 = keys.clone(), values.clone()
            k2[copies, :, :prompt] = float("nan")
            v2[copies, :, :prompt] = float("nan")
            poisoned = (q, k2, v2, key_mask, position, scale)
            got = decode_attention(*poisoned, block_l=block, source=source, shared_slots=slots)
            assert torch.equal(got, own), (rows, group, prompt, block)
            assert decode_attention(*poisoned, block_l=block)[copies].isnan().all()
            # the first rows' later slots are not read for the other rows of their run
            k3, v3 = keys.clone(), values.clone()
            k3[~copies, :, prompt:] = float("nan")
            v3[~copies, :, prompt:] = float("nan")
            got = decode_attention(q, k3, v3, key_mask, position, scale, block_l=block, source=source,
                                   shared_slots=slots)
            assert torch.equal(got[copies], own[copies]) and got[~copies].isnan().all()
    with pytest.raises(ValueError, match="source and shared_slots together"):
        decode_attention(*args, source=source)


def _decoder_logits(model, kernel):
    """One fused step (eager) over random caches: logits and the caches it wrote."""
    from grpo_patches.generation.fused import FusedDecoder

    model.eval()
    with torch.no_grad(), generation.MergedLoRAWeights().applied(model):
        decoder, why = FusedDecoder.bind(model)
        assert why == "", why
        shape = decoder.shape
        g = torch.Generator().manual_seed(3)
        rows, length, pos = 3, 40, 21
        keys = [torch.randn(rows, shape.kv_heads, length, shape.head_dim, generator=g) for _ in range(2)]
        values = [torch.randn(rows, shape.kv_heads, length, shape.head_dim, generator=g) for _ in range(2)]
        key_mask = torch.arange(length)[None, :] >= torch.tensor([0, 5, 11])[:, None]
        tokens = torch.randint(4, 19, (rows, 1), generator=g)
        positions = (pos - torch.tensor([0, 5, 11]))[:, None]
        logits = decoder(keys, values, tokens, positions, torch.tensor([pos]), key_mask, kernel=kernel)
    return logits, keys, values


@interpreted
def test_fused_step_with_the_kernel_decodes_the_matmul_paths_tokens_and_logits():
    from grpo_patches.generation import decode_attention as attn

    launches, launch = [], attn._launch
    attn._launch = lambda *a: launches.append(a[9:]) or launch(*a)  # this process only (a subprocess of the suite)
    for make in (lora_policy, qwen2_lora_policy):  # Llama; Qwen2 with q/k/v biases; 4 query heads on 2 K/V heads
        model = make()
        with_kernel, keys_k, values_k = _decoder_logits(model, kernel=True)
        with_matmul, keys_m, values_m = _decoder_logits(model, kernel=False)
        assert (with_kernel - with_matmul).abs().max() <= 1e-4, make.__name__
        # the new token's K/V: layer 0's written before any attention, layer 1's after layer 0's
        assert torch.equal(keys_k[0], keys_m[0]) and torch.equal(values_k[0], values_m[0])
        assert all((a - b).abs().max() <= 1e-4 for a, b in zip(keys_k + values_k, keys_m + values_m, strict=True))
        stats = generation.GRAPH_STATS.fused
        torch._dynamo.reset()  # each model's steps within dynamo's recompile limit
        configs = {setting: (counting, graph_config(counting, check_every=4, decode_attention=setting))
                   for setting, counting in (("kernel", Counting()), ("matmul", Counting()))}
        for seed, lengths in enumerate(([5, 9, 7, 3], [11, 4, 8, 6], [5, 9, 7, 3])):
            ids, mask = batch(lengths, seed=seed)
            if seed == 2:  # two prompts, each twice (TRL's layout of a prompt's G completions)
                ids, mask = ids[[1, 1, 2, 2]], mask[[1, 1, 2, 2]]
            tokens = {}
            for setting, (_, config) in configs.items():
                tokens[setting] = fast_generate(model, ids, mask, generation_config=greedy(), config=config)
                assert stats.last_reason == "" and stats.attention == setting, (setting, stats.attention)
                if setting == "kernel":  # the kernel ran, once per layer and new token (the compiled step's op)
                    assert len(launches) >= 2 * 11, len(launches)
                    # repeated prompts: each row reads the prompt's slots from its first row (else: its own)
                    source, slots = launches[-1]
                    want = [0, 0, 2, 2] if seed == 2 else [0, 1, 2, 3]
                    assert source.tolist() == want and slots.tolist() == [ids.shape[1] if seed == 2 else 0], (
                        seed, source, slots)
                launches.clear()
            assert torch.equal(tokens["kernel"], tokens["matmul"]), (make.__name__, lengths)
            assert torch.equal(tokens["kernel"], eager_generate(model, ids, mask)), (make.__name__, lengths)
        for setting, (counting, _) in configs.items():  # compiled once, run for every new token
            assert counting.compiles == 1 and counting.runs >= 2 * 11, (setting, counting.compiles, counting.runs)
        # "auto" keeps the matmul path on CPU
        fast_generate(model, ids, mask, generation_config=greedy(), config=graph_config(Counting(), check_every=4))
        assert stats.attention == "matmul"


def test_decode_attention_setting_is_validated_and_chooses_the_kernel_only_where_it_runs(monkeypatch):
    from grpo_patches.generation import decode_attention as attn

    assert FastGenerationConfig().decode_attention == "auto"
    for good in ("auto", "kernel", "matmul"):
        assert FastGenerationConfig.coerce({"decode_attention": good}).decode_attention == good
    for bad in ("triton", "Kernel", None, True, 1):
        with pytest.raises(ValueError) as err:
            FastGenerationConfig(decode_attention=bad)
        text = str(err.value)
        assert f"decode_attention={bad!r}" in text and "'auto', 'kernel', 'matmul'" in text, text
    monkeypatch.setattr(attn, "available", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    big, small = attn.KERNEL_MIN_BATCH, attn.KERNEL_MIN_BATCH - 1
    assert attn.use_kernel("auto", "cuda", big) and not attn.use_kernel("auto", "cuda", small)
    assert attn.use_kernel("kernel", "cuda", 1) and not attn.use_kernel("matmul", "cuda", big)
    assert not attn.use_kernel("kernel", "cpu", big) and not attn.use_kernel("auto", "cpu", big)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert attn.use_kernel("kernel", "cpu", 1) and not attn.use_kernel("auto", "cpu", big)
    monkeypatch.setattr(attn, "available", lambda: False)
    assert not attn.use_kernel("kernel", "cuda", big) and not attn.use_kernel("kernel", "cpu", 1)


def test_module_imports_and_reports_unavailable_without_triton():
    """Without Triton the kit imports, ``available()`` is False and "auto" / "kernel" fall back to the matmuls."""
    script = ("import sys; sys.modules['triton'] = None\n"
              "from grpo_patches.generation import decode_attention as a\n"
              "assert not a.available() and not a.use_kernel('kernel', 'cuda', 1024)\n"
              "assert 'triton' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
              "print('ok')")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr
