"""Preflight's layouts against measured peaks on one GPU: nf4 base, CPU offload, ZeRO-3 (world size 1).

    python benchmarks/preflight_sharded_accuracy.py [--policy 1.5b] [--layouts bf16,nf4,...] [--out DIR]

For each layout a fresh ``accelerate launch --num_processes 1`` (its own CUDA context) runs stock-shaped
TRL GRPO with the kit applied (local placement, a rule reward) on a random-init Qwen2.5-shaped policy
(``bench_grpo.POLICIES``) saved once in bf16, with the pinned LoRA, gradient checkpointing on, and
records ``torch.cuda.max_memory_allocated()`` per phase of the second step: generation (inside
``_generate_and_score_completions``), loss / backward (the rest of ``training_step``), optimizer step
(``on_pre_optimizer_step`` -> ``on_optimizer_step``). The same settings are predicted by
:func:`grpo_patches.preflight` with the matching layout; ``results.md`` gives predicted / measured
per phase and the error (target: within +-15%).

Layouts: ``bf16`` (the control: DDP-style replica), ``nf4`` (bitsandbytes 4-bit, double
quantization), ``int8``, ``fsdp2-offload`` (FSDP2 + CPUOffloadPolicy), ``zero3`` (TRL's default
whole-model gather for generation), ``zero3-layerwise`` (``ds3_gather_for_generation=False``),
``zero3-offload`` (``offload_param_device: cpu``), ``zero3-nf4`` (4-bit base under ZeRO-3 with
layer-wise generation: what ``--plan`` names for the headline scenario, Llama-3.1-70B on 4 x 24 GB). The device image has no deepspeed / bitsandbytes:
carry their wheels (see benchmarks/results/README of the run, or the device command in
docs/defaults_preflight_monitor.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
GiB = 2**30

#: layout -> (accelerate config, preflight layout kwargs, GRPOConfig overrides, quantization config kwargs)
LAYOUTS = {
    "bf16": ("ddp", {"sharding": "ddp"}, {}, None),
    "nf4": ("ddp", {"sharding": "ddp", "quantization": "nf4"}, {},
            dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                 bnb_4bit_compute_dtype="bfloat16")),
    "int8": ("ddp", {"sharding": "ddp", "quantization": "int8"}, {}, dict(load_in_8bit=True)),
    "fsdp2-offload": ("fsdp2", {"sharding": "fsdp2", "offload_base": True}, {}, None),
    "zero3": ("zero3", {"sharding": "zero3"}, {}, None),
    "zero3-layerwise": ("zero3", {"sharding": "zero3"}, {"ds3_gather_for_generation": False}, None),
    "zero3-offload": ("zero3", {"sharding": "zero3", "offload_base": True}, {}, None),
    # the README's plan for Llama-3.1-70B on 4 x 24 GB: 4-bit base under ZeRO-3, layer-wise generation
    "zero3-nf4": ("zero3", {"sharding": "zero3", "quantization": "nf4"}, {"ds3_gather_for_generation": False},
                  dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                       bnb_4bit_compute_dtype="bfloat16", bnb_4bit_quant_storage="bfloat16")),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", default="1.5b")
    p.add_argument("--layouts", default="bf16,nf4,fsdp2-offload,zero3,zero3-layerwise,zero3-offload,zero3-nf4")
    p.add_argument("--per-device-batch", type=int, default=8)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--completion-len", type=int, default=256)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per layout launch")
    p.add_argument("--out", default=None)
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="check the plumbing on a CPU machine (configs with use_cpu, no memory figures)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a layout, in the launched process
    p.add_argument("--policy-dir", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def accelerate_config(name: str, layout: str, folder: Path, cpu: bool = False) -> Path:
    """The example config for ``name`` at 1 process (+ offload where the layout asks for it)."""
    text = (ROOT / "examples" / "accelerate" / f"{name}.yaml").read_text()
    text = text.replace("num_processes: 2", "num_processes: 1")
    if cpu:
        text = text.replace("use_cpu: false", "use_cpu: true").replace("mixed_precision: bf16", 'mixed_precision: "no"')
    if layout == "fsdp2-offload":
        text = text.replace("fsdp_offload_params: false", "fsdp_offload_params: true")
    if layout == "zero3-offload":
        text = text.replace("offload_param_device: none", "offload_param_device: cpu")
    path = folder / f"{layout}.yaml"
    path.write_text(text)
    return path


def grpo_settings(args) -> dict:
    return dict(per_device_train_batch_size=args.per_device_batch, steps_per_generation=1,
                gradient_accumulation_steps=1, num_generations=args.num_generations,
                max_completion_length=args.completion_len, gradient_checkpointing=True)


def predict(args, layout: str, prompt_len: int) -> dict:
    from bench_grpo import model_config

    from grpo_patches.preflight import preflight

    _, kwargs, overrides, _ = LAYOUTS[layout]
    report = preflight(model_config(args.policy), grpo_config={**grpo_settings(args), **overrides},
                       world_size=1, prompt_length=prompt_len, raise_on_error=False, warn=False, **kwargs)
    r = report.ranks[0]
    return {"phases": r.phases, "peak": r.peak, "peak_phase": r.peak_phase, "components": r.components}


# ----------------------------------------------------------------------------------------- worker


def worker(args) -> int:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("transformers", "trl", "accelerate", "datasets", "peft"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import torch
    from bench_grpo import build_tokenizer, rule_reward
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, TrainerCallback
    from trl import GRPOTrainer

    import grpo_patches
    from grpo_patches.defaults import grpo_config, lora_config

    layout = args.worker
    _, _, overrides, quant = LAYOUTS[layout]
    tokenizer = build_tokenizer(json.loads((Path(args.policy_dir) / "config.json").read_text())["vocab_size"])
    rows = [{"prompt": " ".join(f"t{4 + (7 * i + j) % 1000}" for j in range(32))} for i in range(64)]
    out = Path(args.out)
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    reset = torch.cuda.reset_peak_memory_stats if cuda else (lambda: None)
    peak = torch.cuda.max_memory_allocated if cuda else (lambda: 0)
    config = grpo_config(str(out / f"run-{layout}"), max_steps=2, bf16=cuda, report_to=[], save_strategy="no",
                         logging_steps=1, temperature=1.0, **grpo_settings(args), **overrides)
    init = {"dtype": torch.bfloat16 if cuda else torch.float32}
    if quant:
        q = dict(quant)
        for key in ("bnb_4bit_compute_dtype", "bnb_4bit_quant_storage"):
            if key in q:
                q[key] = torch.bfloat16
        init["quantization_config"] = BitsAndBytesConfig(**q)
    grpo_patches.apply(reward_placement="local")
    model = AutoModelForCausalLM.from_pretrained(args.policy_dir, **init)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    trainer = GRPOTrainer(model=model, reward_funcs=[rule_reward], args=config,
                          train_dataset=Dataset.from_list(rows), processing_class=tokenizer, peft_config=lora_config())
    phases: dict[str, list[int]] = {"generation": [], "training": [], "optimizer": []}
    generate = trainer._generate_and_score_completions
    step = trainer.training_step

    def measured_generate(*a, **k):
        sync()
        reset()
        result = generate(*a, **k)
        sync()
        phases["generation"].append(peak())
        reset()  # the rest of training_step: loss and backward
        return result

    def measured_step(*a, **k):
        result = step(*a, **k)
        sync()
        phases["training"].append(peak())
        return result

    class OptimizerPeak(TrainerCallback):
        def on_pre_optimizer_step(self, *a, **k):
            sync()
            reset()

        def on_optimizer_step(self, *a, **k):
            sync()
            phases["optimizer"].append(peak())

    # Where each phase starts (memory already allocated), and what DeepSpeed holds for itself: the contiguous
    # gradient buckets (ZeRO-3 allocates reduce_bucket_size elements at optimizer init) and the persistent params.
    starts: dict[str, list[int]] = {"generation": [], "training": [], "optimizer": []}
    allocated = torch.cuda.memory_allocated if cuda else (lambda: 0)

    def _start(phase):
        sync()
        starts[phase].append(allocated())

    _generate0 = measured_generate

    def measured_generate(*a, **k):  # noqa: F811
        _start("generation")
        result = _generate0(*a, **k)
        starts["training"].append(allocated())
        return result

    _pre = OptimizerPeak.on_pre_optimizer_step

    def _pre_opt(self, *a, **k):
        _start("optimizer")
        return _pre(self, *a, **k)

    OptimizerPeak.on_pre_optimizer_step = _pre_opt
    trainer._generate_and_score_completions = measured_generate
    trainer.training_step = measured_step
    trainer.add_callback(OptimizerPeak())
    t0 = time.time()
    trainer.train()
    prompt_len = len(tokenizer(rows[0]["prompt"])["input_ids"])
    ds = {}
    optimizer = getattr(getattr(trainer, "model_wrapped", None), "optimizer", None)
    buckets = getattr(optimizer, "ipg_buckets", None)
    if buckets:
        ds["bucket_bytes"] = sum(b.buffer.numel() * b.buffer.element_size() for b in buckets.values()
                                 if getattr(b, "buffer", None) is not None and torch.is_tensor(b.buffer))
    params = list(trainer.model_wrapped.parameters()) if hasattr(trainer, "model_wrapped") else []
    if params and hasattr(params[0], "ds_persist"):
        ds["persistent_numel"] = sum(p.ds_numel for p in params if p.ds_persist)
        ds["available_numel_after"] = sum(p.ds_numel for p in params if str(p.ds_status).endswith("AVAILABLE")
                                          and not str(p.ds_status).endswith("NOT_AVAILABLE"))
    record = {"layout": layout, "policy": args.policy, "measured": {k: v[-1] for k, v in phases.items() if v},
              "starts": starts, "deepspeed": ds,
              "all_steps": phases, "prompt_len": prompt_len, "train_s": time.time() - t0,
              "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "distributed_type": str(trainer.accelerator.distributed_type)}
    with open(out / f"{layout}.json", "w") as f:
        json.dump(record, f)
    return 0


# ----------------------------------------------------------------------------------------- driver


def main() -> int:
    args = parse_args()
    if args.worker:
        return worker(args)
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"{time.strftime('%Y-%m-%d')}-preflight-sharded")
    out.mkdir(parents=True, exist_ok=True)
    policy_dir = Path(tempfile.mkdtemp(prefix="policy_"))
    import torch
    from bench_grpo import model_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(model_config(args.policy), dtype=torch.bfloat16)
    model.save_pretrained(policy_dir)
    del model
    records = []
    (out / "results.jsonl").write_text("")
    for layout in args.layouts.split(","):
        cfg = accelerate_config(LAYOUTS[layout][0], layout, out, cpu=args.cpu_dry_run)
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cfg),
               str(Path(__file__).resolve()), "--worker", layout, "--policy", args.policy, "--policy-dir",
               str(policy_dir), "--out", str(out), "--per-device-batch", str(args.per_device_batch),
               "--num-generations", str(args.num_generations), "--completion-len", str(args.completion_len)]
        print(f"[preflight-sharded] {layout}: {' '.join(cmd)}", flush=True)
        try:
            done = subprocess.run(cmd, timeout=args.timeout, capture_output=True, text=True,
                                  env=dict(os.environ, PYTHONPATH=str(ROOT)))
            (out / f"{layout}.log").write_text(done.stdout + done.stderr)
            ok = done.returncode == 0 and (out / f"{layout}.json").exists()
        except subprocess.TimeoutExpired as e:
            (out / f"{layout}.log").write_text(f"timeout after {args.timeout} s\n{e.stdout or ''}{e.stderr or ''}")
            ok = False
        if not ok:
            print(f"[preflight-sharded] {layout}: FAILED (see {layout}.log)", flush=True)
            records.append({"layout": layout, "error": True})
            continue
        rec = json.loads((out / f"{layout}.json").read_text())
        try:
            rec["predicted"] = predict(args, layout, rec["prompt_len"])
        except Exception as e:  # the measurement is what the device is for; predictions are recomputed later
            print(f"[preflight-sharded] {layout}: predict failed: {e!r}", flush=True)
            rec["predicted"] = None
        records.append(rec)
        with open(out / "results.jsonl", "a") as f:  # as it goes: a killed run keeps what finished
            f.write(json.dumps(rec) + "\n")
        print(f"[preflight-sharded] {layout}: measured {rec['measured']}, predicted {rec['predicted']['phases']}",
              flush=True)
    lines = ["| layout | ran as | phase | predicted GiB | measured GiB | error |", "|---|---|---|---|---|---|"]
    for rec in records:
        if rec.get("error") or rec.get("predicted") is None:
            lines.append(f"| {rec['layout']} | | (run failed: see {rec['layout']}.log) | | | |")
            continue
        for phase, measured in rec["measured"].items():
            pred = rec["predicted"]["phases"][phase]
            if not measured:  # --cpu-dry-run
                continue
            ran = rec["distributed_type"].split(".")[-1]
            lines.append(f"| {rec['layout']} | {ran} | {phase} | {pred / GiB:.2f} | {measured / GiB:.2f} | "
                         f"{100 * (pred / measured - 1):+.1f}% |")
        peak_m = max(rec["measured"].values())
        if not peak_m:
            continue
        lines.append(f"| {rec['layout']} | | **peak** ({rec['predicted']['peak_phase']}) | "
                     f"{rec['predicted']['peak'] / GiB:.2f} | {peak_m / GiB:.2f} | "
                     f"{100 * (rec['predicted']['peak'] / peak_m - 1):+.1f}% |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(not r.get("error") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
