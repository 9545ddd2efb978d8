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

The BF16 op (``ref_fused_moe_bf16``) is the same with no quantization: x is rounded to bf16,
h = x_bf16 . w13[e]^T + b13[e] (products exact, summed here in float64, rounded once to fp32),
a = act(gate, up) rounded to bf16, y = a_bf16 . w2[e]^T + b2[e], and the same combine.
"""

from __future__ import annotations

import math
import sys
from typing import Optional

import numpy as np

from . import _C

__all__ = [
    "ACTIVATIONS",
    "quantize_per_token",
    "MXFP4_VALUES",
    "dequantize_int4",
    "dequantize_mxfp4",
    "quantize_int4",
    "quantize_mxfp4",
    "quantize_per_channel",
    "ref_fused_moe_bf16",
    "ref_fused_moe_int4",
    "ref_fused_moe_int8",
    "ref_fused_moe_mxfp4",
    "round_to_dtype",
]

#: The activations of the op, by name (the extension's table; specs with parameters such as
#: "silu_clamp(limit=10)" are parsed by it too, so the reference runs what the op runs).
ACTIVATIONS = tuple(a["name"] for a in _C.activations())
#: Those whose gate and up are interleaved (even / odd columns of a GEMM1 row).
_INTERLEAVED = frozenset(a["name"] for a in _C.activations() if a["interleaved"])

#: Floor of a token's |max| before dividing by 127 (the op's; an all-zero row gets zeros).
TOKEN_AMAX_FLOOR = 1e-7
#: Floor of a weight row's |max| when making int8 checkpoints.
CHANNEL_AMAX_FLOOR = 1e-12

_GELU_TANH_C = 0.7978845608
_GELU_TANH_A = 0.044715

_FLOAT_DTYPES = ("float32", "float16", "bfloat16")


# ---------------------------------------------------------------------------- torch <-> numpy
def _torch_module(obj):
    """The torch module when ``obj`` is a torch tensor, else None (never imports torch)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return torch
    return None


def _dtype_name(a) -> str:
    """'float32', 'bfloat16', 'int8', ... for a torch tensor or a numpy array."""
    if _torch_module(a) is not None:
        return str(a.dtype).replace("torch.", "")
    return np.asarray(a).dtype.name


def _to_numpy(a, *, float32=False):
    """A numpy view/copy of a torch tensor or array-like. ``float32`` widens floats to fp32
    (exact for fp16 and bf16); integer arrays are left as they are."""
    if a is None:
        return None
    torch = _torch_module(a)
    if torch is not None:
        a = a.detach().cpu()
        if a.dtype == torch.bfloat16 or (float32 and a.is_floating_point()):
            a = a.to(torch.float32)
        a = a.numpy()
    else:
        a = np.asarray(a)
    if float32 and a.dtype.kind not in "iub":
        a = a.astype(np.float32)
    return a


def _like(template, arr):
    """Return numpy ``arr`` in the framework of ``template`` (torch tensor or numpy array)."""
    torch = _torch_module(template)
    if torch is None:
        return arr
    return torch.from_numpy(np.ascontiguousarray(arr))


def round_to_dtype(a32: np.ndarray, dtype_name: str) -> np.ndarray:
    """Round fp32 values to ``dtype_name``'s precision (round to nearest even), returned as fp32.

    bfloat16 is done on the bits so that no ml_dtypes is needed: add 0x7fff plus the lowest kept
    bit, drop the low 16 bits; NaN stays NaN. Overflow to inf happens naturally, as in a cast.
    """
    a32 = np.asarray(a32, dtype=np.float32)
    if dtype_name == "float32":
        return a32
    if dtype_name == "float16":
        with np.errstate(over="ignore"):
            return a32.astype(np.float16).astype(np.float32)
    if dtype_name == "bfloat16":
        u = a32.view(np.uint32).astype(np.uint64)
        r = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        out = r.astype(np.uint32).view(np.float32)
        return np.where(np.isnan(a32), a32, out)
    raise ValueError(f"dtype: must be one of {_FLOAT_DTYPES}, got {dtype_name}")


# ---------------------------------------------------------------------------- quantization
def _quantize_rows_np(x32: np.ndarray, amax_floor: float):
    """Symmetric int8 quantization along the last axis of an fp32 array."""
    x32 = np.asarray(x32, dtype=np.float32)
    if x32.shape[-1] == 0:
        amax = np.zeros(x32.shape[:-1], dtype=np.float32)
    else:
        amax = np.max(np.abs(x32), axis=-1)  # a NaN wins (NaN scale): non-finite propagates
    s = np.maximum(amax, np.float32(amax_floor)) / np.float32(127)  # fp32 / fp32: fp32
    s = s.astype(np.float32)
    with np.errstate(invalid="ignore"):
        v = x32 / s[..., None]  # true division
        np.rint(v, out=v)  # round half to even
        np.clip(v, -127, 127, out=v)
    nan = np.isnan(v)
    if nan.any():
        v[nan] = 0  # and NaN quantizes to 0
    return v.astype(np.int8), s


def quantize_per_token(x, amax_floor: float = TOKEN_AMAX_FLOOR):
    """Dynamic per-token (per-row) int8 quantization, as the op does it.

    ``x`` [T, H] (fp32, fp16 or bf16; torch or numpy) -> (q int8 [T, H], s float32 [T]) with
    ``s = max(max|x_t|, amax_floor) / 127`` and ``q = round_half_even(x_t / s)`` clamped to +-127.
    """
    q, s = _quantize_rows_np(_to_numpy(x, float32=True), amax_floor)
    return _like(x, q), _like(x, s)


def quantize_per_channel(w, amax_floor: float = CHANNEL_AMAX_FLOOR):
    """Per-output-channel symmetric int8 quantization of weights, the way int8 checkpoints are made.

    ``w`` [..., N, K] float -> (q int8 [..., N, K], s float32 [..., N]): the absolute maximum is
    over the last (input) axis, divided by 127; round half to even, clamp to +-127.
    """
    w32 = _to_numpy(w, float32=True)
    if w32.ndim < 2:
        raise ValueError(f"w: expected at least 2 dimensions [..., N, K], got shape {w32.shape}")
    q, s = _quantize_rows_np(w32, amax_floor)
    return _like(w, q), _like(w, s)


# ---------------------------------------------------------------------------- activations
_erf = np.frompyfunc(math.erf, 1, 1)


def _sigmoid64(v: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-v))


def _parse_activation(spec) -> tuple:
    """(name, limit, alpha) of an activation spec (the extension's parser and checks)."""
    if not isinstance(spec, str):
        raise TypeError(f"activation: must be a str, got {type(spec).__name__}")
    name, _, limit, alpha = _C.parse_activation(spec)
    return name, float(limit), float(alpha)


def _activation(spec: str, h: np.ndarray, inter: int) -> np.ndarray:
    """Gated activation of GEMM1 rows h [P, 2I] (fp32) -> [P, I] fp32, for an activation spec
    ("silu", "silu_clamp(limit=10)", ...: see cpumoe.parse_activation).

    Evaluated in float64 from the fp32 inputs (so the reference is at least as accurate as the
    fp32 formula it stands for), then rounded once to fp32. Clamps keep NaN (np.minimum and
    np.clip do, as torch.clamp) and use the fp32 limit the op is given.
    """
    name, limit, alpha = _parse_activation(spec)
    if name in _INTERLEAVED:
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
    _parse_activation(activation)


def _run_moe(x, w13, w2, topk_weights, topk_ids, skip_weighted, expert_ffn):
    """Routing and combine shared by both ops: ``expert_ffn(e, x_rows_f32, w13n, w2n)`` gives the
    expert's fp32 outputs for its token rows. Returns [T, H] in x's dtype and framework."""
    dtype_name = _dtype_name(x)
    if dtype_name not in _FLOAT_DTYPES:
        raise TypeError(f"x: dtype must be one of {_FLOAT_DTYPES}, got {dtype_name}")
    xf = _to_numpy(x, float32=True)
    w13n = _to_numpy(w13, float32=True)  # int8 stays int8, bf16 widens exactly
    w2n = _to_numpy(w2, float32=True)
    ids = _to_numpy(topk_ids).astype(np.int64)
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
        wts = _to_numpy(topk_weights, float32=True)
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
    dtype_name = _dtype_name(x)
    s13n = _to_numpy(s13, float32=True)
    s2n = _to_numpy(s2, float32=True)
    b13n = _to_numpy(b13, float32=True)
    b2n = _to_numpy(b2, float32=True)

    def ffn(e, x_rows, w13n, w2n):
        inter = w2n.shape[2]
        # 1. Quantize each token (per row: the same as once per token). 2. GEMM1 + epilogue.
        qx, sx = _quantize_rows_np(x_rows, TOKEN_AMAX_FLOOR)
        h = _linear(qx, sx, w13n[e], s13n[e], None if b13n is None else b13n[e])
        # 3. Activation; 4. round to the input dtype, requantize per row.
        a = round_to_dtype(_activation(activation, h, inter), dtype_name)
        qa, sa = _quantize_rows_np(a, TOKEN_AMAX_FLOOR)
        # 5. GEMM2 with its epilogue.
        return _linear(qa, sa, w2n[e], s2n[e], None if b2n is None else b2n[e])

    return _run_moe(x, w13, w2, topk_weights, topk_ids, skip_weighted, ffn)


# ---------------------------------------------------------------------------- W4A8
def _e2m1(code: int) -> float:
    """The FP4 E2M1 value of a 4-bit code: sign bit 3, exponent bits 2-1, mantissa bit 0."""
    exp, man = (code >> 1) & 3, code & 1
    mag = 0.5 * man if exp == 0 else (1.0 + 0.5 * man) * 2.0 ** (exp - 1)
    return -mag if code & 8 else mag


#: The 16 E2M1 values of the mxfp4 codes 0..15.
MXFP4_VALUES = np.array([_e2m1(c) for c in range(16)], dtype=np.float32)
# Doubled: exact integers in [-12, 12], the int8 values the kernels multiply.
_MXFP4_INT = (2 * MXFP4_VALUES).astype(np.int8)


def _mxfp4_codes(blocks) -> np.ndarray:
    """uint8 [..., K / 32, 16] (two codes per byte, low nibble first) -> uint8 codes [..., K]."""
    b = _to_numpy(blocks)
    if b.dtype != np.uint8 or b.ndim < 2 or b.shape[-1] != 16:
        raise ValueError(f"blocks: expected uint8 [..., K / 32, 16], got {b.dtype} {b.shape}")
    codes = np.stack([b & 15, b >> 4], axis=-1)  # [..., K/32, 16, 2]: k = 2j, 2j + 1
    return codes.reshape(*b.shape[:-2], b.shape[-2] * 32)


def _e8m0_scale(e, halve: bool) -> np.ndarray:
    """float32 2^(e - 127) (halve: 2^(e - 128)) of E8M0 bytes; NaN for 255."""
    e = _to_numpy(e).astype(np.int64)
    v = np.ldexp(np.float64(1.0), e - (128 if halve else 127)).astype(np.float32)
    return np.where(e == 255, np.float32(np.nan), v).astype(np.float32)


def dequantize_int4(values, scales, group_size: int):
    """The real weights of int4 values [..., N, K] with group scales [..., N, K / g] (float32)."""
    v = _to_numpy(values).astype(np.float32)
    sc = _to_numpy(scales, float32=True)
    return _like(values, v * np.repeat(sc, group_size, axis=-1))


def dequantize_mxfp4(blocks, scales):
    """The real weights (float32 [..., N, K]) of mxfp4 blocks [..., N, K / 32, 16] and E8M0
    scales [..., N, K / 32]."""
    vals = MXFP4_VALUES[_mxfp4_codes(blocks)]
    return _like(blocks, vals * np.repeat(_e8m0_scale(scales, False), 32, axis=-1))


def quantize_int4(w, group_size: int = 32, amax_floor: float = CHANNEL_AMAX_FLOOR):
    """Symmetric per-group int4 quantization of weights [..., N, K], groups of ``group_size`` k:
    s = max(amax, floor) / 7, v = round_half_even(w / s) clamped to [-8, 7]. Returns (int8
    values, float32 scales [..., N, K / g])."""
    w32 = _to_numpy(w, float32=True)
    K = w32.shape[-1]
    if group_size < 1 or K % group_size:
        raise ValueError(f"group_size: {group_size} must divide K = {K}")
    wg = w32.reshape(*w32.shape[:-1], K // group_size, group_size)
    amax = np.max(np.abs(wg), axis=-1)
    s = (np.maximum(amax, np.float32(amax_floor)) / np.float32(7)).astype(np.float32)
    v = np.clip(np.rint(wg / s[..., None]), -8, 7).astype(np.int8).reshape(w32.shape)
    return _like(w, v), _like(w, s)


def quantize_mxfp4(w):
    """OCP MX FP4 quantization of weights [..., N, K] (K a multiple of 32), as gpt-oss's
    checkpoints hold them: per 32 k a shared exponent e = floor(log2(amax)) - 2 (E2M1's largest
    exponent), values w / 2^e rounded to the nearest E2M1 value (ties to the even code), clamped to
    +-6. Returns (uint8 blocks [..., N, K / 32, 16], uint8 E8M0 scales [..., N, K / 32])."""
    w32 = _to_numpy(w, float32=True)
    K = w32.shape[-1]
    if K % 32:
        raise ValueError(f"w: K = {K} must be a multiple of 32")
    wg = w32.reshape(*w32.shape[:-1], K // 32, 32)
    amax = np.max(np.abs(wg), axis=-1)
    # floor(log2(amax)) from the float's own exponent (frexp: amax = m * 2^ex, m in [0.5, 1)).
    _, ex = np.frexp(amax)
    exp = np.where(amax > 0, ex.astype(np.int64) - 1 - 2, -127)
    exp = np.clip(exp, -127, 127)
    # Times a power of two: exact (a subnormal product aside).
    scaled = np.clip(wg * np.exp2(-exp.astype(np.float32))[..., None], -6.0, 6.0)
    # The nearest E2M1 magnitude, ties to the even code: steps of 0.5 below 2 (codes 0-4), of 1
    # up to 4 (codes 4-6), of 2 up to 6 (codes 6-7); rint rounds half to even, and in each range
    # an even step count is an even code. Every operation here is exact in fp32.
    a = np.abs(scaled)
    code = np.where(a < 2, np.rint(2 * a),
                    np.where(a < 4, 4 + np.rint(a - 2), 6 + np.rint((a - 4) / 2))).astype(np.uint8)
    code = code | np.where(scaled < 0, 8, 0).astype(np.uint8)
    code = code.reshape(*w32.shape[:-1], K // 32, 16, 2)
    blocks = (code[..., 0] | (code[..., 1] << 4)).astype(np.uint8)
    return _like(w, blocks), _like(w, (exp + 127).astype(np.uint8))


def _w4_linear(q, s, v, gs, g, b):
    """W4A8 GEMM epilogue: fp32 sum over groups of float32(exact group sum) * gs, then * s, + b.
    q int8 [M, K]; v int8 values [N, K]; gs float32 [N, K / g]."""
    M, K = q.shape
    acc = np.zeros((M, v.shape[0]), dtype=np.float32)
    q64 = q.astype(np.float64)
    v64 = v.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        for gi in range(K // g):
            part = (q64[:, gi * g:(gi + 1) * g] @ v64[:, gi * g:(gi + 1) * g].T).astype(np.float32)
            acc = acc + part * gs[None, :, gi]
        y = acc * s[:, None]
        if b is not None:
            y = y + b[None, :]
    return y


def _ref_w4(x, v13, v2, gs13, gs2, g, topk_weights, topk_ids, activation, b13, b2,
            skip_weighted, round_gemm1: Optional[str] = None):
    """The W4A8 op on 4-bit values and float32 group scales. round_gemm1: a dtype each GEMM1
    output is rounded to before the activation (not cpumoe's op, which keeps fp32: the bench's
    model of vLLM's int4 kernel)."""
    _check_activation(activation)
    dtype_name = _dtype_name(x)
    b13n = _to_numpy(b13, float32=True)
    b2n = _to_numpy(b2, float32=True)

    def ffn(e, x_rows, w13n, w2n):
        inter = w2n.shape[2]
        qx, sx = _quantize_rows_np(x_rows, TOKEN_AMAX_FLOOR)
        h = _w4_linear(qx, sx, w13n[e], gs13[e], g, None if b13n is None else b13n[e])
        if round_gemm1 is not None:
            h = round_to_dtype(h, round_gemm1)
        a = round_to_dtype(_activation(activation, h, inter), dtype_name)
        qa, sa = _quantize_rows_np(a, TOKEN_AMAX_FLOOR)
        return _w4_linear(qa, sa, w2n[e], gs2[e], g, None if b2n is None else b2n[e])

    return _run_moe(x, v13, v2, topk_weights, topk_ids, skip_weighted, ffn)


def ref_fused_moe_int4(x, w13, w2, s13, s2, topk_weights, topk_ids, activation="silu",
                       b13=None, b2=None, skip_weighted=False, group_size=32):
    """The W4A8 op on int4 weights, naively: w13 int8 [E, 2I, H] / w2 [E, H, I] holding values in
    [-8, 7], s13 [E, 2I, H / g] / s2 [E, H, I / g] group scales; the rest as ref_fused_moe_int8."""
    v13 = _to_numpy(w13)
    v2 = _to_numpy(w2)
    if v13.dtype != np.int8 or v2.dtype != np.int8:
        raise TypeError("w13/w2: int4 values must be given as int8 arrays")
    if (v13.size and (v13.min() < -8 or v13.max() > 7)) or (v2.size and (v2.min() < -8 or
                                                                          v2.max() > 7)):
        raise ValueError("w13/w2: int4 values must be in [-8, 7]")
    gs13 = _to_numpy(s13, float32=True)
    gs2 = _to_numpy(s2, float32=True)
    return _ref_w4(x, v13, v2, gs13, gs2, group_size, topk_weights, topk_ids, activation, b13,
                   b2, skip_weighted)


def ref_fused_moe_mxfp4(x, w13_blocks, w13_scales, w2_blocks, w2_scales, topk_weights, topk_ids,
                        activation="silu", b13=None, b2=None, skip_weighted=False):
    """The W4A8 op on mxfp4 weights (gpt-oss's layout: blocks uint8 [E, N, K / 32, 16], E8M0
    scales uint8 [E, N, K / 32]), naively; the rest as ref_fused_moe_int8."""
    v13 = _MXFP4_INT[_mxfp4_codes(w13_blocks)]
    v2 = _MXFP4_INT[_mxfp4_codes(w2_blocks)]
    return _ref_w4(x, v13, v2, _e8m0_scale(w13_scales, True), _e8m0_scale(w2_scales, True), 32,
                   topk_weights, topk_ids, activation, b13, b2, skip_weighted)


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
    b13n = _to_numpy(b13, float32=True)
    b2n = _to_numpy(b2, float32=True)
    # bf16 weights widen exactly; other float dtypes are rounded to bf16 first.
    w13_exact = _dtype_name(w13) == "bfloat16"
    w2_exact = _dtype_name(w2) == "bfloat16"

    def ffn(e, x_rows, w13n, w2n):
        inter = w2n.shape[2]
        w13e = w13n[e] if w13_exact else round_to_dtype(w13n[e], "bfloat16")
        w2e = w2n[e] if w2_exact else round_to_dtype(w2n[e], "bfloat16")
        h = _bf16_linear(x_rows, w13e, None if b13n is None else b13n[e])
        a = _activation(activation, h, inter)
        return _bf16_linear(a, w2e, None if b2n is None else b2n[e])

    return _run_moe(x, w13, w2, topk_weights, topk_ids, skip_weighted, ffn)


def _cast_out(x, out32: np.ndarray, dtype_name: str):
    """fp32 result -> x's dtype and framework (round to nearest even)."""
    torch = _torch_module(x)
    if torch is not None:
        return torch.from_numpy(out32).to(getattr(torch, dtype_name))
    with np.errstate(over="ignore"):
        return out32.astype(np.asarray(x).dtype)
