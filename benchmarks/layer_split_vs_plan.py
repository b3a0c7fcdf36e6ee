"""The layer-split layout measured against the planner: a policy split over a GPU and the CPU.

    python benchmarks/layer_split_vs_plan.py --out results/                       # H200: 1.5B shape, cuda:0,cpu, 24 + 4 layers
    python benchmarks/layer_split_vs_plan.py --tiny --devices cpu,cpu --layers 3,1 --steps 1 --out /tmp/x  # CPU check

A random Qwen2-1.5B-shaped policy with an untied LM head (``examples/train_grpo_split.py --untied-head``):
the embedding and the first layers on the first device, the other layers, the final norm and the head on the
second. The planner (:func:`~grpo_patches.preflight.pipeline_split.estimate_split` with the run's
``layers``) predicts each stage from the GRPOConfig the example builds; the example then runs with TRL's
trainer (and the vendored one while time is left), the kit's fast generation asked for (a split policy
decodes eagerly and says why). Written: ``layer_split.json`` (predicted components and peaks, measured peaks,
ratios, step seconds, the eager-decoding message) and one log per run.

The planner's settings are per GPU share: a process driving P devices with ``--per-device-batch`` B runs
P shares of B / P completions (pipeline_split.py's module docstring), so it is given B / P. Its stage peak
(allocator-counted bytes, no CUDA context, no fragmentation) is compared with
``torch.cuda.max_memory_allocated``; ``max_memory_reserved`` is reported beside it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpo_patches.defaults import lora_config  # noqa: E402
from grpo_patches.preflight.pipeline_split import SplitLayout, estimate_split  # noqa: E402
from grpo_patches.preflight.report import GiB  # noqa: E402

EXAMPLE = ROOT / "examples" / "train_grpo_split.py"
EAGER = re.compile(r"fast_generation: (decoding runs eagerly [^\n]*)")


def load_example():
    spec = importlib.util.spec_from_file_location("train_grpo_split", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def example_args(a: argparse.Namespace, trainer: str, report: Path) -> list[str]:
    return ["--model", "tiny" if a.tiny else "qwen2-1.5b-random", "--untied-head", "--devices", a.devices,
            "--layers", a.layers, "--trainer", trainer, "--max-steps", str(a.steps),
            "--num-generations", str(a.num_generations), "--per-device-batch", str(a.batch),
            "--max-completion-length", str(a.completion), "--fast-generation", "--output-dir", "/tmp/layer_split_output",
            "--report", str(report)] + (["--gradient-checkpointing"] if a.checkpointing else [])


def predict(a: argparse.Namespace, example) -> dict:
    """The planner's stages for the run the example makes (its GRPOConfig, LoRA, prompt length, dtype)."""
    devices = a.devices.split(",")
    layers = [int(x) for x in a.layers.split(",")]
    cuda = any(d.startswith("cuda") for d in devices)
    args = example.parse_args(example_args(a, "trl", Path("/tmp/unused.json")))
    cfg = example.trl_config(args, cuda=cuda)
    # the planner's settings are one share; the process runs len(devices) shares
    if cfg.per_device_train_batch_size % len(devices):
        raise SystemExit(f"--batch {a.batch} must split into {len(devices)} shares.")
    grpo = dict(per_device_train_batch_size=cfg.per_device_train_batch_size // len(devices),
                gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                steps_per_generation=cfg.steps_per_generation, num_generations=cfg.num_generations,
                max_completion_length=cfg.max_completion_length, gradient_checkpointing=cfg.gradient_checkpointing,
                bf16=cfg.bf16, optim=str(getattr(cfg.optim, "value", cfg.optim)))
    model = {"model_type": "qwen2", **example.RANDOM_SHAPES["tiny" if a.tiny else "qwen2-1.5b-random"],
             "tie_word_embeddings": False}
    tok = example.tokenizer_for(args, model["vocab_size"])
    prompt = max(len(tok(p)["input_ids"]) for p in example.PROMPTS)
    report = estimate_split(model, SplitLayout(len(devices)), grpo_config=grpo, lora_config=lora_config(r=4),
                            prompt_length=prompt, dtype="bfloat16" if cuda else "float32", layers=layers)
    stages = [{"device": d, "layers": n, "peak_gib": r.peak / GiB, "peak_phase": r.peak_phase,
               "with_fragmentation_gib": r.peak * (1 + r.fragmentation) / GiB,
               "components_gib": {k: v / GiB for k, v in r.components.items() if v},
               "phases_gib": {k: v / GiB for k, v in r.phases.items()}}
              for d, n, r in zip(devices, layers, report.ranks, strict=True)]
    return {"grpo_settings_per_share": grpo, "prompt_length": prompt, "model_config": model,
            "planner_settings": report.settings, "stages": stages}


def run(a: argparse.Namespace, trainer: str, timeout: float) -> dict:
    report, log = a.out / f"report_{trainer}.json", a.out / f"log_{trainer}.txt"
    cmd = [sys.executable, str(EXAMPLE), *example_args(a, trainer, report)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        text = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        text += (exc.stderr or b"").decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        rc = "timeout"
    log.write_text(" ".join(cmd) + "\n" + text)
    eager = EAGER.search(text)
    out = {"trainer": trainer, "command": " ".join(["python"] + cmd[1:]), "rc": rc,
           "wall_s": time.perf_counter() - t0, "eager_decoding": eager.group(1) if eager else None}
    if report.exists():  # rewritten after every step: a run stopped by the budget keeps its finished steps
        out.update(json.loads(report.read_text()))
    if rc != 0:
        out["tail"] = text[-3000:]
    return out


def compare(prediction: dict, measured: dict) -> list[dict]:
    rows = []
    for stage in prediction["stages"]:
        d = stage["device"]
        if not d.startswith("cuda") or d not in measured.get("peak_gib", {}):
            continue
        got, reserved = measured["peak_gib"][d], measured["peak_reserved_gib"][d]
        rows.append({"trainer": measured["trainer"], "device": d, "predicted_gib": stage["peak_gib"],
                     "measured_allocated_gib": got, "ratio": got / stage["peak_gib"],
                     "predicted_with_fragmentation_gib": stage["with_fragmentation_gib"],
                     "measured_reserved_gib": reserved,
                     "reserved_ratio": reserved / stage["with_fragmentation_gib"]})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="the example's tiny shape (a CPU check of the script)")
    p.add_argument("--devices", default="cuda:0,cpu")
    p.add_argument("--layers", default="24,4")
    p.add_argument("--batch", type=int, default=8, help="the process's per-device batch (completions per step)")
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--completion", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--trainers", default="trl,vendored")
    p.add_argument("--budget-s", type=float, default=480, help="wall seconds for all runs; a run gets what is left")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    example = load_example()
    result = {"prediction": predict(a, example), "runs": [], "comparison": []}
    path = a.out / "layer_split.json"
    for trainer in a.trainers.split(","):
        left = a.budget_s - (time.perf_counter() - start)
        if left < 60:
            result["runs"].append({"trainer": trainer, "rc": "skipped", "why": f"{left:.0f} s of the budget left"})
            continue
        measured = run(a, trainer, left)
        result["runs"].append(measured)
        result["comparison"] += compare(result["prediction"], measured)
        path.write_text(json.dumps(result, indent=1, default=str))
    path.write_text(json.dumps(result, indent=1, default=str))
    for s in result["prediction"]["stages"]:
        print(f"predicted {s['device']} ({s['layers']} layers): peak {s['peak_gib']:.3f} GiB in {s['peak_phase']}; "
              + ", ".join(f"{k} {v:.3f}" for k, v in s["components_gib"].items()))
    for r in result["runs"]:
        print(f"{r['trainer']}: rc {r['rc']}, steps {[round(t, 2) for t in r.get('step_seconds', [])]} s, "
              f"peaks {r.get('peak_gib')}, reserved {r.get('peak_reserved_gib')}; eager: {r.get('eager_decoding')}")
        if "tail" in r:
            print(r["tail"][-1500:])
    print("| trainer | device | predicted GiB | measured allocated GiB | ratio | predicted +5% GiB | reserved GiB | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for c in result["comparison"]:
        print(f"| {c['trainer']} | {c['device']} | {c['predicted_gib']:.3f} | {c['measured_allocated_gib']:.3f} | "
              f"{c['ratio']:.3f} | {c['predicted_with_fragmentation_gib']:.3f} | {c['measured_reserved_gib']:.3f} | "
              f"{c['reserved_ratio']:.3f} |")
    return 0 if all(r["rc"] == 0 for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
