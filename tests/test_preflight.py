"""Preflight: meta-device counts, the memory model's structure, the shape rule, S4/S8/S9 advice, CLI."""

from __future__ import annotations

import json
import time
import types
import warnings

import pytest
import torch

from benchmarks.calibrate_activations import measured_layer_bytes
from grpo_patches import preflight as pf
from grpo_patches.cli import main as cli_main
from grpo_patches.defaults import lora_config
from grpo_patches.grouping import GroupShapeError
from grpo_patches.preflight import (
    PreflightError,
    PreflightWarning,
    RewardModelSpec,
    count,
    count_parameters,
    estimate,
    preflight,
)

GiB = 2**30
SMALL = dict(per_device_train_batch_size=4, gradient_accumulation_steps=1, steps_per_generation=1,
             num_generations=4, max_completion_length=128, gradient_checkpointing=True, bf16=True)


def quiet_preflight(*args, **kwargs):
    kwargs.setdefault("warn", False)
    return preflight(*args, **kwargs)


@pytest.fixture(scope="module")
def count_70b():
    start = time.perf_counter()
    counts = count_parameters("llama-3.1-70b")
    return counts, time.perf_counter() - start


# ------------------------------------------------------------------------------ meta-device counts


def test_70b_config_is_counted_on_meta_in_seconds(count_70b):
    counts, seconds = count_70b
    assert 70.5e9 < counts.total < 71e9
    assert counts.share == pytest.approx(0.002927, abs=2e-5)  # the pinned LoRA trains 0.29% of a 70B
    assert seconds < 30, f"meta-device count took {seconds:.1f} s"


@pytest.mark.parametrize(("preset", "share"), [("llama-3.1-8b", 0.0052), ("qwen2-1.5b", 0.0118)])
def test_trainable_shares_match_digest(preset, share):
    assert count_parameters(preset).share == pytest.approx(share, rel=0.02)


@pytest.mark.parametrize("lora", [None, dict(r=8, target_modules=["q_proj", "v_proj"]), dict(r=4, lora_dropout=0.0)])
def test_hand_count_equals_peft_on_the_meta_model(lora):
    lora = lora_config(**lora) if lora is not None else None
    assert count_parameters("qwen2.5-0.5b", lora) == count_parameters("qwen2.5-0.5b", lora, peft_always=True)


def test_configs_the_hand_count_cannot_do_go_through_peft():
    assert not count._is_plain_lora(lora_config(modules_to_save=["lm_head"]))
    assert not count._is_plain_lora(lora_config(target_modules="all-linear"))
    assert not count._is_plain_lora(lora_config(use_dora=True))
    assert count._is_plain_lora(lora_config())


def test_trainable_share_follows_the_lora_config():
    assert count_parameters("qwen2.5-0.5b", lora_config(r=32)).trainable == 2 * count_parameters("qwen2.5-0.5b").trainable


# ------------------------------------------------------------------------------- S4 share advice


def share_advice(model, lora=None):
    report = quiet_preflight(model, grpo_config=SMALL, lora_config=lora, reward_models=["qwen2.5-0.5b"])
    return [w for w in report.warnings if "trainable share" in w]


@pytest.mark.parametrize("model", ["qwen2.5-0.5b", "qwen2-1.5b", "llama-3.1-8b"])
def test_pinned_lora_is_not_flagged_on_small_models(model):
    assert share_advice(model) == []  # 1.75% / 1.2% / 0.52%: outside 0.1-0.5% but right for the size


def test_share_band_is_the_pinned_band_at_70b(count_70b):
    assert share_advice("llama-3.1-70b") == []
    assert share_advice("llama-3.1-70b", lora_config(r=8)) == []  # 0.15%: inside 0.1-0.5%
    assert share_advice("llama-3.1-70b", lora_config(r=32))  # 0.58%: "not 32"


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
def test_unfrozen_weights_are_flagged():
    advice = share_advice("qwen2.5-0.5b", lora_config(modules_to_save=["lm_head"]))
    assert advice and "more weights than the adapter" in advice[0]


def test_share_warning_is_a_preflight_warning():
    with pytest.warns(PreflightWarning, match="trainable share"):
        preflight("qwen2.5-0.5b", grpo_config=SMALL, lora_config=lora_config(r=128), reward_models=["qwen2.5-0.5b"])


# ------------------------------------------------------------------------------ shape rule (S10)


def test_groups_split_across_ranks_are_rejected_with_the_fix():
    shape = dict(SMALL, per_device_train_batch_size=2, num_generations=4)
    with pytest.raises(GroupShapeError, match="Nearest valid settings") as e:
        quiet_preflight("qwen2.5-0.5b", grpo_config=shape, world_size=2)
    assert isinstance(e.value, ValueError)
    report = quiet_preflight("qwen2.5-0.5b", grpo_config=shape, world_size=2, raise_on_error=False)
    assert not report.ok and "per_device_train_batch_size=4" in report.errors[0]


def test_steps_per_generation_counts_toward_the_rank_local_rule():
    shape = dict(SMALL, per_device_train_batch_size=2, steps_per_generation=2, num_generations=4)
    assert quiet_preflight("qwen2.5-0.5b", grpo_config=shape, world_size=4).ok


class _Zero3Config:
    """What transformers reads from a live ``HfDeepSpeedConfig`` (needs no deepspeed install)."""

    config = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}

    def is_zero3(self) -> bool:
        return True


def test_counts_under_a_live_zero3_deepspeed_config(monkeypatch):
    """``accelerate launch`` with a ZeRO-3 config makes an ``HfDeepSpeedConfig`` before the script runs;
    transformers' ``from_config`` then enters ``deepspeed.zero.Init``, which cannot work on the meta device."""
    import transformers
    from transformers.integrations import deepspeed as hf_deepspeed

    expected = count_parameters("qwen2.5-0.5b")  # counted with no DeepSpeed config alive
    rm_expected = count.count_reward_model(pf.load_model_config("qwen2.5-0.5b"))
    monkeypatch.setattr(count, "_COUNT_CACHE", {})  # count afresh below, not from the caches
    count._count_rm_cached.cache_clear()
    monkeypatch.setattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", None)
    try:
        live = transformers.integrations.HfDeepSpeedConfig(dict(_Zero3Config.config))  # sets the weak reference
    except Exception:  # deepspeed not installed: the same weak reference, to a stand-in
        live = _Zero3Config()
        hf_deepspeed.set_hf_deepspeed_config(live)
    assert hf_deepspeed.is_deepspeed_zero3_enabled()
    cfg = pf.load_model_config("qwen2.5-0.5b")
    # upstream: ZeRO-3's init context on meta tensors ("Cannot copy out of meta tensor"; without deepspeed
    # installed, the import of deepspeed it needs)
    with pytest.raises((NotImplementedError, ImportError)), torch.device("meta"):
        transformers.AutoModelForCausalLM.from_config(cfg)
    report = quiet_preflight("qwen2.5-0.5b", sharding="zero3", reward_models=["qwen2.5-0.5b"], reward_placement="main")
    assert report.params == expected
    assert report.ranks[0].components["reward_weights"] == rm_expected * 2
    assert hf_deepspeed.is_deepspeed_zero3_enabled()  # the live config is left as it was
    count._count_rm_cached.cache_clear()
    del live


# ----------------------------------------------------------------------------------- memory model


def test_components_follow_the_documented_formulas():
    report = quiet_preflight("qwen2.5-0.5b", grpo_config=SMALL, prompt_length=64)
    rank = report.ranks[0]
    c, counts, arch = rank.components, report.params, count.architecture(pf.load_model_config("qwen2.5-0.5b"))
    assert c["weights"] == counts.frozen * 2
    assert c["lora_params"] == 4 * counts.trainable and c["optimizer_state"] == 8 * counts.trainable
    seqs, length = 4 * 1, 64 + 128
    assert c["kv_cache"] == 2 * arch.kv * length * seqs * 2 * (arch.layers + 1)
    assert c["autocast_cache"] == 0
    assert rank.phases["training"] == (c["weights"] + c["lora_params"] + c["optimizer_state"] + c["lora_grads"]
                                       + c["activations"] + c["logits_logps"])
    assert rank.peak == max(rank.phases.values())


def test_fast_generation_counts_its_static_cache_and_merged_buffer_while_sampling():
    # Measured on an H200 (1.5B policy, 144 x 256 tokens under a 24 GiB cap, caches kept): the fast path
    # peaked ~1.3 GiB above what the dynamic-cache model predicts: its static cache stayed allocated.
    # Today's default frees the cache and the merged buffer after each round (release_after_sampling).
    eager = quiet_preflight("qwen2.5-0.5b", grpo_config=SMALL, prompt_length=70).ranks[0]
    fast = quiet_preflight("qwen2.5-0.5b", grpo_config=SMALL, prompt_length=70, fast_generation=True).ranks[0]
    kept = quiet_preflight("qwen2.5-0.5b", grpo_config=SMALL, prompt_length=70,
                           fast_generation={"release_after_sampling": False}).ranks[0]
    unmerged = quiet_preflight("qwen2.5-0.5b", grpo_config=SMALL, prompt_length=70,
                               fast_generation={"merge_lora": False}).ranks[0]
    arch = count.architecture(pf.load_model_config("qwen2.5-0.5b"))
    static = 2 * arch.kv * (128 + 128) * 4 * 2 * arch.layers  # prompt 70 rounded up to 128, + 128 new tokens
    params = pf.count_parameters(pf.load_model_config("qwen2.5-0.5b"))
    merged = params.adapted * 2  # bf16: the seven projections of every layer once more
    graphed = quiet_preflight("qwen2.5-0.5b", grpo_config=SMALL, prompt_length=70,
                              fast_generation={"keep_graph": True}).ranks[0]
    graph = 4 * (arch.vocab + 2 * arch.intermediate) * 2  # the fused loop's graph: one step's logits and MLP
    assert fast.components["kv_cache"] == static and fast.components["merged_buffer"] == merged > 0
    assert graphed.components["decode_graph"] == graph and fast.components["decode_graph"] == 0
    assert eager.components["decode_graph"] == 0
    # transformers' warpers (the pinned temperature 0.7 and top-p 0.9: a sort of every row) against the kit's
    # compiled sampler: 2 + 4 + 4 + 24 against 12 bytes per logit of the generation batch
    rows = SMALL["per_device_train_batch_size"] * SMALL.get("steps_per_generation", 1)
    sampler_saved = eager.components["generation_transient"] - fast.components["generation_transient"]
    assert sampler_saved == rows * arch.vocab * 22
    gen_eager = eager.phases["generation"] - eager.components["kv_cache"] - sampler_saved
    assert fast.phases["generation"] == gen_eager + static + merged
    assert unmerged.phases["generation"] == gen_eager + static and unmerged.components["merged_buffer"] == 0
    assert fast.phases["training"] == eager.phases["training"], "released before training, the graph too"
    assert graphed.phases["training"] == eager.phases["training"] + graph, "the kept graph stays through training"
    assert kept.phases["training"] == eager.phases["training"] + static + merged + graph, "kept: the graph too"
    assert kept.phases["scoring"] == eager.phases["scoring"] + static + merged + graph


def test_merged_buffer_bytes_equal_the_buffer_measured_on_the_h200():
    # MergedLoRAWeights.nbytes for the Qwen2.5-1.5B-shaped policy with the pinned LoRA, bf16
    # (benchmarks/results/2026-12-01-h200-fused-decode/decode-1.5b.json, merged_buffer_bytes)
    params = pf.count_parameters(pf.load_model_config("qwen2-1.5b"))
    assert params.adapted * 2 == 2620391424
    # a LoRA on q/v only merges those two
    from peft import LoraConfig

    qv = pf.count_parameters(pf.load_model_config("qwen2-1.5b"), LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
    assert qv.adapted == 28 * (1536 * 1536 + 256 * 1536)


def test_lean_lora_drops_the_fp32_input_copy_where_stock_peft_makes_one():
    from peft import LoraConfig

    arch = count.architecture(pf.load_model_config("qwen2.5-0.5b"))
    tokens = 4 * (64 + 128)
    stock = quiet_preflight("qwen2.5-0.5b", grpo_config=SMALL, prompt_length=64).ranks[0]
    lean = quiet_preflight("qwen2.5-0.5b", grpo_config=SMALL, prompt_length=64, lean_lora=True).ranks[0]
    # the pinned LoRA adapts down_proj (dropout 0.05): its input's fp32 copy and fp32 dropout output
    assert stock.components["activations"] - lean.components["activations"] == tokens * arch.intermediate * 8
    assert {k: v for k, v in lean.components.items() if k != "activations"} == \
        {k: v for k, v in stock.components.items() if k != "activations"}
    no_dropout = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    a, b = (quiet_preflight("qwen2.5-0.5b", grpo_config=SMALL, prompt_length=64, lora_config=no_dropout,
                            lean_lora=flag).ranks[0].components["activations"] for flag in (False, True))
    assert a - b == tokens * arch.hidden * 4, "no dropout: the copy alone, of the widest adapted input"
    # 16-bit adapters (a 4-bit base: TRL casts its adapter to bf16) and fp32 autocast: stock makes no copy
    for kw in (dict(quantization="nf4"), dict(grpo_config={**SMALL, "bf16": False})):
        a, b = (quiet_preflight("qwen2.5-0.5b", prompt_length=64, lean_lora=flag, **{"grpo_config": SMALL, **kw})
                .ranks[0].components["activations"] for flag in (False, True))
        assert a == b, kw


def test_lean_lora_is_offered_as_a_fix_and_predicts_the_h200_peaks():
    # H200, 1.5B policy, LoRA dropout 0.05, 24 GiB cap, fast generation, 8 x 256 tokens, ~80-token prompts
    # (benchmarks/results/2026-12-01-h200-lean-lora/): stock's largest batch 192 (208 out of memory);
    # with lean_lora peak allocated 17.29 / 19.46 GiB at 192 / 224 (the stock kit's: 20.98 at 192)
    config = dict(SMALL, max_completion_length=256)
    def run(batch, lean):
        return quiet_preflight("qwen2-1.5b", grpo_config=dict(config, per_device_train_batch_size=batch),
                               prompt_length=80, gpu_memory_gb=24, fast_generation=True, lean_lora=lean,
                               reward_models=["qwen2.5-0.5b"], raise_on_error=False)
    assert run(192, False).ok and not run(208, False).ok
    assert "apply(lean_lora=True)" in run(208, False).errors[0] and "(fits)" in run(208, False).errors[0]
    for batch, measured in ((192, 17.29), (224, 19.46)):
        predicted = run(batch, True).peak / GiB
        assert measured <= predicted <= measured * 1.05, (batch, predicted)
    assert run(192, False).peak / GiB == pytest.approx(20.98, rel=0.05)


def test_checkpointing_fp32_weights_and_logits_mode_change_the_right_rows():
    on = quiet_preflight("qwen2.5-0.5b", grpo_config=SMALL)
    off = quiet_preflight("qwen2.5-0.5b", grpo_config=dict(SMALL, gradient_checkpointing=False))
    assert off.ranks[0].components["activations"] > 5 * on.ranks[0].components["activations"]
    assert on.activations_full == off.ranks[0].components["activations"]
    fp32 = quiet_preflight("qwen2.5-0.5b", grpo_config=SMALL, dtype="float32")
    assert fp32.ranks[0].components["weights"] == 2 * on.ranks[0].components["weights"]
    assert fp32.ranks[0].components["autocast_cache"] > 0
    full = quiet_preflight("qwen2.5-0.5b", grpo_config=SMALL, logits_mode="full")
    fused = quiet_preflight("qwen2.5-0.5b", grpo_config=SMALL, logits_mode="fused")
    assert full.ranks[0].components["logits_logps"] > 10 * fused.ranks[0].components["logits_logps"]


def test_reward_model_placement():
    rm = RewardModelSpec("qwen2.5-0.5b", dtype="bfloat16")
    local = quiet_preflight("qwen2-1.5b", grpo_config=SMALL, world_size=4, reward_models=[rm])
    main = quiet_preflight("qwen2-1.5b", grpo_config=SMALL, world_size=4, reward_models=[rm],
                           reward_placement="main")
    rm_bytes = count.count_reward_model(pf.load_model_config("qwen2.5-0.5b")) * 2
    assert [r.components["reward_weights"] for r in local.ranks] == [rm_bytes] * 4
    assert [r.components["reward_weights"] for r in main.ranks] == [rm_bytes, 0, 0, 0]
    assert main.ranks[1].peak < local.ranks[1].peak
    assert main.ranks[0].components["reward_scoring"] > local.ranks[0].components["reward_scoring"]
    assert "ranks 1-3" in main.table() and "rank 0" in main.table()


def test_fits_flag_and_error_with_options():
    big = dict(SMALL, max_completion_length=512, gradient_checkpointing=False)
    report = quiet_preflight("llama-3.1-8b", grpo_config=big, gpu_memory_gb=24, raise_on_error=False)
    assert report.fits is False and not report.ranks[0].fits
    assert "gradient_checkpointing=True" in report.errors[0] and "(fits)" in report.errors[0]
    with pytest.raises(PreflightError, match="Options:"):
        quiet_preflight("llama-3.1-8b", grpo_config=big, gpu_memory_gb=24)
    roomy = quiet_preflight("llama-3.1-8b", grpo_config=big, gpu_memory_gb=1000)
    assert roomy.fits is True and roomy.ranks[0].headroom > 0
    assert quiet_preflight("llama-3.1-8b", grpo_config=big).fits is None  # no memory given


def test_grpo_settings_from_dict_namespace_and_trl_config_agree(tmp_path):
    from grpo_patches.defaults import grpo_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trl_cfg = grpo_config(str(tmp_path / "o"), per_device_train_batch_size=4, steps_per_generation=1,
                              num_generations=4, max_completion_length=128, bf16=True, use_cpu=True)
    plain = dict(SMALL)
    a = quiet_preflight("qwen2.5-0.5b", grpo_config=plain, prompt_length=256)
    b = quiet_preflight("qwen2.5-0.5b", grpo_config=types.SimpleNamespace(**plain), prompt_length=256)
    c = quiet_preflight("qwen2.5-0.5b", grpo_config=trl_cfg, prompt_length=256)
    assert a.ranks[0].components == b.ranks[0].components == c.ranks[0].components


def test_model_config_from_object_path_and_preset(tmp_path):
    cfg = pf.load_model_config("qwen2.5-0.5b")
    cfg.save_pretrained(tmp_path)
    by_preset = quiet_preflight("qwen2.5-0.5b", grpo_config=SMALL)
    by_path = quiet_preflight(tmp_path / "config.json", grpo_config=SMALL)
    by_dir = quiet_preflight(str(tmp_path), grpo_config=SMALL)
    by_object = quiet_preflight(cfg, grpo_config=SMALL)
    assert by_preset.peak == by_path.peak == by_dir.peak == by_object.peak
    with pytest.raises(FileNotFoundError):
        quiet_preflight(tmp_path / "missing.json")


# --------------------------------------------------------------------------------------- S8 / S9


def advice_of(report, needle):
    return [w for w in report.warnings if needle in w]


def test_s9_advice(count_70b):
    r = quiet_preflight("llama-3.1-70b", grpo_config=SMALL, world_size=4, gpu_memory_gb=8, raise_on_error=False,
                        dataset_size=500)
    assert advice_of(r, "under 40") and advice_of(r, "under 1000") and advice_of(r, "no reward model")
    r = quiet_preflight("llama-3.1-70b", grpo_config=SMALL, world_size=4, gpu_memory_gb=80, dataset_size=5000,
                        reward_models=[RewardModelSpec("llama-3.1-8b")], raise_on_error=False)
    assert not (advice_of(r, "under 40") or advice_of(r, "under 1000") or advice_of(r, "reward model"))


def test_a_loaded_reward_model_counts_as_a_model():
    from tests.helpers import tiny_reward_model

    rm = tiny_reward_model()
    r = quiet_preflight("qwen2.5-0.5b", grpo_config=SMALL, reward_models=[rm])
    assert r.ranks[0].components["reward_weights"] == sum(p.numel() for p in rm.parameters()) * 4  # fp32


def test_rule_based_rewards_pass_and_a_foreign_family_is_named():
    r = quiet_preflight("qwen2.5-0.5b", grpo_config=SMALL, reward_models=[lambda completions, **kw: [0.0]])
    assert not advice_of(r, "reward")  # rule-based rewards need no memory and no advice
    r = quiet_preflight("qwen2.5-0.5b", grpo_config=SMALL, reward_models=["llama-3.1-8b"])
    assert advice_of(r, "same family")


def test_small_headroom_is_advice_not_error():
    probe = quiet_preflight("qwen2.5-0.5b", grpo_config=SMALL, reward_models=["qwen2.5-0.5b"])
    needed = probe.ranks[0].peak * 1.05 + GiB
    r = quiet_preflight("qwen2.5-0.5b", grpo_config=SMALL, reward_models=["qwen2.5-0.5b"],
                        gpu_memory_gb=(needed + GiB) / GiB)
    assert r.ok and r.fits and advice_of(r, "under 2 GiB free")


# ------------------------------------------------------- the activation coefficients, re-measured


@pytest.mark.parametrize(("kind", "shape", "dtype", "autocast", "act"), [
    ("llama", (192, 512, 6, 2), torch.float32, False, 4),
    ("qwen2", (256, 704, 4, 2), torch.float32, False, 4),
    ("llama", (192, 512, 6, 2), torch.bfloat16, True, 2),
])
def test_activation_coefficients_match_a_cpu_measurement(kind, shape, dtype, autocast, act):
    hidden, inter, heads, kv_heads = shape
    arch = count.Arch(layers=1, hidden=hidden, intermediate=inter, heads=heads, kv_heads=kv_heads,
                    head_dim=hidden // heads, vocab=64, model_type=kind, moe=False)
    predicted = estimate.layer_bytes_per_token(arch, act, dropout=True, device="cpu")
    measured = measured_layer_bytes(kind, hidden, inter, heads, kv_heads, dtype, autocast)
    assert predicted == pytest.approx(measured, rel=0.10)


# ------------------------------------------------------------------------------------------- CLI


def test_cli_doctor_prints_table_and_exit_status(capsys, tmp_path):
    assert cli_main(["doctor", "--model", "qwen2.5-0.5b", "--gpu-memory-gb", "80", "--set", "num_generations=4",
                     "--reward-model", "qwen2.5-0.5b", "--dataset-size", "5000"]) == 0
    out = capsys.readouterr().out
    for row in ("weights", "lora_grads", "activations", "kv_cache", "reward_weights", "peak", "fits"):
        assert row in out
    assert "rank 0" in out and "yes" in out

    settings = tmp_path / "grpo.json"
    settings.write_text(json.dumps(dict(SMALL, per_device_train_batch_size=16, num_generations=16,
                                        max_completion_length=2048, gradient_checkpointing=False)))
    assert cli_main(["doctor", "--model", "llama-3.1-8b", "--grpo-config", str(settings),
                     "--gpu-memory-gb", "24"]) == 1
    assert "NO" in capsys.readouterr().out

    assert cli_main(["doctor", "--model", "qwen2.5-0.5b", "--world-size", "2",
                     "--set", "per_device_train_batch_size=2", "--set", "steps_per_generation=1"]) == 1
    assert "Nearest valid settings" in capsys.readouterr().out

    assert cli_main(["doctor", "--model", str(tmp_path / "nope.json")]) == 2
    assert cli_main(["doctor"]) == 2  # no --model: the command's help and what to give


def test_cli_lora_override_reaches_the_count(capsys):
    assert cli_main(["doctor", "--model", "qwen2.5-0.5b", "--lora", "r=32"]) == 0
    out = capsys.readouterr().out
    trainable = count_parameters("qwen2.5-0.5b", lora_config(r=32)).trainable
    assert f"trainable {trainable / 1e6:.2f}M" in out


def test_a_tiny_models_table_reads_in_small_units_without_rows_of_zeros():
    from tests.helpers import tiny_config

    r = quiet_preflight(tiny_config(), grpo_config=SMALL, reward_models=[lambda completions, **kw: [0.0]])
    lines = r.table().splitlines()
    assert lines[0].split()[0] in ("MiB", "KiB"), lines[0]
    for line in lines[1:]:
        cells = [c for c in line.split()[1:] if c.replace(".", "").isdigit()]
        assert any(float(c) > 0 for c in cells), f"a row of zeros: {line!r}"
    assert "reward_weights" not in r.table()  # no reward model: no row for one
    assert not r.warnings, r.warnings  # a rule-based reward and no dataset size: nothing to advise
    big = quiet_preflight("qwen2.5-0.5b", grpo_config=SMALL).table()
    assert big.splitlines()[0].split()[0] == "GiB"
