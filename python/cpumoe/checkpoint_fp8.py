"""Loading FP8 (E4M3) MoE layers for the W8A16 op: HF "fp8" and compressed-tensors checkpoints.

Two checkpoint kinds, read through :class:`cpumoe.checkpoint.Checkpoint` (safetensors files,
numpy memory maps, no torch needed); expert names as in :mod:`cpumoe.checkpoint` (``qwen3``:
``model.layers.{L}.mlp.experts.{e}.{gate,up,down}_proj``, also DeepSeek-V3/R1, GLM-4.5 and
Qwen3-*-FP8; ``mixtral``: ``block_sparse_moe.experts.{e}.{w1,w3,w2}``, also MiniMax-M2):

- **HF fp8** (``quant_method: fp8``, transformers' ``FineGrainedFP8Config``; DeepSeek-V3/R1,
  Qwen3-*-FP8, MiniMax-M2): ``<name>.weight`` F8_E4M3 [N, K] and ``<name>.weight_scale_inv``
  [ceil(N / bn), ceil(K / bk)] for ``weight_block_size: [bn, bk]`` (one scale per matrix when it
  is null), float32 (or bf16 / f16; ``scale_fmt: ue8m0``: F8_E8M0 bytes 2^(b - 127)). Despite its
  name ``weight_scale_inv`` is the multiplier: w = e4m3(code) * weight_scale_inv, as in
  transformers' ``Fp8Dequantize`` and DeepSeek's ``weight_dequant``. ``activation_scheme`` must
  be ``dynamic`` (a static one is refused: its calibrated activation scales would be ignored);
  experts that ``modules_to_not_convert`` lists are stored unquantized and refused here.
- **compressed-tensors FP8** (``quant_method: compressed-tensors``, format ``float-quantized`` or
  ``naive-quantized``; llm-compressor's FP8_DYNAMIC / FP8_BLOCK): ``<name>.weight`` F8_E4M3 and
  ``<name>.weight_scale`` for weights ``num_bits: 8, type: float, symmetric``, strategy
  ``channel`` ([N, 1]), ``block`` (``block_structure: [bn, bk]``, [ceil(N / bn), ceil(K / bk)]),
  ``group`` ([N, K / g]) or ``tensor`` ([1]). Input activations absent or dynamic (any
  strategy); static ones are refused.

The op computes with bf16 activations: dynamic FP8 activation quantization (FP8_DYNAMIC,
DeepSeek's per-128 groups) is not done, which is more precise than what the checkpoint was
calibrated for, never less.

The layer is stacked as :func:`cpumoe.prepack_fp8` takes it: ``w13`` uint8 E4M3 codes
[E, 2I, H] (gate rows then up rows; interleaved for ``activation="swigluoai"``), ``w2`` [E, H, I],
and the scales re-gridded onto one ``block_size`` = (bn, bk) for both matrices, exactly (every new
block lies inside one block of the checkpoint, whose scale it takes):

=================== ========================================== ==============================
checkpoint          ``block_size``                             ``s13`` / ``s2``
=================== ========================================== ==============================
block [bn, bk]      (bn, bk) when bn divides I, else           [E, ceil(2I / bn'), ceil(H /
                    (gcd(bn, I, ...), bk): blocks straddling   bk)] / [E, ceil(H / bn'),
                    gate and up are split, same scales         ceil(I / bk)]
channel             None (per output channel)                  [E, 2I, 1] / [E, H, 1]
group g             (1, g)                                     [E, 2I, H / g] / [E, H, I / g]
tensor              (I, max(H, I)): gate, up and down one      [E, 2, 1] / [E, ceil(H / I), 1]
                    block each                                 (down's scale repeated)
=================== ========================================== ==============================

With ``swigluoai`` the gate and up rows alternate, so the block rows become single rows (bn = 1).
The block's k extent must be a multiple of 32 or span the depth (the kernels' rule). Anything
that does not fit raises :class:`cpumoe.checkpoint.UnsupportedCheckpoint` naming the tensor or
setting. Fused-expert tensors (one [E, ...] tensor per projection) are not read.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import ops as _ops
from .checkpoint import (Checkpoint, LoadedExperts, PathLike, UnsupportedCheckpoint,
                         expert_modules, open_checkpoint, targets_module)

__all__ = ["Fp8LayerWeights", "dequantize_fp8_linear", "fp8_scheme", "load_fp8_moe_layer",
           "load_packed_fp8_moe_layer", "not_converted_pattern"]

_FLOAT = ("F32", "F16", "BF16", "F64")
_E8M0 = ("F8_E8M0", "U8")


@dataclasses.dataclass
class Fp8LayerWeights(LoadedExperts):
    """One FP8 MoE layer read from a checkpoint (numpy), in :func:`cpumoe.prepack_fp8`'s input
    form: ``w13`` uint8 E4M3 codes [E, 2I, H], ``w2`` [E, H, I], ``s13`` / ``s2`` float32 scales
    of blocks of ``block_size`` = (bn, bk) (None: per output channel, [E, N, 1]), biases float32
    or None. ``group_size`` is bn when the blocks are square (bn == bk; what the generic
    QuantizedExperts helpers assume for "fp8"), else 0: use ``block_size``. ``layout`` is the
    expert naming, ``scheme`` the checkpoint's quantization as read (e.g. "fp8 block [128, 128]",
    "compressed-tensors channel")."""

    block_size: Optional[Tuple[int, int]]
    layout: str
    scheme: str

    def prepack(self, isa: Optional[str] = None, num_threads: Optional[int] = None,
                act_quant: Optional[str] = None):
        """The packed layer (:func:`cpumoe.prepack_fp8` with this layer's ``block_size``);
        act_quant is refused (FP8 keeps its activations in bf16)."""
        if act_quant is not None:
            from .quantize import _check_act_quant_taken
            _check_act_quant_taken("fp8", _ops.prepack_fp8)
        return _ops.prepack_fp8(self.w13, self.w2, self.s13, self.s2, self.b13, self.b2,
                                block_size=self.block_size, isa=isa, num_threads=num_threads)

    def dequantized(self, experts: Any = slice(None)):
        """(w13, w2) float32 of the experts ``experts`` (an index or slice; default all):
        e4m3(code) * the scale of its block."""
        from .quantize import dequantize_fp8
        return (dequantize_fp8(self.w13[experts], self.s13[experts], self.block_size),
                dequantize_fp8(self.w2[experts], self.s2[experts], self.block_size))

    def reference(self, x, topk_weights, topk_ids, **kw):
        """:func:`cpumoe.reference.ref_fused_moe_fp8` of this layer (its activation and
        biases; keywords as that function's)."""
        from .reference import ref_fused_moe_fp8
        kw.setdefault("activation", self.activation)
        return ref_fused_moe_fp8(x, self.w13, self.w2, self.s13, self.s2, topk_weights,
                                 topk_ids, b13=self.b13, b2=self.b2, block_size=self.block_size,
                                 **kw)

    def bytes_per_weight(self) -> float:
        """Bytes the kernels read per weight: the code and the share of its block's scale."""
        n = self.w13.size + self.w2.size
        return (n + 4 * (self.s13.size + self.s2.size)) / max(n, 1)


# ---------------------------------------------------------------------------- the scheme
@dataclasses.dataclass(frozen=True)
class _Scheme:
    """How one projection's scales are stored: the tensor suffix, the granularity ("block",
    "channel", "group", "tensor") and block (bn, bk) (None for channel / tensor: from the
    shape), whether the scales are E8M0 bytes, and a description."""

    scale_suffix: str
    strategy: str
    block: Optional[Tuple[int, int]]
    ue8m0: bool
    what: str

    def source_block(self, n: int, k: int) -> Tuple[int, int]:
        """The (bn, bk) of a [n, k] weight's scale grid."""
        if self.strategy == "channel":
            return 1, k
        if self.strategy == "tensor":
            return n, k
        return self.block


def _block_pair(v: Any, where: str) -> Tuple[int, int]:
    if (not isinstance(v, (list, tuple)) or len(v) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in v)):
        raise UnsupportedCheckpoint(f"{where}: {v!r} is not a pair of positive integers "
                                    f"[bn, bk]")
    return int(v[0]), int(v[1])


def _module_names(module: str) -> List[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def not_converted_pattern(patterns: Any, module: str) -> Optional[str]:
    """The pattern of transformers' ``modules_to_not_convert`` that covers ``module`` or one of
    its parents (transformers' rule: a regex matched from the start up to a module boundary, or
    a suffix), else None."""
    if patterns is None:
        return None
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise UnsupportedCheckpoint(f"quantization_config: modules_to_not_convert must be a list "
                                    f"of strings, got {patterns!r:.80}")
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    for name in _module_names(module):
        for pat in patterns:
            try:
                hit = re.match(rf"(?:{pat}){boundary}", name) or name.endswith(pat)
            except (re.error, RecursionError, OverflowError) as e:
                raise UnsupportedCheckpoint(f"quantization_config: modules_to_not_convert "
                                            f"pattern {pat!r:.80} ({e})") from None
            if hit:
                return pat
    return None


def _hf_fp8_scheme(q: dict, module: str) -> _Scheme:
    act = q.get("activation_scheme", "dynamic")
    if not isinstance(act, str) or act.lower() != "dynamic":
        raise UnsupportedCheckpoint(
            f"quantization_config: activation_scheme {act!r}: static FP8 activation scales are "
            f"not supported (cpumoe runs the experts on bf16 activations; only 'dynamic' "
            f"checkpoints, whose weights were not calibrated against fixed activation scales, "
            f"are read)")
    pat = not_converted_pattern(q.get("modules_to_not_convert"), module)
    if pat is not None:
        raise UnsupportedCheckpoint(
            f"{module}: quantization_config.modules_to_not_convert lists it ({pat!r}): this "
            f"layer's experts are kept unquantized (bf16), not fp8; load them as bf16 weights "
            f"(cpumoe.prepack_bf16)")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedCheckpoint(f"quantization_config: fmt {fmt!r}, cpumoe reads 'e4m3'")
    ed = q.get("expert_dtype", "fp8")
    if ed != "fp8":
        raise UnsupportedCheckpoint(f"quantization_config: expert_dtype {ed!r} (FP4 experts) is "
                                    f"not the fp8 format")
    sf = q.get("scale_fmt") or "float"
    if sf not in ("float", "ue8m0"):
        raise UnsupportedCheckpoint(f"quantization_config: scale_fmt {sf!r} (expected 'float' "
                                    f"or 'ue8m0')")
    wbs = q.get("weight_block_size")
    if wbs is None:
        return _Scheme("weight_scale_inv", "tensor", None, sf == "ue8m0", "fp8 per tensor")
    block = _block_pair(wbs, "quantization_config.weight_block_size")
    return _Scheme("weight_scale_inv", "block", block, sf == "ue8m0",
                   f"fp8 block {list(block)}")


_CT_FORMATS = (None, "float-quantized", "naive-quantized")


def _ct_fp8_scheme(q: dict, module: str) -> _Scheme:
    fmt = q.get("format")
    if fmt not in _CT_FORMATS + ("mixed-precision",):
        raise UnsupportedCheckpoint(f"quantization_config: format {fmt!r} (expected "
                                    f"'float-quantized' for FP8 weights)")
    if targets_module(q.get("ignore") or [], module):
        raise UnsupportedCheckpoint(f"{module}: listed in quantization_config.ignore: this "
                                    f"layer's experts are not quantized (bf16), not fp8")
    groups = q.get("config_groups") or {}
    if not isinstance(groups, dict):
        raise UnsupportedCheckpoint("quantization_config: config_groups must be a JSON object")
    hits = [g for g in groups.values()
            if isinstance(g, dict) and targets_module(g.get("targets") or [], module)]
    if not hits:
        raise UnsupportedCheckpoint(f"{module}: no quantization_config.config_groups entry "
                                    f"targets it")
    g = hits[0]
    gfmt = g.get("format")
    if gfmt not in _CT_FORMATS or (fmt == "mixed-precision" and gfmt is None):
        raise UnsupportedCheckpoint(f"{module}: config group format {gfmt!r} (expected "
                                    f"'float-quantized')")
    w, a = g.get("weights"), g.get("input_activations")
    if not isinstance(w, dict) or not (a is None or isinstance(a, dict)):
        raise UnsupportedCheckpoint(f"{module}: config group weights / input_activations are "
                                    f"not JSON objects")
    for key, want in (("num_bits", 8), ("type", "float"), ("symmetric", True)):
        if w.get(key) != want:
            raise UnsupportedCheckpoint(f"{module}: weights {key} is {w.get(key)!r}, cpumoe's fp8 "
                                        f"format needs {want!r}")
    if w.get("dynamic"):
        raise UnsupportedCheckpoint(f"{module}: weights: dynamic weight quantization is not "
                                    f"supported")
    if w.get("actorder") not in (None, "static", "weight"):
        raise UnsupportedCheckpoint(f"{module}: weights: actorder {w.get('actorder')!r} is not "
                                    f"supported")
    if a and not a.get("dynamic"):
        raise UnsupportedCheckpoint(
            f"{module}: input_activations are static (calibrated scales, e.g. the FP8 preset): "
            f"not supported; cpumoe reads FP8 checkpoints with dynamic or no activation "
            f"quantization (it keeps the activations bf16)")
    if g.get("output_activations"):
        raise UnsupportedCheckpoint(f"{module}: output_activations quantization is not "
                                    f"supported")
    strategy = w.get("strategy")
    if strategy == "channel":
        return _Scheme("weight_scale", "channel", None, False, "compressed-tensors channel")
    if strategy == "tensor":
        return _Scheme("weight_scale", "tensor", None, False, "compressed-tensors tensor")
    if strategy == "block":
        block = _block_pair(w.get("block_structure"), f"{module}: weights block_structure")
        return _Scheme("weight_scale", "block", block, False,
                       f"compressed-tensors block {list(block)}")
    if strategy == "group":
        gs = w.get("group_size")
        if not isinstance(gs, int) or isinstance(gs, bool) or gs < 1:
            raise UnsupportedCheckpoint(f"{module}: weights group_size {gs!r}")
        return _Scheme("weight_scale", "block", (1, gs), False, f"compressed-tensors group {gs}")
    raise UnsupportedCheckpoint(f"{module}: weights strategy {strategy!r} (cpumoe's fp8 format "
                                f"reads channel, block, group and tensor)")


def fp8_scheme(qcfg: Optional[dict], module: str) -> Optional[_Scheme]:
    """The FP8 scheme ``quantization_config`` gives ``module`` (None without a config);
    UnsupportedCheckpoint when the config is not an FP8 one cpumoe reads."""
    if qcfg is None:
        return None
    method = qcfg.get("quant_method")
    if method == "fp8":
        return _hf_fp8_scheme(qcfg, module)
    if method == "compressed-tensors":
        return _ct_fp8_scheme(qcfg, module)
    raise UnsupportedCheckpoint(f"quantization_config: quant_method {method!r}: cpumoe's fp8 "
                                f"loader reads 'fp8' (HF fine-grained FP8) and "
                                f"'compressed-tensors' FP8 checkpoints")


def _scheme_from_tensors(ck: Checkpoint, module: str, n: int, k: int,
                         block_size: Any) -> _Scheme:
    """Without a config: the scale tensor's name gives the kind; ``block_size`` (or an
    unambiguous scale shape: [n, 1] per channel, one value per tensor) the granularity."""
    for suffix in ("weight_scale_inv", "weight_scale"):
        name = f"{module}.{suffix}"
        if name in ck:
            break
    else:
        raise UnsupportedCheckpoint(f"checkpoint: missing {module}.weight_scale_inv (or "
                                    f".weight_scale): no FP8 scales for {module}.weight")
    ue8m0 = ck.dtype(name) in _E8M0
    if block_size is not None:
        bn, bk = _block_pair(block_size, "block_size")
        return _Scheme(suffix, "block", (bn, bk), ue8m0, f"{suffix} block {[bn, bk]}")
    shape = tuple(ck.shape(name))
    if shape in ((n, 1), (n,)) and n > 1:
        return _Scheme(suffix, "channel", None, ue8m0, f"{suffix} channel")
    if int(np.prod(shape)) == 1 and len(shape) <= 2:
        return _Scheme(suffix, "tensor", None, ue8m0, f"{suffix} tensor")
    raise ValueError(f"block_size: {name} of shape {list(shape)} does not say its blocks and "
                     f"there is no quantization_config; pass block_size=(bn, bk)")


# ---------------------------------------------------------------------------- re-gridding
def _row_sources(I: int, interleaved: bool) -> Tuple[np.ndarray, np.ndarray]:
    """For each row of w13: its projection (0 gate, 1 up) and its row in that projection."""
    r = np.arange(2 * I)
    if interleaved:
        return r % 2, r // 2
    proj = (r >= I).astype(np.int64)
    return proj, r - proj * I


def _changes(ids: np.ndarray) -> np.ndarray:
    return np.nonzero(np.diff(ids))[0] + 1


def _common_extent(changes: List[np.ndarray], preferred: Optional[int], span: int) -> int:
    """The largest extent every change point is a multiple of (``preferred`` if it is one; the
    whole ``span`` without change points)."""
    pts = np.concatenate(changes) if changes else np.zeros(0, np.int64)
    if preferred is not None and np.all(pts % preferred == 0):
        return preferred
    if pts.size == 0:
        return span
    return int(np.gcd.reduce(pts.astype(np.int64)))


def _regrid(S: Sequence[np.ndarray], proj: np.ndarray, row: np.ndarray,
            blocks: Sequence[Tuple[int, int]], K: int, bn: int, bk: int) -> np.ndarray:
    """Scales [E, ceil(rows / bn), ceil(K / bk)] of the stacked matrix whose row r comes from
    projection proj[r], row row[r]; S[p] the scales [E, ., .] of projection p, of blocks
    blocks[p]. Every new block lies in one old block (the extents were chosen so)."""
    r0 = np.arange(0, proj.size, bn)
    c0 = np.arange(0, K, bk)
    out = np.empty((S[0].shape[0], r0.size, c0.size), np.float32)
    for p, (s, (pbn, pbk)) in enumerate(zip(S, blocks)):
        m = proj[r0] == p
        if m.any():
            out[:, m, :] = s[:, row[r0[m]] // pbn][:, :, c0 // pbk]
    return out


def _common_block(I: int, H: int, blocks: Dict[str, Tuple[int, int]], interleaved: bool,
                  preferred: Optional[Tuple[int, int]]) -> Tuple[int, int]:
    """One (bn, bk) for w13 and w2 on which every scale of the checkpoint's blocks (``blocks``:
    gate, up, down -> (bn, bk)) falls exactly."""
    proj, row = _row_sources(I, interleaved)
    (gbn, gbk), (ubn, ubk), (dbn, dbk) = blocks["gate"], blocks["up"], blocks["down"]
    rid13 = proj * (2 * I + 1) + np.where(proj == 0, row // gbn, row // ubn)
    rows = [_changes(rid13), _changes(np.arange(H) // dbn)]
    kh, ki = np.arange(H), np.arange(I)
    cols = [_changes(kh // gbk), _changes(kh // ubk), _changes(ki // dbk)]
    bn = _common_extent(rows, preferred and preferred[0], max(2 * I, H))
    bk = _common_extent(cols, preferred and preferred[1], max(H, I))
    for name, depth in (("H", H), ("I", I)):
        if bk < depth and bk % 32:
            have = ", ".join(f"{p} {list(b)}" for p, b in blocks.items())
            raise UnsupportedCheckpoint(
                f"the checkpoint's scale blocks ({have}) need blocks of {bk} inputs over "
                f"{name} = {depth}: cpumoe's fp8 kernels take blocks of a multiple of 32 "
                f"inputs, or one spanning the depth")
    return bn, bk


# ---------------------------------------------------------------------------- loading
def _need(ck: Checkpoint, name: str, dtypes: Sequence[str], shapes: Sequence[Tuple[int, ...]],
          what: str) -> None:
    if name not in ck:
        raise UnsupportedCheckpoint(f"checkpoint: missing {name} ({what})")
    dt = ck.dtype(name)
    if dt not in dtypes:
        hint = ""
        if what.startswith("E4M3") and dt in _FLOAT:
            hint = " (stored unquantized: this layer's experts are not fp8)"
        raise UnsupportedCheckpoint(f"{name}: dtype {dt}, expected {' or '.join(dtypes)} "
                                    f"({what}){hint}")
    if tuple(ck.shape(name)) not in [tuple(s) for s in shapes]:
        raise UnsupportedCheckpoint(f"{name}: shape {list(ck.shape(name))}, expected "
                                    f"{' or '.join(str(list(s)) for s in shapes)} ({what})")


def _scale_shapes(sch: _Scheme, n: int, k: int) -> List[Tuple[int, ...]]:
    if sch.strategy == "channel":
        return [(n, 1), (n,)]
    if sch.strategy == "tensor":
        return [(), (1,), (1, 1)]
    bn, bk = sch.block
    return [(-(-n // bn), -(-k // bk))]


def _codes(ck: Checkpoint, name: str) -> np.ndarray:
    c = ck.get(name)
    nan = np.count_nonzero((c & 0x7F) == 0x7F)
    if nan:
        raise UnsupportedCheckpoint(f"{name}: {nan} E4M3 NaN code(s) (0x7F / 0xFF): not a "
                                    f"weight")
    return c


def _scales(ck: Checkpoint, name: str, sch: _Scheme, n: int, k: int) -> np.ndarray:
    """The scale grid [ceil(n / bn), ceil(k / bk)] of the projection, float32, checked."""
    bn, bk = sch.source_block(n, k)
    if ck.dtype(name) in _E8M0:
        b = ck.get(name).astype(np.int64)
        s = np.where(b == 255, np.float32(np.nan),
                     np.ldexp(np.float32(1), (b - 127).astype(np.int32))).astype(np.float32)
    else:
        s = ck.get_float32(name)
    s = np.asarray(s, np.float32).reshape(-(-n // bn), -(-k // bk))
    bad = ~(np.isfinite(s) & (s >= 0))
    if bad.any():
        raise UnsupportedCheckpoint(f"{name}: {int(bad.sum())} scale(s) not finite and >= 0 "
                                    f"(e.g. {s[bad].flat[0]!r})")
    return s


def dequantize_fp8_linear(ck: Checkpoint, name: str) -> np.ndarray:
    """The float32 weight of an FP8 Linear that is not an expert (``name``: its ``.weight``,
    F8_E4M3 codes [N, K]): e4m3(code) * the scale of its block, the scheme from the config (or,
    without one, from the scale tensor's name and shape)."""
    from .quantize import dequantize_fp8
    module = name[:-len(".weight")] if name.endswith(".weight") else None
    shape = tuple(ck.shape(name))
    if module is None or len(shape) != 2:
        raise UnsupportedCheckpoint(f"{name}: F8_E4M3 tensor of shape {list(shape)} is not "
                                        f"the 2-D weight of a Linear")
    n, k = shape
    sch = fp8_scheme(ck.quantization_config, module)
    if sch is None:
        sch = _scheme_from_tensors(ck, module, n, k, None)
    scale = f"{module}.{sch.scale_suffix}"
    _need(ck, scale, _FLOAT + (_E8M0 if sch.ue8m0 else ()),
               _scale_shapes(sch, n, k), f"{sch.what} scales")
    s = _scales(ck, scale, sch, n, k)
    return dequantize_fp8(_codes(ck, name), s, sch.source_block(n, k))


def load_fp8_moe_layer(path: Union[PathLike, Checkpoint], layer: int, *,
                       experts: Optional[Sequence[int]] = None, activation: str = "silu",
                       layout: Optional[str] = None,
                       block_size: Optional[Tuple[int, int]] = None,
                       check_config: bool = True) -> Fp8LayerWeights:
    """Reads the routed experts of one FP8 MoE layer and stacks them (see the module doc).

    Args:
      path, layer, experts, activation, layout: as :func:`cpumoe.checkpoint.load_moe_layer`.
      block_size: the scales' (bn, bk) when there is no quantization_config to say it (and the
        scale shapes do not: [N, 1] is per channel, one value per tensor); with a config it must
        agree with it.
      check_config: read config.json's quantization_config (HF ``fp8`` or compressed-tensors
        FP8); False: the kind from the scale tensors' names, the blocks from ``block_size``.
    Returns an :class:`Fp8LayerWeights` (``.prepack()`` makes the packed layer). Raises
    UnsupportedCheckpoint (a ValueError) naming the tensor or setting that does not fit.
    """
    interleaved = _ops.activation_interleaved(activation)  # its errors for a bad spec
    ck = open_checkpoint(path)
    em = expert_modules(ck, layer, experts, layout)
    layout, projs, n_global, ids, mod = em.layout, em.projs, em.n_global, em.ids, em.module

    g0 = mod(ids[0], projs[0]) + ".weight"
    if len(ck.shape(g0)) != 2:
        raise UnsupportedCheckpoint(f"{g0}: shape {list(ck.shape(g0))}, expected 2-D")
    I, H = ck.shape(g0)
    if I < 1 or H < 1:
        raise UnsupportedCheckpoint(f"{g0}: shape {[I, H]} has an empty dimension")
    roles = dict(zip(("gate", "up", "down"), projs))
    dims = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    qcfg = ck.quantization_config if check_config else None
    schemes: Dict[str, _Scheme] = {}
    for role, proj in roles.items():
        sch = fp8_scheme(qcfg, mod(ids[0], proj))
        if sch is None:
            sch = _scheme_from_tensors(ck, mod(ids[0], proj), *dims[role], block_size)
        elif block_size is not None and sch.block != tuple(block_size):
            raise ValueError(f"block_size: {tuple(block_size)} given, the checkpoint's "
                             f"quantization_config says {sch.what}")
        schemes[role] = sch
    blocks = {r: schemes[r].source_block(*dims[r]) for r in roles}
    declared = [schemes[r].block for r in roles]
    preferred = declared[0] if declared[0] is not None and len(set(declared)) == 1 else None
    bn, bk = _common_block(I, H, blocks, interleaved, preferred)

    E = len(ids)
    has_bias = mod(ids[0], projs[0]) + ".bias" in ck
    # Every tensor's name, dtype and shape first (headers only): the arrays below are then the
    # size of tensors the files hold.
    for e in ids:
        for role, proj in roles.items():
            n, k = dims[role]
            m, sch = mod(e, proj), schemes[role]
            _need(ck, m + ".weight", ("F8_E4M3",), [(n, k)], "E4M3 codes")
            _need(ck, f"{m}.{sch.scale_suffix}", _FLOAT + (_E8M0 if sch.ue8m0 else ()),
                  _scale_shapes(sch, n, k), f"{sch.what} scales")
            if has_bias:
                _need(ck, m + ".bias", _FLOAT, [(n,)], "bias")
            zp = m + ".weight_zero_point"
            if zp in ck and np.any(ck.get(zp) != 0):
                raise UnsupportedCheckpoint(f"{zp}: nonzero zero points (asymmetric weights) "
                                            f"are not supported")
    w13 = np.empty((E, 2 * I, H), np.uint8)
    w2 = np.empty((E, H, I), np.uint8)
    src = {r: np.empty((E, -(-dims[r][0] // blocks[r][0]), -(-dims[r][1] // blocks[r][1])),
                       np.float32) for r in roles}
    b13 = np.empty((E, 2 * I), np.float32) if has_bias else None
    b2 = np.empty((E, H), np.float32) if has_bias else None
    rg, ru = (slice(0, None, 2), slice(1, None, 2)) if interleaved else (
        slice(0, I), slice(I, 2 * I))
    for j, e in enumerate(ids):
        for role, rows, wdst, bdst in (("gate", rg, w13, b13), ("up", ru, w13, b13),
                                       ("down", slice(None), w2, b2)):
            m, sch = mod(e, roles[role]), schemes[role]
            wdst[j, rows] = _codes(ck, m + ".weight")
            src[role][j] = _scales(ck, f"{m}.{sch.scale_suffix}", sch, *dims[role])
            if has_bias:
                bdst[j, rows] = ck.get_float32(m + ".bias")
    proj, row = _row_sources(I, interleaved)
    s13 = _regrid([src["gate"], src["up"]], proj, row, [blocks["gate"], blocks["up"]], H, bn, bk)
    s2 = _regrid([src["down"]], np.zeros(H, np.int64), np.arange(H), [blocks["down"]], I, bn,
                 bk)
    block: Optional[Tuple[int, int]] = (bn, bk)
    if bn == 1 and bk >= max(H, I):  # one scale per row: per output channel
        block = None
    what = sorted(set(s.what for s in schemes.values()))
    return Fp8LayerWeights("fp8", bn if bn == bk else 0, w13, w2, s13, s2, b13, b2, ids,
                           n_global, activation, layer, block, layout, " / ".join(what))


def load_packed_fp8_moe_layer(path: Union[PathLike, Checkpoint], layer: int, *,
                              isa: Optional[str] = None, num_threads: Optional[int] = None,
                              **kw) -> Any:
    """:func:`load_fp8_moe_layer` then :func:`cpumoe.prepack_fp8`; the stacked copy is freed on
    return. Keyword arguments are those of load_fp8_moe_layer."""
    return load_fp8_moe_layer(path, layer, **kw).prepack(isa=isa, num_threads=num_threads)

