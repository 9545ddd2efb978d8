"""Naive references of the fused-MoE ops (W8A8 and BF16): the oracles the kernels are tested
against.

Written to be obviously right rather than fast: plain numpy, one expert at a time, integer
matrix products done in float64 (exact: |sum| <= K * 127 * 127 < 2**53 for any K we meet).
Every function takes torch tensors or numpy arrays and answers in the same kind. torch is never
imported here: a torch tensor is recognised through ``sys.modules`` (if the caller has a tensor,
torch is already imported), so this module and its numpy form work without torch installed.
bfloat16 numpy arrays use ``ml_dtypes.bfloat16``; the reference itself does not need ml_dtypes.

The op, per token t and each of its k experts e = topk_ids[t, j]:
  1. s_t = max(max|x_t|, 1e-7) / 127, q_t = round_half_even(x_t / s_t) clamped to +-127 (fp32,
     x converted to fp32 first, a true division); each token is quantized once. A NaN or inf in
     x_t makes s_t NaN / inf and every q_t 0, so the token's output is all NaN.
  2. h = float32(q_t . w13[e]^T) * s_t * s13[e] + b13[e], in fp32, multiplied in that order.
  3. gate/up = first/second half of h (swigluoai: even/odd columns); a = act(gate, up).
  4. a is rounded to the input dtype, then quantized per row as in 1.
  5. y = float32(q_a . w2[e]^T) * s_a * s2[e] + b2[e];
     out[t] = sum_j topk_weights[t, j] * y_j (weight 1 with skip_weighted), fp32, j in order,
     stored in the input dtype.

The W4A8 ops (``ref_fused_moe_int4``, ``ref_fused_moe_mxfp4``) are the W8A8 op with 4-bit weights:
each weight is an integer value v (int4: [-8, 7]; mxfp4: 2 * E2M1, in [-12, 12]) and each group of
g consecutive k of an output row n has one fp32 scale s[n, g] (mxfp4: g = 32, s = 2^(e - 128) from
the E8M0 byte e, the 1/2 of the doubled values folded in; e = 255 is NaN). Steps 2 and 5 become
  h[n] = (sum over groups in increasing order, in fp32: acc = acc + float32(isum_g) * s[n, g]) * s_t
         + b[n],   isum_g = the exact int32 sum of q[k] * v[n, k] over the group's k
(each fp32 product and sum rounded on its own: no fused multiply-add).
The affine 4-bit op (``ref_fused_moe_int4_affine``: codes c in [0, 15], an fp32 (scale, min) pair
per group, w = scale * c + min) runs v = c - 8 with the scale as above and then adds the group
offsets o[n, g] = float32(min + 8 * scale) (one rounding):
  h[n] = (above) + (sum over groups in increasing order, in fp32 from 0:
                    corr = corr + float32(asum_g) * o[n, g]) * s_t,
  asum_g = the exact int32 sum of q[k] over the group's k.
With ``act_quant="group"`` the W4A8 ops quantize each GEMM input row per weight group (one scale
a_g per g values, as the row's scale is computed), s_t = 1, and each group's term becomes
float32(isum_g) * s[n, g] * a_g (two fp32 roundings, in that order); the affine offsets' asum_g
becomes float32(asum_g) * a_g.
The affine 8-bit op (``ref_fused_moe_int8_affine``: codes c in [0, 255], w = scale * c + min)
is the same with v = c - 128 and o[n, g] = float32(min + 128 * scale). (The kernels that keep
8-bit codes compute exactly this; a build's kernels without them, none in this tree, would run
two 4-bit planes, c = 16 hi + lo, within fp32 rounding of it.)

The BF16 op (``ref_fused_moe_bf16``) is the same with no quantization: x is rounded to bf16,
h = x_bf16 . w13[e]^T + b13[e] (products exact, summed here in float64, rounded once to fp32),
a = act(gate, up) rounded to bf16, y = a_bf16 . w2[e]^T + b2[e], and the same combine.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from .ops import ACTIVATIONS, activation_interleaved, parse_activation
from .quantize import (CHANNEL_AMAX_FLOOR, E4M3_VALUES, FLOAT_DTYPES,  # noqa: F401
                       MXFP4_INT, MXFP4_VALUES,
                       TOKEN_AMAX_FLOOR, dequantize_int4, dequantize_int4_affine,
                       dequantize_int8_affine, dequantize_mxfp4, dtype_name_of, e8m0_scale, like,
                       mxfp4_codes, quantize_int4, quantize_int4_affine, quantize_int8_affine,
                       quantize_mxfp4,
                       quantize_per_channel, quantize_per_token, quantize_rows, round_to_dtype,
                       to_numpy, torch_of)

__all__ = [
    "ACTIVATIONS",
    "quantize_per_token",
    "MXFP4_VALUES",
    "dequantize_int4",
    "dequantize_int4_affine",
    "dequantize_int8_affine",
    "dequantize_mxfp4",
    "quantize_int4",
    "quantize_int4_affine",
    "quantize_int8_affine",
    "quantize_mxfp4",
    "quantize_per_channel",
    "ref_fused_moe_bf16",
    "ref_fused_moe_experts",
    "ref_fused_moe_fp8",
    "ref_fused_moe_int4",
    "ref_fused_moe_int4_affine",
    "ref_fused_moe_int8_affine",
    "ref_fused_moe_int8",
    "ref_fused_moe_mxfp4",
    "round_to_dtype",
]

# ACTIVATIONS, parse_activation and activation_interleaved are the op's own (cpumoe.ops, the
# extension's table and parser): specs such as "silu_clamp(limit=10)" mean here what the op runs.
_GELU_TANH_C = 0.7978845608
_GELU_TANH_A = 0.044715



# ---------------------------------------------------------------------------- activations
_erf = np.frompyfunc(math.erf, 1, 1)


def _sigmoid64(v: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-v))


def gated_activation(spec: str, h: np.ndarray, inter: int) -> np.ndarray:
    """Gated activation of GEMM1 rows h [P, 2I] (fp32) -> [P, I] fp32, for an activation spec
    ("silu", "silu_clamp(limit=10)", ...: see cpumoe.parse_activation).

    Evaluated in float64 from the fp32 inputs (so the reference is at least as accurate as the
    fp32 formula it stands for), then rounded once to fp32. Clamps keep NaN (np.minimum and
    np.clip do, as torch.clamp) and use the fp32 limit the op is given.
    """
    name, _, limit, alpha = parse_activation(spec)
    if activation_interleaved(spec):
        g, u = h[:, 0::2], h[:, 1::2]
    else:
        g, u = h[:, :inter], h[:, inter:]
    g = g.astype(np.float64)
    u = u.astype(np.float64)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        if name in ("swigluoai", "silu_clamp", "silu_clamp_post"):
            u = np.clip(u, -limit, limit)
        if name == "silu":
            a = g * _sigmoid64(g) * u
        elif name == "gelu":
            a = 0.5 * g * (1.0 + _erf(g / math.sqrt(2.0)).astype(np.float64)) * u
        elif name == "gelu_tanh":
            a = 0.5 * g * (1.0 + np.tanh(_GELU_TANH_C * (g + _GELU_TANH_A * g * g * g))) * u
        elif name == "swigluoai":
            g = np.minimum(g, limit)
            a = (u + 1.0) * g * _sigmoid64(float(np.float32(alpha)) * g)
        elif name == "silu_clamp":
            g = np.minimum(g, limit)
            a = g * _sigmoid64(g) * u
        elif name == "silu_clamp_post":
            a = np.minimum(g * _sigmoid64(g), limit) * u
        else:  # a row of the extension's table without its formula here
            raise NotImplementedError(f"activation {name!r}: no reference formula")
        return a.astype(np.float32)


# ---------------------------------------------------------------------------- the op
def _int_matmul_t(q: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Exact int32 q @ w.T for int8 q [M, K], w [N, K], returned as fp32 (one rounding)."""
    acc = q.astype(np.float64) @ w.astype(np.float64).T  # integers < 2**53: exact
    return acc.astype(np.float32)


def _linear(q, s, w, ws, b):
    """(float32(q . w^T) * s) * ws + b, all fp32, in that order (NaN/inf propagate quietly)."""
    with np.errstate(invalid="ignore", over="ignore"):
        y = _int_matmul_t(q, w) * s[:, None]
        y = y * ws[None, :]
        if b is not None:
            y = y + b[None, :]
    return y


def _check_activation(activation):
    parse_activation(activation)


def _run_moe(x, w13, w2, topk_weights, topk_ids, skip_weighted, expert_ffn):
    """Routing and combine shared by both ops: ``expert_ffn(e, x_rows_f32, w13n, w2n)`` gives the
    expert's fp32 outputs for its token rows. Returns [T, H] in x's dtype and framework."""
    dtype_name = dtype_name_of(x)
    if dtype_name not in FLOAT_DTYPES:
        raise TypeError(f"x: dtype must be one of {FLOAT_DTYPES}, got {dtype_name}")
    xf = to_numpy(x, float32=True)
    w13n = to_numpy(w13, float32=True)  # int8 stays int8, bf16 widens exactly
    w2n = to_numpy(w2, float32=True)
    ids = to_numpy(topk_ids).astype(np.int64)
    if xf.ndim != 2:
        raise ValueError(f"x: expected [T, H], got shape {xf.shape}")
    T, H = xf.shape
    E, two_i, H13 = w13n.shape
    inter = two_i // 2
    if H13 != H or w2n.shape != (E, H, inter) or two_i != 2 * inter:
        raise ValueError(f"w13/w2: shapes {w13n.shape} / {w2n.shape} do not fit x of H = {H}")
    if ids.ndim != 2 or ids.shape[0] != T:
        raise ValueError(f"topk_ids: expected [T={T}, k], got shape {ids.shape}")
    k = ids.shape[1]
    if skip_weighted:
        if k != 1:
            raise ValueError(f"skip_weighted: only allowed with k == 1 (got k = {k})")
        wts = np.ones((T, k), dtype=np.float32)
    else:
        wts = to_numpy(topk_weights, float32=True)
        if wts.shape != ids.shape:
            raise ValueError(f"topk_weights: shape {wts.shape} != topk_ids shape {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= E):
        raise ValueError(f"topk_ids: expert ids must be in [0, {E})")

    # Slots p = t * k + j, each computed by its expert.
    slot_token = np.repeat(np.arange(T), k)
    slot_expert = ids.reshape(-1)
    y = np.zeros((T * k, H), dtype=np.float32)
    for e in np.unique(slot_expert):
        rows = np.nonzero(slot_expert == e)[0]
        y[rows] = expert_ffn(e, xf[slot_token[rows]], w13n, w2n)

    # Weighted combine in fp32, j in order.
    y = y.reshape(T, k, H)
    out = np.zeros((T, H), dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        for j in range(k):
            out = out + wts[:, j:j + 1] * y[:, j, :]
    return _cast_out(x, out, dtype_name)


def ref_fused_moe_int8(x, w13, w2, s13, s2, topk_weights, topk_ids, activation="silu",
                       b13=None, b2=None, skip_weighted=False):
    """The W8A8 op, naively: returns [T, H] in x's dtype and framework (torch tensor or numpy).

    x [T, H] fp32/fp16/bf16; w13 int8 [E, 2I, H]; w2 int8 [E, H, I]; s13 [E, 2I], s2 [E, H] fp32;
    b13 [E, 2I], b2 [E, H] optional (any float dtype, widened to fp32); topk_ids int [T, k];
    topk_weights fp32 [T, k] (ignored, and may be None, with skip_weighted, which needs k == 1).
    Only the experts that some token uses are computed.
    """
    _check_activation(activation)
    dtype_name = dtype_name_of(x)
    s13n = to_numpy(s13, float32=True)
    s2n = to_numpy(s2, float32=True)
    b13n = to_numpy(b13, float32=True)
    b2n = to_numpy(b2, float32=True)

    def ffn(e, x_rows, w13n, w2n):
        inter = w2n.shape[2]
        # 1. Quantize each token (per row: the same as once per token). 2. GEMM1 + epilogue.
        qx, sx = quantize_rows(x_rows, TOKEN_AMAX_FLOOR)
        h = _linear(qx, sx, w13n[e], s13n[e], None if b13n is None else b13n[e])
        # 3. Activation; 4. round to the input dtype, requantize per row.
        a = round_to_dtype(gated_activation(activation, h, inter), dtype_name)
        qa, sa = quantize_rows(a, TOKEN_AMAX_FLOOR)
        # 5. GEMM2 with its epilogue.
        return _linear(qa, sa, w2n[e], s2n[e], None if b2n is None else b2n[e])

    return _run_moe(x, w13, w2, topk_weights, topk_ids, skip_weighted, ffn)


# ---------------------------------------------------------------------------- W4A8
def _w4_linear(q, s, v, gs, g, b, offsets=None, ga=None):
    """W4A8 GEMM epilogue: fp32 sum over groups of float32(exact group sum) * gs, then * s, + b;
    with ``offsets`` (float32 [N, K / g], int4_affine) then + (fp32 sum over groups of
    float32(exact sum of q over the group) * offsets) * s. ``ga`` (float32 [M, K / g], the
    activations' group scales, or None) multiplies each group's term and group sum.
    q int8 [M, K]; v int8 values [N, K]; gs float32 [N, K / g]."""
    M, K = q.shape
    acc = np.zeros((M, v.shape[0]), dtype=np.float32)
    q64 = q.astype(np.float64)
    v64 = v.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        for gi in range(K // g):
            part = (q64[:, gi * g:(gi + 1) * g] @ v64[:, gi * g:(gi + 1) * g].T).astype(np.float32)
            term = part * gs[None, :, gi]
            acc = acc + (term if ga is None else term * ga[:, gi, None])
        y = acc * s[:, None]
        if b is not None:
            y = y + b[None, :]
        if offsets is not None:
            corr = np.zeros_like(y)
            for gi in range(K // g):
                asum = q64[:, gi * g:(gi + 1) * g].sum(axis=1).astype(np.float32)
                if ga is not None:
                    asum = asum * ga[:, gi]
                corr = corr + asum[:, None] * offsets[None, :, gi]
            y = y + corr * s[:, None]
    return y


def _quantize_w4_input(rows, g, act_quant):
    """(q, s, ga): one scale per row (ga None), or per group of g values (s = 1)."""
    if act_quant == "row":
        q, s = quantize_rows(rows, TOKEN_AMAX_FLOOR)
        return q, s, None
    M, K = rows.shape
    q, ga = quantize_rows(np.asarray(rows, np.float32).reshape(M, K // g, g), TOKEN_AMAX_FLOOR)
    return q.reshape(M, K), np.ones(M, np.float32), ga


def _check_act_quant(act_quant):
    if act_quant not in ("row", "group"):
        raise ValueError(f"act_quant: must be 'row' or 'group', got {act_quant!r}")


def ref_w4(x, v13, v2, gs13, gs2, g, topk_weights, topk_ids, activation, b13, b2,
           skip_weighted, round_gemm1: Optional[str] = None, o13=None, o2=None,
           act_quant: str = "row"):
    """The W4A8 op on int8 values (4-bit ones, or int8_affine's c - 128) and float32 group scales
    (and the affine formats' group offsets o13 / o2 when given). round_gemm1: a dtype each GEMM1
    output is rounded to before the activation (not cpumoe's op, which keeps fp32: the bench's
    model of vLLM's int4 kernel). act_quant: "row" or "group" (the module comment)."""
    _check_activation(activation)
    _check_act_quant(act_quant)
    dtype_name = dtype_name_of(x)
    b13n = to_numpy(b13, float32=True)
    b2n = to_numpy(b2, float32=True)

    def ffn(e, x_rows, w13n, w2n):
        inter = w2n.shape[2]
        qx, sx, gx = _quantize_w4_input(x_rows, g, act_quant)
        h = _w4_linear(qx, sx, w13n[e], gs13[e], g, None if b13n is None else b13n[e],
                       None if o13 is None else o13[e], gx)
        if round_gemm1 is not None:
            h = round_to_dtype(h, round_gemm1)
        a = round_to_dtype(gated_activation(activation, h, inter), dtype_name)
        qa, sa, ga = _quantize_w4_input(a, g, act_quant)
        y = _w4_linear(qa, sa, w2n[e], gs2[e], g, None if b2n is None else b2n[e],
                       None if o2 is None else o2[e], ga)
        return y

    return _run_moe(x, v13, v2, topk_weights, topk_ids, skip_weighted, ffn)


def ref_fused_moe_int4(x, w13, w2, s13, s2, topk_weights, topk_ids, activation="silu",
                       b13=None, b2=None, skip_weighted=False, group_size=32, act_quant="row"):
    """The W4A8 op on int4 weights, naively: w13 int8 [E, 2I, H] / w2 [E, H, I] holding values in
    [-8, 7], s13 [E, 2I, H / g] / s2 [E, H, I / g] group scales; act_quant as the module comment
    says; the rest as ref_fused_moe_int8."""
    v13 = to_numpy(w13)
    v2 = to_numpy(w2)
    if v13.dtype != np.int8 or v2.dtype != np.int8:
        raise TypeError("w13/w2: int4 values must be given as int8 arrays")
    if (v13.size and (v13.min() < -8 or v13.max() > 7)) or (v2.size and (v2.min() < -8 or
                                                                          v2.max() > 7)):
        raise ValueError("w13/w2: int4 values must be in [-8, 7]")
    gs13 = to_numpy(s13, float32=True)
    gs2 = to_numpy(s2, float32=True)
    return ref_w4(x, v13, v2, gs13, gs2, group_size, topk_weights, topk_ids, activation, b13,
                  b2, skip_weighted, act_quant=act_quant)


def ref_fused_moe_int4_affine(x, w13, w2, s13, s2, topk_weights, topk_ids, activation="silu",
                              b13=None, b2=None, skip_weighted=False, group_size=32,
                              act_quant="row"):
    """The W4A8 op on affine 4-bit weights, naively: w13 uint8 [E, 2I, H] / w2 [E, H, I] codes
    in [0, 15], s13 [E, 2I, H / g, 2] / s2 [E, H, I / g, 2] (scale, min) pairs (w = scale * code
    + min); the rest as ref_fused_moe_int8. See the module comment for the offsets' order."""
    c13 = to_numpy(w13)
    c2 = to_numpy(w2)
    if c13.dtype != np.uint8 or c2.dtype != np.uint8:
        raise TypeError("w13/w2: int4_affine codes must be given as uint8 arrays")
    if (c13.size and c13.max() > 15) or (c2.size and c2.max() > 15):
        raise ValueError("w13/w2: int4_affine codes must be in [0, 15]")
    p13 = to_numpy(s13, float32=True)
    p2 = to_numpy(s2, float32=True)
    with np.errstate(over="ignore", invalid="ignore"):
        o13 = (p13[..., 1] + np.float32(8) * p13[..., 0]).astype(np.float32)
        o2 = (p2[..., 1] + np.float32(8) * p2[..., 0]).astype(np.float32)
    v13 = c13.astype(np.int8) - np.int8(8)
    v2 = c2.astype(np.int8) - np.int8(8)
    return ref_w4(x, v13, v2, p13[..., 0], p2[..., 0], group_size, topk_weights, topk_ids,
                  activation, b13, b2, skip_weighted, o13=o13, o2=o2, act_quant=act_quant)


def ref_fused_moe_int8_affine(x, w13, w2, s13, s2, topk_weights, topk_ids, activation="silu",
                              b13=None, b2=None, skip_weighted=False, group_size=32,
                              act_quant="row"):
    """The W4A8 op on affine 8-bit weights (int8_affine: w13 uint8 [E, 2I, H] / w2 [E, H, I]
    codes in [0, 255], (scale, min) pairs as int4_affine; w = scale * code + min), naively: as
    int4_affine with the values code - 128 and the offsets min + 128 * scale. The rest as
    ref_fused_moe_int8."""
    c13 = to_numpy(w13)
    c2 = to_numpy(w2)
    if c13.dtype != np.uint8 or c2.dtype != np.uint8:
        raise TypeError("w13/w2: int8_affine codes must be given as uint8 arrays")
    p13 = to_numpy(s13, float32=True)
    p2 = to_numpy(s2, float32=True)
    with np.errstate(over="ignore", invalid="ignore"):
        o13 = (p13[..., 1] + np.float32(128) * p13[..., 0]).astype(np.float32)
        o2 = (p2[..., 1] + np.float32(128) * p2[..., 0]).astype(np.float32)
    v13 = (c13 ^ np.uint8(0x80)).view(np.int8)
    v2 = (c2 ^ np.uint8(0x80)).view(np.int8)
    return ref_w4(x, v13, v2, p13[..., 0], p2[..., 0], group_size, topk_weights, topk_ids,
                  activation, b13, b2, skip_weighted, o13=o13, o2=o2, act_quant=act_quant)


def ref_fused_moe_mxfp4(x, w13_blocks, w13_scales, w2_blocks, w2_scales, topk_weights, topk_ids,
                        activation="silu", b13=None, b2=None, skip_weighted=False,
                        act_quant="row"):
    """The W4A8 op on mxfp4 weights (gpt-oss's layout: blocks uint8 [E, N, K / 32, 16], E8M0
    scales uint8 [E, N, K / 32]), naively; the rest as ref_fused_moe_int8."""
    v13 = MXFP4_INT[mxfp4_codes(w13_blocks)]
    v2 = MXFP4_INT[mxfp4_codes(w2_blocks)]
    return ref_w4(x, v13, v2, e8m0_scale(w13_scales, True), e8m0_scale(w2_scales, True), 32,
                  topk_weights, topk_ids, activation, b13, b2, skip_weighted, act_quant=act_quant)


def ref_fused_moe_experts(x, experts, topk_weights, topk_ids, activation="silu",
                          skip_weighted=False, act_quant=None):
    """The op of ``experts`` (a :class:`cpumoe.quantize.QuantizedExperts`: any weight format)
    naively: the format's reference above with its weights, scales and biases; act_quant
    ("row" / "group") for the W4A8 formats, as their prepack took it."""
    q, fmt = experts, experts.weight_format
    bias = dict(b13=q.b13, b2=q.b2, skip_weighted=skip_weighted)
    w4 = bias if act_quant is None else dict(bias, act_quant=act_quant)
    if fmt == "int8":
        return ref_fused_moe_int8(x, q.w13, q.w2, q.s13, q.s2, topk_weights, topk_ids,
                                  activation, **bias)
    if fmt == "int4":
        return ref_fused_moe_int4(x, q.w13, q.w2, q.s13, q.s2, topk_weights, topk_ids,
                                  activation, group_size=q.group_size, **w4)
    if fmt == "int4_affine":
        return ref_fused_moe_int4_affine(x, q.w13, q.w2, q.s13, q.s2, topk_weights, topk_ids,
                                         activation, group_size=q.group_size, **w4)
    if fmt == "int8_affine":
        return ref_fused_moe_int8_affine(x, q.w13, q.w2, q.s13, q.s2, topk_weights, topk_ids,
                                         activation, group_size=q.group_size, **w4)
    if fmt == "mxfp4":
        return ref_fused_moe_mxfp4(x, q.w13, q.s13, q.w2, q.s2, topk_weights, topk_ids,
                                   activation, **w4)
    if fmt == "bf16":
        return ref_fused_moe_bf16(x, q.w13, q.w2, topk_weights, topk_ids, activation, **bias)
    if fmt == "fp8":
        return ref_fused_moe_fp8(x, q.w13, q.w2, q.s13, q.s2, topk_weights, topk_ids, activation,
                                 block_size=(q.group_size, q.group_size), **bias)
    raise ValueError(f"weight format {fmt!r}: no reference for it in cpumoe.reference")


def _bf16_linear(a32, w32, b):
    """float32(bf16(a) . w^T) + b: exact products, float64 sums, one rounding, then the bias."""
    with np.errstate(invalid="ignore", over="ignore"):
        a64 = round_to_dtype(a32, "bfloat16").astype(np.float64)
        y = (a64 @ w32.astype(np.float64).T).astype(np.float32)
        if b is not None:
            y = y + b[None, :]
    return y


def ref_fused_moe_bf16(x, w13, w2, topk_weights, topk_ids, activation="silu", b13=None, b2=None,
                       skip_weighted=False):
    """The BF16 op, naively: returns [T, H] in x's dtype and framework.

    x [T, H] fp32/fp16/bf16; w13 [E, 2I, H] and w2 [E, H, I] bf16 (any float dtype is taken as
    its values rounded to bf16); b13, b2 optional; topk_* and skip_weighted as in the int8 op.
    """
    _check_activation(activation)
    b13n = to_numpy(b13, float32=True)
    b2n = to_numpy(b2, float32=True)
    # bf16 weights widen exactly; other float dtypes are rounded to bf16 first.
    w13_exact = dtype_name_of(w13) == "bfloat16"
    w2_exact = dtype_name_of(w2) == "bfloat16"

    def ffn(e, x_rows, w13n, w2n):
        inter = w2n.shape[2]
        w13e = w13n[e] if w13_exact else round_to_dtype(w13n[e], "bfloat16")
        w2e = w2n[e] if w2_exact else round_to_dtype(w2n[e], "bfloat16")
        h = _bf16_linear(x_rows, w13e, None if b13n is None else b13n[e])
        a = gated_activation(activation, h, inter)
        return _bf16_linear(a, w2e, None if b2n is None else b2n[e])

    return _run_moe(x, w13, w2, topk_weights, topk_ids, skip_weighted, ffn)


# ---------------------------------------------------------------------------- FP8 (W8A16)
def _fp8_linear(a32, v, s, bn, bk, b):
    """The fp8 GEMM: per block of bk inputs, S = the exact sum of bf16(a) * e4m3 products
    (float64 here: bf16 x e4m3 products are exact, their sums at these sizes too, to within one
    rounding), rounded once to fp32; then acc = acc + S * s (fp32) over the blocks in increasing
    order; then + b. v: E4M3 values [N, K] (float32); s: block scales [ceil(N / bn), ceil(K /
    bk)]."""
    K = v.shape[1]
    a64 = round_to_dtype(a32, "bfloat16").astype(np.float64)
    v64 = v.astype(np.float64)
    srow = np.repeat(s, bn, axis=0)[:v.shape[0]]  # [N, blocks]: each row's scales
    acc = np.zeros((a32.shape[0], v.shape[0]), dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        for gi, k0 in enumerate(range(0, K, bk)):
            part = (a64[:, k0:k0 + bk] @ v64[:, k0:k0 + bk].T).astype(np.float32)
            acc = acc + part * srow[None, :, gi]
        if b is not None:
            acc = acc + b[None, :]
    return acc


def ref_fused_moe_fp8(x, w13, w2, s13, s2, topk_weights, topk_ids, activation="silu", b13=None,
                      b2=None, skip_weighted=False, block_size=(128, 128)):
    """The BF16 op on FP8 weights (W8A16), naively: x rounded to bf16, each GEMM as
    :func:`_fp8_linear` (fp32 per block of ``block_size`` = (bn, bk), times the block's scale),
    the activation in fp32 and its output rounded to bf16, the combine in fp32. w13 / w2: E4M3
    codes uint8 [E, 2I, H] / [E, H, I] (or torch float8_e4m3fn); s13 / s2: fp32 block scales
    [E, ceil(N / bn), ceil(K / bk)] (block_size None: per output channel, [E, N] or [E, N, 1]);
    the rest as ref_fused_moe_bf16."""
    _check_activation(activation)
    b13n = to_numpy(b13, float32=True)
    b2n = to_numpy(b2, float32=True)

    def values(w):
        c = to_numpy(w)
        return E4M3_VALUES[c.view(np.uint8) if c.dtype != np.uint8 else c]

    v13, v2 = values(w13), values(w2)
    (bn13, bk13), (bn2, bk2) = [(1, k) if block_size is None else block_size
                                for k in (v13.shape[2], v2.shape[2])]
    s13n = to_numpy(s13, float32=True).reshape(v13.shape[0], -(-v13.shape[1] // bn13), -1)
    s2n = to_numpy(s2, float32=True).reshape(v2.shape[0], -(-v2.shape[1] // bn2), -1)

    def ffn(e, x_rows, w13n, w2n):
        inter = w2n.shape[2]
        h = _fp8_linear(x_rows, w13n[e], s13n[e], bn13, bk13, None if b13n is None else b13n[e])
        a = gated_activation(activation, h, inter)
        return _fp8_linear(a, w2n[e], s2n[e], bn2, bk2, None if b2n is None else b2n[e])

    return _run_moe(x, v13, v2, topk_weights, topk_ids, skip_weighted, ffn)


def _cast_out(x, out32: np.ndarray, dtype_name: str):
    """fp32 result -> x's dtype and framework (round to nearest even)."""
    torch = torch_of(x)
    if torch is not None:
        return torch.from_numpy(out32).to(getattr(torch, dtype_name))
    with np.errstate(over="ignore"):
        return out32.astype(np.asarray(x).dtype)
