"""``cpumoe accuracy``: how far each weight format's layer is from the fp32 layer.

For each preset layer (H, I, activation and biases of the real model; fewer experts, which does
not change the per-expert error) float experts are drawn from a real-looking distribution: each
output row has its own scale (log-normal spread), elements are Student-t with 5 degrees of freedom
(heavier tails than a Gaussian, as trained weights have). The fp32 layer (float64 math on the float
weights, the op's activation and combine) is the reference; each format is quantized from the same
floats and run through cpumoe's op: every format of ``cpumoe.formats()`` (int8 and 4-bit with int8
activations, bf16 and fp8 with bf16 ones), at each group size (of 32, 64, 128) it allows for the
layer; the 4-bit ones also with act_quant="group" (rows "act/group": the int8 activations
quantized per weight group), int4 and mxfp4 also with act_quant="bf16" (rows "act/bf16": W4A16,
bf16 activations on the FP8 kernels). The error is ||out - ref|| / ||ref|| over all
tokens (Frobenius), bf16 inputs.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Dict

import numpy as np

from . import problem


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cpumoe accuracy",
                                description="Relative error of each weight format's layer "
                                            "(at group sizes 32 / 64 / 128) against the fp32 "
                                            "layer.")
    p.add_argument("--preset", type=problem.name_list(list(problem.PRESETS),
                                                      ["qwen3-30b-a3b", "gpt-oss-20b"], "preset"),
                   default=["qwen3-30b-a3b", "gpt-oss-20b"],
                   help=f"comma-separated from {', '.join(problem.PRESETS)} or all "
                        f"(default: qwen3-30b-a3b,gpt-oss-20b)")
    p.add_argument("--experts", type=problem.positive_int, default=8,
                   help="experts drawn per layer (default 8)")
    p.add_argument("--tokens", type=problem.positive_int, default=64, help="tokens (default 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="also write the table as JSON")
    return p


def _real_looking(rng, n: int, k: int) -> np.ndarray:
    """[n, k] float32: row scales log-normal around 1/sqrt(k), Student-t(5) elements."""
    w = rng.standard_t(5, size=(n, k)) * np.exp(rng.normal(0, 0.3, size=(n, 1)))
    return (w / math.sqrt(k) / math.sqrt(5 / 3)).astype(np.float32)


def _act(name: str, h: np.ndarray, inter: int) -> np.ndarray:
    from ..reference import gated_activation
    return gated_activation(name, h.astype(np.float32), inter).astype(np.float64)


def _fp32_layer(x, w13, w2, b13, b2, ids, tw, act):
    """The unquantized layer in float64 (x as given, no rounding between the GEMMs)."""
    T, H = x.shape
    inter = w2.shape[2]
    out = np.zeros((T, H))
    for t in range(T):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            h = w13[e].astype(np.float64) @ x[t].astype(np.float64)
            if b13 is not None:
                h = h + b13[e]
            a = _act(act, h[None, :], inter)[0]
            y = w2[e].astype(np.float64) @ a
            if b2 is not None:
                y = y + b2[e]
            out[t] += tw[t, j] * y
    return out


def measure(preset: str, E: int, T: int, seed: int) -> Dict[str, Dict[str, float]]:
    """{format: {"fp32": relative error against the fp32 layer, "own": against the fp64 layer
    on the format's own dequantized weights (what the op adds beyond the weights' rounding: the
    activations' quantization or bf16 rounding)}} for one preset."""
    import cpumoe
    from .. import quantize as Q
    H, I, _, k, act, bias = problem.PRESETS[preset]
    k = min(k, E)
    rng = np.random.default_rng([seed, H, I])
    w13 = np.stack([_real_looking(rng, 2 * I, H) for _ in range(E)])
    w2 = np.stack([_real_looking(rng, H, I) for _ in range(E)])
    b13 = (rng.standard_normal((E, 2 * I)) * 0.02).astype(np.float32) if bias else None
    b2 = (rng.standard_normal((E, H)) * 0.02).astype(np.float32) if bias else None
    x32 = rng.standard_normal((T, H)).astype(np.float32)
    x = Q.round_to_dtype(x32, "bfloat16")  # the op's bf16 input, as fp32 values
    ids, tw = problem.make_routing(rng, T, E, k)
    ref = _fp32_layer(x, w13, w2, b13, b2, ids, tw, act)
    import ml_dtypes  # noqa: F401  (bf16 numpy arrays for the op)
    xb = x.astype(ml_dtypes.bfloat16)

    def rel(out, want) -> float:
        return float(np.linalg.norm(out - want) / np.linalg.norm(want))

    res = {}
    for row in cpumoe.formats():  # every format cpumoe.quantize makes
        if row["name"] not in Q.quantized_formats():
            continue
        for g in Q.group_sizes(row["name"], H, I, preferred=(32, 64, 128)):
            q = Q.quantize_experts(row["name"], w13, w2, group_size=g, b13=b13, b2=b2)
            label = (f"{row['name']} g{g}" if row["group"] in ("multiple", "block")
                     else row["name"])
            own = _fp32_layer(x, *q.dequantized(), b13, b2, ids, tw, act)
            # The W4A8 formats also with their activations quantized per weight group, and
            # int4 / mxfp4 with bf16 ones (W4A16).
            modes = ("row", "group") if row["family"] == "q4gemm" else (None,)
            if row["name"] in ("int4", "mxfp4"):
                modes += ("bf16",)
            for mode in modes:
                out = cpumoe.fused_moe(xb, q.prepack(act_quant=mode), tw, ids,
                                       activation=act).astype(np.float64)
                name = label + (f" act/{mode}" if mode in ("group", "bf16") else "")
                res[name] = {"fp32": rel(out, ref), "own": rel(out, own)}
            if row["name"] == "fp8" and g == 128:  # requantize="int8": against the fp8 layer
                r = Q.requantize_fp8(q.w13, q.w2, q.s13, q.s2, b13, b2, block_size=(g, g))
                out8 = cpumoe.fused_moe(xb, r.prepack(), tw, ids, activation=act)
                res["fp8->int8"] = {"fp32": rel(out8.astype(np.float64), ref),
                                    "own": rel(out8.astype(np.float64), own)}
    return res


def run(args: argparse.Namespace) -> int:
    table: Dict[str, Dict[str, Dict[str, float]]] = {}
    for preset in args.preset:
        table[preset] = measure(preset, args.experts, args.tokens, args.seed)
        H, I, _, k, act, _ = problem.PRESETS[preset]
        print(f"{preset} (H={H} I={I} {act}, {args.experts} experts, T={args.tokens}): "
              f"||out - ref|| / ||ref||, ref: the fp32 layer / the layer on the format's own "
              f"dequantized weights")
        width = max(map(len, table[preset]), default=0)
        for fmt, e in table[preset].items():
            print(f"  {fmt:{width}s} {e['fp32']:.4f}   {e['own']:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)
    return 0
