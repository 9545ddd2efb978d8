"""Loading 4-bit MoE layers (W4A8): compressed-tensors int4 and gpt-oss MXFP4 checkpoints.

Two checkpoint kinds, read through :class:`cpumoe.checkpoint.Checkpoint` (safetensors files,
numpy memory maps, no torch needed):

- **compressed-tensors int4** (``format: pack-quantized``; weights ``num_bits: 4``, ``type:
  int``, ``strategy: group``, ``group_size: g``, ``symmetric`` true or false; input activations
  absent (W4A16: cpumoe quantizes them per token anyway) or dynamic per-token int8 (W4A8)). Each
  expert projection is a Linear: ``<name>.weight_packed`` int32 [out, in / 8] (eight 4-bit fields
  per word, element i at bits 4i, each the signed value q in [-8, 7] plus 8),
  ``<name>.weight_scale`` [out, in / g] (float), ``<name>.weight_shape`` [2] (out, in), and for
  ``symmetric: false`` ``<name>.weight_zero_point`` int32 [ceil(out / 8), in / g]: the zero
  points zp in [-8, 7] (int8 before packing) plus 8, packed eight to a word *along out* (row
  8 r + i at bits 4i of word [r, group]); the weight is ``(q - zp) * scale``. (compressed-tensors
  0.20: ``compressors/pack_quantized/base.py`` ``PackedQuantizationCompressor.compress`` packs
  ``zero_point`` with ``pack_to_int32(zp, 4, packed_dim=0)``; ``pack_quantized/helpers.py``
  ``pack_to_int32`` adds ``1 << (num_bits - 1)``; ``quantization/lifecycle/forward_helpers.py``
  ``_dequantize``: ``(x_q - zero_point) * scale``; ``quantization/utils/helpers.py``
  ``calculate_qparams`` / ``calculate_range``: zp in [-8, 7].) A symmetric checkpoint stores no
  zero points (older writers: all-zero ones, accepted). Expert names as in
  :mod:`cpumoe.checkpoint` (``qwen3`` / ``mixtral`` layouts). :func:`load_int4_moe_layer`: format
  ``"int4"`` (values q, scales) when every zero point is 0, else ``"int4_affine"`` for the layer:
  codes c = q + 8 in [0, 15] (the stored nibbles) with (scale, min) = (scale, -scale * (zp + 8))
  per group, so ``scale * c + min`` is ``(q - zp) * scale`` exactly for fp16 / bf16 scales (the
  model dtype, as llm-compressor writes them: every product and the sum are exact in fp32; fp32
  scales: within fp32 rounding).
- **gpt-oss MXFP4**: fused expert tensors ``model.layers.{L}.mlp.experts.gate_up_proj_blocks``
  uint8 [E, 2I, H / 32, 16], ``gate_up_proj_scales`` uint8 [E, 2I, H / 32] (E8M0),
  ``gate_up_proj_bias`` [E, 2I], and ``down_proj_blocks`` / ``_scales`` / ``_bias``; gate and up
  interleaved by row (even rows gate, odd up: the op's swigluoai layout, gpt-oss's activation).
  :func:`load_mxfp4_moe_layer`.

Both give a :class:`W4LayerWeights` whose :meth:`~W4LayerWeights.prepack` makes the packed layer
for :func:`cpumoe.fused_moe_int8`. Anything that does not fit raises
:class:`cpumoe.checkpoint.UnsupportedCheckpoint` naming the tensor or setting.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np

from . import ops as _ops
from .checkpoint import (Checkpoint, LoadedExperts, PathLike, UnsupportedCheckpoint,
                         expert_ids_of, expert_modules, need_tensor, nibbles,
                         open_checkpoint, targets_module)

__all__ = ["W4LayerWeights", "dequantize_int4_linear", "int4_scheme_problem",
           "load_int4_moe_layer", "load_mxfp4_moe_layer", "unpack_int4"]

_FLOAT = ("F32", "F16", "BF16", "F64")


class W4LayerWeights(LoadedExperts):
    """One 4-bit MoE layer read from a checkpoint (numpy), in its format's prepack input form
    (see :class:`cpumoe.checkpoint.LoadedExperts`)."""


# ---------------------------------------------------------------------------- int4
def int4_scheme_problem(group: dict, *, asymmetric: bool = False) -> Optional[str]:
    """None if a compressed-tensors config group is int4 as the W4A8 op computes it (symmetric
    group-wise int4 weights; activations unquantized or dynamic per-token int8); else what
    differs. ``asymmetric=True`` also takes ``symmetric: false`` weights (group zero points:
    what :func:`load_int4_moe_layer` reads as int4_affine). The group size is the group's
    ``weights.group_size``."""
    if not isinstance(group, dict):
        return "config group: not a JSON object"
    w = group.get("weights") or {}
    a = group.get("input_activations")
    if not isinstance(w, dict) or not (a is None or isinstance(a, dict)):
        return "weights / input_activations: not JSON objects"
    for k, v in {"num_bits": 4, "type": "int", "strategy": "group"}.items():
        if w.get(k) != v:
            return f"weights: {k} is {w.get(k)!r}, cpumoe's int4 path needs {v!r}"
    if asymmetric:
        if w.get("symmetric") not in (True, False):
            return f"weights: symmetric is {w.get('symmetric')!r}, expected true or false"
    elif w.get("symmetric") is not True:
        return f"weights: symmetric is {w.get('symmetric')!r}, cpumoe's int4 path needs True"
    if w.get("dynamic"):
        return "weights: dynamic weight quantization is not supported"
    if w.get("actorder") not in (None, "static", "weight"):
        return f"weights: actorder {w.get('actorder')!r} (a permuted group order) is not supported"
    g = w.get("group_size")
    if not isinstance(g, int) or isinstance(g, bool) or g < 32 or g % 32:
        return f"weights: group_size {g!r}, cpumoe needs a positive multiple of 32"
    if a:
        for k, v in {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                     "dynamic": True}.items():
            if a.get(k) != v:
                return f"input_activations: {k} is {a.get(k)!r}, cpumoe needs {v!r} (or none)"
    return None


def _int4_config_group(qcfg: Optional[dict], module: str) -> Optional[dict]:
    """The config group that covers ``module`` (checked; symmetric or not), or None without a
    config."""
    if qcfg is None:
        return None
    if qcfg.get("quant_method") != "compressed-tensors":
        raise UnsupportedCheckpoint(f"quantization_config: quant_method "
                                    f"{qcfg.get('quant_method')!r}, expected 'compressed-tensors'")
    if qcfg.get("format") not in (None, "pack-quantized"):
        raise UnsupportedCheckpoint(f"quantization_config: format {qcfg.get('format')!r} "
                                    f"(expected 'pack-quantized' for int4)")
    if targets_module(qcfg.get("ignore") or (), module):
        raise UnsupportedCheckpoint(f"{module}: listed in quantization_config.ignore")
    groups = qcfg.get("config_groups") or {}
    if not isinstance(groups, dict):
        raise UnsupportedCheckpoint("quantization_config: config_groups must be a JSON object")
    hits = [g for g in groups.values()
            if isinstance(g, dict) and targets_module(g.get("targets") or (), module)]
    if not hits:
        raise UnsupportedCheckpoint(f"{module}: no quantization_config.config_groups entry "
                                    f"targets it")
    problem = int4_scheme_problem(hits[0], asymmetric=True)
    if problem is not None:
        raise UnsupportedCheckpoint(f"{module}: {problem}")
    return hits[0]


def unpack_int4(words: np.ndarray, cols: int) -> np.ndarray:
    """int32 [rows, ceil(cols / 8)] of compressed-tensors' packing -> int8 values [rows, cols]."""
    return (_nibbles(words, cols).astype(np.int16) - 8).astype(np.int8)


def _nibbles(words: np.ndarray, cols: int) -> np.ndarray:
    """int32 [rows, ceil(cols / 8)] -> uint8 [rows, cols]: field i of a word is bits 4i..4i+3."""
    return nibbles(words).reshape(words.shape[0], -1)[:, :cols]


_SYMMETRIC_ZERO = 8  # the stored nibble of zero point 0


def _config_symmetric(ck: Checkpoint, module: str) -> Optional[bool]:
    """``weights.symmetric`` of the compressed-tensors config group covering ``module``; None
    without a (readable) config or group."""
    q = ck.quantization_config
    if not isinstance(q, dict) or q.get("quant_method") != "compressed-tensors":
        return None
    groups = q.get("config_groups")
    if not isinstance(groups, dict):
        return None
    try:
        for grp in groups.values():
            if isinstance(grp, dict) and targets_module(grp.get("targets") or (), module):
                sym = (grp.get("weights") or {}).get("symmetric")
                return sym if sym in (True, False) else None
    except UnsupportedCheckpoint:
        return None
    return None


def _zero_points(ck: Checkpoint, module: str, n: int, groups: int,
                 symmetric: Optional[bool]) -> Optional[np.ndarray]:
    """The zero points of the pack-quantized Linear ``module`` (n out, ``groups`` groups) in
    the stored domain: int16 [n, groups], zp + 8 in [0, 15]; None when it is symmetric.

    ``symmetric`` is the config's ``weights.symmetric`` (None: unknown, told by the data): true
    takes no zero points or all-zero ones (any layout, as older writers stored them); false
    needs compressed-tensors' packing, int32 [ceil(n / 8), groups] (zp + 8 packed eight to a
    word along out); unknown reads a tensor in that packing as zero points and takes any other
    only if all zero."""
    name = module + ".weight_zero_point"
    packed = ((n + 7) // 8, groups)
    if name not in ck:
        if symmetric is False:
            raise UnsupportedCheckpoint(f"checkpoint: missing {name} (symmetric: false weights "
                                        f"need their zero points)")
        return None
    is_packed = ck.dtype(name) == "I32" and tuple(ck.shape(name)) == packed
    if symmetric or (symmetric is None and not is_packed):
        if np.any(np.asarray(ck.get(name)) != 0):
            why = ("the config says symmetric: true" if symmetric else
                   f"not compressed-tensors' packed zero points (I32 {list(packed)})")
            raise UnsupportedCheckpoint(f"{name}: nonzero zero points in a {ck.dtype(name)} "
                                        f"{list(ck.shape(name))} tensor, but {why}")
        return None
    need_tensor(ck, name, ("I32",), packed, "",
                f" (compressed-tensors packs zero points eight to an int32 along out: "
                f"[ceil(out / 8), groups] for out {n}, {groups} groups)")
    words = np.asarray(ck.get(name))  # [R, G]: row 8 r + i at bits 4i of word [r, g]
    return np.ascontiguousarray(_nibbles(words.T, n).T).astype(np.int16)


def _finite_scales(ck: Checkpoint, name: str) -> np.ndarray:
    s = ck.get_float32(name)
    bad = ~np.isfinite(s)
    if bad.any():
        r, c = (int(v) for v in np.argwhere(bad)[0])
        raise UnsupportedCheckpoint(f"{name}: {int(bad.sum())} non-finite scales (first "
                                    f"{s[r, c]} at row {r}, group {c}); asymmetric int4 needs "
                                    f"finite scales")
    return s


def dequantize_int4_linear(path: Union[PathLike, Checkpoint], module: str) -> np.ndarray:
    """The float32 weight [out, in] of the compressed-tensors int4 (pack-quantized) Linear
    ``module``: its values minus its zero points (asymmetric) times its group scales, the group
    size read from the scales' shape (for the Linears an engine runs in float, e.g. the
    attention of an int4 checkpoint); exact for fp16 / bf16 scales."""
    ck = open_checkpoint(path)
    packed, scale, sh = (module + s for s in (".weight_packed", ".weight_scale",
                                              ".weight_shape"))
    for name in (packed, scale):
        if name not in ck:
            raise UnsupportedCheckpoint(f"checkpoint: missing {name}")
    if len(ck.shape(packed)) != 2 or len(ck.shape(scale)) != 2:
        raise UnsupportedCheckpoint(f"{module}: weight_packed / weight_scale of shapes "
                                    f"{list(ck.shape(packed))} / {list(ck.shape(scale))}, "
                                    f"expected 2-D")
    n, k = ck.shape(packed)[0], ck.shape(packed)[1] * 8
    if sh in ck:
        n, k = (int(v) for v in np.asarray(ck.get(sh)).reshape(-1)[:2])
    groups = ck.shape(scale)[1]
    if groups < 1 or k % groups:
        raise UnsupportedCheckpoint(f"{scale}: {groups} groups do not divide in = {k}")
    need_tensor(ck, packed, ("I32",), (n, (k + 7) // 8))
    need_tensor(ck, scale, _FLOAT, (n, groups))
    zp = _zero_points(ck, module, n, groups, _config_symmetric(ck, module))
    values = unpack_int4(ck.get(packed), k).astype(np.float32)
    if zp is not None:
        values -= np.repeat(zp.astype(np.float32) - _SYMMETRIC_ZERO, k // groups, axis=1)
    return values * np.repeat(ck.get_float32(scale), k // groups, axis=1)


def load_int4_moe_layer(path: Union[PathLike, Checkpoint], layer: int, *,
                        experts: Optional[Sequence[int]] = None, activation: str = "silu",
                        layout: Optional[str] = None, group_size: Optional[int] = None,
                        check_config: bool = True) -> W4LayerWeights:
    """Reads the routed experts of one compressed-tensors int4 (pack-quantized) MoE layer,
    symmetric or not (see the module doc).

    Args:
      path, layer, experts, activation, layout: as :func:`cpumoe.checkpoint.load_moe_layer`.
      group_size: the group size; default from config.json (required without a config).
      check_config: check config.json's quantization_config for the int4 scheme (its
        ``symmetric`` then says whether zero points must be there; without the check a
        ``weight_zero_point`` in compressed-tensors' packing is read as zero points).
    Returns a :class:`W4LayerWeights`, format "int4" when every zero point is 0 (or there are
    none), else "int4_affine".
    """
    interleaved = _ops.activation_interleaved(activation)  # its errors for a bad spec
    ck = open_checkpoint(path)
    em = expert_modules(ck, layer, experts, layout, ".weight_packed", "int4 (weight_packed)")
    layout, n_global, ids, mod = em.layout, em.n_global, em.ids, em.module
    gate, up, down = em.projs
    g = group_size
    sym = {gate: None, up: None, down: None}  # per projection: the config's weights.symmetric
    if check_config:
        for proj in (gate, up, down):
            grp = _int4_config_group(ck.quantization_config, mod(ids[0], proj))
            if grp is not None:
                cfg_g = grp["weights"]["group_size"]
                if g is not None and g != cfg_g:
                    raise ValueError(f"group_size: {g} given, the checkpoint's is {cfg_g}")
                g = cfg_g
                sym[proj] = grp["weights"]["symmetric"]
    if g is None:
        raise ValueError("group_size: not in a config.json; pass it")
    shape_name = mod(ids[0], gate) + ".weight_shape"
    if shape_name not in ck or ck.shape(shape_name) != (2,):
        raise UnsupportedCheckpoint(f"checkpoint: missing or not [2]: {shape_name}")
    I, H = (int(v) for v in np.asarray(ck.get(shape_name)).reshape(2))
    if I < 1 or H < 1 or H % g or I % g:
        raise UnsupportedCheckpoint(f"{shape_name}: [{I}, {H}] does not fit group_size {g} "
                                    f"(both must be positive multiples of it)")
    E = len(ids)
    has_bias = mod(ids[0], gate) + ".bias" in ck
    projs = ((gate, (I, H)), (up, (I, H)), (down, (H, I)))
    for e in ids:  # every header first: the arrays below are then the size of data on disk
        for proj, (n, k) in projs:
            m = mod(e, proj)
            need_tensor(ck, m + ".weight_packed", ("I32",), (n, (k + 7) // 8))
            need_tensor(ck, m + ".weight_scale", _FLOAT, (n, k // g))
            if has_bias:
                need_tensor(ck, m + ".bias", _FLOAT, (n,))
            sh = m + ".weight_shape"
            if sh in ck and tuple(int(v) for v in np.asarray(ck.get(sh)).reshape(-1)) != (n, k):
                raise UnsupportedCheckpoint(f"{sh}: {list(np.asarray(ck.get(sh)))}, expected "
                                            f"{[n, k]}")
    # The zero points of the whole layer (small: one per group) pick the format before the
    # values are unpacked.
    zeros = {}
    for e in ids:
        for proj, (n, k) in projs:
            z = _zero_points(ck, mod(e, proj), n, k // g, sym[proj])
            if z is not None:
                zeros[e, proj] = z
    affine = any(np.any(z != _SYMMETRIC_ZERO) for z in zeros.values())
    if affine:
        w13 = np.empty((E, 2 * I, H), np.uint8)
        w2 = np.empty((E, H, I), np.uint8)
        s13 = np.empty((E, 2 * I, H // g, 2), np.float32)
        s2 = np.empty((E, H, I // g, 2), np.float32)
    else:
        w13 = np.empty((E, 2 * I, H), np.int8)
        w2 = np.empty((E, H, I), np.int8)
        s13 = np.empty((E, 2 * I, H // g), np.float32)
        s2 = np.empty((E, H, I // g), np.float32)
    b13 = np.empty((E, 2 * I), np.float32) if has_bias else None
    b2 = np.empty((E, H), np.float32) if has_bias else None
    rg, ru = (slice(0, None, 2), slice(1, None, 2)) if interleaved else (
        slice(0, I), slice(I, 2 * I))
    for j, e in enumerate(ids):
        for proj, rows, wdst, sdst, bdst, k in ((gate, rg, w13, s13, b13, H),
                                                (up, ru, w13, s13, b13, H),
                                                (down, slice(None), w2, s2, b2, I)):
            m = mod(e, proj)
            if affine:  # codes: the stored nibbles q + 8; min = -scale * (zp + 8)
                s = _finite_scales(ck, m + ".weight_scale")
                wdst[j, rows] = _nibbles(ck.get(m + ".weight_packed"), k)
                z = zeros.get((e, proj))
                z = (np.float32(_SYMMETRIC_ZERO) if z is None else z.astype(np.float32))
                sdst[j, rows, :, 0] = s
                sdst[j, rows, :, 1] = np.float32(0) - s * z
            else:
                wdst[j, rows] = unpack_int4(ck.get(m + ".weight_packed"), k)
                sdst[j, rows] = ck.get_float32(m + ".weight_scale")
            if has_bias:
                bdst[j, rows] = ck.get_float32(m + ".bias")
    return W4LayerWeights("int4_affine" if affine else "int4", g, w13, w2, s13, s2, b13, b2,
                          ids, n_global, activation, layer)


# ---------------------------------------------------------------------------- mxfp4
def load_mxfp4_moe_layer(path: Union[PathLike, Checkpoint], layer: int, *,
                         experts: Optional[Sequence[int]] = None,
                         prefix: str = "model.layers.{layer}.mlp.experts.") -> W4LayerWeights:
    """Reads one gpt-oss MXFP4 MoE layer (fused expert tensors, see the module doc); its
    activation is swigluoai (gate and up already interleaved by row)."""
    ck = open_checkpoint(path)
    p = prefix.format(layer=layer)
    gu, dn = p + "gate_up_proj", p + "down_proj"
    if gu + "_blocks" not in ck:
        raise UnsupportedCheckpoint(f"checkpoint: missing {gu}_blocks (not a gpt-oss MXFP4 "
                                    f"layer)")
    shape = ck.shape(gu + "_blocks")
    if len(shape) != 4 or shape[3] != 16 or shape[1] % 2:
        raise UnsupportedCheckpoint(f"{gu}_blocks: shape {list(shape)}, expected "
                                    f"[E, 2I, H / 32, 16]")
    n_global, I2, G, _ = shape
    I, H = I2 // 2, G * 32
    if I % 32:
        raise UnsupportedCheckpoint(f"{gu}_blocks: I = {I} is not a multiple of 32")
    need_tensor(ck, gu + "_scales", ("U8",), (n_global, I2, G))
    need_tensor(ck, dn + "_blocks", ("U8",), (n_global, H, I // 32, 16))
    need_tensor(ck, dn + "_scales", ("U8",), (n_global, H, I // 32))
    need_tensor(ck, gu + "_blocks", ("U8",), shape)
    has_bias = gu + "_bias" in ck
    if has_bias:
        need_tensor(ck, gu + "_bias", _FLOAT, (n_global, I2))
        need_tensor(ck, dn + "_bias", _FLOAT, (n_global, H))
    ids = expert_ids_of(experts, n_global)
    sel = np.asarray(ids, dtype=np.int64)

    def take(name):
        return np.ascontiguousarray(ck.get(name)[sel])

    return W4LayerWeights(
        "mxfp4", 32, take(gu + "_blocks"), take(dn + "_blocks"), take(gu + "_scales"),
        take(dn + "_scales"),
        ck.get_float32(gu + "_bias")[sel] if has_bias else None,
        ck.get_float32(dn + "_bias")[sel] if has_bias else None,
        ids, n_global, "swigluoai", layer)
