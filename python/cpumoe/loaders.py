"""One entry point for MoE layers of quantized checkpoints: :func:`load_experts` (packed, for
:func:`cpumoe.fused_moe`) and :func:`read_experts` (unpacked, a
:class:`cpumoe.checkpoint.LoadedExperts`), whatever the checkpoint's kind:

- ``gguf``: a file starting with ``b"GGUF"`` (:mod:`cpumoe.checkpoint_gguf`): Q4_0 -> int4,
  MXFP4 -> mxfp4, BF16 -> bf16, Q4_1 and Q4_K -> int4_affine, Q8_0, Q5_0, Q5_1 and Q5_K ->
  int8_affine (a layer mixing these integer types: the widest).
- ``gptq``: ``quant_method: gptq``, 4- or 8-bit, checkpoint_format gptq (v1) or gptq_v2
  (:mod:`cpumoe.checkpoint_gptq`): 4-bit int4 when symmetric, else int4_affine; 8-bit
  int8_affine.
- ``awq``: ``quant_method: awq``, 4-bit GEMM packing (:mod:`cpumoe.checkpoint_gptq`): int4 when
  symmetric, else int4_affine.
- ``compressed-tensors``: pack-quantized int4 (:func:`cpumoe.checkpoint_w4.load_int4_moe_layer`)
  -> int4 when symmetric (every zero point 0), else int4_affine; FP8 (:func:`cpumoe.checkpoint_fp8.load_fp8_moe_layer`) -> fp8; W8A8 int8
  (:func:`cpumoe.checkpoint.load_moe_layer`) -> int8.
- ``fp8``: ``quant_method: fp8`` (HF fine-grained FP8, :mod:`cpumoe.checkpoint_fp8`) -> fp8.
- ``mxfp4``: ``quant_method: mxfp4`` (gpt-oss, :func:`cpumoe.checkpoint_w4.load_mxfp4_moe_layer`)
  -> mxfp4, activation swigluoai.

The safetensors kinds are told apart by the ``quant_method`` of config.json's
``quantization_config`` (or AutoGPTQ's ``quantize_config.json``) in the folder (or beside the
.safetensors / index file) given. The layer's activation (which sets w13's layout) is the
``activation=`` given, else the checkpoint's: a GGUF file's architecture's, gpt-oss MXFP4's
"swigluoai", otherwise "silu"; the unpacked layer's ``.activation`` says which.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence, Union

from .checkpoint import LoadedExperts, UnsupportedCheckpoint, autogptq_config, read_json

__all__ = ["LOADERS", "detect_format", "load_experts", "read_experts"]

PathLike = Union[str, os.PathLike]

#: The checkpoint kinds ``format=`` takes.
LOADERS = ("gguf", "gptq", "awq", "compressed-tensors", "fp8", "mxfp4")


def _what() -> str:
    return ", ".join(map(repr, LOADERS))


def _quant_config(folder: Path) -> Optional[dict]:
    cfg_path = folder / "config.json"
    if cfg_path.exists():
        cfg = read_json(cfg_path, "config.json")
        if not isinstance(cfg, dict):
            raise UnsupportedCheckpoint(f"{cfg_path}: not a JSON object")
        q = cfg.get("quantization_config") or cfg.get("compression_config")
        if q is not None:
            if not isinstance(q, dict):
                raise UnsupportedCheckpoint(f"{cfg_path}: quantization_config is not a JSON "
                                            f"object")
            return q
    return autogptq_config(folder)


def detect_format(path: PathLike) -> str:
    """The checkpoint kind of ``path`` (one of :data:`LOADERS`): a file starting with b"GGUF"
    is "gguf"; a folder (or a .safetensors / .json file in one) by its quantization config's
    ``quant_method``. UnsupportedCheckpoint when it is none of them."""
    p = Path(os.fspath(path))
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file or directory")
    if p.is_file():
        with open(p, "rb") as f:
            if f.read(4) == b"GGUF":
                return "gguf"
        if not (p.name.endswith(".safetensors") or p.name.endswith(".json")):
            raise UnsupportedCheckpoint(
                f"{p}: cannot tell its format: not a GGUF file (no b'GGUF' magic), nor a "
                f".safetensors or index file; load_experts reads {_what()}")
        folder = p.parent
    else:
        folder = p
    q = _quant_config(folder)
    if q is None:
        raise UnsupportedCheckpoint(
            f"{p}: cannot tell its format: no quantization_config in {folder / 'config.json'} "
            f"(nor a quantize_config.json); load_experts reads {_what()} checkpoints")
    method = q.get("quant_method")
    if isinstance(method, str) and method.lower() in LOADERS[1:]:
        return method.lower()
    raise UnsupportedCheckpoint(f"{p}: quantization_config.quant_method {method!r}: "
                                f"load_experts reads {_what()}")


def _compressed_tensors_kind(q: dict) -> str:
    """"int4", "fp8" or "int8" of a compressed-tensors quantization config."""
    fmt = q.get("format")
    by_format = {"pack-quantized": "int4", "float-quantized": "fp8", "int-quantized": "int8"}
    if fmt in by_format:
        return by_format[fmt]
    groups = q.get("config_groups") or {}
    if not isinstance(groups, dict):
        groups = {}
    weights = [g.get("weights") for g in groups.values() if isinstance(g, dict)]
    for w in weights:
        if isinstance(w, dict):
            bits, typ = w.get("num_bits"), w.get("type")
            if bits == 4 and typ == "int":
                return "int4"
            if bits == 8 and typ == "float":
                return "fp8"
            if bits == 8 and typ == "int":
                return "int8"
    raise UnsupportedCheckpoint(f"quantization_config: compressed-tensors format {fmt!r} with "
                                f"weights {weights!r:.200}: cpumoe reads its int4 "
                                f"(pack-quantized), FP8 and int8 (W8A8) schemes")


def read_experts(path: PathLike, layer: int, *, format: Optional[str] = None,
                 experts: Optional[Sequence[int]] = None,
                 activation: Optional[str] = None,
                 requantize: Optional[str] = None) -> LoadedExperts:
    """MoE layer ``layer``'s routed experts of the checkpoint ``path`` (a GGUF file, or a
    safetensors folder / file), unpacked in their cpumoe format's prepack input form, as stored
    (see the module doc). ``.prepack()`` packs the result; its ``.activation`` is the activation
    to run it with.

    Args:
      format: one of :data:`LOADERS`, or None to detect it.
      experts: the global ids to read (default all).
      activation: the activation spec the layer is run with (it sets w13's layout: gate / up
        interleaved for swigluoai); None: the GGUF architecture's, gpt-oss MXFP4's swigluoai,
        otherwise "silu".
      requantize: GGUF only: "int8_affine" reads the tensors of types no cpumoe format holds
        (Q6_K, ...) re-quantized to 8-bit groups of 32
        (:func:`cpumoe.checkpoint_gguf.read_gguf_experts`); None (default) refuses them.
    """
    if format is None:
        format = detect_format(path)
    if format not in LOADERS:
        raise ValueError(f"format: one of {_what()} or None (detect); got {format!r}")
    if format == "gguf":
        from .checkpoint_gguf import read_gguf_experts
        return read_gguf_experts(path, layer, experts=experts, activation=activation,
                                 requantize=requantize)
    if requantize is not None:
        raise ValueError(f"requantize: only for GGUF files (this is {format!r}: its formats "
                         f"are read as stored)")
    if format == "mxfp4":
        from .checkpoint_w4 import load_mxfp4_moe_layer
        if activation is not None and not str(activation).startswith("swigluoai"):
            raise ValueError(f"activation: gpt-oss MXFP4 experts are stored for swigluoai (gate "
                             f"and up interleaved), got {activation!r}")
        lw = load_mxfp4_moe_layer(path, layer, experts=experts)
        if activation is not None:
            lw.activation = activation
        return lw
    act = "silu" if activation is None else activation
    if format in ("gptq", "awq"):
        from .checkpoint_gptq import load_awq_moe_layer, load_gptq_moe_layer
        fn = load_gptq_moe_layer if format == "gptq" else load_awq_moe_layer
        return fn(path, layer, experts=experts, activation=act)
    if format == "fp8":
        from .checkpoint_fp8 import load_fp8_moe_layer
        return load_fp8_moe_layer(path, layer, experts=experts, activation=act)
    # compressed-tensors: the scheme of its config groups
    from .checkpoint import open_checkpoint
    ck = open_checkpoint(path)
    q = ck.quantization_config
    if q is None:
        raise UnsupportedCheckpoint(f"{path}: no quantization_config in config.json: cannot tell "
                                    f"the compressed-tensors scheme")
    kind = _compressed_tensors_kind(q)
    if kind == "int4":
        from .checkpoint_w4 import load_int4_moe_layer
        return load_int4_moe_layer(ck, layer, experts=experts, activation=act)
    if kind == "fp8":
        from .checkpoint_fp8 import load_fp8_moe_layer
        return load_fp8_moe_layer(ck, layer, experts=experts, activation=act)
    from .checkpoint import load_moe_layer
    return load_moe_layer(ck, layer, experts=experts, activation=act)


def load_experts(path: PathLike, layer: int, *, format: Optional[str] = None,
                 isa: Optional[str] = None, num_threads: Optional[int] = None,
                 activation: Optional[str] = None, requantize: Optional[str] = None,
                 act_quant: Optional[str] = None):
    """The packed layer (for :func:`cpumoe.fused_moe`) of MoE layer ``layer``'s routed experts in
    the checkpoint ``path``: a GGUF file, or a GPTQ / AWQ / compressed-tensors / FP8 / gpt-oss
    MXFP4 safetensors checkpoint (see the module doc), in the cpumoe weight format its stored
    form is (``packed.weight_format``); no re-quantization. Run it with ``activation`` when
    given, else the checkpoint's: :func:`read_experts`'s ``.activation`` (a GGUF file's
    architecture's, gpt-oss: "swigluoai", otherwise "silu").

    Args:
      format: one of :data:`LOADERS`, or None to detect it from the file / config.
      isa, num_threads: as in the prepack functions.
      activation, requantize: as in :func:`read_experts` (None: the checkpoint's; none).
      act_quant: for layers in a W4A8 format (int4, int4_affine, int8_affine, mxfp4), how the
        op treats the activations, as in :func:`cpumoe.prepack_int4`: "row" (the default),
        "group", or for int4 and mxfp4 "bf16" (W4A16: a GPTQ / AWQ-symmetric / Q4_0 / MXFP4
        layer run as its checkpoint was calibrated, with bf16 activations). ValueError for a
        layer in another format.
    Raises UnsupportedCheckpoint (a ValueError) naming the tensor or setting that does not fit.
    """
    experts = read_experts(path, layer, format=format, activation=activation,
                           requantize=requantize)
    return experts.prepack(isa=isa, num_threads=num_threads, act_quant=act_quant)
