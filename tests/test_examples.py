"""The examples as a user runs them: examples/train_grpo_lora.py through ``accelerate launch
--config_file`` with each shipped config that runs on CPU (DDP and FSDP2 over gloo, 2 processes),
2 steps each with the kit applied, then a resume from the checkpoint; examples/demo.py with and
without the kit.

The configs in examples/accelerate/ are written for GPUs; the CPU copy changes only ``use_cpu: true``
and ``mixed_precision: "no"`` (``accelerate launch --cpu`` would start one process). ZeRO-2/3 need
DeepSpeed: tests/test_deepspeed.py launches the example with them (``nox -s layouts``). multinode.yaml
needs two hosts: only its parsing is checked here.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("tensorboard", "math_verify")),
                       reason="needs the 'examples' extra (tensorboard, math-verify): pip install -e .[examples]"),
]


def cpu_copy(name: str, tmp_path: Path) -> Path:
    text = (ROOT / "examples" / "accelerate" / f"{name}.yaml").read_text()
    assert "use_cpu: false" in text and "mixed_precision: bf16" in text
    out = tmp_path / f"{name}-cpu.yaml"
    out.write_text(text.replace("use_cpu: false", "use_cpu: true").replace("mixed_precision: bf16",
                                                                           'mixed_precision: "no"'))
    return out


def launch(config: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--main_process_port",
           str(free_port()), str(ROOT / "examples" / "train_grpo_lora.py"), "--model", "tiny", "--output-dir",
           str(out), "--max-completion-length", "16", "--save-steps", "2", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name", ["ddp", "fsdp2"])
def test_example_runs_under_the_cpu_configs(name, tmp_path):
    out = tmp_path / "run"
    lean = ("--lean-lora",) if name == "fsdp2" else ()  # the option's hooks on layers FSDP2 shards later
    done = launch(cpu_copy(name, tmp_path), out, "--max-steps", "2", *lean)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert "no LoRA Linear layer" not in log, "lean_lora must find the policy's LoRA layers (its warning otherwise)"
    assert "world_size=2" in log  # the preflight ran, on the launched world
    assert "done, 2 steps" in log
    # the kit's defaults fit the installed TRL and DDP without a word: no field warning, no unused-parameter search
    assert "has no field for" not in log and "find_unused_parameters=True" not in log, log[-4000:]
    assert "S9" not in log and "0.00 GiB" not in log  # preflight in plain words, in units that show the tiny model
    assert (out / "checkpoint-2").is_dir() and (out / "final" / "adapter_config.json").is_file()
    assert list((out / "runs").rglob("events.out.tfevents.*"))  # report_to tensorboard
    if name == "ddp":  # resume: one more step from checkpoint-2
        again = launch(cpu_copy(name, tmp_path), out, "--max-steps", "3", "--resume")
        log = again.stdout + again.stderr
        assert again.returncode == 0, log[-4000:]
        assert f"resuming from {out / 'checkpoint-2'}" in log and "done, 3 steps" in log


def test_preflight_stops_the_example_before_loading_weights(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "train_grpo_lora.py"), "--model", "tiny",
                           "--gpu-memory-gb", "0.0001", "--output-dir", str(tmp_path / "o")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "ERROR: grpo_patches.preflight: rank 0 needs" in done.stdout
    assert not (tmp_path / "o" / "runs").exists()  # no trainer was built


@pytest.mark.parametrize("name", ["ddp", "fsdp2", "zero2", "zero3", "multinode"])
def test_every_shipped_config_is_one_accelerate_reads(name):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(ROOT / "examples" / "accelerate" / f"{name}.yaml"))
    assert config.use_cpu is False and config.mixed_precision == "bf16"  # GPU-ready as shipped
    assert config.num_processes >= 2


def test_demo_shows_stock_splitting_groups_and_the_kit_keeping_them_whole(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    logs = {}
    for run in ("--unpatched", None):
        cmd = [sys.executable, str(ROOT / "examples" / "demo.py"), "--steps", "4", "--out", str(tmp_path)]
        done = subprocess.run(cmd + ([run] if run else []), cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
        logs[run] = done.stdout + done.stderr
        assert done.returncode == 0, logs[run][-4000:]
        assert "find_unused_parameters=True" not in logs[run]
    stock, kit = logs["--unpatched"], logs[None]
    assert "4 groups of 8 generated, 4 split across ranks -> stock TRL splits groups" in stock, stock[-3000:]
    assert "the kit refuses the demo's settings" in kit and "Nearest valid settings" in kit
    assert "0 split across ranks -> OK" in kit, kit[-3000:]
    import json

    assert {json.loads((tmp_path / f"history-{r}.json").read_text())["split"] for r in ("patched", "unpatched")} \
        == {0, 4}
    assert (tmp_path / "reward_curve.png").stat().st_size > 0
