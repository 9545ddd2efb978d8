"""Quantizers of the weights and activations cpumoe's ops take (int8 per channel / per token,
int4 per group, OCP MX FP4), the rounding to a dtype, and the torch <-> numpy conversions they and
the reference share. The loaders use them to make packed layers from float or checkpoint weights;
the reference (cpumoe.reference) uses them where the op's semantics quantize.

Every function takes torch tensors or numpy arrays and answers in the same kind; torch is never
imported here (a tensor is recognised through ``sys.modules``).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

__all__ = [
    "CHANNEL_AMAX_FLOOR",
    "MXFP4_VALUES",
    "QuantizedExperts",
    "TOKEN_AMAX_FLOOR",
    "E4M3_VALUES",
    "dequantize_fp8",
    "dequantize_int4",
    "dequantize_int4_affine",
    "dequantize_int8_affine",
    "dequantize_mxfp4",
    "dequantize_weights",
    "group_sizes",
    "quantize_experts",
    "quantize_fp8",
    "quantize_int4",
    "quantize_int4_affine",
    "quantize_int8_affine",
    "quantize_mxfp4",
    "quantize_per_channel",
    "quantize_per_token",
    "quantize_weights",
    "quantized_formats",
    "requantize_fp8",
    "round_to_dtype",
]

#: Floor of a token's |max| before dividing by 127 (the op's; an all-zero row gets zeros).
TOKEN_AMAX_FLOOR = 1e-7
#: Floor of a weight row's |max| when making int8 checkpoints.
CHANNEL_AMAX_FLOOR = 1e-12
#: The input dtypes of the ops, by name.
FLOAT_DTYPES = ("float32", "float16", "bfloat16")


# ---------------------------------------------------------------------------- torch <-> numpy
def torch_of(obj):
    """The torch module when ``obj`` is a torch tensor, else None (never imports torch)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return torch
    return None


def dtype_name_of(a) -> str:
    """'float32', 'bfloat16', 'int8', ... for a torch tensor or a numpy array."""
    if torch_of(a) is not None:
        return str(a.dtype).replace("torch.", "")
    return np.asarray(a).dtype.name


def to_numpy(a, *, float32=False):
    """A numpy view/copy of a torch tensor or array-like. ``float32`` widens floats to fp32
    (exact for fp16 and bf16); integer arrays are left as they are."""
    if a is None:
        return None
    torch = torch_of(a)
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


def like(template, arr):
    """Return numpy ``arr`` in the framework of ``template`` (torch tensor or numpy array)."""
    torch = torch_of(template)
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
    raise ValueError(f"dtype: must be one of {FLOAT_DTYPES}, got {dtype_name}")


# ---------------------------------------------------------------------------- quantization
def quantize_rows(x32: np.ndarray, amax_floor: float):
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
    q, s = quantize_rows(to_numpy(x, float32=True), amax_floor)
    return like(x, q), like(x, s)


def quantize_per_channel(w, amax_floor: float = CHANNEL_AMAX_FLOOR):
    """Per-output-channel symmetric int8 quantization of weights, the way int8 checkpoints are made.

    ``w`` [..., N, K] float -> (q int8 [..., N, K], s float32 [..., N]): the absolute maximum is
    over the last (input) axis, divided by 127; round half to even, clamp to +-127.
    """
    w32 = to_numpy(w, float32=True)
    if w32.ndim < 2:
        raise ValueError(f"w: expected at least 2 dimensions [..., N, K], got shape {w32.shape}")
    q, s = quantize_rows(w32, amax_floor)
    return like(w, q), like(w, s)


# ---------------------------------------------------------------------------- W4A8
def _e2m1(code: int) -> float:
    """The FP4 E2M1 value of a 4-bit code: sign bit 3, exponent bits 2-1, mantissa bit 0."""
    exp, man = (code >> 1) & 3, code & 1
    mag = 0.5 * man if exp == 0 else (1.0 + 0.5 * man) * 2.0 ** (exp - 1)
    return -mag if code & 8 else mag


#: The 16 E2M1 values of the mxfp4 codes 0..15.
MXFP4_VALUES = np.array([_e2m1(c) for c in range(16)], dtype=np.float32)
# Doubled: exact integers in [-12, 12], the int8 values the kernels multiply.
MXFP4_INT = (2 * MXFP4_VALUES).astype(np.int8)


def mxfp4_codes(blocks) -> np.ndarray:
    """uint8 [..., K / 32, 16] (two codes per byte, low nibble first) -> uint8 codes [..., K]."""
    b = to_numpy(blocks)
    if b.dtype != np.uint8 or b.ndim < 2 or b.shape[-1] != 16:
        raise ValueError(f"blocks: expected uint8 [..., K / 32, 16], got {b.dtype} {b.shape}")
    codes = np.stack([b & 15, b >> 4], axis=-1)  # [..., K/32, 16, 2]: k = 2j, 2j + 1
    return codes.reshape(*b.shape[:-2], b.shape[-2] * 32)


def e8m0_scale(e, halve: bool) -> np.ndarray:
    """float32 2^(e - 127) (halve: 2^(e - 128)) of E8M0 bytes; NaN for 255."""
    e = to_numpy(e).astype(np.int64)
    v = np.ldexp(np.float64(1.0), e - (128 if halve else 127)).astype(np.float32)
    return np.where(e == 255, np.float32(np.nan), v).astype(np.float32)


def dequantize_int4(values, scales, group_size: int):
    """The real weights of int4 values [..., N, K] with group scales [..., N, K / g] (float32)."""
    v = to_numpy(values).astype(np.float32)
    sc = to_numpy(scales, float32=True)
    return like(values, v * np.repeat(sc, group_size, axis=-1))


def dequantize_mxfp4(blocks, scales):
    """The real weights (float32 [..., N, K]) of mxfp4 blocks [..., N, K / 32, 16] and E8M0
    scales [..., N, K / 32]."""
    vals = MXFP4_VALUES[mxfp4_codes(blocks)]
    return like(blocks, vals * np.repeat(e8m0_scale(scales, False), 32, axis=-1))


def quantize_int4(w, group_size: int = 32, amax_floor: float = CHANNEL_AMAX_FLOOR):
    """Symmetric per-group int4 quantization of weights [..., N, K], groups of ``group_size`` k:
    s = max(amax, floor) / 7, v = round_half_even(w / s) clamped to [-8, 7]. Returns (int8
    values, float32 scales [..., N, K / g])."""
    w32 = to_numpy(w, float32=True)
    K = w32.shape[-1]
    if group_size < 1 or K % group_size:
        raise ValueError(f"group_size: {group_size} must divide K = {K}")
    wg = w32.reshape(*w32.shape[:-1], K // group_size, group_size)
    amax = np.max(np.abs(wg), axis=-1)
    s = (np.maximum(amax, np.float32(amax_floor)) / np.float32(7)).astype(np.float32)
    v = np.clip(np.rint(wg / s[..., None]), -8, 7).astype(np.int8).reshape(w32.shape)
    return like(w, v), like(w, s)


def dequantize_int4_affine(codes, scale_min, group_size: int):
    """The real weights (float32 [..., N, K]) of affine 4-bit codes [..., N, K] (uint8, 0..15)
    with (scale, min) pairs [..., N, K / g, 2] (float32): ``w = scale * code + min`` (the product
    exact for the scales the loaders make, then one fp32 rounding)."""
    c = to_numpy(codes).astype(np.float32)
    sm = to_numpy(scale_min, float32=True)
    s = np.repeat(sm[..., 0], group_size, axis=-1)
    m = np.repeat(sm[..., 1], group_size, axis=-1)
    return like(codes, (c * s + m).astype(np.float32))


def dequantize_int8_affine(codes, scale_min, group_size: int):
    """As :func:`dequantize_int4_affine` for affine 8-bit codes (uint8, 0..255)."""
    return dequantize_int4_affine(codes, scale_min, group_size)


def _quantize_affine(w, group_size, top):
    w32 = to_numpy(w, float32=True)
    K = w32.shape[-1]
    if group_size < 1 or K % group_size:
        raise ValueError(f"group_size: {group_size} must divide K = {K}")
    wg = w32.reshape(*w32.shape[:-1], K // group_size, group_size)
    lo = np.min(wg, axis=-1)
    hi = np.max(wg, axis=-1)
    s = ((hi - lo) / np.float32(top)).astype(np.float32)
    s = np.where(s > 0, s, np.float32(1)).astype(np.float32)
    c = np.clip(np.rint((wg - lo[..., None]) / s[..., None]), 0, top).astype(np.uint8)
    return like(w, c.reshape(w32.shape)), like(w, np.stack([s, lo], axis=-1).astype(np.float32))


def quantize_int4_affine(w, group_size: int = 32):
    """Asymmetric (min-max) per-group 4-bit quantization of weights [..., N, K], AWQ's and
    GGUF Q4_1's: per group, min = min(w), s = (max - min) / 15 (1 for a constant group),
    code = round_half_even((w - min) / s) clamped to [0, 15]. Returns (uint8 codes
    [..., N, K], float32 (scale, min) pairs [..., N, K / g, 2])."""
    return _quantize_affine(w, group_size, 15)


def quantize_int8_affine(w, group_size: int = 32):
    """As :func:`quantize_int4_affine` with 8-bit codes: s = (max - min) / 255, codes in
    [0, 255] (an 8-bit asymmetric GPTQ / AWQ layer's form; GGUF Q8_0 and Q5_x load into it)."""
    return _quantize_affine(w, group_size, 255)


def quantize_mxfp4(w):
    """OCP MX FP4 quantization of weights [..., N, K] (K a multiple of 32), as gpt-oss's
    checkpoints hold them: per 32 k a shared exponent e = floor(log2(amax)) - 2 (E2M1's largest
    exponent), values w / 2^e rounded to the nearest E2M1 value (ties to the even code), clamped to
    +-6. Returns (uint8 blocks [..., N, K / 32, 16], uint8 E8M0 scales [..., N, K / 32])."""
    w32 = to_numpy(w, float32=True)
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
    return like(w, blocks), like(w, (exp + 127).astype(np.uint8))


# ---------------------------------------------------------------------------- FP8 (W8A16)
def _e4m3(code: int) -> float:
    """The float8 E4M3 (e4m3fn) value of a code: sign bit 7, exponent bits 6-3 (bias 7),
    mantissa bits 2-0; exponent 0 is subnormal; 0x7F / 0xFF are NaN (no infinity)."""
    exp, man = (code >> 3) & 15, code & 7
    if exp == 15 and man == 7:
        return float("nan")
    mag = man / 8 * 2.0 ** -6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)
    return -mag if code & 0x80 else mag


#: The 256 E4M3 values by code (NaN at 0x7F and 0xFF).
E4M3_VALUES = np.array([_e4m3(c) for c in range(256)], dtype=np.float32)
#: The largest finite E4M3 magnitude.
E4M3_MAX = 448.0


def e4m3_codes(v) -> np.ndarray:
    """float32 values -> uint8 E4M3 codes, rounded to the nearest (ties to the even code),
    saturated at +-448; NaN -> 0x7F."""
    v = np.asarray(v, dtype=np.float32)
    a = np.minimum(np.abs(v), np.float32(E4M3_MAX))
    _, ex = np.frexp(a)  # a = m * 2^ex, m in [0.5, 1): floor(log2 a) = ex - 1
    e = np.maximum(ex.astype(np.int64) - 1, -6)  # below 2^-6: the subnormal step
    step = np.ldexp(np.float32(1), (e - 3).astype(np.int32)).astype(np.float32)
    r = np.rint(a / step) * step  # exact: a power-of-two step; rint ties to even
    r = np.minimum(r, np.float32(E4M3_MAX))
    _, rex = np.frexp(r)
    re = rex.astype(np.int64) - 1
    normal = r >= np.float32(2.0 ** -6)
    exp_field = np.where(normal, re + 7, 0)
    man = np.where(normal, r / np.ldexp(np.float32(1), re.astype(np.int32)) * 8 - 8,
                   r * np.float32(512))
    code = ((exp_field << 3) | np.rint(man).astype(np.int64)).astype(np.uint8)
    code = code | np.where(np.signbit(v), 0x80, 0).astype(np.uint8)
    return np.where(np.isnan(v), np.uint8(0x7F), code).astype(np.uint8)


def _block_amax(w32: np.ndarray, bn: int, bk: int) -> np.ndarray:
    """max |w| over each block of bn rows x bk columns of [..., N, K] (partial blocks at the
    ends): [..., ceil(N / bn), ceil(K / bk)]."""
    N, K = w32.shape[-2:]
    nb, kb = -(-N // bn), -(-K // bk)
    pad = [(0, 0)] * (w32.ndim - 2) + [(0, nb * bn - N), (0, kb * bk - K)]
    a = np.pad(np.abs(w32), pad)
    a = a.reshape(*w32.shape[:-2], nb, bn, kb, bk)
    return a.max(axis=(-3, -1))


def _expand_blocks(s: np.ndarray, N: int, K: int, bn: int, bk: int) -> np.ndarray:
    """Block scales [..., ceil(N / bn), ceil(K / bk)] -> one per element [..., N, K]."""
    return np.repeat(np.repeat(s, bn, axis=-2)[..., :N, :], bk, axis=-1)[..., :K]


def quantize_fp8(w, block_size=(128, 128)):
    """FP8 (E4M3) quantization of weights [..., N, K] with one fp32 scale per block of
    ``block_size`` = (bn, bk) (None: per output channel), as DeepSeek's and Qwen's FP8
    checkpoints are made: s = amax(block) / 448 (an all-zero block gets s = 1), codes = the
    nearest E4M3 value of w / s. Returns (uint8 codes [..., N, K], float32 scales [..., ceil(N /
    bn), ceil(K / bk)]; per channel: [..., N, 1])."""
    w32 = to_numpy(w, float32=True)
    N, K = w32.shape[-2:]
    bn, bk = (1, K) if block_size is None else block_size
    amax = _block_amax(w32, bn, bk)
    s = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1)).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        codes = e4m3_codes(w32 / _expand_blocks(s, N, K, bn, bk))
    return like(w, codes), like(w, s)


def dequantize_fp8(codes, scales, block_size=(128, 128)):
    """The real weights (float32 [..., N, K]) of E4M3 codes [..., N, K] and their block scales
    (see :func:`quantize_fp8`)."""
    c = to_numpy(codes)
    if c.dtype != np.uint8:  # a torch float8_e4m3fn tensor comes as its bits
        c = c.view(np.uint8)
    s = to_numpy(scales, float32=True)
    N, K = c.shape[-2:]
    bn, bk = (1, K) if block_size is None else block_size
    s = s.reshape(*c.shape[:-2], -(-N // bn), -(-K // bk))
    return like(codes, E4M3_VALUES[c] * _expand_blocks(s, N, K, bn, bk))


# ---------------------------------------------------------------------------- by format name
# What this module knows of each weight format of the extension's table (cpumoe.FORMATS): how
# float weights become the format's prepack input (values, scales), how they turn back into
# floats, and the order in which its prepack function takes them. A format is one row here;
# everything below and every caller (the CLI, the benchmarks, the transformers backends) works
# from the format's name.
@dataclasses.dataclass(frozen=True)
class _FormatIO:
    quantize: Callable  # (w [..., N, K] float, group) -> (values, scales or None)
    dequantize: Callable  # (values, scales, group) -> float32 [..., N, K]
    prepack_args: Callable  # (w13, w2, s13, s2) -> the prepack function's positional weights
    prepack_kw: Callable  # group -> the prepack function's keywords for it


def _bf16_values(w, group):
    torch = torch_of(w)
    if torch is not None:
        return w.to(torch.bfloat16), None  # round to nearest even, as round_to_dtype
    import ml_dtypes
    return np.asarray(w, dtype=np.float32).astype(ml_dtypes.bfloat16), None


def _no_kw(g):
    return {}


def _weights_then_scales(w13, w2, s13, s2):
    return w13, w2, s13, s2


# fp8's blocks here are square (g x g, DeepSeek's 128 x 128); prepack_fp8 takes any (bn, bk).
_FORMAT_IO = {
    "int8": _FormatIO(lambda w, g: quantize_per_channel(w),
                      lambda v, s, g: to_numpy(v).astype(np.float32)
                      * to_numpy(s, float32=True)[..., None], _weights_then_scales, _no_kw),
    "int4": _FormatIO(quantize_int4, dequantize_int4, _weights_then_scales,
                      lambda g: {"group_size": g}),
    "int4_affine": _FormatIO(quantize_int4_affine, dequantize_int4_affine,
                             _weights_then_scales, lambda g: {"group_size": g}),
    "int8_affine": _FormatIO(quantize_int8_affine, dequantize_int8_affine,
                             _weights_then_scales, lambda g: {"group_size": g}),
    "mxfp4": _FormatIO(lambda w, g: quantize_mxfp4(w), lambda v, s, g: dequantize_mxfp4(v, s),
                       lambda w13, w2, s13, s2: (w13, s13, w2, s2), _no_kw),
    "bf16": _FormatIO(_bf16_values, lambda v, s, g: to_numpy(v, float32=True),
                      lambda w13, w2, s13, s2: (w13, w2), _no_kw),
    "fp8": _FormatIO(lambda w, g: quantize_fp8(w, (g, g)),
                     lambda v, s, g: dequantize_fp8(v, s, (g, g)), _weights_then_scales,
                     lambda g: {"block_size": (g, g)}),
}


#: The integer weight formats whose layers one wider format holds exactly, narrowest first
#: (:func:`widen_values`): int4 values as int4_affine codes, 4-bit codes as 8-bit codes.
WIDENING = ("int4", "int4_affine", "int8_affine")


def widest_format(formats) -> str:
    """The widest of ``formats`` (all of :data:`WIDENING`)."""
    return max(formats, key=WIDENING.index)


def widen_values(v, s, src: str, dst: str):
    """Values and scales of format ``src`` as format ``dst`` (the same, or both of
    :data:`WIDENING`, dst not narrower), the same weights exactly: int4 (v, s) becomes the
    affine codes v + 8 with (scale, min) = (s, -8 s) (s * (v + 8) - 8 s = s * v for the
    fp16-sized scales of checkpoints); 4-bit affine codes and pairs are 8-bit ones as they
    are."""
    if src == dst:
        return v, s
    if src not in WIDENING or dst not in WIDENING or WIDENING.index(dst) < WIDENING.index(src):
        raise ValueError(f"widen_values: {src} does not fit in {dst}")
    if src != "int4":
        return v, s
    codes = (np.asarray(v, dtype=np.int16) + 8).astype(np.uint8)
    s = np.asarray(s, dtype=np.float32)
    return codes, np.stack([s, np.float32(-8) * s], axis=-1).astype(np.float32)


def _format_io(fmt: str) -> _FormatIO:
    io = _FORMAT_IO.get(fmt)
    if io is None:
        raise ValueError(f"weight format {fmt!r}: cpumoe.quantize has no quantizer for it "
                         f"(it has: {', '.join(_FORMAT_IO)})")
    return io


def quantized_formats() -> Tuple[str, ...]:
    """The formats of the extension's table (cpumoe.FORMATS, in its order) that
    :func:`quantize_weights` and :func:`quantize_experts` can make."""
    from .ops import FORMATS
    return tuple(f for f in FORMATS if f in _FORMAT_IO)


def group_sizes(fmt: str, *dims: int, preferred: Sequence[int] = (128, 64, 32)) -> List[int]:
    """The group sizes of ``preferred`` (in that order) that format ``fmt`` allows and that divide
    every one of ``dims`` (the K of the layer's matrices: H and I); a format with one fixed group
    gives that one, a format without groups ``[0]``. Empty when none fits."""
    from .ops import formats
    row = next((r for r in formats() if r["name"] == fmt), None)
    if row is None:
        raise ValueError(f"weight format {fmt!r}: not one of cpumoe.FORMATS")
    if row["group"] == "none":
        return [0]
    if row["group"] == "exact":
        cands = [row["group_size"]]
    elif row["group"] == "block":  # 2-D blocks may end partial: no need to divide
        return [g for g in preferred if g % row["group_size"] == 0]
    else:
        cands = [g for g in preferred
                 if g % row["group_size"] == 0 and g <= row["group_max"]]
    return [g for g in cands if all(d % g == 0 for d in dims)]


def quantize_weights(fmt: str, w, group_size: int = 0):
    """Weights ``w`` [..., N, K] (float) in format ``fmt``'s prepack input form: (values,
    scales), scales None for a format without (bf16). ``group_size`` for a format that takes
    one (see :func:`group_sizes`)."""
    return _format_io(fmt).quantize(w, group_size)


def dequantize_weights(fmt: str, values, scales, group_size: int = 0):
    """The real weights (float32 [..., N, K]) of ``values`` / ``scales`` in format ``fmt``."""
    return _format_io(fmt).dequantize(values, scales, group_size)


def _check_act_quant_taken(fmt: str, fn) -> None:
    """ValueError unless the prepack function ``fn`` of format ``fmt`` takes act_quant."""
    import inspect
    if "act_quant" not in inspect.signature(fn).parameters:
        from . import ops
        takes = [r["name"] for r in ops.formats()
                 if "act_quant" in inspect.signature(getattr(ops, r["prepack"])).parameters]
        raise ValueError(f"act_quant: the {fmt} format has one activation mode; "
                         f"act_quant is for {', '.join(takes)}")


@dataclasses.dataclass
class QuantizedExperts:
    """One layer's experts in a weight format's prepack input form (see :func:`quantize_experts`
    and :func:`cpumoe.formats`): ``w13`` / ``s13`` for [E, 2I, H], ``w2`` / ``s2`` for [E, H, I]
    (scales None for bf16), biases float32 or None."""

    weight_format: str
    group_size: int
    w13: Any
    w2: Any
    s13: Any
    s2: Any
    b13: Any
    b2: Any

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden(self) -> int:
        return self.w2.shape[1]

    @property
    def intermediate(self) -> int:
        return self.w13.shape[1] // 2

    def prepack(self, isa: Optional[str] = None, num_threads: Optional[int] = None,
                act_quant: Optional[str] = None):
        """The packed layer (the format's prepack function of cpumoe.formats()); act_quant
        ("row" / "group", and "bf16" for int4 and mxfp4) for the formats that take it (the W4A8
        ones); ValueError for the others."""
        from . import ops
        io = _format_io(self.weight_format)
        fn = getattr(ops, next(r["prepack"] for r in ops.formats()
                               if r["name"] == self.weight_format))
        kw = io.prepack_kw(self.group_size)
        if act_quant is not None:
            _check_act_quant_taken(self.weight_format, fn)
            kw["act_quant"] = act_quant
        return fn(*io.prepack_args(self.w13, self.w2, self.s13, self.s2), self.b13, self.b2,
                  isa=isa, num_threads=num_threads, **kw)

    def dequantized(self, experts: Any = slice(None)):
        """(w13, w2) float32 of the experts ``experts`` (an index or slice; default all)."""
        def sub(a):
            return None if a is None else a[experts]
        return (dequantize_weights(self.weight_format, sub(self.w13), sub(self.s13),
                                   self.group_size),
                dequantize_weights(self.weight_format, sub(self.w2), sub(self.s2),
                                   self.group_size))

    def select(self, experts: Any) -> "QuantizedExperts":
        """The same layer restricted to ``experts`` (an index array or slice)."""
        def sub(a):
            return None if a is None else a[experts]
        return dataclasses.replace(self, w13=sub(self.w13), w2=sub(self.w2), s13=sub(self.s13),
                                   s2=sub(self.s2), b13=sub(self.b13), b2=sub(self.b2))

    def bytes_per_weight(self) -> float:
        """Bytes the kernels read per weight: the values' bits and the scales of a group."""
        from .ops import formats
        row = next(r for r in formats() if r["name"] == self.weight_format)
        # A scale per group of k, or (2-D blocks, square here) per g x g block.
        per = self.group_size * (self.group_size if row["group"] == "block" else 1)
        per_scale = row["scale_bytes"] / per if per else 0.0
        return row["bits"] / 8 + per_scale


def quantize_experts(fmt: str, w13, w2, *, group_size: int = 0, b13=None, b2=None,
                     num_experts: Optional[int] = None) -> QuantizedExperts:
    """A layer's float experts in format ``fmt``, quantized one expert at a time (no float32 copy
    of the whole layer): ``w13`` [E, 2I, H] and ``w2`` [E, H, I] float arrays or tensors, or
    callables ``e -> [N, K]`` float with ``num_experts`` given. Answers numpy arrays, or torch
    tensors when the experts are tensors."""
    io = _format_io(fmt)
    if num_experts is None:
        num_experts = len(w13)
        f13, f2 = (lambda e: w13[e]), (lambda e: w2[e])
    else:
        f13, f2 = w13, w2
    out = []
    for f in (f13, f2):
        parts = [io.quantize(f(e), group_size) for e in range(num_experts)]
        vals = _stack([v for v, _ in parts])
        scales = None if parts and parts[0][1] is None else _stack([s for _, s in parts])
        out.append((vals, scales))
    (v13, s13), (v2, s2) = out
    return QuantizedExperts(fmt, group_size, v13, v2, s13, s2, b13, b2)


def _stack(parts):
    torch = torch_of(parts[0]) if parts else None
    if torch is not None:
        return torch.stack(parts)
    return np.stack(parts)


def requantize_fp8(w13, w2, s13, s2, b13=None, b2=None, *, block_size=(128, 128),
                   to: str = "int8", group_size: int = 0) -> QuantizedExperts:
    """FP8 experts (E4M3 codes and block scales, as :func:`cpumoe.prepack_fp8` takes them)
    re-quantized to weight format ``to`` (default int8: the W8A8 op, for CPUs where it is faster
    than the fp8 one), one expert at a time from the exactly dequantized weights; ``.prepack()``
    packs the result. Its error against the fp8 layer is cpumoe accuracy's to report."""
    c13, c2 = to_numpy(w13), to_numpy(w2)
    t13, t2 = to_numpy(s13, float32=True), to_numpy(s2, float32=True)
    return quantize_experts(
        to, lambda e: dequantize_fp8(c13[e], t13[e], block_size),
        lambda e: dequantize_fp8(c2[e], t2[e], block_size), group_size=group_size,
        b13=b13, b2=b2, num_experts=c13.shape[0])
