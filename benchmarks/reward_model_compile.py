"""The reward model's forward eager against compiled (GPU): what ``compile_reward_models`` saves.

The 0.5B reward model of ``bench_grpo.py`` (Qwen2ForSequenceClassification, random weights, bf16) scores 8
chunks of 128 right-padded rows of 280..287 tokens (the kit's ``REWARD_MODEL_ROWS`` chunks of the 1.5B grid
row's 1024 completions), under ``inference_mode``. Prints the eager time of the 8 chunks, then for each way of
compiling its first call (compilation), its time and the largest score difference from eager:
``layers`` is the kit's option (:mod:`grpo_patches.compiled_reward_models`: one compiled function for every
decoder layer), ``whole`` is ``torch.compile(model, dynamic=True)`` (about two minutes of compilation).

    python benchmarks/reward_model_compile.py [--modes layers,whole]
"""

from __future__ import annotations

import argparse
import copy
import functools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lm_head_slice import ms  # noqa: E402  (CUDA-synchronized ms per call)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", default="layers", help="comma-separated: layers (the kit's option), whole")
    modes = parser.parse_args().modes.split(",")
    if set(modes) - {"layers", "whole"}:
        parser.error(f"--modes {','.join(modes)}: each one of layers, whole")
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 1
    import bench_grpo
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(1)
    with torch.device("cuda"):
        model = AutoModelForSequenceClassification.from_config(
            bench_grpo.model_config("0.5b", num_labels=1), dtype=torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    chunks = []
    for i in range(8):
        width = 280 + i
        ids = torch.randint(3, 151936, (128, width), generator=g)
        lengths = torch.randint(width - 40, width + 1, (128,), generator=g)
        lengths[0] = width
        mask = (torch.arange(width)[None] < lengths[:, None]).long()
        chunks.append((ids.masked_fill(mask == 0, 0).cuda(), mask.cuda()))

    def run(forward):
        with torch.inference_mode():
            return [forward(input_ids=ids, attention_mask=mask).logits[:, 0] for ids, mask in chunks]

    print(f"[rm] {torch.cuda.get_device_name()}: eager 8 chunks {ms(lambda: run(model), 3):.1f} ms", flush=True)
    reference = run(model)
    scale = max(b.float().abs().max().item() for b in reference)
    for mode in modes:
        if mode == "layers":
            from grpo_patches.compiled_reward_models import enable_compiled_reward_models

            compiled = copy.deepcopy(model)
            enable_compiled_reward_models([compiled])
        else:
            compiled = torch.compile(model, dynamic=True)
        start = time.perf_counter()
        run(compiled)
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        took = ms(functools.partial(run, compiled), 3)
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(run(compiled), reference, strict=True))
        print(f"[rm] compiled {mode}: first {first:.1f}s, 8 chunks {took:.1f} ms, max|diff| {diff:.3g} "
              f"(largest |score| {scale:.3g})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
