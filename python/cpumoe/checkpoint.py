"""Loading W8A8 int8 MoE layers of compressed-tensors checkpoints (safetensors files).

A compressed-tensors W8A8 int8 checkpoint (``quant_method: compressed-tensors``, format
``int-quantized``; e.g. the ``*.w8a8`` Qwen3-MoE checkpoints) stores each expert projection as a
Linear: ``<name>.weight`` int8 [out, in] and ``<name>.weight_scale`` [out, 1] (float32, bfloat16
or float16: static symmetric per-output-channel scales; activations are quantized per token at
run time), optionally ``<name>.bias`` [out]. A ``<name>.weight_zero_point`` that is present must
be all zeros (symmetric). Expert naming (``layout``):

=========== ====================================================================================
``qwen3``   ``model.layers.{L}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}`` (Qwen2/3-MoE,
            OLMoE, DeepSeek and gpt-oss checkpoints quantized per expert by llm-compressor)
``mixtral`` ``model.layers.{L}.block_sparse_moe.experts.{e}.{w1,w3,w2}`` (w1 gate, w3 up, w2 down)
=========== ====================================================================================

The layer is stacked to the op's layout: ``w13`` int8 [E, 2I, H] (gate rows then up rows; with
``activation="swigluoai"`` interleaved: even rows gate, odd rows up), ``w2`` int8 [E, H, I],
``s13`` [E, 2I], ``s2`` [E, H] float32, biases [E, 2I] / [E, H] float32 if the checkpoint has them.
Fused expert tensors (one [E, ...] tensor per projection, as in the bf16/MXFP4 gpt-oss release)
are not read: no int8 W8A8 variant of that layout is documented.

Files: a directory with ``model.safetensors.index.json`` (shards listed in its ``weight_map``) or
with ``*.safetensors`` files, a single ``.safetensors`` file, or an index file. The safetensors
format (8-byte little-endian header size, JSON header of name -> dtype, shape, byte offsets, then
the raw little-endian data) is read here directly through numpy memory maps: neither torch nor
the safetensors package is needed, and only the tensors asked for are read from disk.
``config.json`` (beside the weights) supplies ``quantization_config``, which is checked to be
W8A8 int8 for the experts when present.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import ops as _ops

__all__ = [
    "LAYOUTS",
    "Checkpoint",
    "MoeLayerWeights",
    "UnsupportedCheckpoint",
    "load_moe_layer",
    "load_float_tensor",
    "load_packed_moe_layer",
    "scheme_problem",
]

PathLike = Union[str, os.PathLike]

#: layout name -> (module name template of one expert projection, (gate, up, down) names).
LAYOUTS: Dict[str, Tuple[str, Tuple[str, str, str]]] = {
    "qwen3": ("model.layers.{layer}.mlp.experts.{expert}.{proj}",
              ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}",
                ("w1", "w3", "w2")),
}

# safetensors dtype -> little-endian numpy dtype (BF16 is read as its uint16 bits).
_ST_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "I64": "<i8",
              "I32": "<i4", "I16": "<i2", "I8": "i1", "U64": "<u8", "U32": "<u4", "U16": "<u2",
              "U8": "u1", "BOOL": "?"}
_MAX_HEADER = 100 * 1024 * 1024


class UnsupportedCheckpoint(ValueError):
    """The checkpoint (or the layer asked for) is not a W8A8 int8 MoE cpumoe can load."""


# ---------------------------------------------------------------------------- safetensors
class _SafetensorsFile:
    """One .safetensors file: its header, and tensors as zero-copy numpy views of a memmap."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise UnsupportedCheckpoint(f"{path}: not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER:
                raise UnsupportedCheckpoint(f"{path}: header of {n} bytes is not plausible")
            try:
                header = json.loads(f.read(n).decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise UnsupportedCheckpoint(f"{path}: bad safetensors header ({e})") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self.entries: Dict[str, dict] = header
        self.data_start = 8 + n
        self._map: Optional[np.memmap] = None

    def _bytes(self) -> np.ndarray:
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._map

    def dtype(self, name: str) -> str:
        return self.entries[name]["dtype"]

    def shape(self, name: str) -> Tuple[int, ...]:
        return tuple(int(d) for d in self.entries[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only numpy array (BF16 as uint16 bits), native byte order."""
        e = self.entries[name]
        st = e["dtype"]
        if st not in _ST_DTYPES:
            raise UnsupportedCheckpoint(f"{self.path}: {name}: dtype {st} is not supported")
        dt = np.dtype(_ST_DTYPES[st])
        begin, end = (int(v) for v in e["data_offsets"])
        shape = tuple(int(d) for d in e["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        if end - begin != count * dt.itemsize or begin < 0:
            raise UnsupportedCheckpoint(f"{self.path}: {name}: data_offsets {[begin, end]} do not "
                                        f"fit shape {list(shape)} of {st}")
        buf = self._bytes()
        start = self.data_start + begin
        if start + (end - begin) > buf.size:
            raise UnsupportedCheckpoint(f"{self.path}: {name}: data runs past the end of the file")
        arr = buf[start:start + (end - begin)].view(dt).reshape(shape)
        if not dt.isnative:
            arr = arr.astype(dt.newbyteorder("="))
        return arr


def _to_float32(arr: np.ndarray, st_dtype: str) -> np.ndarray:
    if st_dtype == "BF16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    if st_dtype not in ("F32", "F16", "F64"):
        raise UnsupportedCheckpoint(f"expected a float tensor, got {st_dtype}")
    return arr.astype(np.float32)


class Checkpoint:
    """The safetensors tensors of a checkpoint (one file, shards with an index, or a folder),
    plus its ``config.json``. Tensors are read lazily, through memory maps."""

    def __init__(self, path: PathLike):
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"checkpoint: {p} does not exist")
        self.root = p if p.is_dir() else p.parent
        if p.is_dir():
            index = p / "model.safetensors.index.json"
            if index.exists():
                files = self._from_index(index)
            else:
                files = sorted(p.glob("*.safetensors"))
                if not files:
                    raise UnsupportedCheckpoint(f"checkpoint: no *.safetensors file in {p}")
        elif p.name.endswith(".json"):
            files = self._from_index(p)
        else:
            files = [p]
        self._files = [_SafetensorsFile(f) for f in files]
        self._where: Dict[str, _SafetensorsFile] = {}
        for f in self._files:
            for name in f.entries:
                self._where.setdefault(name, f)

    def _from_index(self, index: Path) -> List[Path]:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise UnsupportedCheckpoint(f"{index}: not a safetensors index ({e!r})") from None
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (index.parent / n).exists()]
        if missing:
            raise FileNotFoundError(f"{index}: shard(s) missing: {', '.join(missing)}")
        return [index.parent / n for n in names]

    # tensors ------------------------------------------------------------------
    def keys(self) -> List[str]:
        return sorted(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def dtype(self, name: str) -> str:
        """The safetensors dtype string (``I8``, ``BF16``, ``F32``, ...)."""
        return self._file(name).dtype(name)

    def shape(self, name: str) -> Tuple[int, ...]:
        return self._file(name).shape(name)

    def get(self, name: str) -> np.ndarray:
        """Read-only numpy view (BF16 as its uint16 bits; see :meth:`get_float32`)."""
        return self._file(name).get(name)

    def get_float32(self, name: str) -> np.ndarray:
        """A float tensor widened to float32 (exact for BF16 and F16)."""
        f = self._file(name)
        return _to_float32(f.get(name), f.dtype(name))

    def _file(self, name: str) -> _SafetensorsFile:
        try:
            return self._where[name]
        except KeyError:
            raise KeyError(f"checkpoint: no tensor {name!r}") from None

    # config -------------------------------------------------------------------
    @property
    def config(self) -> dict:
        """config.json beside the weights, or {}."""
        c = self.root / "config.json"
        return json.loads(c.read_text()) if c.exists() else {}

    @property
    def quantization_config(self) -> Optional[dict]:
        cfg = self.config
        return cfg.get("quantization_config") or cfg.get("compression_config")

    # MoE layers ---------------------------------------------------------------
    def detect_layout(self, layer: int) -> Optional[str]:
        for name, (template, projs) in LAYOUTS.items():
            if template.format(layer=layer, expert=0, proj=projs[0]) + ".weight" in self:
                return name
        return None

    def moe_layers(self, layout: Optional[str] = None) -> List[int]:
        """Indices of the layers that have experts (of ``layout``, default any)."""
        found = set()
        for lname, (template, projs) in LAYOUTS.items():
            if layout is not None and lname != layout:
                continue
            rx = re.compile("^" + re.escape(template).replace(r"\{layer\}", r"(\d+)")
                            .replace(r"\{expert\}", "0").replace(r"\{proj\}", re.escape(projs[0]))
                            + r"\.weight$")
            for k in self._where:
                m = rx.match(k)
                if m:
                    found.add(int(m.group(1)))
        return sorted(found)

    def num_experts(self, layer: int, layout: Optional[str] = None) -> int:
        """Experts 0, 1, ... present for ``layer`` (counted until the first missing id)."""
        layout = layout or self.detect_layout(layer)
        if layout is None:
            return 0
        template, projs = LAYOUTS[layout]
        e = 0
        while template.format(layer=layer, expert=e, proj=projs[0]) + ".weight" in self:
            e += 1
        return e


# ---------------------------------------------------------------------------- the scheme
def _targets_module(patterns: Iterable[str], module: str, class_name: str = "Linear") -> bool:
    for pat in patterns or ():
        if pat.startswith("re:"):
            if re.match(pat[3:], module):
                return True
        elif pat in (module, class_name):
            return True
    return False


def scheme_problem(group: dict) -> Optional[str]:
    """None if a compressed-tensors config group is W8A8 int8 as the op computes it: weights
    8-bit int, symmetric, per channel, static; input activations 8-bit int, symmetric, per
    token, dynamic. Otherwise what differs."""
    w = group.get("weights") or {}
    a = group.get("input_activations")
    want_w = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    for k, v in want_w.items():
        if w.get(k) != v:
            return f"weights: {k} is {w.get(k)!r}, cpumoe needs {v!r}"
    if w.get("dynamic"):
        return "weights: dynamic weight quantization is not supported"
    if not a:
        return "input_activations: not quantized (weight-only W8A16 is not this op)"
    want_a = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
              "dynamic": True}
    for k, v in want_a.items():
        if a.get(k) != v:
            return f"input_activations: {k} is {a.get(k)!r}, cpumoe needs {v!r}"
    return None


def check_scheme(qcfg: Optional[dict], module: str) -> None:
    """Raises UnsupportedCheckpoint unless ``module`` is W8A8 int8 under quantization_config."""
    if qcfg is None:
        return  # no config.json: the tensors' dtypes are checked while loading
    method = qcfg.get("quant_method")
    if method != "compressed-tensors":
        raise UnsupportedCheckpoint(f"quantization_config: quant_method {method!r}, expected "
                                    f"'compressed-tensors'")
    fmt = qcfg.get("format")
    if fmt not in (None, "int-quantized", "naive-quantized"):
        raise UnsupportedCheckpoint(f"quantization_config: format {fmt!r} (expected "
                                    f"'int-quantized')")
    if _targets_module(qcfg.get("ignore") or (), module):
        raise UnsupportedCheckpoint(f"{module}: listed in quantization_config.ignore (not "
                                    f"quantized)")
    groups = [g for g in (qcfg.get("config_groups") or {}).values()
              if _targets_module(g.get("targets") or (), module)]
    if not groups:
        raise UnsupportedCheckpoint(f"{module}: no quantization_config.config_groups entry "
                                    f"targets it")
    problem = scheme_problem(groups[0])
    if problem is not None:
        raise UnsupportedCheckpoint(f"{module}: {problem}")


# ---------------------------------------------------------------------------- loading
@dataclasses.dataclass
class MoeLayerWeights:
    """One MoE layer stacked to the op's layout (numpy; see :func:`cpumoe.prepack`).

    w13 int8 [E, 2I, H], w2 int8 [E, H, I], s13 float32 [E, 2I], s2 float32 [E, H],
    b13 float32 [E, 2I] or None, b2 float32 [E, H] or None. ``expert_ids`` are the global ids
    of the E experts, in order; ``num_global_experts`` how many the layer has in all.
    """

    w13: np.ndarray
    w2: np.ndarray
    s13: np.ndarray
    s2: np.ndarray
    b13: Optional[np.ndarray]
    b2: Optional[np.ndarray]
    expert_ids: List[int]
    num_global_experts: int
    activation: str
    layer: int
    layout: str

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden(self) -> int:
        return self.w13.shape[2]

    @property
    def intermediate(self) -> int:
        return self.w2.shape[2]

    def expert_map(self) -> np.ndarray:
        """int32 [num_global_experts]: global id -> local id, -1 for experts not loaded."""
        m = np.full(self.num_global_experts, -1, np.int32)
        m[np.asarray(self.expert_ids, dtype=np.int64)] = np.arange(len(self.expert_ids))
        return m

    def prepack(self, isa: Optional[str] = None,
                num_threads: Optional[int] = None) -> _ops.PackedMoe:
        return _ops.prepack(self.w13, self.w2, self.s13, self.s2, self.b13, self.b2, isa=isa,
                            num_threads=num_threads)

    def as_layer(self, framework: str = "numpy") -> Any:
        """An object with vLLM's attribute names (w13_weight, w2_weight, w13_weight_scale,
        w2_weight_scale, w13_bias, w2_bias) for :meth:`cpumoe.experts.Int8Experts.
        process_weights_after_loading`; ``framework="torch"`` wraps the arrays as tensors
        (zero-copy)."""
        import types
        conv = (lambda a: a)
        if framework == "torch":
            import torch
            conv = (lambda a: None if a is None else torch.from_numpy(a))
        elif framework != "numpy":
            raise ValueError(f"framework: 'numpy' or 'torch', got {framework!r}")
        return types.SimpleNamespace(
            w13_weight=conv(self.w13), w2_weight=conv(self.w2), w13_weight_scale=conv(self.s13),
            w2_weight_scale=conv(self.s2), w13_bias=conv(self.b13), w2_bias=conv(self.b2))


def _open(path: Union[PathLike, Checkpoint]) -> Checkpoint:
    return path if isinstance(path, Checkpoint) else Checkpoint(path)


def _int8(ck: Checkpoint, name: str, shape: Tuple[int, int]) -> np.ndarray:
    if name not in ck:
        raise UnsupportedCheckpoint(f"checkpoint: missing {name}")
    if ck.dtype(name) != "I8":
        raise UnsupportedCheckpoint(f"{name}: dtype {ck.dtype(name)}, expected I8 (int8 "
                                    f"weights of a W8A8 checkpoint)")
    if ck.shape(name) != shape:
        raise UnsupportedCheckpoint(f"{name}: shape {list(ck.shape(name))}, expected "
                                    f"{list(shape)}")
    return ck.get(name)


def _vector(ck: Checkpoint, name: str, n: int) -> np.ndarray:
    if name not in ck:
        raise UnsupportedCheckpoint(f"checkpoint: missing {name}")
    shape = ck.shape(name)
    if shape not in ((n,), (n, 1)):
        raise UnsupportedCheckpoint(f"{name}: shape {list(shape)}, expected [{n}, 1] or [{n}] "
                                    f"(per output channel)")
    return ck.get_float32(name).reshape(n)


def _check_zero_point(ck: Checkpoint, module: str) -> None:
    name = module + ".weight_zero_point"
    if name in ck and np.any(ck.get(name) != 0):
        raise UnsupportedCheckpoint(f"{name}: nonzero zero points (asymmetric weights) are not "
                                    f"supported")


def load_moe_layer(path: Union[PathLike, Checkpoint], layer: int, *,
                   experts: Optional[Sequence[int]] = None, activation: str = "silu",
                   layout: Optional[str] = None, check_config: bool = True) -> MoeLayerWeights:
    """Reads the routed experts of one MoE layer and stacks them (see the module doc).

    Args:
      path: a checkpoint folder, .safetensors file or index file (or a :class:`Checkpoint`).
      layer: the decoder layer index L.
      experts: global ids of the experts to load, in the local order (expert parallelism;
        default all). :meth:`MoeLayerWeights.expert_map` gives the matching expert_map.
      activation: the op's activation; "swigluoai" interleaves gate/up rows as the op expects.
      layout: "qwen3" or "mixtral" (default: detected).
      check_config: check config.json's quantization_config, when present, for W8A8 int8.
    Raises UnsupportedCheckpoint (a ValueError) naming the tensor or setting that does not fit.
    """
    if activation not in _ops.ACTIVATIONS:
        raise ValueError(f"activation: must be one of {', '.join(_ops.ACTIVATIONS)}; got "
                         f"{activation!r}")
    ck = _open(path)
    layout = layout or ck.detect_layout(layer)
    if layout is None:
        raise UnsupportedCheckpoint(f"layer {layer}: no routed experts found (known layouts: "
                                    f"{', '.join(LAYOUTS)})")
    if layout not in LAYOUTS:
        raise ValueError(f"layout: one of {', '.join(LAYOUTS)}; got {layout!r}")
    template, (gate, up, down) = LAYOUTS[layout]
    n_global = ck.num_experts(layer, layout)
    if n_global == 0:
        raise UnsupportedCheckpoint(f"layer {layer}: no experts of layout {layout!r}")
    ids = list(range(n_global)) if experts is None else [int(e) for e in experts]
    if not ids or any(e < 0 or e >= n_global for e in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"experts: distinct ids in [0, {n_global}) expected, got {experts!r}")

    def mod(e: int, proj: str) -> str:
        return template.format(layer=layer, expert=e, proj=proj)

    if check_config:
        qcfg = ck.quantization_config
        for proj in (gate, up, down):
            check_scheme(qcfg, mod(ids[0], proj))
    g0 = mod(ids[0], gate) + ".weight"
    if g0 not in ck or len(ck.shape(g0)) != 2:
        raise UnsupportedCheckpoint(f"checkpoint: missing or not 2-D: {g0}")
    I, H = ck.shape(g0)
    E = len(ids)
    has_bias = mod(ids[0], gate) + ".bias" in ck
    w13 = np.empty((E, 2 * I, H), np.int8)
    w2 = np.empty((E, H, I), np.int8)
    s13 = np.empty((E, 2 * I), np.float32)
    s2 = np.empty((E, H), np.float32)
    b13 = np.empty((E, 2 * I), np.float32) if has_bias else None
    b2 = np.empty((E, H), np.float32) if has_bias else None
    # Rows of gate and up in w13: halves, or interleaved for swigluoai.
    rg, ru = (slice(0, None, 2), slice(1, None, 2)) if activation == "swigluoai" else (
        slice(0, I), slice(I, 2 * I))
    for j, e in enumerate(ids):
        for proj in (gate, up, down):
            _check_zero_point(ck, mod(e, proj))
        w13[j, rg] = _int8(ck, mod(e, gate) + ".weight", (I, H))
        w13[j, ru] = _int8(ck, mod(e, up) + ".weight", (I, H))
        w2[j] = _int8(ck, mod(e, down) + ".weight", (H, I))
        s13[j, rg] = _vector(ck, mod(e, gate) + ".weight_scale", I)
        s13[j, ru] = _vector(ck, mod(e, up) + ".weight_scale", I)
        s2[j] = _vector(ck, mod(e, down) + ".weight_scale", H)
        if has_bias:
            b13[j, rg] = _vector(ck, mod(e, gate) + ".bias", I)
            b13[j, ru] = _vector(ck, mod(e, up) + ".bias", I)
            b2[j] = _vector(ck, mod(e, down) + ".bias", H)
    return MoeLayerWeights(w13, w2, s13, s2, b13, b2, ids, n_global, activation, layer, layout)


def load_packed_moe_layer(path: Union[PathLike, Checkpoint], layer: int, *,
                          isa: Optional[str] = None, num_threads: Optional[int] = None,
                          **kw) -> _ops.PackedMoe:
    """:func:`load_moe_layer` then :func:`cpumoe.prepack`; the stacked copy is freed on return.
    Keyword arguments are those of load_moe_layer."""
    weights = load_moe_layer(path, layer, **kw)
    return weights.prepack(isa=isa, num_threads=num_threads)


def load_float_tensor(path: Union[PathLike, Checkpoint], name: str) -> np.ndarray:
    """A tensor of the checkpoint as float32: a float tensor widened, or the ``.weight`` of a
    W8A8-quantized Linear (int8 with ``.weight_scale`` per output channel) dequantized as
    ``weight * weight_scale`` (for the layers an engine runs in float: attention, dense MLPs).
    Raises UnsupportedCheckpoint for a missing tensor or an int tensor that is not such a weight.
    """
    ck = _open(path)
    if name not in ck:
        raise UnsupportedCheckpoint(f"checkpoint: missing {name}")
    dt = ck.dtype(name)
    if dt in ("F32", "F16", "BF16", "F64"):
        return ck.get_float32(name)
    module = name[:-len(".weight")] if name.endswith(".weight") else None
    if dt != "I8" or module is None or module + ".weight_scale" not in ck:
        raise UnsupportedCheckpoint(f"{name}: dtype {dt} is neither float nor the int8 weight of "
                                    f"a quantized Linear (with {name}_scale)")
    shape = ck.shape(name)
    if len(shape) != 2:
        raise UnsupportedCheckpoint(f"{name}: int8 weight of shape {list(shape)}, expected 2-D")
    _check_zero_point(ck, module)
    scale = _vector(ck, module + ".weight_scale", shape[0])
    return ck.get(name).astype(np.float32) * scale[:, None]
