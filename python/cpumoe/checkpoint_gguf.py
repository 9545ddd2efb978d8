"""Loading a MoE layer's experts from a GGUF file (llama.cpp's format) as stored: no
re-quantization.

A GGUF MoE layer ``L`` holds its routed experts as three stacked tensors (names from the ``gguf``
package's ``gguf.constants.TENSOR_NAMES``; shapes as numpy / the ``gguf`` reader give them, ggml's
dims reversed): ``blk.{L}.ffn_gate_exps.weight`` [E, I, H], ``blk.{L}.ffn_up_exps.weight``
[E, I, H], ``blk.{L}.ffn_down_exps.weight`` [E, H, I], and optionally (gpt-oss) the biases
``blk.{L}.ffn_{gate,up,down}_exps.bias`` [E, I] / [E, I] / [E, H]. Only the GGUF types that are
exactly a cpumoe weight format are read:

========= =============== =========================================================================
GGUF      cpumoe          mapping (a block of 32 k is one group)
========= =============== =========================================================================
``Q4_0``  ``int4``        values q - 8 in [-8, 7], scale float(d) (fp16 d, any sign: llama.cpp's
                          quantizer makes d < 0 whenever a block's largest-magnitude weight is
                          positive, and cpumoe's int4 takes negative and zero scales), group_size
                          32.
``MXFP4`` ``mxfp4``       the same E8M0 byte and E2M1 codes (GGUF's doubled E2M1 times its halved
                          E8M0 is the same product); nibbles reordered (GGUF: element j low,
                          j + 16 high; cpumoe / gpt-oss: 2j low, 2j + 1 high). E8M0 255 (NaN in
                          cpumoe, 2^127 in ggml) is refused.
``BF16``  ``bf16``        the bits.
``Q4_1``  ``int4_affine`` the codes q in [0, 15] (element j of a block in the low nibble of byte j,
                          j + 16 in the high one) and per block (scale, min) = (float(d),
                          float(m)) (``w = d * q + m``), group_size 32.
``Q4_K``  ``int4_affine`` per sub-block s of 32 k (8 to a super-block of 256) the codes q (the 128
                          bytes in 4 runs of 32: sub-block 2r in the low nibbles of run r, 2r + 1
                          in the high ones) and (scale, min) = (float(d) * sc_s,
                          -(float(dmin) * m_s)), sc_s / m_s the 6-bit values of the 12 packed
                          bytes (``w = d * sc * q - dmin * m``), group_size 32.
``Q8_0``  ``int8_affine`` codes q + 128 (q the int8 value) and (scale, min) = (float(d),
                          -128 float(d)) per block (``w = d * q``), group_size 32.
``Q5_0``  ``int8_affine`` codes q in [0, 31] (the low 4 bits as Q4_1's, the fifth bit of element j
                          bit j of the block's 32-bit qh) and (float(d), -16 float(d))
                          (``w = d * (q - 16)``), group_size 32.
``Q5_1``  ``int8_affine`` the codes as Q5_0, (float(d), float(m)) (``w = d * q + m``).
``Q5_K``  ``int8_affine`` per sub-block of 32: the low 4 bits as Q4_K's (128 bytes after the 32
                          qh bytes), the fifth bit of element l of sub-block s bit s of qh[l];
                          (scale, min) as Q4_K's, group_size 32.
========= =============== =========================================================================

Exactness: the weights cpumoe's dequantization (``scale * q + min`` in float32) gives for the
loaded layer are ``gguf.quants.dequantize``'s bit for bit (up to the sign of a zero weight for
Q8_0 and Q5_0, whose ``d * q`` gguf computes without a min): fp16 d (11 significant bits) times
q (up to 8 bits), float(d) * sc (6 bits) times q, and d * 128 or d * 16 are exact in float32, so
both sides round once, in the same addition (``x - y`` is ``x + (-y)`` in IEEE arithmetic).

A layer whose gate / up / down are of different integer formats (Q4_0 int4, Q4_1 / Q4_K
int4_affine, Q8_0 / Q5_x int8_affine: llama.cpp's Q4_K_M and Q5_K_M files mix them) is read in
the widest of them, exactly (int4 values v with scale s as codes v + 8 with (s, -8 s); 4-bit codes
are 8-bit codes as they are): one packed layer holds one format. Every other type (F32, F16,
Q6_K, Q2_K, Q3_K, IQ types, ...) and a mix with MXFP4 or BF16 raise :class:`GgufUnsupported` (an
:class:`cpumoe.checkpoint.UnsupportedCheckpoint`) naming the tensor and its type; Q6_K (in
llama.cpp's Q4_K_M files the down projections of some layers) has a scale per 16 k, which no
cpumoe format holds. A non-finite block scale (d, m, dmin) is refused naming the tensor, expert,
row and block. A fused ``ffn_gate_up_exps`` tensor is refused too.

w13 is laid out for the activation of the file's architecture (``general.architecture``), from
the table :data:`GGUF_ACTIVATIONS` of the MoE architectures llama.cpp's GGUF writer emits (as
llama.cpp runs their experts): ``gpt-oss`` -> ``"swigluoai"`` (gate and up interleaved by row:
even rows gate, odd rows up), ``grok`` -> ``"gelu_tanh"``, the others (Mixtral's ``llama``,
``qwen2moe``, ``qwen3moe``, ``deepseek2``, ``dbrx``, ``olmoe``, ``granitemoe``, ...) ->
``"silu"`` (gate rows then up rows). An architecture not in the table is refused unless the caller
names the activation (``activation=``). :func:`read_gguf_experts` returns the layer unpacked with
that ``activation``; :func:`cpumoe.load_experts` (:mod:`cpumoe.loaders`) packs it.

The ``gguf`` package (``pip install gguf``, the reader llama.cpp ships) is imported on first use.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Optional, Sequence, Tuple, Union

import numpy as np

from .checkpoint import LoadedExperts, UnsupportedCheckpoint, expert_ids_of
from .quantize import WIDENING, quantize_int8_affine, widen_values, widest_format

__all__ = ["GGUF_ACTIVATIONS", "GGUF_FORMATS", "GgufExperts", "GgufUnsupported",
           "gguf_activation", "read_gguf_experts"]

PathLike = Union[str, os.PathLike]

#: GGUF tensor type -> the cpumoe weight format it is exactly.
GGUF_FORMATS = {"Q4_0": "int4", "MXFP4": "mxfp4", "BF16": "bf16", "Q4_1": "int4_affine",
                "Q4_K": "int4_affine", "Q8_0": "int8_affine", "Q5_0": "int8_affine",
                "Q5_1": "int8_affine", "Q5_K": "int8_affine"}

#: What a GGUF type would need from cpumoe, for the errors.
_NEEDS = {
    "F32": "no float32 expert format (only bf16)",
    "F16": "no float16 expert format (only bf16)",
    "F64": "no float64 expert format",
    "Q8_1": "an intermediate type of llama.cpp's dot products, not a storage type",
    "Q2_K": "needs 2-bit values (a K-quant; of the K-quants cpumoe reads Q4_K and Q5_K)",
    "Q3_K": "needs 3-bit values (a K-quant; of the K-quants cpumoe reads Q4_K and Q5_K)",
    "Q6_K": "needs a scale per 16 k (a K-quant with 6-bit values; cpumoe's groups are "
            "multiples of 32; of the K-quants it reads Q4_K and Q5_K)",
    "Q8_K": "an intermediate type of llama.cpp's dot products (of the K-quants cpumoe reads "
            "Q4_K and Q5_K)",
}
_FLOAT_BIAS = ("F32", "F16", "BF16")
#: GGUF ``general.architecture`` (gguf.constants.MODEL_ARCH_NAMES) -> the activation of its
#: routed experts, as llama.cpp runs them (its build_moe_ffn calls): the MoE architectures of
#: llama.cpp's GGUF writer whose experts cpumoe runs. An architecture not here is refused unless
#: the caller names the activation (its experts' activation may be none of cpumoe's: e.g.
#: smallthinker's relu, nemotron_h_moe's relu^2 without a gate; step35's per-layer clamps).
GGUF_ACTIVATIONS = {
    "llama": "silu",          # Mixtral (and every llama-architecture MoE)
    "llama4": "silu",
    "qwen2moe": "silu",
    "qwen3moe": "silu",
    "qwen3vlmoe": "silu",
    "qwen3next": "silu",
    "deepseek": "silu",
    "deepseek2": "silu",      # DeepSeek-V2 / V3 / R1, Kimi K2
    "dbrx": "silu",
    "olmoe": "silu",
    "granitemoe": "silu",
    "granitehybrid": "silu",
    "phimoe": "silu",
    "jamba": "silu",
    "arctic": "silu",
    "minicpm": "silu",
    "ernie4_5-moe": "silu",
    "glm4moe": "silu",
    "hunyuan-moe": "silu",
    "bailingmoe": "silu",
    "bailingmoe2": "silu",
    "dots1": "silu",
    "mistral3": "silu",
    "grok": "gelu_tanh",      # Grok-1 / 2: GELU, tanh form (JAX's default; ggml_gelu's)
    "gpt-oss": "swigluoai",   # gate / up interleaved by row
}


class GgufUnsupported(UnsupportedCheckpoint):
    """The GGUF file (or the layer asked for) holds experts cpumoe cannot run as stored."""


@dataclasses.dataclass
class GgufExperts(LoadedExperts):
    """One MoE layer read from a GGUF file in its cpumoe format's prepack input form (see
    :class:`cpumoe.checkpoint.LoadedExperts`), with the file's ``architecture`` and the GGUF
    types of gate, up and down (``gguf_types``)."""

    architecture: str
    gguf_types: Tuple[str, str, str]
    #: the tensors re-quantized to int8_affine (read with requantize="int8_affine"), else ()
    requantized: Tuple[str, ...] = ()


def _gguf():
    try:
        import gguf
    except ImportError as e:
        raise ImportError("cpumoe.load_experts: reading GGUF files needs the gguf package: "
                          "pip install 'gguf>=0.17' (or pip install 'cpumoe[gguf]')") from e
    return gguf


def gguf_activation(architecture: str) -> str:
    """The activation (and so the w13 layout) of the routed experts of GGUF
    ``general.architecture`` ``architecture`` (:data:`GGUF_ACTIVATIONS`): "swigluoai" for gpt-oss
    (gate / up interleaved by row), "gelu_tanh" for grok, "silu" for Mixtral (``llama``), Qwen,
    DeepSeek, OLMoE, Granite, DBRX, ... (halves). :class:`GgufUnsupported` for an architecture
    not in the table."""
    act = GGUF_ACTIVATIONS.get(architecture)
    if act is None:
        raise GgufUnsupported(
            f"the expert activation of architecture {architecture!r} is not known to cpumoe "
            f"(known: {', '.join(sorted(GGUF_ACTIVATIONS))}); name it: "
            f"read_gguf_experts(..., activation=...) / cpumoe.load_experts(..., activation=...), "
            f"one of "
            f"{', '.join(_activation_names())}")
    return act


def _activation_names() -> Tuple[str, ...]:
    from .ops import ACTIVATIONS
    return tuple(ACTIVATIONS)


def _check_activation(activation: Any) -> str:
    """An activation spec the caller gave (a name of cpumoe.ACTIVATIONS, with its parameters
    where it takes them), checked by the op's own parser; returned as given."""
    from .ops import parse_activation
    if not isinstance(activation, str):
        raise TypeError(f"activation: must be a str (one of {', '.join(_activation_names())}), "
                        f"got {type(activation).__name__}")
    try:
        parse_activation(activation)
    except (TypeError, ValueError) as e:
        raise ValueError(f"activation: {activation!r} is not an activation of cpumoe (one of "
                         f"{', '.join(_activation_names())}): {e}") from e
    return activation


def _why_not(qtype: str) -> str:
    if qtype in _NEEDS:
        return _NEEDS[qtype]
    if qtype.endswith("_K"):
        return "needs K-quant super-blocks (of the K-quants cpumoe reads Q4_K and Q5_K)"
    if qtype.startswith("IQ") or qtype.startswith("TQ"):
        return "needs codebook / ternary values"
    return "no cpumoe weight format holds it exactly"


def _open(path: PathLike):
    gguf = _gguf()
    try:
        return gguf.GGUFReader(os.fspath(path), "r")
    except OSError:
        raise
    except Exception as e:  # truncated or malformed: the reader raises ValueError, KeyError, ...
        raise GgufUnsupported(f"{os.fspath(path)}: not a readable GGUF file "
                              f"({type(e).__name__}: {e})") from e


def _field(reader, key: str) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return None
    try:
        return f.contents()
    except Exception:  # an odd field type: treated as absent
        return None


def _np_shape(t) -> Tuple[int, ...]:
    return tuple(int(d) for d in reversed(t.shape.tolist()))


def _type_name(t) -> str:
    return t.tensor_type.name


def _float32_of(t) -> np.ndarray:
    """A float tensor (F32 / F16 / BF16) as float32 with its numpy shape."""
    q = _type_name(t)
    if q == "BF16":
        u = np.ascontiguousarray(t.data).view("<u2").reshape(_np_shape(t))
        return (u.astype(np.uint32) << 16).view(np.float32)
    return np.asarray(t.data, dtype=np.float32).reshape(_np_shape(t))


def _q4_0_expert(name: str, e: int, raw: np.ndarray, n: int, k: int):
    """Q4_0 bytes [n, k / 32 * 18] of one expert -> (int8 values [n, k], fp32 scales
    [n, k / 32]), exactly; raises for a non-finite scale."""
    b = np.ascontiguousarray(raw).reshape(n, k // 32, 18)
    d = b[..., :2].copy().view("<f2")[..., 0].astype(np.float32)  # [n, G]
    qs = b[..., 2:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int8)  # [n, G, 32]: j, j + 16
    if not np.isfinite(d).all():
        r, g = (int(i[0]) for i in np.nonzero(~np.isfinite(d)))
        raise GgufUnsupported(f"{name}: Q4_0 block scale {d[r, g]} (expert {e}, row {r}, block "
                              f"{g}) is not finite; cpumoe's int4 needs finite scales")
    v = (q - np.int8(8)).astype(np.int8)
    s = d.astype(np.float32)  # as stored: negative (llama.cpp's quantizer) and zero d are values
    return v.reshape(n, k), s


def _mxfp4_expert(name: str, e: int, raw: np.ndarray, n: int, k: int):
    """GGUF MXFP4 bytes [n, k / 32 * 17] of one expert -> (cpumoe blocks uint8 [n, k / 32, 16],
    E8M0 uint8 [n, k / 32]): the same codes and scale bytes, nibbles reordered."""
    b = np.ascontiguousarray(raw).reshape(n, k // 32, 17)
    scales = b[..., 0].copy()
    if (scales == 255).any():
        r, g = (int(i[0]) for i in np.nonzero(scales == 255))
        raise GgufUnsupported(f"{name}: MXFP4 block (expert {e}, row {r}, block {g}) has E8M0 "
                              f"scale 255 (2^127 in ggml, NaN in cpumoe's mxfp4)")
    qs = b[..., 1:]
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1)  # [n, G, 32] in element order
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return blocks, scales


def _bf16_expert(name: str, e: int, raw: np.ndarray, n: int, k: int):
    return np.ascontiguousarray(raw).view("<u2").reshape(n, k), None


def _refuse_non_finite(name: str, qtype: str, e: int, what: str, v: np.ndarray,
                       block: str = "block", fmt: str = "int4_affine") -> None:
    """GgufUnsupported naming the first non-finite value of ``v`` [n, blocks] (expert e)."""
    if np.isfinite(v).all():
        return
    r, g = (int(i[0]) for i in np.nonzero(~np.isfinite(v)))
    raise GgufUnsupported(f"{name}: {qtype} {what} {v[r, g]} (expert {e}, row {r}, {block} {g}) "
                          f"is not finite; cpumoe's {fmt} needs finite scales and mins")


def _q4_1_expert(name: str, e: int, raw: np.ndarray, n: int, k: int):
    """Q4_1 bytes [n, k / 32 * 20] of one expert -> (uint8 codes [n, k], fp32 (scale, min) pairs
    [n, k / 32, 2]) = (float(d), float(m)), exactly; raises for a non-finite d or m."""
    b = np.ascontiguousarray(raw).reshape(n, k // 32, 20)
    d = b[..., 0:2].copy().view("<f2")[..., 0].astype(np.float32)  # [n, G]
    m = b[..., 2:4].copy().view("<f2")[..., 0].astype(np.float32)
    _refuse_non_finite(name, "Q4_1", e, "block scale d", d)
    _refuse_non_finite(name, "Q4_1", e, "block min m", m)
    qs = b[..., 4:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1)  # [n, G, 32]: j, j + 16
    return q.reshape(n, k).astype(np.uint8), np.stack([d, m], axis=-1)


def _f16(b: np.ndarray) -> np.ndarray:
    """The fp16 at bytes b[..., 0:2] as float32."""
    return b[..., 0:2].copy().view("<f2")[..., 0].astype(np.float32)


def _q8_0_expert(name: str, e: int, raw: np.ndarray, n: int, k: int):
    """Q8_0 bytes [n, k / 32 * 34] of one expert -> (uint8 codes q + 128 [n, k], fp32 (scale,
    min) pairs (float(d), -128 float(d)) [n, k / 32, 2]): d * (q + 128) - 128 d = d * q
    exactly (19 significant bits); raises for a non-finite d."""
    b = np.ascontiguousarray(raw).reshape(n, k // 32, 34)
    d = _f16(b)
    _refuse_non_finite(name, "Q8_0", e, "block scale d", d, fmt="int8_affine")
    codes = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return codes.reshape(n, k), np.stack([d, np.float32(-128) * d], axis=-1)


def _q5_codes(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1 codes [..., 32] (0..31) of blocks with qh [..., 4] (bit j: element j's fifth
    bit) and qs [..., 16] (element j in the low nibble of byte j, j + 16 in the high one)."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")  # [..., 32]: bit j of the le uint32
    lo = np.concatenate([qs & 15, qs >> 4], axis=-1)
    return (lo | (bits << 4)).astype(np.uint8)


def _q5_0_expert(name: str, e: int, raw: np.ndarray, n: int, k: int):
    """Q5_0 bytes [n, k / 32 * 22] -> (codes q [n, k], pairs (float(d), -16 float(d))):
    w = d * (q - 16), exactly; raises for a non-finite d."""
    b = np.ascontiguousarray(raw).reshape(n, k // 32, 22)
    d = _f16(b)
    _refuse_non_finite(name, "Q5_0", e, "block scale d", d, fmt="int8_affine")
    q = _q5_codes(b[..., 2:6], b[..., 6:])
    return q.reshape(n, k), np.stack([d, np.float32(-16) * d], axis=-1)


def _q5_1_expert(name: str, e: int, raw: np.ndarray, n: int, k: int):
    """Q5_1 bytes [n, k / 32 * 24] -> (codes q [n, k], pairs (float(d), float(m))):
    w = d * q + m; raises for a non-finite d or m."""
    b = np.ascontiguousarray(raw).reshape(n, k // 32, 24)
    d, m = _f16(b), _f16(b[..., 2:4])
    _refuse_non_finite(name, "Q5_1", e, "block scale d", d, fmt="int8_affine")
    _refuse_non_finite(name, "Q5_1", e, "block min m", m, fmt="int8_affine")
    q = _q5_codes(b[..., 4:8], b[..., 8:])
    return q.reshape(n, k), np.stack([d, m], axis=-1)


def _k_scales(name, qtype, e, b, n, S):
    """The (scale, min) pairs [n, S * 8, 2] of Q4_K / Q5_K super-blocks b [n, S, bytes]: fp16 d,
    dmin at bytes 0-3, the 12 packed 6-bit sc / m at bytes 4-15, as llama.cpp's
    get_scale_min_k4 (bytes 0-3: sc 0-3 in the low 6 bits, the top 2 bits of sc 4-7 above; 4-7:
    the same for m; 8-11: the low 4 bits of sc 4-7 and, above, of m 4-7): (float(d) * sc,
    -(float(dmin) * m)), both products exact (11 significant bits times 6)."""
    d, dmin = _f16(b), _f16(b[..., 2:4])  # [n, S]
    fmt = "int4_affine" if qtype == "Q4_K" else "int8_affine"
    _refuse_non_finite(name, qtype, e, "super-block scale d", d, "super-block", fmt)
    _refuse_non_finite(name, qtype, e, "super-block min scale dmin", dmin, "super-block", fmt)
    sb = b[..., 4:16].reshape(n, S, 3, 4)
    lo_s, lo_m, hi = sb[..., 0, :], sb[..., 1, :], sb[..., 2, :]
    sc = np.concatenate([lo_s & 63, (hi & 15) | ((lo_s >> 2) & 48)], axis=-1)  # [n, S, 8]
    mn = np.concatenate([lo_m & 63, (hi >> 4) | ((lo_m >> 2) & 48)], axis=-1)
    scale = d[..., None] * sc.astype(np.float32)
    mins = -(dmin[..., None] * mn.astype(np.float32))
    return np.stack([scale, mins], axis=-1).reshape(n, S * 8, 2).astype(np.float32)


def _q4_k_expert(name: str, e: int, raw: np.ndarray, n: int, k: int):
    """Q4_K bytes [n, k / 256 * 144] of one expert -> (uint8 codes [n, k], fp32 (scale, min)
    pairs [n, k / 32, 2]) (_k_scales) per sub-block of 32; raises for a non-finite d or dmin."""
    S = k // 256
    b = np.ascontiguousarray(raw).reshape(n, S, 144)
    pairs = _k_scales(name, "Q4_K", e, b, n, S)
    qs = b[..., 16:].reshape(n, S, 4, 1, 32)  # 4 runs of 32 bytes: sub-blocks 2r (low), 2r + 1
    q = np.concatenate([qs & 15, qs >> 4], axis=-2)  # [n, S, 4, 2, 32]
    return q.reshape(n, k).astype(np.uint8), pairs


def _q5_k_expert(name: str, e: int, raw: np.ndarray, n: int, k: int):
    """Q5_K bytes [n, k / 256 * 176] of one expert -> (uint8 codes 0..31 [n, k], pairs as Q4_K):
    the low 4 bits as Q4_K's (128 bytes at 48: 4 runs of 32, sub-block 2r low, 2r + 1 high),
    the fifth bit of element l of sub-block s from bit s of qh[l] (32 bytes at 16)."""
    S = k // 256
    b = np.ascontiguousarray(raw).reshape(n, S, 176)
    pairs = _k_scales(name, "Q5_K", e, b, n, S)
    qh = b[..., 16:48]  # [n, S, 32]
    qs = b[..., 48:].reshape(n, S, 4, 1, 32)
    lo = np.concatenate([qs & 15, qs >> 4], axis=-2).reshape(n, S, 8, 32)
    hi = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [n, S, 8, 32]
    return (lo | (hi << 4)).reshape(n, k).astype(np.uint8), pairs


def _requantized_expert(qtype, name: str, e: int, raw: np.ndarray, n: int, k: int):
    """One expert's tensor of a type cpumoe does not hold (requantize="int8_affine"): gguf's
    float32 weights [n, k], re-quantized to int8_affine groups of 32 (codes, pairs)."""
    from gguf.quants import dequantize
    try:
        w = np.asarray(dequantize(np.ascontiguousarray(raw), qtype), np.float32).reshape(n, k)
    except NotImplementedError as err:
        raise GgufUnsupported(f"{name}: {qtype.name}: gguf cannot dequantize it, so it cannot be "
                              f"re-quantized ({err})") from err
    if not np.isfinite(w).all():
        r, c = (int(i[0]) for i in np.nonzero(~np.isfinite(w)))
        raise GgufUnsupported(f"{name}: {qtype.name} weight {w[r, c]} (expert {e}, row {r}, "
                              f"column {c}) is not finite")
    return quantize_int8_affine(w, 32)


_CONVERT = {"Q4_0": _q4_0_expert, "MXFP4": _mxfp4_expert, "BF16": _bf16_expert,
            "Q4_1": _q4_1_expert, "Q4_K": _q4_k_expert, "Q8_0": _q8_0_expert,
            "Q5_0": _q5_0_expert, "Q5_1": _q5_1_expert, "Q5_K": _q5_k_expert}


def read_gguf_experts(path: PathLike, layer: int, *,
                      experts: Optional[Sequence[int]] = None,
                      activation: Optional[str] = None,
                      requantize: Optional[str] = None) -> GgufExperts:
    """Reads MoE layer ``layer`` of GGUF file ``path`` (see the module doc) one expert at a
    time; ``experts``: the global ids to read (default all). ``.prepack()`` packs the result,
    ``.activation`` is the activation its w13 layout is for: ``activation`` (a spec of
    :func:`cpumoe.parse_activation`: a name of :data:`cpumoe.ACTIVATIONS`, with parameters where
    it takes them) when given, else :func:`gguf_activation` of the file's architecture.

    ``requantize="int8_affine"``: a gate / up / down tensor of a type no cpumoe format holds
    exactly (Q6_K, the other K-quants, IQ types, F16, F32, ...; the ones ``gguf`` dequantizes) is
    dequantized by ``gguf.quants.dequantize`` and re-quantized to 8-bit min-max groups of 32
    (:func:`cpumoe.quantize.quantize_int8_affine`): not the file's weights, but within about
    1/510 of each group's range of them (``requantized`` names those tensors); the others are
    read exactly, in the widest format. Default None: such tensors are refused."""
    if requantize not in (None, "int8_affine"):
        raise ValueError(f"requantize: None or 'int8_affine', got {requantize!r}")
    gguf = _gguf()
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        raise TypeError(f"layer: must be an int, got {type(layer).__name__}")
    layer = int(layer)
    if activation is not None:
        activation = _check_activation(activation)
    reader = _open(path)
    arch = _field(reader, gguf.Keys.General.ARCHITECTURE)
    arch = arch if isinstance(arch, str) else ""
    n_blocks = _field(reader, gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)) if arch else None
    if layer < 0 or (isinstance(n_blocks, int) and layer >= n_blocks):
        raise ValueError(f"layer: {layer} is out of range: {os.fspath(path)} has "
                         f"{n_blocks if isinstance(n_blocks, int) else 'an unknown number of'} "
                         f"blocks (architecture {arch!r})")
    tensors = {t.name: t for t in reader.tensors}
    names = gguf.TENSOR_NAMES
    MT = gguf.MODEL_TENSOR

    def tname(kind, suffix="weight"):
        return f"{names[kind].format(bid=layer)}.{suffix}"

    gate_n, up_n, down_n = (tname(k) for k in (MT.FFN_GATE_EXP, MT.FFN_UP_EXP, MT.FFN_DOWN_EXP))
    fused_kind = getattr(MT, "FFN_GATE_UP_EXP", None)
    if fused_kind is not None and fused_kind in names and tname(fused_kind) in tensors:
        raise GgufUnsupported(f"{tname(fused_kind)}: fused gate_up experts are not read yet "
                              f"(cpumoe reads separate ffn_gate_exps / ffn_up_exps)")
    present = [n for n in (gate_n, up_n, down_n) if n in tensors]
    if not present:
        split = _field(reader, gguf.Keys.Split.LLM_KV_SPLIT_COUNT)
        hint = (f" (a split GGUF of {split} files: split files are not read yet)"
                if isinstance(split, int) and split > 1 else "")
        raise GgufUnsupported(f"{os.fspath(path)}: layer {layer} has no MoE experts "
                              f"({gate_n} not found){hint}")
    for n in (gate_n, up_n, down_n):
        if n not in tensors:
            raise GgufUnsupported(f"{os.fspath(path)}: missing {n} (layer {layer} has "
                                  f"{', '.join(present)})")
    tg, tu, td = tensors[gate_n], tensors[up_n], tensors[down_n]
    types = tuple(_type_name(t) for t in (tg, tu, td))
    requantized = tuple(t.name for t, q in zip((tg, tu, td), types) if q not in GGUF_FORMATS)
    for t, q in zip((tg, tu, td), types):
        if q not in GGUF_FORMATS and requantize is None:
            hint = (" (requantize='int8_affine' reads it re-quantized to 8-bit groups of 32, "
                    "where gguf dequantizes it)")
            raise GgufUnsupported(f"{t.name} is {q}: cpumoe does not run {q} experts yet "
                                  f"({_why_not(q)}); it reads "
                                  f"{', '.join(f'{k} (as {v})' for k, v in GGUF_FORMATS.items())}"
                                  f" (layer {layer}: gate / up / down are {' / '.join(types)})"
                                  f"{hint}")
    fmts = [GGUF_FORMATS.get(q, "int8_affine") for q in types]
    if len(set(fmts)) != 1 and not set(fmts) <= set(WIDENING):
        raise GgufUnsupported(
            f"layer {layer}: gate / up / down are {' / '.join(types)}, i.e. cpumoe formats "
            f"{' / '.join(fmts)}: a packed layer holds one format (no re-quantization)")
    fmt = widest_format(fmts) if set(fmts) <= set(WIDENING) else fmts[0]
    sg, su, sd = (_np_shape(t) for t in (tg, tu, td))
    if len(sg) != 3 or sg != su or len(sd) != 3 or sd != (sg[0], sg[2], sg[1]):
        raise GgufUnsupported(f"layer {layer}: shapes {gate_n} {list(sg)}, {up_n} {list(su)}, "
                              f"{down_n} {list(sd)}: expected [E, I, H], [E, I, H], [E, H, I]")
    n_global, I, H = sg
    if n_global < 1 or I < 1 or H < 1:
        raise GgufUnsupported(f"{gate_n}: empty shape {list(sg)}")
    ids = expert_ids_of(experts, n_global)
    E = len(ids)

    bias_names = [tname(k, "bias") for k in (MT.FFN_GATE_EXP, MT.FFN_UP_EXP, MT.FFN_DOWN_EXP)]
    biases = []
    for bn, want in zip(bias_names, ((n_global, I), (n_global, I), (n_global, H))):
        if bn not in tensors:
            biases.append(None)
            continue
        t = tensors[bn]
        if _type_name(t) not in _FLOAT_BIAS:
            raise GgufUnsupported(f"{bn} is {_type_name(t)}: biases must be F32, F16 or BF16")
        if _np_shape(t) != want:
            raise GgufUnsupported(f"{bn}: shape {list(_np_shape(t))}, expected {list(want)}")
        biases.append(t)
    if (biases[0] is None) != (biases[1] is None):
        have, miss = (bias_names[0], bias_names[1]) if biases[1] is None else (bias_names[1],
                                                                              bias_names[0])
        raise GgufUnsupported(f"{have} present but {miss} missing: gate and up biases go "
                              f"together")

    if activation is None:
        activation = gguf_activation(arch)
    from .ops import activation_interleaved
    interleaved = activation_interleaved(activation)
    if fmt == "int4":
        w13 = np.empty((E, 2 * I, H), np.int8)
        w2 = np.empty((E, H, I), np.int8)
        s13 = np.empty((E, 2 * I, H // 32), np.float32)
        s2 = np.empty((E, H, I // 32), np.float32)
    elif fmt in ("int4_affine", "int8_affine"):
        w13 = np.empty((E, 2 * I, H), np.uint8)
        w2 = np.empty((E, H, I), np.uint8)
        s13 = np.empty((E, 2 * I, H // 32, 2), np.float32)
        s2 = np.empty((E, H, I // 32, 2), np.float32)
    elif fmt == "mxfp4":
        w13 = np.empty((E, 2 * I, H // 32, 16), np.uint8)
        w2 = np.empty((E, H, I // 32, 16), np.uint8)
        s13 = np.empty((E, 2 * I, H // 32), np.uint8)
        s2 = np.empty((E, H, I // 32), np.uint8)
    else:
        w13 = np.empty((E, 2 * I, H), np.uint16)
        w2 = np.empty((E, H, I), np.uint16)
        s13 = s2 = None
    rg, ru = ((slice(0, None, 2), slice(1, None, 2)) if interleaved
              else (slice(0, I), slice(I, 2 * I)))
    try:
        for j, e in enumerate(ids):
            for t, q, rows, wdst, sdst, n, k in ((tg, types[0], rg, w13, s13, I, H),
                                                 (tu, types[1], ru, w13, s13, I, H),
                                                 (td, types[2], slice(None), w2, s2, H, I)):
                conv = _CONVERT.get(q) or functools.partial(_requantized_expert, t.tensor_type)
                v, s = widen_values(*conv(t.name, e, t.data[e], n, k),
                                    GGUF_FORMATS.get(q, "int8_affine"), fmt)
                wdst[j, rows] = v
                if sdst is not None:
                    sdst[j, rows] = s
        b13 = b2 = None
        if biases[0] is not None:
            b13 = np.empty((E, 2 * I), np.float32)
            b13[:, rg] = _float32_of(biases[0])[ids]
            b13[:, ru] = _float32_of(biases[1])[ids]
        if biases[2] is not None:
            b2 = np.ascontiguousarray(_float32_of(biases[2])[ids])
    except GgufUnsupported:
        raise
    except (ValueError, IndexError, TypeError) as err:  # data not as its header says
        raise GgufUnsupported(f"{os.fspath(path)}: layer {layer}: the tensor data cannot be "
                              f"read ({type(err).__name__}: {err})") from err
    if fmt == "bf16":
        try:
            import ml_dtypes
        except ImportError as err:
            raise ImportError("cpumoe.load_experts: BF16 experts need ml_dtypes as numpy's "
                              "bfloat16: pip install ml_dtypes") from err
        w13, w2 = w13.view(ml_dtypes.bfloat16), w2.view(ml_dtypes.bfloat16)
    return GgufExperts(fmt, 32 if fmt in ("int4", "int4_affine", "int8_affine", "mxfp4") else 0,
                       w13, w2, s13, s2, b13, b2, ids, n_global, activation, layer, arch,
                       types, requantized)
