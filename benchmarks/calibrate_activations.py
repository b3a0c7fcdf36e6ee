"""Measure the bytes autograd saves per token in one decoder layer with the pinned LoRA adapter, and fit
the per-width coefficients ``grpo_patches.preflight`` uses for activations without checkpointing.

The saved tensors of a layer depend on the device: the CPU and GPU pick different attention kernels
and dropout implementations, so preflight keeps one table per device kind, each measured on it::

    python benchmarks/calibrate_activations.py --device cuda --out act_cuda.jsonl     # on the GPU machine
    python benchmarks/calibrate_activations.py --fit act_cuda.jsonl                   # prints the table

A measurement sums the unique storages that ``torch.autograd.graph.saved_tensors_hooks`` sees during
a training-mode forward (parameters excluded), for 3 layers minus 2 layers, per token. Inputs carry
a left-padded attention mask as TRL's do.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

WIDTHS = ("hidden", "intermediate", "q", "kv", "heads")
#: (hidden, intermediate, heads, kv_heads): Qwen2.5-0.5B / 1.5B / 3B / 7B-like layers and off-grid
#: shapes, so the five widths vary independently.
SHAPES = [(896, 4864, 14, 2), (1536, 8960, 12, 2), (2048, 11008, 16, 2), (3584, 18944, 28, 4),
          (1024, 2816, 16, 4), (512, 1376, 8, 8), (768, 3072, 12, 12), (1280, 3456, 20, 4), (640, 5120, 10, 2)]


def saved_bytes(module, forward) -> int:
    """Bytes of the unique storages autograd saves during ``forward()`` (its saved-tensor hook sees them),
    ``module``'s parameters excluded."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(seen.values())


def measured_layer_bytes(kind: str, hidden: int, inter: int, heads: int, kv_heads: int, dtype, autocast: bool,
                         *, dropout: float = 0.05, device: str = "cpu", batch: int = 2, seq: int = 96) -> float:
    """Bytes autograd saves per token for one decoder layer with the pinned LoRA: (3 layers - 2 layers)."""
    import peft
    import torch
    import transformers

    from grpo_patches.defaults import lora_config

    def saved(layers: int) -> int:
        torch.manual_seed(0)
        cls = transformers.Qwen2Config if kind == "qwen2" else transformers.LlamaConfig
        cfg = cls(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, vocab_size=64)
        with torch.device(device):
            base = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
        model = peft.get_peft_model(base, lora_config(lora_dropout=dropout))
        model.train()
        ids = torch.randint(0, 64, (batch, seq), device=device)
        mask = torch.ones_like(ids)
        mask[0, : seq // 8] = 0  # one left-padded row, as TRL's prompts are
        ctx = torch.autocast(torch.device(device).type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()

        def forward():
            with ctx:
                model.base_model.model.model(input_ids=ids, attention_mask=mask)

        return saved_bytes(model, forward)

    return (saved(3) - saved(2)) / (batch * seq)


def measure(device: str, out: Path, seqs: list[int], batch: int) -> None:
    import torch

    rows = []
    for dtype, autocast, act in ((torch.bfloat16, True, 2), (torch.float32, False, 4)):
        for dropout, seq in [(d, q) for d in (0.05, 0.0) for q in seqs]:
            for hidden, inter, heads, kv_heads in SHAPES:
                b = measured_layer_bytes("qwen2", hidden, inter, heads, kv_heads, dtype, autocast, dropout=dropout,
                                         device=device, batch=batch, seq=seq)
                head_dim = hidden // heads
                row = {"device": device, "act": act, "dropout": dropout > 0, "hidden": hidden, "intermediate": inter,
                       "q": heads * head_dim, "kv": kv_heads * head_dim, "heads": heads, "bytes_per_token": b,
                       "batch": batch, "seq": seq, "torch": torch.__version__}
                rows.append(row)
                print(json.dumps(row), flush=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))


def fit(path: Path) -> dict[tuple[int, bool], dict[str, float]]:
    """Least squares per (act, dropout) over the measured shapes and sequence lengths; prints the table
    and the residuals. Qwen2/Llama layers have q = heads * head_dim = hidden, so the two widths are one
    column here (both get its coefficient)."""
    import torch

    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    table = {}
    cols = [w for w in WIDTHS if w != "q"]
    for key in sorted({(r["act"], r["dropout"]) for r in rows}):
        sel = [r for r in rows if (r["act"], r["dropout"]) == key]
        a = torch.tensor([[float(r[w]) + (r["q"] if w == "hidden" else 0) for w in cols] for r in sel],
                         dtype=torch.float64)
        y = torch.tensor([r["bytes_per_token"] for r in sel], dtype=torch.float64)
        coef = torch.linalg.lstsq(a, y.unsqueeze(1)).solution.squeeze(1)
        resid = (a @ coef - y) / y
        table[key] = {w: round(float(c), 2) for w, c in zip(cols, coef, strict=True)}
        table[key]["q"] = table[key]["hidden"]
        print(f"{key}: {table[key]}  max |residual| {float(resid.abs().max()) * 100:.2f}% over {len(sel)} points "
              f"(seq {sorted({r['seq'] for r in sel})})")
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, default=Path("act_calibration.jsonl"))
    p.add_argument("--fit", type=Path, default=None, help="fit the coefficients of a measurement file")
    p.add_argument("--seq", type=int, nargs="+", default=[128, 288])
    p.add_argument("--batch", type=int, default=2)
    args = p.parse_args()
    if args.fit:
        fit(args.fit)
    else:
        measure(args.device, args.out, args.seq, args.batch)


if __name__ == "__main__":
    main()
