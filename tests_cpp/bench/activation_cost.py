"""The cost of an activation against plain silu on the Qwen3-30B-A3B MoE layer (H 2048, I 768,
E 128, top-8, bf16 x, random int8 experts): the op timed with each activation in turn, the calls
interleaved call by call so the machine's drift hits both alike; prints the median ms per call
and the median of the per-round ratios.

Usage: python tests_cpp/bench/activation_cost.py [--tokens 1,128] [--rounds 200]
       [--activations "silu_clamp(limit=10),silu_clamp_post(limit=10),swigluoai"] [--op int8|bf16]
(with an installed cpumoe, or PYTHONPATH at a staged build).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import cpumoe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,128")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--activations", default="silu_clamp(limit=10),silu_clamp_post(limit=10)")
    ap.add_argument("--op", choices=("int8", "bf16"), default="int8")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    import ml_dtypes  # bf16 x without torch

    H, I, E, k = 2048, 768, 128, 8
    rng = np.random.default_rng(0)
    w13f = rng.standard_normal((E, 2 * I, H), np.float32) * np.float32(H ** -0.5)
    w2f = rng.standard_normal((E, H, I), np.float32) * np.float32(I ** -0.5)
    if args.op == "int8":
        w13, s13 = cpumoe.quantize_per_channel(w13f)
        w2, s2 = cpumoe.quantize_per_channel(w2f)
        packed, op = cpumoe.prepack(w13, w2, s13, s2), cpumoe.fused_moe_int8
    else:
        packed = cpumoe.prepack_bf16(w13f.astype(ml_dtypes.bfloat16),
                                     w2f.astype(ml_dtypes.bfloat16))
        op = cpumoe.fused_moe_bf16
    del w13f, w2f
    acts = ["silu"] + _split(args.activations)
    print(f"cpumoe {cpumoe.__version__}, {args.op} op, path {packed.path}, kernel "
          f"{packed.kernel}; CPU features {sorted(k for k, v in cpumoe.cpu_features().items() if v is True)}")
    for T in (int(t) for t in args.tokens.split(",")):
        x = (rng.standard_normal((T, H), np.float32) * 4).astype(ml_dtypes.bfloat16)
        ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
        wts = np.full((T, k), 1.0 / k, np.float32)
        out = np.empty((T, H), ml_dtypes.bfloat16)
        times = {a: [] for a in acts}
        for r in range(args.rounds + 5):
            for a in acts:
                t0 = time.perf_counter()
                op(x, packed, wts, ids, a, out=out, num_threads=args.threads)
                dt = time.perf_counter() - t0
                if r >= 5:  # warm-up rounds
                    times[a].append(dt)
        base = times["silu"]
        for a in acts:
            ratio = statistics.median(t / b for t, b in zip(times[a], base))
            print(f"T={T:4d} {a:28s} median {statistics.median(times[a]) * 1e3:8.3f} ms"
                  f"   vs silu {ratio:.4f}x")


def _split(s: str):
    """Specs separated by commas outside parentheses."""
    out, depth, cur = [], 0, ""
    for c in s:
        depth += c == "("
        depth -= c == ")"
        if c == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += c
    return [a.strip() for a in out + [cur] if a.strip()]


if __name__ == "__main__":
    main()
