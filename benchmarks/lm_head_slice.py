"""The prefill's LM head over the last position: a strided slice against a contiguous one (GPU).

transformers' ``logits_to_keep=1`` hands the head ``hidden[:, -1:, :]``, a ``[B, 1, H]`` view whose rows lie
``prompt * H`` apart; ``F.linear`` runs it as a batched matmul over an expanded weight, so every row reads the
whole head. An index tensor (``logits_to_keep=torch.tensor([prompt - 1])``, what the kit's prefill passes)
gathers a contiguous copy, and the head is one matmul. 1.5B shapes: 1024 rows, 32-token prompts, H 1536,
152k vocabulary, bf16.

    python benchmarks/lm_head_slice.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def ms(fn, reps: int = 5) -> float:
    """Milliseconds per call of ``fn`` after one warm call, the device synchronized around the timed calls."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e3


def main() -> int:
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 1
    rows, prompt, hidden, vocab = 1024, 32, 1536, 151936
    h = torch.randn(rows, prompt, hidden, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16)
    index = torch.tensor([prompt - 1], device="cuda")
    print(f"[head] {torch.cuda.get_device_name()}: {rows} rows, {prompt}-token prompts, H {hidden}, vocab {vocab}")
    print(f"[head] slice [:, -1:, :] ms {ms(lambda: F.linear(h[:, -1:, :], weight)):.3f}")
    print(f"[head] slice contiguous ms {ms(lambda: F.linear(h[:, -1:, :].contiguous(), weight)):.3f}")
    print(f"[head] index tensor [:, [{prompt - 1}], :] ms {ms(lambda: F.linear(h[:, index, :], weight)):.3f}")
    print(f"[head] all {prompt} positions ms {ms(lambda: F.linear(h, weight)):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
