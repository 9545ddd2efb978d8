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
Fused expert tensors (one [E, ...] tensor per projection, as in gpt-oss's releases)
are not read: no int8 W8A8 variant of that layout is documented.

Files: a directory with ``model.safetensors.index.json`` (shards listed in its ``weight_map``) or
with ``*.safetensors`` files, a single ``.safetensors`` file, or an index file. The safetensors
format (8-byte little-endian header size, JSON header of name -> dtype, shape, byte offsets, then
the raw little-endian data) is read here directly through numpy memory maps: neither torch nor
the safetensors package is needed (safetensors is a test dependency only, absent from the aarch64
CPython CI uses), and only the tensors asked for are read from disk. The header is held to the
format's rules as strictly as the safetensors package holds it (known dtypes, non-negative
integer shapes, offsets that tile the data section exactly, string metadata), so a file this
reader accepts is one the package reads identically: tests_py/fuzz_checkpoint.py checks that
under a coverage-guided fuzzer. Any malformed file, index or config raises UnsupportedCheckpoint.
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
from .quantize import QuantizedExperts

__all__ = [
    "LAYOUTS",
    "Checkpoint",
    "LoadedExperts",
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
# Dtypes a header may declare that the loader never reads (their bytes still tile the data).
_ST_OTHER_SIZES = {"F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
# FP8 dtypes get() reads as their uint8 bits (cpumoe.checkpoint_fp8: E4M3 codes, E8M0 scales);
# numpy has no such dtype, so the safetensors package's numpy reader cannot read them.
_ST_BITS = {"F8_E4M3": "u1", "F8_E8M0": "u1"}
_MAX_HEADER = 100_000_000  # the safetensors package's own limit
_U64 = 2**64  # sizes and offsets are u64 in the format (usize in the package)
_MAX_JSON_FILE = 64 * 1024 * 1024  # index / config.json: real ones are well below 10 MB


class UnsupportedCheckpoint(ValueError):
    """The checkpoint (or the layer asked for) is not a W8A8 int8 MoE cpumoe can load."""


def read_json(path: Path, what: str) -> Any:
    """A small JSON file (index, config): UnsupportedCheckpoint when it is not one."""
    if not path.is_file():
        raise UnsupportedCheckpoint(f"{path}: {what} is not a regular file")
    size = path.stat().st_size
    if size > _MAX_JSON_FILE:
        raise UnsupportedCheckpoint(f"{path}: {what} of {size} bytes is not plausible")
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise UnsupportedCheckpoint(f"{path}: {what} is not valid JSON ({e})") from None


def autogptq_config(folder: Path) -> Optional[dict]:
    """AutoGPTQ's ``quantize_config.json`` in ``folder`` as a quantization config (its
    ``quant_method`` "gptq" unless it says otherwise); None when there is none."""
    side = folder / "quantize_config.json"
    if not side.exists():
        return None
    q = read_json(side, "quantize_config.json")
    if not isinstance(q, dict):
        raise UnsupportedCheckpoint(f"{side}: not a JSON object")
    return {"quant_method": "gptq", **q}


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # Python's json takes NaN / Infinity; JSON does not


def _unique_keys(pairs: list) -> dict:
    """A JSON object whose keys are all different: json keeps the last of duplicates, the
    safetensors package parses (and may refuse) each, so a header with two is ambiguous."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"duplicate key {dup!r}")
    return out


def _check_strings(v: Any) -> None:
    """Every string of a parsed header is valid Unicode (json takes lone surrogates)."""
    if isinstance(v, str):
        v.encode("utf-8")  # UnicodeEncodeError (a ValueError) for a lone surrogate
    elif isinstance(v, dict):
        for k, x in v.items():
            k.encode("utf-8")
            _check_strings(x)
    elif isinstance(v, list):
        for x in v:
            _check_strings(x)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# ---------------------------------------------------------------------------- safetensors
class _SafetensorsFile:
    """One .safetensors file: its header, and tensors as zero-copy numpy views of a memmap."""

    def __init__(self, path: Path):
        self.path = path
        if not path.is_file():  # a FIFO would block the open below
            raise UnsupportedCheckpoint(f"{path}: not a regular file")
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) != 8:
                raise UnsupportedCheckpoint(f"{path}: not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER:
                raise UnsupportedCheckpoint(f"{path}: header of {n} bytes is not plausible")
            if 8 + n > size:
                raise UnsupportedCheckpoint(f"{path}: header of {n} bytes runs past the end of "
                                            f"the file ({size} bytes)")
            try:
                text = f.read(n).decode("utf-8")
                if not text.startswith("{"):
                    raise ValueError("does not start with '{'")
                header = json.loads(text, parse_constant=_no_constant,
                                    object_pairs_hook=_unique_keys)
                _check_strings(header)
            except (UnicodeDecodeError, ValueError, RecursionError) as e:
                raise UnsupportedCheckpoint(f"{path}: bad safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise UnsupportedCheckpoint(f"{path}: bad safetensors header (not a JSON object)")
        meta = header.pop("__metadata__", None)
        if meta is not None and not (isinstance(meta, dict) and
                                     all(isinstance(v, str) for v in meta.values())):
            raise UnsupportedCheckpoint(f"{path}: __metadata__ must map strings to strings")
        self.metadata = meta or {}
        self.data_start = 8 + n
        self.entries: Dict[str, dict] = {}
        spans = []
        for name, e in header.items():
            begin, end, shape, st = self._entry(name, e)
            self.entries[name] = {"dtype": st, "shape": shape, "data_offsets": (begin, end)}
            spans.append((begin, end, name))
        # The tensors tile the data section: sorted by offset, each starts where the previous one
        # ends, from 0 to the end of the file (no gaps, no overlaps, no lying offsets).
        at = 0
        for begin, end, name in sorted(spans):
            if begin != at:
                raise UnsupportedCheckpoint(f"{path}: {name}: data_offsets start at {begin}, "
                                            f"expected {at} (tensors must tile the data)")
            at = end
        if self.data_start + at != size:
            raise UnsupportedCheckpoint(
                f"{path}: the tensors cover {at} data bytes but the file has "
                f"{size - self.data_start} after the header (truncated or padded: data runs "
                f"past the end of the file, or stops short of it)")
        self._map: Optional[np.memmap] = None

    def _entry(self, name: str, e: Any) -> Tuple[int, int, Tuple[int, ...], str]:
        """(begin, end, shape, dtype) of a header entry, checked against each other."""
        where = f"{self.path}: {name}"
        if not isinstance(e, dict):
            raise UnsupportedCheckpoint(f"{where}: header entry is not a JSON object")
        st, shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if not isinstance(st, str) or (st not in _ST_DTYPES and st not in _ST_OTHER_SIZES):
            raise UnsupportedCheckpoint(f"{where}: dtype {st!r} is not supported")
        if not isinstance(shape, list) or not all(_is_int(d) and 0 <= d < _U64 for d in shape):
            raise UnsupportedCheckpoint(f"{where}: shape {shape!r} is not a list of integers >= 0")
        if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(v) for v in offs)
                and 0 <= offs[0] <= offs[1] < _U64):
            raise UnsupportedCheckpoint(f"{where}: data_offsets {offs!r} are not [begin, end] "
                                        f"with 0 <= begin <= end")
        item = np.dtype(_ST_DTYPES[st]).itemsize if st in _ST_DTYPES else _ST_OTHER_SIZES[st]
        count = 1
        for d in shape:  # as the format's u64 arithmetic: every partial product must fit
            count *= d
            if count >= _U64:
                raise UnsupportedCheckpoint(f"{where}: shape {shape} overflows 64 bits")
        if count * item >= _U64 or offs[1] - offs[0] != count * item:
            raise UnsupportedCheckpoint(f"{where}: data_offsets {offs} do not fit shape "
                                        f"{shape} of {st}")
        return offs[0], offs[1], tuple(shape), st

    def _bytes(self) -> np.ndarray:
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._map

    def dtype(self, name: str) -> str:
        return self.entries[name]["dtype"]

    def shape(self, name: str) -> Tuple[int, ...]:
        return self.entries[name]["shape"]

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only numpy array (BF16 as uint16 bits, FP8 as uint8 bits), native
        byte order."""
        e = self.entries[name]
        st = e["dtype"]
        code = _ST_DTYPES.get(st, _ST_BITS.get(st))
        if code is None:
            raise UnsupportedCheckpoint(f"{self.path}: {name}: dtype {st} is not supported")
        dt = np.dtype(code)
        begin, end = e["data_offsets"]
        shape = e["shape"]
        if begin == end:  # empty: the file may end at the header (nothing to map)
            return np.zeros(shape, dt.newbyteorder("="))
        buf = self._bytes()
        start = self.data_start + begin
        if start + (end - begin) > buf.size:  # the file shrank since it was opened
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
        doc = read_json(index, "safetensors index")
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str)
                                                       for v in weight_map.values()):
            raise UnsupportedCheckpoint(f"{index}: not a safetensors index (needs a weight_map "
                                        f"object of tensor name -> shard file name)")
        names = sorted(set(weight_map.values()))
        # Shards are files beside the index: a path elsewhere (../, absolute) is not followed.
        odd = [n for n in names if n in ("", ".", "..") or Path(n).name != n or "\\" in n]
        if odd:
            raise UnsupportedCheckpoint(f"{index}: shard names must be plain file names beside "
                                        f"the index, got {odd[:3]}")
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
        if not c.exists():
            return {}
        cfg = read_json(c, "config.json")
        if not isinstance(cfg, dict):
            raise UnsupportedCheckpoint(f"{c}: config.json is not a JSON object")
        return cfg

    @property
    def quantization_config(self) -> Optional[dict]:
        cfg = self.config
        q = cfg.get("quantization_config") or cfg.get("compression_config")
        if q is not None and not isinstance(q, dict):
            raise UnsupportedCheckpoint(f"{self.root / 'config.json'}: quantization_config is "
                                        f"not a JSON object")
        return q

    # MoE layers ---------------------------------------------------------------
    def detect_layout(self, layer: int, suffix: str = ".weight") -> Optional[str]:
        """The layout of LAYOUTS whose expert 0 of ``layer`` has its gate tensor
        (``<module><suffix>``: ".weight", ".qweight", ".weight_packed"), None if none has."""
        for name, (template, projs) in LAYOUTS.items():
            if template.format(layer=layer, expert=0, proj=projs[0]) + suffix in self:
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

    def num_experts(self, layer: int, layout: Optional[str] = None,
                    suffix: str = ".weight") -> int:
        """Experts 0, 1, ... present for ``layer`` (counted until the first missing id)."""
        layout = layout or self.detect_layout(layer, suffix)
        if layout is None:
            return 0
        template, projs = LAYOUTS[layout]
        e = 0
        while template.format(layer=layer, expert=e, proj=projs[0]) + suffix in self:
            e += 1
        return e


def nibbles(words: np.ndarray) -> np.ndarray:
    """int32 words [..., M] of 4-bit fields (GPTQ, AWQ, compressed-tensors' packing) -> uint8
    [..., M, 8]: field i is bits 4i..4i+3 of each word."""
    return fields(words, 4)


def fields(words: np.ndarray, bits: int) -> np.ndarray:
    """int32 words [..., M] of ``bits``-bit fields (4 or 8) -> uint8 [..., M, 32 / bits]: field
    i is bits (bits * i) .. (bits * i + bits - 1) of each word."""
    b = np.ascontiguousarray(words).astype("<i4", copy=False).view(np.uint8)
    b = b.reshape(*words.shape, 4)
    if bits == 8:
        return b.copy()
    return np.stack([b & 15, b >> 4], axis=-1).reshape(*words.shape, 8)


def need_tensor(ck: "Checkpoint", name: str, dtypes: Sequence[str], shape: Sequence[int],
                missing_hint: str = "", shape_note: str = "") -> None:
    """UnsupportedCheckpoint unless tensor ``name`` is in ``ck`` with one of ``dtypes`` (the
    safetensors names) and exactly ``shape`` (headers only); the hint / note end the message."""
    if name not in ck:
        raise UnsupportedCheckpoint(f"checkpoint: missing {name}{missing_hint}")
    if ck.dtype(name) not in dtypes:
        raise UnsupportedCheckpoint(f"{name}: dtype {ck.dtype(name)}, expected "
                                    f"{' or '.join(dtypes)}")
    if tuple(ck.shape(name)) != tuple(shape):
        raise UnsupportedCheckpoint(f"{name}: shape {list(ck.shape(name))}, expected "
                                    f"{list(shape)}{shape_note}")


@dataclasses.dataclass(frozen=True)
class ExpertModules:
    """The names of one MoE layer's expert Linears in a checkpoint (:func:`expert_modules`)."""

    layout: str
    layer: int
    projs: Tuple[str, str, str]  # the gate, up and down projections' names
    n_global: int  # experts the layer has
    ids: List[int]  # the global ids to load

    def module(self, e: int, proj: str) -> str:
        """The Linear of projection ``proj`` of expert ``e`` (global id)."""
        return LAYOUTS[self.layout][0].format(layer=self.layer, expert=e, proj=proj)


def expert_modules(ck: "Checkpoint", layer: int, experts: Optional[Sequence[int]] = None,
                   layout: Optional[str] = None, suffix: str = ".weight",
                   what: str = "routed") -> ExpertModules:
    """The layout (given, or detected from the tensors ``<module><suffix>``), the experts of
    ``layer`` and the ids to load (:func:`expert_ids_of`) of a checkpoint's MoE layer.
    UnsupportedCheckpoint when it has none (``what`` names the kind sought: "int4
    (weight_packed)", ...); ValueError for an unknown layout or bad ids."""
    if layout is None:
        layout = ck.detect_layout(layer, suffix)
        if layout is None:
            tried = " or ".join(t.format(layer=layer, expert=0, proj=p[0]) + suffix
                                for t, p in LAYOUTS.values())
            raise UnsupportedCheckpoint(f"layer {layer}: no {what} experts found (no {tried}; "
                                        f"known layouts: {', '.join(LAYOUTS)})")
    if layout not in LAYOUTS:
        raise ValueError(f"layout: one of {', '.join(LAYOUTS)}; got {layout!r}")
    n_global = ck.num_experts(layer, layout, suffix)
    if n_global == 0:
        raise UnsupportedCheckpoint(f"layer {layer}: no experts of layout {layout!r}")
    return ExpertModules(layout, layer, LAYOUTS[layout][1], n_global,
                         expert_ids_of(experts, n_global))


# ---------------------------------------------------------------------------- the scheme
def targets_module(patterns: Iterable[str], module: str, class_name: str = "Linear") -> bool:
    if patterns and (not isinstance(patterns, list) or
                     not all(isinstance(p, str) for p in patterns)):
        raise UnsupportedCheckpoint(f"quantization_config: targets/ignore must be lists of "
                                    f"strings, got {patterns!r:.80}")
    for pat in patterns or ():
        if pat.startswith("re:"):
            try:
                hit = re.match(pat[3:], module)
            except (re.error, RecursionError, OverflowError) as e:
                raise UnsupportedCheckpoint(f"quantization_config: bad pattern {pat!r:.80} "
                                            f"({e})") from None
            if hit:
                return True
        elif pat in (module, class_name):
            return True
    return False


def scheme_problem(group: dict) -> Optional[str]:
    """None if a compressed-tensors config group is W8A8 int8 as the op computes it: weights
    8-bit int, symmetric, per channel, static; input activations 8-bit int, symmetric, per
    token, dynamic. Otherwise what differs."""
    if not isinstance(group, dict):
        return "config group: not a JSON object"
    w = group.get("weights") or {}
    a = group.get("input_activations")
    if not isinstance(w, dict) or not (a is None or isinstance(a, dict)):
        return "weights / input_activations: not JSON objects"
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
    if targets_module(qcfg.get("ignore") or (), module):
        raise UnsupportedCheckpoint(f"{module}: listed in quantization_config.ignore (not "
                                    f"quantized)")
    config_groups = qcfg.get("config_groups") or {}
    if not isinstance(config_groups, dict) or not all(isinstance(g, dict)
                                                      for g in config_groups.values()):
        raise UnsupportedCheckpoint("quantization_config: config_groups must map names to "
                                    "JSON objects")
    groups = [g for g in config_groups.values()
              if targets_module(g.get("targets") or (), module)]
    if not groups:
        raise UnsupportedCheckpoint(f"{module}: no quantization_config.config_groups entry "
                                    f"targets it")
    problem = scheme_problem(groups[0])
    if problem is not None:
        raise UnsupportedCheckpoint(f"{module}: {problem}")


# ---------------------------------------------------------------------------- loading
@dataclasses.dataclass
class LoadedExperts(QuantizedExperts):
    """A MoE layer's experts read from a checkpoint, in their format's prepack input form (a
    :class:`cpumoe.quantize.QuantizedExperts`, whose ``prepack()`` packs it), with where they came
    from: the global ids of the E experts, in order, how many the layer has in all, the layer's
    activation and index."""

    expert_ids: List[int]
    num_global_experts: int
    activation: str
    layer: int

    def expert_map(self) -> np.ndarray:
        """int32 [num_global_experts]: global id -> local id, -1 for experts not loaded."""
        return expert_map_of(self.expert_ids, self.num_global_experts)


@dataclasses.dataclass
class MoeLayerWeights(LoadedExperts):
    """One int8 MoE layer stacked to the op's layout (numpy; see :func:`cpumoe.prepack`), format
    "int8": w13 int8 [E, 2I, H], w2 int8 [E, H, I], s13 float32 [E, 2I], s2 float32 [E, H],
    b13 float32 [E, 2I] or None, b2 float32 [E, H] or None; ``layout`` the checkpoint's expert
    naming."""

    layout: str

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


def expert_ids_of(experts: Optional[Sequence[int]], n_global: int) -> List[int]:
    """The global ids to load (default all), checked: distinct, in [0, n_global)."""
    ids = list(range(n_global)) if experts is None else [int(e) for e in experts]
    if not ids or any(e < 0 or e >= n_global for e in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"experts: distinct ids in [0, {n_global}) expected, got {experts!r}")
    return ids


def expert_map_of(expert_ids: Sequence[int], n_global: int) -> np.ndarray:
    """int32 [n_global]: global id -> its index in expert_ids, -1 for the others."""
    m = np.full(n_global, -1, np.int32)
    m[np.asarray(expert_ids, dtype=np.int64)] = np.arange(len(expert_ids))
    return m


def open_checkpoint(path: Union[PathLike, Checkpoint]) -> Checkpoint:
    return path if isinstance(path, Checkpoint) else Checkpoint(path)


def _int8(ck: Checkpoint, name: str, shape: Tuple[int, int]) -> np.ndarray:
    _check_int8(ck, name, shape)
    return ck.get(name)


def _check_int8(ck: Checkpoint, name: str, shape: Tuple[int, int]) -> None:
    if name not in ck:
        raise UnsupportedCheckpoint(f"checkpoint: missing {name}")
    if ck.dtype(name) != "I8":
        raise UnsupportedCheckpoint(f"{name}: dtype {ck.dtype(name)}, expected I8 (int8 "
                                    f"weights of a W8A8 checkpoint)")
    if ck.shape(name) != shape:
        raise UnsupportedCheckpoint(f"{name}: shape {list(ck.shape(name))}, expected "
                                    f"{list(shape)}")


def _vector(ck: Checkpoint, name: str, n: int) -> np.ndarray:
    _check_vector(ck, name, n)
    return ck.get_float32(name).reshape(n)


def _check_vector(ck: Checkpoint, name: str, n: int) -> None:
    if name not in ck:
        raise UnsupportedCheckpoint(f"checkpoint: missing {name}")
    shape = ck.shape(name)
    if shape not in ((n,), (n, 1)):
        raise UnsupportedCheckpoint(f"{name}: shape {list(shape)}, expected [{n}, 1] or [{n}] "
                                    f"(per output channel)")
    if ck.dtype(name) not in ("F32", "F16", "BF16", "F64"):
        raise UnsupportedCheckpoint(f"{name}: dtype {ck.dtype(name)}, expected a float tensor")


def check_zero_point(ck: Checkpoint, module: str) -> None:
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
    interleaved = _ops.activation_interleaved(activation)  # its errors for a bad spec
    ck = open_checkpoint(path)
    em = expert_modules(ck, layer, experts, layout)
    layout, n_global, ids, mod = em.layout, em.n_global, em.ids, em.module
    gate, up, down = em.projs

    if check_config:
        qcfg = ck.quantization_config
        for proj in (gate, up, down):
            check_scheme(qcfg, mod(ids[0], proj))
    g0 = mod(ids[0], gate) + ".weight"
    if g0 not in ck or len(ck.shape(g0)) != 2:
        raise UnsupportedCheckpoint(f"checkpoint: missing or not 2-D: {g0}")
    I, H = ck.shape(g0)
    if I < 1 or H < 1:
        raise UnsupportedCheckpoint(f"{g0}: shape {[I, H]} has an empty dimension")
    E = len(ids)
    has_bias = mod(ids[0], gate) + ".bias" in ck
    # Every tensor's name, dtype and shape first (headers only): the arrays below are then the
    # size of tensors the files hold (each header shape is tied to bytes on disk), never an
    # allocation sized by a header alone.
    for e in ids:
        for proj, shape in ((gate, (I, H)), (up, (I, H)), (down, (H, I))):
            _check_int8(ck, mod(e, proj) + ".weight", shape)
            _check_vector(ck, mod(e, proj) + ".weight_scale", shape[0])
            if has_bias:
                _check_vector(ck, mod(e, proj) + ".bias", shape[0])
    w13 = np.empty((E, 2 * I, H), np.int8)
    w2 = np.empty((E, H, I), np.int8)
    s13 = np.empty((E, 2 * I), np.float32)
    s2 = np.empty((E, H), np.float32)
    b13 = np.empty((E, 2 * I), np.float32) if has_bias else None
    b2 = np.empty((E, H), np.float32) if has_bias else None
    # Rows of gate and up in w13: halves, or interleaved (swigluoai).
    rg, ru = (slice(0, None, 2), slice(1, None, 2)) if interleaved else (
        slice(0, I), slice(I, 2 * I))
    for j, e in enumerate(ids):
        for proj in (gate, up, down):
            check_zero_point(ck, mod(e, proj))
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
    return MoeLayerWeights("int8", 0, w13, w2, s13, s2, b13, b2, ids, n_global, activation,
                           layer, layout)


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
    ck = open_checkpoint(path)
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
    check_zero_point(ck, module)
    scale = _vector(ck, module + ".weight_scale", shape[0])
    return ck.get(name).astype(np.float32) * scale[:, None]
