"""Layer-split layouts in ``--plan`` (preflight/pipeline_split.py) and the example that runs them.

The arithmetic is pinned on a hand-sized config; the run is real: examples/train_grpo_split.py with
TRL's trainer and the vendored one, 2 ranks over gloo, each driving a policy dispatched with
accelerate's hooks (``hf_device_map`` set; on CPU every part is "cpu").
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_patches.cli import main as cli_main
from grpo_patches.preflight import count_parameters
from grpo_patches.preflight.layout import RoundCost
from grpo_patches.preflight.pipeline_split import (
    PIPELINE_COEFFICIENTS,
    SplitLayout,
    estimate_split,
    layers_per_stage,
    split_round_cost,
    stage_params,
)
from grpo_patches.preflight.plan import CostModel, plan
from tests.test_plan import HEADLINE

ROOT = Path(__file__).resolve().parents[1]
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "tie_word_embeddings": False}


def test_layers_split_evenly_with_the_remainder_in_the_middle():
    assert layers_per_stage(80, 4) == [20, 20, 20, 20]
    assert layers_per_stage(30, 4) == [7, 8, 8, 7]
    assert layers_per_stage(5, 2) == [3, 2]
    with pytest.raises(ValueError, match="cannot be split"):
        layers_per_stage(3, 4)


def test_a_stage_holds_its_layers_and_the_ends_hold_embedding_and_head():
    p = count_parameters(TINY)
    first, middle, last = (stage_params(p, 1, first=i == 0, last=i == 2) for i in range(3))
    layer_linear = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128  # q, o; k, v (2 kv heads x 16); gate, up, down
    assert middle.linear_frozen == layer_linear and middle.embedding == 0 and middle.output_embedding == 0
    assert middle.frozen == layer_linear + 2 * 64  # + the layer's two norms
    assert first.frozen - middle.frozen == 100 * 64  # the embedding
    assert last.frozen - middle.frozen == 100 * 64 + 64  # the LM head and the final norm
    assert middle.trainable * 4 == p.trainable  # the adapter sits on the decoder's Linears
    four = [stage_params(p, 1, first=i == 0, last=i == 3) for i in range(4)]
    assert sum(s.frozen for s in four) == p.frozen and sum(s.trainable for s in four) == p.trainable


def test_round_cost_by_hand():
    """2 stages, one GPU's share: batch 2, 3 micro-batches, prompt 10 + completion 6 tokens, checkpointing."""
    p = count_parameters(TINY)
    n, b, steps, seq, completion, hidden = p.total, 2, 3, 16, 6, 64
    share = dict(per_device_train_batch_size=b, steps_per_generation=steps, prompt_length=10, completion_length=6,
                 gradient_checkpointing=True, act=2)
    cost = split_round_cost(SplitLayout(2), p, hidden, share)
    generation = 2 * n * b * steps * seq  # prefill + decoding of the share's 6 completions
    training = 2 * n * b * seq * (2 * steps + steps)  # forward + backward, + recompute, per micro-batch
    assert cost.idle_flops == (2 - 1) * (generation + training)
    # the pipeline carries 2 shares: 2 x 2 x 3 sequences generated, 2 x 2 per micro-batch through 3 passes each
    tokens = 2 * b * steps * seq + 2 * b * seq * 3 * steps
    assert cost.boundary_bytes == 1 * tokens * hidden * 2
    assert cost.fixed_seconds == pytest.approx(1 * (completion + 2 * steps + steps) * PIPELINE_COEFFICIENTS["hop_latency_s"])
    assert cost.recompute_flops == steps * 2 * n * b * seq and cost.gather_bytes == cost.host_bytes == 0
    assert cost.dequant_bytes == 0
    nf4 = split_round_cost(SplitLayout(2, quantization="nf4"), p, hidden, share)
    assert nf4.dequant_bytes == (2 * steps + completion) * 2 * p.linear_frozen * 2
    # seconds: FLOPs at tflops, boundary bytes at the link, plus the hops
    cm = CostModel(link_gbps=5, host_gbps=1, hbm_gbps=100, tflops=2)
    assert cm.seconds(cost) == pytest.approx((cost.idle_flops + cost.recompute_flops) / 2e12
                                             + cost.boundary_bytes / 5e9 + cost.fixed_seconds)
    assert RoundCost(idle_flops=1e12, boundary_bytes=1e9, fixed_seconds=0.5).seconds(
        link_gbps=1, host_gbps=1, hbm_gbps=1, tflops=1) == pytest.approx(2.5)


def test_stage_memory_counts_its_layers_cache_and_boundary():
    grpo = dict(per_device_train_batch_size=1, steps_per_generation=2, num_generations=2, max_completion_length=8,
                gradient_checkpointing=True)
    two = estimate_split(TINY, SplitLayout(2), grpo_config=grpo, prompt_length=8, gpu_memory_gb=2)
    one, other = two.ranks
    assert two.settings["per_device_train_batch_size"] == 2 and two.settings["layers_per_stage"] == [2, 2]
    # the KV cache of a stage's 2 layers: 2 x kv width x 16 tokens x 4 sequences (2 shares x 2) x 2 bytes, + one layer
    assert one.components["kv_cache"] == 2 * 2 * 32 * 16 * 4 * 2 + 2 * 32 * 16 * 4 * 2
    assert one.components["boundary"] == 0 and other.components["boundary"] == 2 * 16 * 64 * 2
    assert one.components["logits_logps"] == 0 < other.components["logits_logps"]  # the untied head is last
    assert other.components["weights"] - one.components["weights"] == 2 * 64  # head + final norm vs embedding
    assert one.components["reward_weights"] == 0 and two.fits


def test_explicit_layer_counts_place_the_layers_where_the_run_puts_them():
    """A GPU + CPU split (examples/train_grpo_split.py --layers 3,1): stage 0 holds 3 layers' weights,
    adapter, cache; the default stays the even split."""
    grpo = dict(per_device_train_batch_size=1, num_generations=2, max_completion_length=8)
    even = estimate_split(TINY, SplitLayout(2), grpo_config=grpo, prompt_length=8)
    assert estimate_split(TINY, SplitLayout(2), grpo_config=grpo, prompt_length=8, layers=[2, 2]).ranks == even.ranks
    gpu_heavy = estimate_split(TINY, SplitLayout(2), grpo_config=grpo, prompt_length=8, layers=[3, 1])
    cpu_heavy = estimate_split(TINY, SplitLayout(2), grpo_config=grpo, prompt_length=8, layers=(1, 3))
    assert gpu_heavy.settings["layers_per_stage"] == [3, 1] and cpu_heavy.settings["layers_per_stage"] == [1, 3]
    layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64  # Linears + two norms, bf16 below
    first, last = gpu_heavy.ranks
    assert first.components["weights"] - cpu_heavy.ranks[0].components["weights"] == 2 * layer * 2
    assert first.components["kv_cache"] == 2 * last.components["kv_cache"]  # (3 + 1) layers against (1 + 1)
    assert first.components["lora_params"] == 3 * last.components["lora_params"]
    assert first.components["logits_logps"] == 0 < last.components["logits_logps"]  # the untied head stays last
    for bad in ([4], [2, 1], [4, 0]):
        with pytest.raises(ValueError, match="positive counts summing to 4"):
            estimate_split(TINY, SplitLayout(2), grpo_config=grpo, prompt_length=8, layers=bad)


def test_headline_scenario_cheapest_fit_is_a_pipeline_at_a_quarter_of_fsdp2(capsys):
    result = plan("llama-3.1-70b", grpo_config=HEADLINE, world_size=4, gpu_memory_gb=24, prompt_length=256)
    best = result.best
    assert best.label() == "pipeline 4 nf4+dq ckpt" and best.fits and not best.tight
    assert best.seconds <= 430
    fsdp = next(e for e in result.fitting if e.layout.sharding == "fsdp2")
    assert fsdp.label() == "fsdp2 nf4+dq ckpt" and fsdp.seconds > 4 * best.seconds
    assert [round(r.required / 2**30, 1) for r in best.report.ranks] == [16.3, 14.3, 14.3, 16.5]
    # every layout named in the plan runs from files in the repository
    for e in result.entries:
        assert (ROOT / e.launch["script"]).is_file() and (ROOT / e.launch["config"]).is_file(), e.label()
    # quantized data parallelism over pipelines is refused by accelerate: listed, never recommended
    dp = [e for e in result.entries if e.label().startswith("pipeline 2 x dp 2 nf4")]
    assert dp and all(e.known_failure and e not in result.fitting for e in dp)
    args = ["doctor", "--model", "llama-3.1-70b", "--world-size", "4", "--gpu-memory-gb", "24", "--plan", "--json",
            "--prompt-length", "256"] + [f"--set={k}={v}" for k, v in HEADLINE.items()]
    assert cli_main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["best"]["label"] == "pipeline 4 nf4+dq ckpt"
    assert data["best"]["extra_seconds_per_round"] == pytest.approx(best.seconds, abs=1e-3)
    assert data["best"]["launch"] == {"script": "examples/train_grpo_split.py",
                                      "config": "examples/accelerate/pipeline.yaml",
                                      "command": "accelerate launch --config_file examples/accelerate/pipeline.yaml "
                                                 "examples/train_grpo_split.py --stages 4 --quantization nf4"}
    assert len(data["best"]["needed_gib_per_gpu"]) == 4


def test_fast_generation_on_a_split_policy_decodes_eagerly_and_says_why():
    import torch

    from grpo_patches.generation import FastGenerationConfig, compile_decision, split_devices

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert split_devices(model) == []
    model[0].hf_device_map = {"a": 0, "b": "cpu"}
    assert split_devices(model) == ["0", "cpu"]
    compiled, reason = compile_decision("cuda", FastGenerationConfig(), split=split_devices(model))
    assert not compiled and "split over 0, cpu (device_map)" in reason
    model[0].hf_device_map = {"a": "cpu", "b": "cpu"}  # dispatched, one device: not a split
    assert split_devices(model) == []


needs_examples = pytest.mark.skipif(importlib.util.find_spec("datasets") is None, reason="needs datasets")


@needs_examples
@pytest.mark.distributed
@pytest.mark.parametrize("trainer", ["trl", "vendored"])
def test_two_ranks_each_with_a_split_policy_train_with_the_kit(trainer, tmp_path):
    from tests.launch import free_port
    from tests.test_examples import cpu_copy

    config = cpu_copy("pipeline_dp", tmp_path)
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--main_process_port",
           str(free_port()), str(ROOT / "examples" / "train_grpo_split.py"), "--model", "tiny", "--stages", "2",
           "--trainer", trainer, "--max-steps", "2", "--output-dir", str(tmp_path / "o"), "--report", str(report),
           "--fast-generation", "--num-generations", "4", "--per-device-batch", "4"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert log.count("policy split over ['cpu', 'cpu']") == 2 and "(8 modules placed)" in log
    assert log.count("done, 2 steps") == 2
    data = json.loads(report.read_text())
    assert data["world_size"] == 2 and len(data["step_seconds"]) == 2
