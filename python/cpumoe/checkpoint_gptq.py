"""Loading 4-bit GPTQ and AWQ MoE layers, and 8-bit GPTQ ones (safetensors checkpoints), as
stored: no re-quantization.

Both store each expert projection as a Linear of packed b-bit codes ``q`` (b = 4; GPTQ also 8)
with, per group of ``g`` input columns k and per output row n, an fp16 scale ``s`` and a b-bit
zero point ``z``:
``w[n, k] = s[k // g, n] * (q[n, k] - z[k // g, n])``. Read through
:class:`cpumoe.checkpoint.Checkpoint` (numpy memory maps, no torch), expert names as in
:mod:`cpumoe.checkpoint` (``qwen3``: ``model.layers.{L}.mlp.experts.{e}.{gate,up,down}_proj``,
``mixtral``: ``model.layers.{L}.block_sparse_moe.experts.{e}.{w1,w3,w2}``), one expert at a time.

**GPTQ** (config.json ``quantization_config``, or AutoGPTQ's ``quantize_config.json``:
``quant_method: gptq``, ``bits: 4`` or ``8``, ``group_size: g`` (-1: one group over K), ``desc_act``,
``sym``, ``checkpoint_format`` ``gptq`` (v1) or ``gptq_v2``), per Linear [N out, K in]:

============ ================ =================================================================
``qweight``  int32 [K/8, N]   packed along K: k = 8 r + i at bits 4i of word [r, n] (8-bit:
                              [K/4, N], k = 4 r + i at bits 8i)
``qzeros``   int32 [G, N/8]   packed along N: n = 8 c + i at bits 4i of word [g, c] (8-bit:
                              [G, N/4], n = 4 c + i at bits 8i)
``scales``   fp16 [G, N]      (bf16 / fp32 taken too); G = ceil(K / g)
``g_idx``    int32 [K]        optional: must be k // g (act-order permutations are refused)
``bias``     float [N]        optional
============ ================ =================================================================

v1 (AutoGPTQ's ``pack``: ``zeros -= 1`` before packing) stores z - 1: the zero point is the stored
nibble + 1, per nibble (z in [1, 16]), as AutoGPTQ's ``QuantLinear.forward`` (``(qzeros >> 4i) &
15`` then ``+ 1``, auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py) and vLLM's v1 ``gptq_gemm``
(``zeros[i] + 1``) read it; a true zero of 0 was stored as -1, i.e. nibble 15, and reads as 16
(GPTQModel's whole-word ``qzeros += 0x11111111`` differs from this only where a nibble is 15).
``gptq_v2`` (GPTQModel) stores z itself. 8-bit fields the same way (v1: the stored byte + 1).

**AWQ** (``quant_method: awq``, ``version: gemm``, ``zero_point: true``, ``bits`` (or ``w_bit``)
4, ``group_size`` (or ``q_group_size``) g), AutoAWQ's ``WQLinear_GEMM``:

============ ================ =================================================================
``qweight``  int32 [K, N/8]   packed along N in AWQ's order: nibble i (bits 4i) of word [k, c]
                              holds n = 8 c + [0, 2, 4, 6, 1, 3, 5, 7][i]
``qzeros``   int32 [G, N/8]   the same packing; z as stored (no offset)
``scales``   fp16 [G, N]
``bias``     float [N]        optional
============ ================ =================================================================

(awq/modules/linear/gemm.py ``from_linear`` packs with ``order_map = [0, 2, 4, 6, 1, 3, 5, 7]``;
awq/utils/packing_utils.py unpacks with ``AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]``.)
``version`` gemv / gemv_fast / marlin (other packings) and ``zero_point: false`` are refused.

**cpumoe format.** 8-bit layers are ``"int8_affine"``: codes q in [0, 255] with (scale, min) =
(float32(s), -float32(s) * z) per group (exact as below). 4-bit: when every zero point of the
layer is 8 (symmetric quantization) the layer is ``"int4"``: values q - 8 in [-8, 7], scales
float32(s). Otherwise it is ``"int4_affine"`` for all three projections: codes q in [0, 15] with
(scale, min) = (float32(s), -float32(s) * z) per group, so ``scale * q + min`` is ``s * (q - z)``
exactly (fp16 or bf16 scales: every product and the sum are exact in fp32, for 8-bit codes
too). The layer is stacked as the op takes it (``w13`` [E, 2I, H]: gate
rows then up rows, interleaved for ``activation="swigluoai"``; ``w2`` [E, H, I]) with one group
size for both matrices: g when it divides H and I, else the largest multiple of 32 dividing g
(or K for -1), H and I (each new group inside one group of the checkpoint: exact), refused when
there is none.

Anything that does not fit (another quant_method or bits, a missing tensor, a wrong dtype or
shape, NaN / inf scales, act-order, a per-module override touching the experts) raises
:class:`cpumoe.checkpoint.UnsupportedCheckpoint` naming the tensor or setting.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Optional, Sequence, Tuple, Union

import numpy as np

from . import ops as _ops
from .checkpoint import (Checkpoint, LoadedExperts, PathLike, UnsupportedCheckpoint,
                         autogptq_config, expert_modules, fields, need_tensor,
                         open_checkpoint)

__all__ = ["AWQ_ORDER", "QuantizedLayerWeights", "dequantize_linear", "gptq_awq_config",
           "load_awq_moe_layer", "load_gptq_moe_layer", "load_quantized_moe_layer"]

#: AutoAWQ's packing order: nibble i of a word holds output column 8 c + AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_REVERSE = tuple(int(i) for i in np.argsort(AWQ_ORDER))  # (0, 4, 1, 5, 2, 6, 3, 7)
_FLOAT = ("F16", "BF16", "F32")
_GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> offset added to stored zeros
_GROUP_MAX = 65536  # the int4 formats' largest group (cpumoe.formats())
_SYMMETRIC_ZERO = 8  # of 4-bit layers
_BITS = {"gptq": (4, 8), "awq": (4,)}  # the code widths read


@dataclasses.dataclass
class QuantizedLayerWeights(LoadedExperts):
    """One GPTQ / AWQ MoE layer in its cpumoe format's prepack input form (see
    :class:`cpumoe.checkpoint.LoadedExperts`): ``weight_format`` "int4" (symmetric),
    "int4_affine" or (8-bit) "int8_affine"; ``quant_method`` "gptq" or "awq", ``checkpoint_format`` ("gptq", "gptq_v2" or
    "gemm"), the checkpoint's ``checkpoint_group_size`` (-1: one group over K) and ``layout``."""

    quant_method: str
    checkpoint_format: str
    checkpoint_group_size: int
    layout: str


@dataclasses.dataclass(frozen=True)
class _Scheme:
    method: str  # "gptq" | "awq"
    fmt: str  # "gptq" | "gptq_v2" | "gemm"
    group_size: int  # -1: one group over K
    zero_offset: int  # added to the stored zero nibble
    desc_act: bool
    dynamic: Any = None  # GPTQModel's per-module overrides
    not_converted: Tuple[str, ...] = ()  # AWQ's modules_to_not_convert
    bits: int = 4  # of a code and a zero point

    @property
    def per_word(self) -> int:
        return 32 // self.bits


# ---------------------------------------------------------------------------- the config
def gptq_awq_config(path: Union[PathLike, Checkpoint]) -> Optional[dict]:
    """The quantization config of a checkpoint: config.json's ``quantization_config``, else
    AutoGPTQ's ``quantize_config.json`` beside it (its ``quant_method`` defaulting to "gptq");
    None when neither exists."""
    ck = open_checkpoint(path)
    q = ck.quantization_config
    if q is not None:
        return q
    return autogptq_config(ck.root)


def _int_setting(q: dict, keys: Sequence[str], default: Any = None) -> Any:
    for k in keys:
        if k in q:
            return q[k]
    return default


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _scheme(qcfg: Optional[dict], want: Optional[str]) -> _Scheme:
    if qcfg is None:
        raise UnsupportedCheckpoint("checkpoint: no quantization_config in config.json (nor a "
                                    "quantize_config.json): cannot tell GPTQ / AWQ settings")
    if not isinstance(qcfg, dict):
        raise UnsupportedCheckpoint("quantization_config: not a JSON object")
    method = qcfg.get("quant_method")
    method = method.lower() if isinstance(method, str) else method
    if method not in ("gptq", "awq"):
        raise UnsupportedCheckpoint(f"quantization_config: quant_method {method!r}: this loader "
                                    f"reads 'gptq' and 'awq' checkpoints")
    if want is not None and method != want:
        raise UnsupportedCheckpoint(f"quantization_config: quant_method {method!r}, expected "
                                    f"{want!r}")
    bits = _int_setting(qcfg, ("bits", "w_bit"))
    if bits not in _BITS[method]:
        raise UnsupportedCheckpoint(f"quantization_config: bits {bits!r}: cpumoe reads "
                                    f"{' and '.join(map(str, _BITS[method]))}-bit "
                                    f"{method.upper()} checkpoints only")
    g = _int_setting(qcfg, ("group_size", "q_group_size"), -1 if method == "gptq" else None)
    if not _is_int(g) or not (g == -1 or g > 0):
        raise UnsupportedCheckpoint(f"quantization_config: group_size {g!r} is not -1 or a "
                                    f"positive integer")
    if method == "gptq":
        fmt = qcfg.get("checkpoint_format", qcfg.get("format", "gptq"))
        fmt = fmt.lower() if isinstance(fmt, str) else fmt
        if fmt not in _GPTQ_FORMATS:
            raise UnsupportedCheckpoint(
                f"quantization_config: checkpoint_format {fmt!r}: cpumoe reads GPTQ "
                f"{' and '.join(map(repr, _GPTQ_FORMATS))} (other formats are repacked for "
                f"their kernels)")
        pack = qcfg.get("pack_dtype", "int32")
        if pack not in ("int32", "torch.int32"):
            raise UnsupportedCheckpoint(f"quantization_config: pack_dtype {pack!r}: cpumoe reads "
                                        f"int32 packing only")
        return _Scheme("gptq", fmt, g, _GPTQ_FORMATS[fmt], bool(qcfg.get("desc_act", False)),
                       qcfg.get("dynamic"), bits=bits)
    version = qcfg.get("version", qcfg.get("format", "gemm"))
    version = version.lower() if isinstance(version, str) else version
    if version != "gemm":
        raise UnsupportedCheckpoint(f"quantization_config: AWQ version {version!r}: cpumoe reads "
                                    f"the 'gemm' packing only (gemv / gemv_fast / marlin pack "
                                    f"differently)")
    if qcfg.get("zero_point", True) is not True:
        raise UnsupportedCheckpoint(f"quantization_config: AWQ zero_point "
                                    f"{qcfg.get('zero_point')!r}: cpumoe reads AWQ with zero "
                                    f"points (zero_point: true) only")
    skip = qcfg.get("modules_to_not_convert") or ()
    if not isinstance(skip, (list, tuple)) or not all(isinstance(s, str) for s in skip):
        raise UnsupportedCheckpoint("quantization_config: modules_to_not_convert must be a list "
                                    "of strings")
    return _Scheme("awq", "gemm", g, 0, False, None, tuple(skip))


def _check_module(sch: _Scheme, module: str, quantized: bool) -> None:
    """Refuses an expert Linear the config exempts from quantization or overrides. AWQ's
    modules_to_not_convert match as substrings (AutoAWQ's and transformers' rule), so ["gate"],
    meant for the router, also names every expert's gate_proj: a module whose tensors are
    quantized (``quantized``: its .qweight is there) is read whatever the list says."""
    if not quantized and any(s and s in module for s in sch.not_converted):
        raise UnsupportedCheckpoint(f"{module}: listed in quantization_config."
                                    f"modules_to_not_convert (not quantized)")
    dyn = sch.dynamic
    if not dyn:
        return
    if not isinstance(dyn, dict):
        raise UnsupportedCheckpoint("quantization_config: dynamic must be a JSON object")
    for key in dyn:
        pat = key[2:] if key[:2] in ("+:", "-:") else key
        try:
            hit = re.match(pat, module)
        except (re.error, RecursionError, OverflowError) as e:
            raise UnsupportedCheckpoint(f"quantization_config.dynamic: bad pattern {key!r:.80} "
                                        f"({e})") from None
        if not hit:
            continue
        if key.startswith("-:"):
            raise UnsupportedCheckpoint(f"{module}: quantization_config.dynamic[{key!r:.80}] "
                                        f"skips it (not quantized)")
        o = dyn[key] if isinstance(dyn[key], dict) else {}
        # An override the data already tells (sym, desc_act: zeros, g_idx) or that repeats the
        # layer's settings is harmless; another bits or group size is not read.
        if (o.get("bits", sch.bits) != sch.bits
                or o.get("group_size", sch.group_size) != sch.group_size):
            raise UnsupportedCheckpoint(
                f"{module}: quantization_config.dynamic[{key!r:.80}] overrides its settings "
                f"(bits {o.get('bits', sch.bits)!r}, group_size "
                f"{o.get('group_size', sch.group_size)!r}): per-module bits / group sizes of "
                f"experts are not read")


# ---------------------------------------------------------------------------- unpacking
def _groups(k: int, g: int) -> Tuple[int, int]:
    """(effective group size, number of groups) of a checkpoint group size over depth k."""
    ge = k if g == -1 else g
    return ge, -(-k // ge)


class _Linear:
    """One quantized Linear [n out, k in] of the checkpoint: its tensors checked, then read."""

    def __init__(self, ck: Checkpoint, sch: _Scheme, module: str, n: int, k: int):
        self.ck, self.sch, self.module, self.n, self.k = ck, sch, module, n, k
        self.ge, self.G = _groups(k, sch.group_size)

    def _need(self, suffix: str, dtypes: Sequence[str], shape: Tuple[int, ...]) -> str:
        name = self.module + suffix
        hint = ""
        if suffix == ".qweight" and self.module + ".weight" in self.ck:
            hint = f" ({self.module}.weight is there: a Linear the checkpoint left unquantized)"
        need_tensor(self.ck, name, dtypes, shape, hint,
                    f" ({self.sch.method.upper()} {self.sch.fmt}, out {self.n}, in {self.k}, "
                    f"group_size {self.sch.group_size})")
        return name

    def check(self, bias: bool) -> None:
        """Names, dtypes and shapes (headers only)."""
        _check_module(self.sch, self.module, self.module + ".qweight" in self.ck)
        n, k = self.n, self.k
        if self.sch.method == "gptq":
            self._need(".qweight", ("I32",), (k // self.sch.per_word, n))
            gi = self.module + ".g_idx"
            if gi in self.ck:
                self._need(".g_idx", ("I32", "I64"), (k,))
            elif self.sch.desc_act:
                raise UnsupportedCheckpoint(f"checkpoint: missing {gi} (desc_act: true needs the "
                                            f"act-order group index)")
        else:
            self._need(".qweight", ("I32",), (k, n // 8))
        self._need(".qzeros", ("I32",), (self.G, n // self.sch.per_word))
        self._need(".scales", _FLOAT, (self.G, n))
        if bias:
            self._need(".bias", _FLOAT, (n,))
        elif self.module + ".bias" in self.ck:
            raise UnsupportedCheckpoint(f"{self.module}.bias: present, but the first expert's "
                                        f"projection of this kind has none (biases must be on "
                                        f"every expert or none)")

    def check_g_idx(self) -> None:
        gi = self.module + ".g_idx"
        if gi not in self.ck:
            return
        got = np.asarray(self.ck.get(gi))
        if not np.array_equal(got, np.arange(self.k) // self.ge):
            raise UnsupportedCheckpoint(
                f"{gi}: not k // group_size ({self.ge}) for every k: an act-order (desc_act) "
                f"checkpoint whose groups follow a permutation of the input columns; act-order "
                f"GPTQ is not supported (re-quantize with desc_act: false, or static_groups)")

    def zeros(self) -> np.ndarray:
        """int16 [G, n]: the zero points (the stored field plus v1's offset)."""
        nib = fields(self.ck.get(self.module + ".qzeros"), self.sch.bits)  # [G, n / pw, pw]
        if self.sch.method == "awq":
            nib = nib[..., list(_AWQ_REVERSE)]
        return nib.reshape(self.G, self.n).astype(np.int16) + self.sch.zero_offset

    def scales(self) -> np.ndarray:
        """float32 [G, n], checked finite."""
        name = self.module + ".scales"
        s = self.ck.get_float32(name).reshape(self.G, self.n)
        bad = ~np.isfinite(s)
        if bad.any():
            gi, ni = (int(v) for v in np.argwhere(bad)[0])
            raise UnsupportedCheckpoint(f"{name}: {int(bad.sum())} non-finite scales (first "
                                        f"{s[gi, ni]} at group {gi}, row {ni})")
        return s

    def codes(self) -> np.ndarray:
        """uint8 [n, k]: the codes q."""
        nib = fields(self.ck.get(self.module + ".qweight"), self.sch.bits)
        if self.sch.method == "gptq":  # [k / pw, n, pw] -> [n, k / pw, pw]: k = pw r + i
            return np.ascontiguousarray(nib.transpose(1, 0, 2)).reshape(self.n, self.k)
        # AWQ: [k, n / 8, 8] in AWQ's order -> [k, n] -> [n, k]
        return np.ascontiguousarray(nib[..., list(_AWQ_REVERSE)].reshape(self.k, self.n).T)

    def bias(self) -> np.ndarray:
        return self.ck.get_float32(self.module + ".bias").reshape(self.n)

    def regrid(self, per_group: np.ndarray, g: int) -> np.ndarray:
        """[G, n] per checkpoint group -> [n, k / g] per group of g (g divides ge and k)."""
        idx = (np.arange(self.k // g) * g) // self.ge
        return np.ascontiguousarray(per_group[idx].T)


def _common_group(g: int, H: int, I: int, where: str) -> int:
    """The layer's group size: the largest multiple of 32 dividing the checkpoint's groups of
    both depths and both depths (so every new group lies in one old one)."""
    g13, _ = _groups(H, g)
    g2, _ = _groups(I, g)
    c = math.gcd(math.gcd(g13, g2), math.gcd(H, I))
    if c % 32:
        raise UnsupportedCheckpoint(
            f"{where}: group_size {g} with H = {H}, I = {I}: no group size that is a multiple of "
            f"32 divides both the checkpoint's groups and the depths (cpumoe's int4 groups are "
            f"multiples of 32)")
    if c > _GROUP_MAX:  # the largest multiple of 32 dividing c within the formats' limit
        c = next(32 * d for d in range(_GROUP_MAX // 32, 0, -1) if (c // 32) % d == 0)
    return c


def dequantize_linear(path: Union[PathLike, Checkpoint], module: str) -> np.ndarray:
    """The float32 weight [out, in] of the GPTQ / AWQ Linear ``module`` (its config from the
    checkpoint): ``scales * (q - zeros)`` per group, exact for fp16 / bf16 scales (for the Linears
    an engine runs in float, e.g. attention). A ``.bias`` beside it is checked (float, [out]) and
    left to the caller: it is a plain tensor of the checkpoint."""
    ck = open_checkpoint(path)
    sch = _scheme(gptq_awq_config(ck), None)
    name = module + ".qweight"
    if name not in ck or len(ck.shape(name)) != 2:
        raise UnsupportedCheckpoint(f"checkpoint: missing or not 2-D: {name}")
    r, c = ck.shape(name)
    pw = sch.per_word
    n, k = (c, pw * r) if sch.method == "gptq" else (pw * c, r)
    if n < pw or k < pw or n % pw:
        raise UnsupportedCheckpoint(f"{name}: shape {[r, c]} gives out {n}, in {k}: out must be "
                                    f"a positive multiple of {pw} (packed zero points)")
    lin = _Linear(ck, sch, module, n, k)
    lin.check(bias=module + ".bias" in ck)
    lin.check_g_idx()
    s, z = lin.scales(), lin.zeros()
    gidx = np.arange(k) // lin.ge
    q = lin.codes().astype(np.float32)
    return (s[gidx].T * (q - z[gidx].T.astype(np.float32))).astype(np.float32)


# ---------------------------------------------------------------------------- the layer
def _layer(path: Union[PathLike, Checkpoint], layer: int, want: Optional[str],
           experts: Optional[Sequence[int]], activation: str, layout: Optional[str],
           quant_config: Optional[dict]) -> QuantizedLayerWeights:
    interleaved = _ops.activation_interleaved(activation)  # its errors for a bad spec
    ck = open_checkpoint(path)
    sch = _scheme(quant_config if quant_config is not None else gptq_awq_config(ck), want)
    em = expert_modules(ck, layer, experts, layout, ".qweight", sch.method.upper())
    layout, n_global, ids, mod = em.layout, em.n_global, em.ids, em.module
    gate, up, down = em.projs
    g0 = mod(ids[0], gate) + ".qweight"
    shape = ck.shape(g0)
    if len(shape) != 2 or ck.dtype(g0) != "I32":
        raise UnsupportedCheckpoint(f"{g0}: {ck.dtype(g0)} {list(shape)}, expected a 2-D I32 "
                                    f"tensor")
    pw = sch.per_word
    I, H = (shape[1], pw * shape[0]) if sch.method == "gptq" else (pw * shape[1], shape[0])
    if I < 32 or H < 32 or I % 32 or H % 32:
        raise UnsupportedCheckpoint(f"{g0}: shape {list(shape)} gives I = {I}, H = {H}: both "
                                    f"must be positive multiples of 32")
    g = _common_group(sch.group_size, H, I, "quantization_config")
    E = len(ids)
    b13_on = mod(ids[0], gate) + ".bias" in ck
    b2_on = mod(ids[0], down) + ".bias" in ck
    projs = ((gate, I, H, b13_on), (up, I, H, b13_on), (down, H, I, b2_on))

    def linears(e: int):
        return [(_Linear(ck, sch, mod(e, p), n, k), b) for p, n, k, b in projs]

    # Every header first, then the zero points and scales of the whole layer (small: one per
    # group) to check them and to pick the format before the codes are unpacked.
    symmetric = sch.bits == 4  # 8-bit layers are int8_affine, symmetric or not
    for e in ids:
        for lin, b in linears(e):
            lin.check(b)
    for e in ids:
        for lin, _ in linears(e):
            lin.check_g_idx()
            lin.scales()
            if symmetric and np.any(lin.zeros() != _SYMMETRIC_ZERO):
                symmetric = False
    fmt = "int4" if symmetric else "int4_affine" if sch.bits == 4 else "int8_affine"
    if symmetric:
        w13 = np.empty((E, 2 * I, H), np.int8)
        w2 = np.empty((E, H, I), np.int8)
        s13 = np.empty((E, 2 * I, H // g), np.float32)
        s2 = np.empty((E, H, I // g), np.float32)
    else:
        w13 = np.empty((E, 2 * I, H), np.uint8)
        w2 = np.empty((E, H, I), np.uint8)
        s13 = np.empty((E, 2 * I, H // g, 2), np.float32)
        s2 = np.empty((E, H, I // g, 2), np.float32)
    b13 = np.empty((E, 2 * I), np.float32) if b13_on else None
    b2 = np.empty((E, H), np.float32) if b2_on else None
    rg, ru = ((slice(0, None, 2), slice(1, None, 2)) if interleaved
              else (slice(0, I), slice(I, 2 * I)))
    for j, e in enumerate(ids):
        for (lin, has_b), rows, wdst, sdst, bdst in zip(
                linears(e), (rg, ru, slice(None)), (w13, w13, w2), (s13, s13, s2),
                (b13, b13, b2)):
            q = lin.codes()
            s = lin.scales()
            if symmetric:
                wdst[j, rows] = (q.astype(np.int8) - np.int8(_SYMMETRIC_ZERO))
                sdst[j, rows] = lin.regrid(s, g)
            else:
                wdst[j, rows] = q
                z = lin.zeros().astype(np.float32)
                sdst[j, rows, :, 0] = lin.regrid(s, g)
                sdst[j, rows, :, 1] = lin.regrid(np.float32(0) - s * z, g)
            if has_b:
                bdst[j, rows] = lin.bias()
    ck_g = sch.group_size
    return QuantizedLayerWeights(fmt, g, w13, w2, s13, s2, b13, b2, ids, n_global, activation,
                                 layer, sch.method, sch.fmt, ck_g, layout)


def load_gptq_moe_layer(path: Union[PathLike, Checkpoint], layer: int, *,
                        experts: Optional[Sequence[int]] = None, activation: str = "silu",
                        layout: Optional[str] = None,
                        quant_config: Optional[dict] = None) -> QuantizedLayerWeights:
    """Reads the routed experts of one 4- or 8-bit GPTQ MoE layer (see the module doc).

    Args:
      path: a checkpoint folder, .safetensors file or index file (or a Checkpoint).
      layer: the decoder layer index L.
      experts: global ids of the experts to load, in the local order (default all).
      activation: the op's activation; "swigluoai" interleaves gate / up rows.
      layout: "qwen3" or "mixtral" (default: detected).
      quant_config: the quantization config (default: config.json's, or quantize_config.json).
    Returns a :class:`QuantizedLayerWeights` (4-bit: "int4" when symmetric, else "int4_affine";
    8-bit: "int8_affine"; ``.prepack()`` packs it). Raises UnsupportedCheckpoint naming what does not fit.
    """
    return _layer(path, layer, "gptq", experts, activation, layout, quant_config)


def load_awq_moe_layer(path: Union[PathLike, Checkpoint], layer: int, *,
                       experts: Optional[Sequence[int]] = None, activation: str = "silu",
                       layout: Optional[str] = None,
                       quant_config: Optional[dict] = None) -> QuantizedLayerWeights:
    """Reads the routed experts of one 4-bit AWQ (GEMM) MoE layer; arguments and result as
    :func:`load_gptq_moe_layer`."""
    return _layer(path, layer, "awq", experts, activation, layout, quant_config)


def load_quantized_moe_layer(path: Union[PathLike, Checkpoint], layer: int, *,
                             experts: Optional[Sequence[int]] = None, activation: str = "silu",
                             layout: Optional[str] = None,
                             quant_config: Optional[dict] = None) -> QuantizedLayerWeights:
    """:func:`load_gptq_moe_layer` or :func:`load_awq_moe_layer` by the config's
    ``quant_method``."""
    return _layer(path, layer, None, experts, activation, layout, quant_config)
