"""The public ops: prepack the expert weights once, run the fused W8A8 (W4A8, BF16) MoE."""

from __future__ import annotations

import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import _C
from ._tensors import (FLOAT_DTYPES, View, as_float32, check_dtype, check_rows, check_shape,
                       contiguous, empty_like_rows, view)

#: The public API (re-exported by the package): the tables, the packed classes, prepack of each
#: format (the table's ``prepack`` names), the op, the kernel and path queries.
__all__ = ["ACTIVATIONS", "FORMATS", "PackedMoe", "PackedMoeBf16", "PackedMoeFp8", "PackedMoeW4",
           "activation_spec", "activations", "available_paths", "bf16_kernels", "cpu_features",
           "formats", "fused_moe", "fused_moe_bf16", "fused_moe_int8", "kernels",
           "parse_activation", *(f["prepack"] for f in _C.formats()), "scratch_bytes",
           "selected_path", "w4_kernels", "f8_kernels"]

#: The op's activations by name, from the extension's table (activation.h); each runs as a spec
#: string: the name alone, or with its parameters, e.g. "silu_clamp(limit=10)" (see
#: :func:`activation_spec`).
ACTIVATIONS = tuple(a["name"] for a in _C.activations())
#: The weight formats by name, from the extension's table (weight_format.h): the values of
#: ``packed.weight_format`` (see :func:`formats`).
FORMATS = tuple(f["name"] for f in _C.formats())
PackedMoe = _C.PackedMoe
PackedMoeBf16 = _C.PackedMoeBf16
PackedMoeW4 = _C.PackedMoeW4
PackedMoeFp8 = _C.PackedMoeFp8
# The packed class of each kernel family of the table, and the _C op that runs it.
_PACKED_OF_FAMILY = {"qgemm": PackedMoe, "q4gemm": PackedMoeW4, "bgemm": PackedMoeBf16,
                     "f8gemm": PackedMoeFp8}
_OP_OF_PACKED = {PackedMoe: _C.fused_moe_int8, PackedMoeW4: _C.fused_moe_w4,
                 PackedMoeBf16: _C.fused_moe_bf16, PackedMoeFp8: _C.fused_moe_fp8}


def _packed_kinds(activations: Optional[str] = None) -> Tuple[Any, ...]:
    """The packed classes of the formats whose op takes ``activations`` ("int8" / "bf16"; None:
    every format), in table order."""
    return tuple(dict.fromkeys(_PACKED_OF_FAMILY[f["family"]] for f in _C.formats()
                               if activations in (None, f["activations"])))


def _expected_packed(activations: Optional[str] = None) -> str:
    """What ``packed`` may be, for a TypeError: each format's class and prepack function."""
    return ", ".join(f"cpumoe.{_PACKED_OF_FAMILY[f['family']].__name__} from {f['prepack']}() "
                     f"({f['name']})" for f in _C.formats()
                     if activations in (None, f["activations"]))


#: The packed kinds fused_moe_int8 runs (int8 activations): W8A8 and W4A8.
_INT8_PACKED = _packed_kinds("int8")
#: ... and fused_moe_bf16 (bf16 activations): BF16 and fp8 (W8A16).
_BF16_PACKED = _packed_kinds("bf16")
_ANY_PACKED = _packed_kinds()


def formats() -> List[Dict[str, Any]]:
    """The weight formats, one dict per row of the extension's table: ``name``, ``bits`` (per
    weight), ``value_code`` ("int", "e2m1", "bf16"), ``scale`` ("fp32_per_channel",
    "fp32_per_group", "e8m0_per_block" or "none") and ``scale_bytes`` (one scale in prepack's
    input), ``group`` ("none", "multiple": any multiple of ``group_size`` up to ``group_max``,
    "exact": ``group_size``), ``zero_point``, ``family`` (the kernel family that reads it),
    ``activations`` (its op's: "int8", quantized per token, or "bf16") and ``prepack`` (the
    function of this package that packs it)."""
    return [dict(f) for f in _C.formats()]


def activations() -> List[Dict[str, Any]]:
    """The op's activations: ``name``, ``interleaved`` (gate/up at even/odd columns of w13's
    rows, else halves), ``params`` (parameter -> default, None where it must be given) and
    ``formula``."""
    return [dict(a, params=dict(a["params"])) for a in _C.activations()]


def parse_activation(spec: Any) -> Tuple[str, str, float, float]:
    """(name, canonical spec, limit, alpha) of an activation spec: a name of :data:`ACTIVATIONS`
    alone ("silu", "swigluoai": the defaults) or with parameters ("silu_clamp(limit=10)",
    "swigluoai(limit=7,alpha=1.702)"); limit and alpha as the op's fp32 values (0 where the
    activation takes none). TypeError / ValueError when it cannot run."""
    if not isinstance(spec, str):
        raise TypeError(f"activation: must be a str, got {type(spec).__name__}")
    name, canon, limit, alpha = _C.parse_activation(spec)
    return str(name), str(canon), float(limit), float(alpha)


def activation_interleaved(spec: Any) -> bool:
    """Whether the activation of ``spec`` reads gate and up interleaved (even / odd rows of w13,
    swigluoai) rather than as halves; errors as :func:`parse_activation`."""
    name = parse_activation(spec)[0]
    return next(a["interleaved"] for a in _C.activations() if a["name"] == name)


def activation_spec(name: str, *, limit: Optional[float] = None,
                    alpha: Optional[float] = None) -> str:
    """The canonical spec string of activation ``name`` with its parameters (None: the default;
    a parameter the activation does not take is an error), e.g.
    ``activation_spec("silu_clamp", limit=10) == "silu_clamp(limit=10)"``."""
    if not isinstance(name, str):
        raise TypeError(f"activation: must be a str, got {type(name).__name__}")
    parts = []
    for key, v in (("limit", limit), ("alpha", alpha)):
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"activation {name}: {key} must be a number, got {type(v).__name__}")
        parts.append(f"{key}={float(v)!r}")
    return parse_activation(f"{name}({','.join(parts)})" if parts else name)[1]


def cpu_features() -> Dict[str, Any]:
    """Features of the running CPU that cpumoe's kernels use (read at run time), plus ``arch``."""
    return dict(_C.cpu_features())


def kernels() -> List[Dict[str, Any]]:
    """The int8 GEMM kernels compiled in, best first, each with ``supported`` on this CPU."""
    return [dict(k) for k in _C.kernels()]


def bf16_kernels() -> List[Dict[str, Any]]:
    """The bf16 GEMM kernels (of :func:`fused_moe_bf16`) compiled in, best first."""
    return [dict(k) for k in _C.bf16_kernels()]


def w4_kernels() -> List[Dict[str, Any]]:
    """The W4A8 GEMM kernels (of :func:`prepack_int4` / :func:`prepack_mxfp4`) compiled in,
    best first."""
    return [dict(k) for k in _C.w4_kernels()]


def f8_kernels() -> List[Dict[str, Any]]:
    """The fp8 (W8A16) GEMM kernels (of :func:`prepack_fp8`) compiled in, best first."""
    return [dict(k) for k in _C.f8_kernels()]


#: The kernel listing and selection of each kernel family of the format table.
_KERNELS_OF_FAMILY = {"qgemm": (_C.kernels, _C.select_kernel),
                      "q4gemm": (_C.w4_kernels, _C.select_w4_kernel),
                      "bgemm": (_C.bf16_kernels, _C.select_bf16_kernel),
                      "f8gemm": (_C.f8_kernels, _C.select_f8_kernel)}


def _family(op: str):
    """The kernel family functions of the layers of weight format ``op`` (a name of
    :data:`FORMATS`; "w4", the earlier name of the 4-bit layers, is int4's)."""
    fmt = "int4" if op == "w4" else op
    row = next((f for f in _C.formats() if f["name"] == fmt), None)
    if row is None:
        raise ValueError(f"op: must be a weight format, one of {', '.join(FORMATS)}, got {op!r}")
    return _KERNELS_OF_FAMILY[row["family"]]


def available_paths(op: str = "int8") -> List[str]:
    """Paths (ISA levels) this CPU runs for layers of weight format ``op`` (a name of
    :data:`FORMATS`, e.g. "int8", "mxfp4", "bf16"), best first, ``"portable"`` last, capped by
    CPUMOE_ISA."""
    kernels_of, _ = _family(op)
    cap = _C.env_isa_cap()
    ladder = _C.isa_ladder()
    allowed = ladder[ladder.index(cap):] if cap is not None else ladder
    compiled = {k["isa"] for k in kernels_of() if k["supported"]}
    return [p for p in allowed if p in compiled]


def selected_path(isa: Optional[str] = None, op: str = "int8") -> str:
    """The path the prepack of weight format ``op`` (as :func:`available_paths`) picks by
    default, or under the cap ``isa``."""
    kernels_of, select = _family(op)
    name = select(isa)
    return next(k["isa"] for k in kernels_of() if k["name"] == name)


def _num_threads(num_threads: Optional[int], *tensors: Any) -> int:
    """Explicit count, else torch's when a torch tensor is involved, else OpenMP's default (0)."""
    if num_threads is not None:
        if not isinstance(num_threads, int) or isinstance(num_threads, bool) or num_threads < 1:
            raise ValueError(f"num_threads: must be a positive int, got {num_threads!r}")
        return min(num_threads, 2**31 - 1)  # the native side caps it further (see moe.h)
    torch = sys.modules.get("torch")
    if torch is not None and any(isinstance(t, torch.Tensor) for t in tensors):
        return int(torch.get_num_threads())
    return 0


def _scales(name: str, obj: Any, E: int, N: int):
    s = as_float32(name, obj)
    v = view(name, s)
    if v.ndim == 3 and v.shape[2] == 1:  # compressed-tensors stores [E, N, 1]
        s = s.reshape(E, N) if v.shape[:2] == (E, N) else s
        v = view(name, s)
    check_shape(v, name, (E, N))
    return s, v


def _bias(name: str, obj: Any, E: int, N: int):
    if obj is None:
        return None, 0, "float32"
    b = as_float32(name, obj)
    v = view(name, b)
    check_shape(v, name, (E, N))
    return b, v.address, v.dtype


def _expert_weights(w13: Any, w2: Any, dtype: str, isa: Any):
    """Checks w13 [E, 2I, H] and w2 [E, H, I] of ``dtype`` and the isa argument of a prepack.
    Returns (w13 contiguous, its view, w2's view, E, H, I); w2's view keeps w2 alive."""
    w13 = contiguous("w13", w13)
    w2 = contiguous("w2", w2)
    v13, v2 = view("w13", w13), view("w2", w2)
    check_dtype(v13, "w13", (dtype,))
    check_dtype(v2, "w2", (dtype,))
    if v13.ndim != 3:
        raise ValueError(f"w13: shape must be [E, 2I, H], got {list(v13.shape)}")
    E, I2, H = v13.shape
    if I2 % 2:
        raise ValueError(f"w13: dim 1 must be 2*I (even), got {I2}")
    I = I2 // 2
    check_shape(v2, "w2", (E, H, I), " to match w13 [E, 2I, H]")
    if isa is not None and not isinstance(isa, str):
        raise TypeError(f"isa: must be a str or None, got {type(isa).__name__}")
    return w13, v13, v2, E, H, I


def prepack(w13: Any, w2: Any, s13: Any, s2: Any, b13: Any = None, b2: Any = None, *,
            isa: Optional[str] = None, num_threads: Optional[int] = None) -> PackedMoe:
    """Packs a layer's int8 expert weights once, for the path this CPU will use.

    Args:
      w13: int8 [E, 2I, H]: gate rows [0, I), up rows [I, 2I) (swigluoai: even / odd rows).
      w2: int8 [E, H, I].
      s13, s2: per-output-channel scales [E, 2I] / [E, H] (or [..., 1]); finite and > 0.
      b13, b2: optional biases [E, 2I] / [E, H], any float dtype (kept as float32).
      isa: cap the path (e.g. ``"portable"``); default: the best this CPU runs, capped by the
        CPUMOE_ISA environment variable.
    H and I must be multiples of 8. The inputs are copied; they can be freed afterwards.
    """
    w13, v13, v2, E, H, I = _expert_weights(w13, w2, "int8", isa)
    s13, vs13 = _scales("s13", s13, E, 2 * I)
    s2, vs2 = _scales("s2", s2, E, H)
    b13, b13_addr, b13_dt = _bias("b13", b13, E, 2 * I)
    b2, b2_addr, b2_dt = _bias("b2", b2, E, H)
    return _C.prepack(E, H, I, v13.address, v2.address, vs13.address, vs2.address, b13_addr,
                      b13_dt, b2_addr, b2_dt, isa, _num_threads(num_threads, w13))


def prepack_bf16(w13: Any, w2: Any, b13: Any = None, b2: Any = None, *,
                 isa: Optional[str] = None, num_threads: Optional[int] = None) -> PackedMoeBf16:
    """Packs a layer's bf16 expert weights once, for :func:`fused_moe_bf16`.

    Args:
      w13: bfloat16 [E, 2I, H]: gate rows [0, I), up rows [I, 2I) (swigluoai: even / odd rows).
      w2: bfloat16 [E, H, I].
      b13, b2: optional biases [E, 2I] / [E, H], any float dtype (kept as float32).
      isa: cap the path, as in :func:`prepack`.
    H and I must be multiples of 8. The inputs are copied; they can be freed afterwards.
    """
    w13, v13, v2, E, H, I = _expert_weights(w13, w2, "bfloat16", isa)
    b13, b13_addr, b13_dt = _bias("b13", b13, E, 2 * I)
    b2, b2_addr, b2_dt = _bias("b2", b2, E, H)
    return _C.prepack_bf16(E, H, I, v13.address, v2.address, b13_addr, b13_dt, b2_addr, b2_dt,
                           isa, _num_threads(num_threads, w13))


def _w4_bias_and_isa(E, H, I, b13, b2, isa):
    if isa is not None and not isinstance(isa, str):
        raise TypeError(f"isa: must be a str or None, got {type(isa).__name__}")
    b13, b13_addr, b13_dt = _bias("b13", b13, E, 2 * I)
    b2, b2_addr, b2_dt = _bias("b2", b2, E, H)
    return (b13, b2), (b13_addr, b13_dt, b2_addr, b2_dt)


def _int_arg(name: str, v: Any, low: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not low <= v < 2**62:
        raise ValueError(f"{name}: must be an int >= {low}, got {v!r}")
    return v


def prepack_int4(w13: Any, w2: Any, s13: Any, s2: Any, b13: Any = None, b2: Any = None, *,
                 group_size: int = 32, isa: Optional[str] = None,
                 num_threads: Optional[int] = None, act_quant: str = "row") -> Any:
    """Packs a layer's int4 expert weights (W4A8) once, for :func:`fused_moe`
    (a :class:`PackedMoeW4`; with act_quant="bf16" a :class:`PackedMoeFp8`).

    Args:
      w13: int8 [E, 2I, H] holding int4 values in [-8, 7] (unpacked, one per element): gate rows
        [0, I), up rows [I, 2I) (swigluoai: even / odd rows).
      w2: int8 [E, H, I], values in [-8, 7].
      s13, s2: group scales [E, 2I, H / g] / [E, H, I / g], finite (any sign): weight
        ``w[n, k] = value[n, k] * s[n, k // g]``.
      b13, b2: optional biases [E, 2I] / [E, H], any float dtype (kept as float32).
      group_size: g, a multiple of 32 dividing H and I, at most 65536.
      isa: cap the path, as in :func:`prepack`.
      act_quant: how the op quantizes the int8 activations: "row" (one scale per token row,
        the default) or "group" (one scale per g values of a row, aligned with the weight
        groups: closer to the float layer where a row's magnitudes vary along k, for one more
        multiply per group; ``packed.act_quant`` tells). See cpumoe.reference's module comment.
        "bf16" (W4A16, accuracy over speed): no activation quantization; the result is a
        :class:`PackedMoeFp8` (weight_format "fp8") that the FP8 op runs with bf16
        activations: the 4-bit codes index a 16-entry E4M3 codebook of the values (exact),
        the group scales are (1, g) blocks. Kernels that keep 4-bit codes (AVX-512 BF16, AMX,
        AVX-512, Arm BF16, portable: ``packed.code_bits`` 4) read 4 bits per weight plus the
        scales; the others (AVX2, Arm NEON) get the E4M3 codes (8 bits).
    The packed layer holds 4 bits per weight plus the scales. Each GEMM output is
    ``s_x * sum_g (exact int32 group sum) * s[n, g] + b[n]``, fp32 over the groups in order.
    """
    return _prepack_int_groups("int4", w13, w2, s13, s2, b13, b2, group_size, isa, num_threads,
                               act_quant)


def _act_quant_arg(act_quant: Any, fmt: str = "int4_affine") -> str:
    """The act_quant of a W4A8 prepack of format fmt: "row", "group", and for int4 and mxfp4
    "bf16" (W4A16: _prepack_w4a16)."""
    modes = ("row", "group", "bf16") if fmt in ("int4", "mxfp4") else ("row", "group")
    if act_quant not in modes:
        extra = (" ('bf16' is for int4 and mxfp4: an affine format's mins need the int8 "
                 "activations' group sums)" if act_quant == "bf16" else "")
        raise ValueError(f"act_quant: must be {', '.join(map(repr, modes))} for {fmt}, got "
                         f"{act_quant!r}{extra}")
    return act_quant


def _prepack_w4a16(idx13, idx2, book, scales13, scales2, b13, b2, g, isa, num_threads):
    """act_quant="bf16" (W4A16): the 4-bit codes (uint8 indices [E, N, K] into ``book``, the 16
    integer values of the format: int4's -8..7, mxfp4's 2 E2M1) with the group scales as (1, g)
    blocks, packed for the FP8 op (a PackedMoeFp8, weight_format "fp8"), which keeps the
    activations in bf16. The codebook is the values' E4M3 codes (exact: integers up to 12);
    kernels that keep 4-bit codes read half a byte per weight, the others get the E4M3 codes
    (``packed.code_bits``). The scales keep their sign (a codebook has none to spare); a
    non-finite one is an error."""
    import numpy as np
    from .quantize import e4m3_codes, to_numpy
    codebook = np.ascontiguousarray(e4m3_codes(np.asarray(book, np.float32)))
    w13, v13, v2, E, H, I = _expert_weights(to_numpy(idx13).astype(np.uint8),
                                            to_numpy(idx2).astype(np.uint8), "uint8", isa)
    s13, vs13 = _block_scales("s13", scales13, E, 2 * I, H, 1, g)
    s2, vs2 = _block_scales("s2", scales2, E, H, I, 1, g)
    keep, (b13a, b13d, b2a, b2d) = _w4_bias_and_isa(E, H, I, b13, b2, isa)
    return _C.prepack_fp8(E, H, I, 1, g, v13.address, v2.address, vs13.address, vs2.address,
                          b13a, b13d, b2a, b2d, isa, _num_threads(num_threads, w13), 4,
                          codebook.ctypes.data)


def _prepack_int_groups(fmt, w13, w2, s13, s2, b13, b2, group_size, isa, num_threads,
                        act_quant):
    """prepack_int4 / prepack_int4_affine / prepack_int8_affine: values [E, N, K] and per-group
    scales [E, N, K / g] (the affine formats: [E, N, K / g, 2] (scale, min) pairs)."""
    act_quant = _act_quant_arg(act_quant, fmt)
    w13, v13, v2, E, H, I = _expert_weights(w13, w2, "int8" if fmt == "int4" else "uint8", isa)
    g = _int_arg("group_size", group_size, 1)
    if g % 32:
        raise ValueError(f"group_size: must be a positive multiple of 32, got {g}")
    for name, dim in (("H", H), ("I", I)):
        if dim % g:
            raise ValueError(f"group_size: {g} must divide {name} = {dim} (w13 [E, 2I, H], "
                             f"w2 [E, H, I])")
    pair = (2,) if fmt in ("int4_affine", "int8_affine") else ()
    s13 = as_float32("s13", s13)
    s2 = as_float32("s2", s2)
    vs13, vs2 = view("s13", s13), view("s2", s2)
    check_shape(vs13, "s13", (E, 2 * I, H // g) + pair, f" (group_size {g})")
    check_shape(vs2, "s2", (E, H, I // g) + pair, f" (group_size {g})")
    if act_quant == "bf16":  # its own bias handling, in _prepack_w4a16
        import numpy as np
        from .quantize import to_numpy
        v = [to_numpy(a) for a in (w13, w2)]
        if any(a.size and (a.min() < -8 or a.max() > 7) for a in v):
            raise ValueError("w13/w2: int4 values must be in [-8, 7]")
        return _prepack_w4a16(*((a.astype(np.int16) + 8).astype(np.uint8) for a in v),
                              np.arange(-8, 8), s13, s2, b13, b2, g, isa, num_threads)
    keep, (b13a, b13d, b2a, b2d) = _w4_bias_and_isa(E, H, I, b13, b2, isa)
    return _C.prepack_w4(E, H, I, fmt, g, v13.address, v2.address, vs13.address, vs2.address,
                         b13a, b13d, b2a, b2d, isa, _num_threads(num_threads, w13), act_quant)


def prepack_int4_affine(w13: Any, w2: Any, s13: Any, s2: Any, b13: Any = None, b2: Any = None,
                        *, group_size: int = 32, isa: Optional[str] = None,
                        num_threads: Optional[int] = None,
                        act_quant: str = "row") -> PackedMoeW4:
    """Packs a layer's affine 4-bit expert weights (a scale and a min per group: AWQ, asymmetric
    GPTQ, GGUF Q4_1 / Q4_K) once, for :func:`fused_moe`; ``packed.weight_format`` is
    "int4_affine".

    Args:
      w13: uint8 [E, 2I, H] holding codes in [0, 15] (one per element): gate rows [0, I), up
        rows [I, 2I) (swigluoai: even / odd rows).
      w2: uint8 [E, H, I], codes in [0, 15].
      s13, s2: float32 (scale, min) pairs [E, 2I, H / g, 2] / [E, H, I / g, 2], finite (any
        sign): weight ``w[n, k] = s[n, k // g, 0] * code[n, k] + s[n, k // g, 1]``.
      b13, b2: optional biases [E, 2I] / [E, H], any float dtype (kept as float32).
      group_size: g, a multiple of 32 dividing H and I, at most 65536.
      isa: cap the path, as in :func:`prepack`.
      act_quant: "row" or "group", as in :func:`prepack_int4`.
    The packed layer holds 4 bits per weight plus 8 bytes per group. The kernels run the codes
    as int4 values ``code - 8`` with the group scale (the W4A8 kernels) and add the offsets
    ``o = fp32(min + 8 * scale)`` times the exact int32 sums of the int8 activations over each
    group: each GEMM output is ``(s_x * sum_g isum_g * scale_g + b) + (sum_g asum_g * o_g) * s_x``
    (fp32, groups in order).
    """
    return _prepack_int_groups("int4_affine", w13, w2, s13, s2, b13, b2, group_size, isa,
                               num_threads, act_quant)


def prepack_int8_affine(w13: Any, w2: Any, s13: Any, s2: Any, b13: Any = None, b2: Any = None,
                        *, group_size: int = 32, isa: Optional[str] = None,
                        num_threads: Optional[int] = None,
                        act_quant: str = "row") -> PackedMoeW4:
    """Packs a layer's affine 8-bit expert weights (8-bit codes with a scale and a min per group:
    GGUF Q8_0, Q5_0, Q5_1 and Q5_K load into it) once, for :func:`fused_moe`;
    ``packed.weight_format`` is "int8_affine".

    Args:
      w13, w2: uint8 codes [E, 2I, H] / [E, H, I] (any value 0..255), rows as in
        :func:`prepack_int4_affine`.
      s13, s2: float32 (scale, min) pairs [E, 2I, H / g, 2] / [E, H, I / g, 2], finite (any
        sign): ``w[n, k] = s[n, k // g, 0] * code[n, k] + s[n, k // g, 1]``.
      b13, b2, group_size, isa, act_quant: as in :func:`prepack_int4_affine`.
    The kernels run the codes as the int8 values code - 128 with the scale (8 bits per weight),
    and the pipeline adds the group offsets min + 128 * scale (an fp32 each, none kept when all
    are zero: GGUF's Q8_0), so its time is close to W8A8's.
    """
    return _prepack_int_groups("int8_affine", w13, w2, s13, s2, b13, b2, group_size, isa,
                               num_threads, act_quant)


def prepack_mxfp4(w13_blocks: Any, w13_scales: Any, w2_blocks: Any, w2_scales: Any,
                  b13: Any = None, b2: Any = None, *, isa: Optional[str] = None,
                  num_threads: Optional[int] = None, act_quant: str = "row") -> Any:
    """Packs a layer's MXFP4 expert weights (OCP MX, gpt-oss's layout) once, for
    :func:`fused_moe` (a :class:`PackedMoeW4`; with act_quant="bf16" a :class:`PackedMoeFp8`).

    Args:
      w13_blocks: uint8 [E, 2I, H / 32, 16]: two FP4 E2M1 codes per byte, the low nibble first
        (gate and up rows as in :func:`prepack`; gpt-oss interleaves them: swigluoai).
      w13_scales: uint8 [E, 2I, H / 32]: E8M0 group scales, 2^(e - 127); 255 is NaN (the outputs
        of its group are NaN).
      w2_blocks: uint8 [E, H, I / 32, 16]; w2_scales: uint8 [E, H, I / 32].
      b13, b2: optional biases [E, 2I] / [E, H], any float dtype.
      isa: cap the path, as in :func:`prepack`.
      act_quant: "row", "group" (blocks of 32, as GGUF quantizes activations) or "bf16"
        (W4A16; E8M0 255 is then an error: FP8 scales are finite), as in :func:`prepack_int4`.
    """
    act_quant = _act_quant_arg(act_quant, "mxfp4")
    w13_blocks = contiguous("w13_blocks", w13_blocks)
    w2_blocks = contiguous("w2_blocks", w2_blocks)
    w13_scales = contiguous("w13_scales", w13_scales)
    w2_scales = contiguous("w2_scales", w2_scales)
    v13, v2 = view("w13_blocks", w13_blocks), view("w2_blocks", w2_blocks)
    vs13, vs2 = view("w13_scales", w13_scales), view("w2_scales", w2_scales)
    for v, name in ((v13, "w13_blocks"), (v2, "w2_blocks"), (vs13, "w13_scales"),
                    (vs2, "w2_scales")):
        check_dtype(v, name, ("uint8",))
    if v13.ndim != 4 or v13.shape[3] != 16:
        raise ValueError(f"w13_blocks: shape must be [E, 2I, H / 32, 16], got {list(v13.shape)}")
    E, I2, G13, _ = v13.shape
    if I2 % 2:
        raise ValueError(f"w13_blocks: dim 1 must be 2*I (even), got {I2}")
    I, H = I2 // 2, G13 * 32
    if I % 32:
        raise ValueError(f"w2_blocks: I = {I} must be a multiple of 32 (mxfp4 groups)")
    check_shape(v2, "w2_blocks", (E, H, I // 32, 16), " to match w13_blocks [E, 2I, H / 32, 16]")
    check_shape(vs13, "w13_scales", (E, 2 * I, H // 32))
    check_shape(vs2, "w2_scales", (E, H, I // 32))
    if act_quant == "bf16":  # its own bias handling, in _prepack_w4a16
        from .quantize import MXFP4_INT, e8m0_scale, mxfp4_codes
        return _prepack_w4a16(mxfp4_codes(w13_blocks), mxfp4_codes(w2_blocks), MXFP4_INT,
                              e8m0_scale(w13_scales, True), e8m0_scale(w2_scales, True), b13, b2,
                              32, isa, num_threads)
    keep, (b13a, b13d, b2a, b2d) = _w4_bias_and_isa(E, H, I, b13, b2, isa)
    return _C.prepack_w4(E, H, I, "mxfp4", 32, v13.address, v2.address, vs13.address,
                         vs2.address, b13a, b13d, b2a, b2d, isa,
                         _num_threads(num_threads, w13_blocks), act_quant)


def _fp8_bits(name: str, obj: Any):
    """A torch float8_e4m3fn tensor viewed as its uint8 bits; anything else as it is (the
    dtype check that follows wants uint8)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.dtype == getattr(torch, "float8_e4m3fn", None):
            return obj.view(torch.uint8)
        if obj.dtype != torch.uint8:
            raise TypeError(f"{name}: must be float8_e4m3fn (or uint8 holding its bits), got "
                            f"{str(obj.dtype).replace('torch.', '')}")
    return obj


def _block_scales(name: str, obj: Any, E: int, N: int, K: int, bn: int, bk: int):
    s = as_float32(name, obj)
    v = view(name, s)
    want = (E, -(-N // bn), 1 if bk == 0 else -(-K // bk))
    if bn == 1 and bk == 0 and v.ndim == 2 and tuple(v.shape) == (E, N):  # per channel: [E, N]
        s = s.reshape(E, N, 1)
        v = view(name, s)
    check_shape(v, name, want, f" (blocks of {bn} x {'K' if bk == 0 else bk})")
    return s, v


def prepack_fp8(w13: Any, w2: Any, s13: Any, s2: Any, b13: Any = None, b2: Any = None, *,
                block_size: Optional[Tuple[int, int]] = (128, 128), isa: Optional[str] = None,
                num_threads: Optional[int] = None) -> PackedMoeFp8:
    """Packs a layer's FP8 expert weights (float8 E4M3 with fp32 block scales, as DeepSeek-V3,
    Qwen3-FP8 and compressed-tensors FP8 checkpoints hold them) once, for :func:`fused_moe` (the
    BF16 op's pipeline: activations in bf16, no quantization of them: W8A16).

    Args:
      w13: [E, 2I, H] torch float8_e4m3fn, or uint8 holding its bits (gate and up rows as in
        :func:`prepack`); the codes 0x7F and 0xFF (NaN) are an error.
      w2: [E, H, I] likewise.
      s13, s2: float32 scales (any float dtype is widened), the multipliers of the blocks
        (HF's ``weight_scale_inv``): ``w[n, k] = e4m3(q[n, k]) * s[n // bn, k // bk]``, shapes
        [E, ceil(2I / bn), ceil(H / bk)] and [E, ceil(H / bn), ceil(I / bk)]; finite and >= 0.
      block_size: (bn, bk), default (128, 128); bk a multiple of 32 or at least the depth it
        blocks. None: per output channel, scales [E, N] or [E, N, 1].
      b13, b2: optional biases [E, 2I] / [E, H], any float dtype.
      isa: cap the path, as in :func:`prepack`.
    H and I must be multiples of 8. The inputs are copied; they can be freed afterwards.
    """
    if block_size is None:
        bn, bk = 1, 0
    else:
        if (not isinstance(block_size, (tuple, list)) or len(block_size) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) for b in block_size)):
            raise TypeError(f"block_size: must be a pair of ints (bn, bk) or None, got "
                            f"{block_size!r}")
        bn, bk = block_size
        if bn < 1 or bk < 1:
            raise ValueError(f"block_size: both must be >= 1, got {tuple(block_size)}")
    w13, v13, v2, E, H, I = _expert_weights(_fp8_bits("w13", w13), _fp8_bits("w2", w2), "uint8",
                                            isa)
    s13, vs13 = _block_scales("s13", s13, E, 2 * I, H, bn, bk)
    s2, vs2 = _block_scales("s2", s2, E, H, I, bn, bk)
    keep, (b13a, b13d, b2a, b2d) = _w4_bias_and_isa(E, H, I, b13, b2, isa)
    return _C.prepack_fp8(E, H, I, bn, bk, v13.address, v2.address, vs13.address, vs2.address,
                          b13a, b13d, b2a, b2d, isa, _num_threads(num_threads, w13))


def scratch_bytes(T: int, k: int, packed: Any, *, num_threads: Optional[int] = None) -> int:
    """Upper bound of the scratch memory (bytes) one :func:`fused_moe_int8` call with ``T`` tokens
    and ``k`` experts per token takes, for any routing. It stops growing beyond one internal chunk
    (16384 token-expert slots). The calling thread keeps its scratch for its next calls, so a
    thread's steady-state use is this bound for its largest call; ``num_threads`` as in the op
    (default: the OpenMP default; torch inputs use torch's count, which only changes a few KB)."""
    if not isinstance(packed, _ANY_PACKED):
        raise TypeError(f"packed: expected a packed layer ({_expected_packed()}), got "
                        f"{type(packed).__name__}")
    for name, v, low in (("T", T, 0), ("k", k, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or not low <= v < 2**63:
            raise ValueError(f"{name}: must be an int in [{low}, 2**63), got {v!r}")
    return int(_C.scratch_bytes(packed, T, k, _num_threads(num_threads)))


def fused_moe(x: Any, packed: Any, topk_weights: Any, topk_ids: Any, *,
              activation: str = "silu", skip_weighted: bool = False, out: Any = None,
              expert_map: Any = None, num_threads: Optional[int] = None) -> Any:
    """The fused MoE layer: ``out[t] = sum_j topk_weights[t, j] * FFN_{topk_ids[t, j]}(x[t])``
    on any packed layer; the packed object knows its weight format (``packed.weight_format``, a
    name of :data:`FORMATS`), whose row of :func:`formats` says the op's ``activations``: "int8"
    (activations quantized per token) or "bf16".

    Args:
      x: [T, H] float32 / float16 / bfloat16, rows contiguous (row stride may exceed H).
      packed: from the prepack function of its weight format (:func:`formats`' ``prepack``:
        :func:`prepack` for int8, :func:`prepack_int4`, :func:`prepack_bf16`, ...).
      topk_weights: float32 [T, k]. topk_ids: int32 or int64 [T, k], each in [0, E); an id that
        repeats in a row counts twice (two slots, each with its weight), so k > E is allowed.
      activation: a spec of :func:`parse_activation`: a name of :data:`ACTIVATIONS` alone (its
        default parameters) or with its parameters, e.g. "silu_clamp(limit=10)"
        (:func:`activations` has the formulas; :func:`activation_spec` builds the string).
      skip_weighted: the router weight is already applied to x (only with k == 1).
      out: optional [T, H] of x's dtype, written in place and returned; must share no memory
        with x, topk_weights, topk_ids or expert_map.
      expert_map: optional int32 [E_global] for expert parallelism: topk_ids are then global ids
        in [0, E_global), expert_map[g] is the local expert of the packed weights or -1 when it
        lives elsewhere; such slots contribute nothing (a token with none gets zeros).
      num_threads: default: torch's count for torch tensors, else OpenMP's.
    Returns ``out``, or a new tensor/array of x's kind, dtype and shape [T, H].

    int8 activations: dynamic per-token int8 quantization of x and of the activation, fp32
    accumulation. bf16 activations: x (if not bf16) and the activation output rounded to bf16
    (nearest even), products exact and summed in fp32. Either way the combine is fp32 and the
    result is stored in x's dtype. A token whose row of x holds a NaN or an inf gets an all-NaN
    output row (as the reference); NaN/inf router weights or biases propagate through the fp32
    arithmetic; an all-zero token quantizes to zeros. Paths of different ISAs give the same bits
    for the int8 op; for the bf16 op they may differ in the last bits of their fp32 sums (each
    deterministic for any thread count). Thread-safe: concurrent calls (the GIL is released)
    each use their own thread's scratch, at most :func:`scratch_bytes` and kept for that
    thread's next call.
    On torch tensors it compiles: under ``torch.compile(fullgraph=True)`` the call is one
    ``cpumoe::fused_moe_packed`` node (see :mod:`cpumoe.torch_ops`).
    """
    if not isinstance(packed, _ANY_PACKED):
        raise TypeError(f"packed: expected a packed layer ({_expected_packed()}), got "
                        f"{type(packed).__name__}")
    tops = _torch_ops_for(x, topk_weights, topk_ids, activation, skip_weighted, out, expert_map,
                          num_threads)
    if tops is not None:
        return tops.fused_moe_packed(x, packed, topk_weights, topk_ids, activation,
                                     skip_weighted, out, expert_map, num_threads)
    return run_op(native_op(packed), x, packed, topk_weights, topk_ids, activation, skip_weighted,
                  out, expert_map, num_threads)


def _require_kind(packed: Any, kinds: Any, expected: Callable[[], str]) -> None:
    """The TypeError of an alias given a packed layer of another kind (``expected()`` names it;
    called only then: under torch.compile the check must not reach the extension)."""
    if not isinstance(packed, kinds):
        raise TypeError(f"packed: expected {expected()}, got {type(packed).__name__}")


def fused_moe_int8(x: Any, packed: Any, topk_weights: Any, topk_ids: Any,
                   activation: str = "silu", skip_weighted: bool = False, out: Any = None, *,
                   expert_map: Any = None, num_threads: Optional[int] = None) -> Any:
    """:func:`fused_moe` on a layer of int8 activations (``packed`` from :func:`prepack`,
    :func:`prepack_int4` or :func:`prepack_mxfp4`; a bf16 layer is a TypeError)."""
    _require_kind(packed, _INT8_PACKED,
                  lambda: f"a layer of int8 activations ({_expected_packed('int8')})")
    return fused_moe(x, packed, topk_weights, topk_ids, activation=activation,
                     skip_weighted=skip_weighted, out=out, expert_map=expert_map,
                     num_threads=num_threads)


def fused_moe_bf16(x: Any, packed: Any, topk_weights: Any, topk_ids: Any,
                   activation: str = "silu", skip_weighted: bool = False, out: Any = None, *,
                   expert_map: Any = None, num_threads: Optional[int] = None) -> Any:
    """:func:`fused_moe` on a layer of bf16 activations (``packed`` from :func:`prepack_bf16`
    or :func:`prepack_fp8`; an int8-activation layer is a TypeError)."""
    _require_kind(packed, _BF16_PACKED,
                  lambda: f"a layer of bf16 activations ({_expected_packed('bf16')})")
    return fused_moe(x, packed, topk_weights, topk_ids, activation=activation,
                     skip_weighted=skip_weighted, out=out, expert_map=expert_map,
                     num_threads=num_threads)


def native_op(packed):
    """The _C entry point that runs ``packed`` (by its kind)."""
    return _OP_OF_PACKED[type(packed)]


def _torch_ops_for(x, topk_weights, topk_ids, activation, skip_weighted, out, expert_map,
                   num_threads):
    """cpumoe.torch_ops when the call must go through its custom op: torch tensors being traced
    (torch.compile, export, fake or functional tensors), so the op is one node of the graph; else
    None: numpy inputs, arguments the direct path rejects with its own messages, and eager calls
    on plain tensors (same kernel, without the dispatcher's overhead)."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(x, torch.Tensor):
        return None
    tensor = torch.Tensor
    if not (isinstance(topk_weights, tensor) and isinstance(topk_ids, tensor)
            and (out is None or isinstance(out, tensor))
            and (expert_map is None or isinstance(expert_map, tensor))
            and isinstance(activation, str) and isinstance(skip_weighted, bool)):
        return None
    if type(x) is tensor and not torch.compiler.is_compiling():
        return None  # eager on plain tensors: the direct call (the dispatcher adds 15-30 us)
    if num_threads is not None:
        _num_threads(num_threads)  # its checks, before the value enters the op
    from . import torch_ops
    return torch_ops


def run_op(op, x, packed, topk_weights, topk_ids, activation, skip_weighted, out, expert_map,
         num_threads):
    """Checks the call's arguments (shared by both ops) and runs ``op`` on raw buffers."""
    xv = view("x", x)
    check_dtype(xv, "x", FLOAT_DTYPES)
    check_shape(xv, "x", (None, packed.hidden), f" (H = {packed.hidden} of the packed weights)")
    T = xv.shape[0]
    iv = view("topk_ids", topk_ids)
    check_dtype(iv, "topk_ids", ("int32", "int64"))
    if iv.ndim != 2 or iv.shape[0] != T:
        raise ValueError(f"topk_ids: shape must be [T, k] with T = {T}, got {list(iv.shape)}")
    k = iv.shape[1]
    if k < 1:
        raise ValueError("topk_ids: k (its second dim) must be >= 1, got 0")
    wv = view("topk_weights", topk_weights)
    check_dtype(wv, "topk_weights", ("float32",))
    check_shape(wv, "topk_weights", (T, k), " (the shape of topk_ids)")
    parse_activation(activation)  # its TypeError / ValueError before anything runs
    if not isinstance(skip_weighted, bool):
        raise TypeError(f"skip_weighted: must be a bool, got {type(skip_weighted).__name__}")
    if skip_weighted and k != 1:
        raise ValueError(f"skip_weighted: only allowed with k == 1, got k = {k}")
    x_stride = check_rows(xv, "x")
    ids_stride = check_rows(iv, "topk_ids")
    tw_stride = check_rows(wv, "topk_weights")
    if out is None:
        out = empty_like_rows(xv, T, packed.hidden)
    ov = view("out", out)
    if ov.framework != xv.framework or ov.dtype != xv.dtype:
        raise TypeError(f"out: must be a {xv.framework} {xv.dtype} like x, got "
                        f"{ov.framework} {ov.dtype}")
    check_shape(ov, "out", (T, packed.hidden))
    if not ov.writable:
        raise ValueError("out: is read-only")
    out_stride = check_rows(ov, "out")
    map_addr, num_global = 0, 0
    if expert_map is not None:
        mv = view("expert_map", expert_map)
        check_dtype(mv, "expert_map", ("int32",))
        if mv.ndim != 1 or (mv.shape[0] > 1 and mv.strides[0] != 1):
            raise ValueError(f"expert_map: must be a contiguous 1-D [E_global] int32, got shape "
                             f"{list(mv.shape)}")
        map_addr, num_global = mv.address, mv.shape[0]
        if num_global == 0:
            raise ValueError("expert_map: must have at least one entry")
    op(packed, T, k, xv.address, x_stride, xv.dtype, wv.address, tw_stride, iv.address,
       iv.dtype == "int64", ids_stride, activation, skip_weighted, ov.address, out_stride,
       _num_threads(num_threads, x), map_addr, num_global)
    return out
