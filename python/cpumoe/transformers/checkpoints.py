"""Models of quantized checkpoints on cpumoe's backends, their experts packed from the
checkpoint's integer weights without a float copy: compressed-tensors W8A8 (:func:`load_w8a8`),
compressed-tensors int4 and gpt-oss MXFP4 (:func:`load_w4a8`), HF fp8 and compressed-tensors FP8
(:func:`load_w8a16`), GPTQ and AWQ (:func:`load_quantized`)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional

import numpy as np
import torch

from .. import checkpoint as _ck
from .. import checkpoint_fp8 as _ck8
from .. import checkpoint_gptq as _gptq
from .. import checkpoint_w4 as _ck4
from .. import loaders as _loaders
from .. import ops as _ops
from ..quantize import WIDENING, widen_values, widest_format
from .backends import experts_modules
from .layout import UnsupportedExperts, refuse, Layout, layout_of
from .packing import EXPERT_PARAMS, STATE_ATTR, BACKENDS, PackedState

# The checkpoint names a model tensor may have besides its own: Mixtral's original MoE block
# name (transformers renames ".block_sparse_moe." to ".mlp." when it loads such checkpoints).
_CHECKPOINT_ALIASES = ((".mlp.", ".block_sparse_moe."),)


def _checkpoint_name(ck, key: str) -> Optional[str]:
    """The checkpoint's name of the model tensor ``key`` (an int4 Linear's ``.weight`` is there
    as ``.weight_packed``, a GPTQ / AWQ one's as ``.qweight``: the name returned is the
    ``.weight``), or None."""
    def there(name: str) -> bool:
        return name in ck or (name.endswith(".weight") and (
            name + "_packed" in ck or _gptq_linear(name) in ck))
    if there(key):
        return key
    for ours, theirs in _CHECKPOINT_ALIASES:
        alt = key.replace(ours, theirs)
        if alt != key and there(alt):
            return alt
    return None


def load_w8a8(path, *, dtype: torch.dtype = torch.bfloat16, model_class: Any = None):
    """A model of a compressed-tensors W8A8 int8 checkpoint (``quant_method:
    compressed-tensors``, int8 per-channel weights, dynamic per-token activations; one Linear
    per expert projection, as llm-compressor saves MoE models) on the ``"cpumoe"`` backend.

    The routed experts go from the checkpoint's int8 weights and scales straight into packed
    layers (:func:`cpumoe.checkpoint.load_moe_layer`: no float copy of the experts is ever
    made); every other tensor is loaded in ``dtype`` (quantized Linears such as the attention
    projections dequantized, since transformers runs them in float). The model is built on the
    meta device from ``config.json`` (without its quantization_config) and materialised
    without the float experts. Other tensors are matched by name: the module names of the
    transformers model (Qwen2/3-MoE, OLMoE, DeepSeek checkpoints), or Mixtral's original
    ``...block_sparse_moe...`` for the model's ``...mlp...`` (its router, as transformers itself
    renames it on loading).

    model_class: default ``AutoModelForCausalLM``. Raises UnsupportedCheckpoint (a ValueError)
    for a checkpoint that is not W8A8 int8 or lacks a tensor, UnsupportedExperts for experts
    cpumoe cannot take.
    """
    ck = _ck.Checkpoint(path)
    if (ck.quantization_config or {}).get("quant_method") != "compressed-tensors":
        raise _ck.UnsupportedCheckpoint(f"{path}: config.json has no compressed-tensors "
                                        f"quantization_config")
    return _load_quantized(ck, "int8", dtype, model_class)


def load_w4a8(path, *, dtype: torch.dtype = torch.bfloat16, model_class: Any = None):
    """A model of a 4-bit MoE checkpoint with its experts packed at 4 bits, as
    :func:`load_w8a8` does for W8A8 (the experts never exist in float: a bf16 copy would take
    four times their bytes), on the backend of the checkpoint's format:

    - ``"cpumoe_int4"``: a compressed-tensors int4 checkpoint in the ``pack-quantized`` format
      (symmetric group scales: llm-compressor's W4A16 layout; W4A8 in it too), the experts read by
      :func:`cpumoe.checkpoint_w4.load_int4_moe_layer` with the config's group size; other
      int4 Linears (attention, if the recipe quantized it) dequantized into ``dtype``;
    - ``"cpumoe_mxfp4"``: a gpt-oss MXFP4 checkpoint (``quant_method: mxfp4``, the release
      layout), read by :func:`cpumoe.checkpoint_w4.load_mxfp4_moe_layer`.

    The experts run W4A8 (:func:`cpumoe.fused_moe_int8`: per-token int8 activations, also for
    a W4A16 checkpoint). Raises UnsupportedCheckpoint (a ValueError) for another format (such
    as compressed-tensors' ``int-quantized``, the int4 values stored as int8, which cpumoe's vLLM
    plugin serves) or a missing tensor, UnsupportedExperts for experts cpumoe cannot take.
    """
    ck = _ck.Checkpoint(path)
    qcfg = ck.quantization_config or {}
    method = qcfg.get("quant_method")
    if method not in ("compressed-tensors", "mxfp4"):
        raise _ck.UnsupportedCheckpoint(f"{path}: config.json's quantization_config is not "
                                        f"compressed-tensors int4 or mxfp4 (quant_method "
                                        f"{method!r})")
    if method == "compressed-tensors" and qcfg.get("format") not in (None, "pack-quantized"):
        raise _ck.UnsupportedCheckpoint(
            f"{path}: compressed-tensors format {qcfg.get('format')!r}; load_w4a8 reads int4 "
            f"in the 'pack-quantized' format (W8A8 int8: load_w8a8; int4 stored as int8, "
            f"'int-quantized' W4A8: cpumoe's vLLM plugin serves it)")
    return _load_quantized(ck, "mxfp4" if method == "mxfp4" else "int4", dtype, model_class)


def _compressed_tensors_weights(qcfg: dict) -> set:
    """The (type, num_bits) of the weights of a compressed-tensors config's groups."""
    groups = qcfg.get("config_groups") or {}
    out = set()
    for g in (groups.values() if isinstance(groups, dict) else ()):
        w = g.get("weights") if isinstance(g, dict) else None
        if isinstance(w, dict):
            out.add((w.get("type", "int"), w.get("num_bits")))
    return out


def load_w8a16(path, *, dtype: torch.dtype = torch.bfloat16, model_class: Any = None):
    """A model of an FP8 (E4M3) MoE checkpoint with its experts packed in cpumoe's fp8 format
    from the checkpoint's codes and scales as stored (no float copy of the experts), on the
    ``"cpumoe_fp8"`` backend, as :func:`load_w8a8` does for W8A8:

    - HF ``fp8`` (``quant_method: fp8``, transformers' ``FineGrainedFP8Config``: DeepSeek-V3/R1,
      Qwen3-*-FP8, MiniMax-M2; ``weight_scale_inv`` per ``weight_block_size`` block, or per
      matrix);
    - compressed-tensors FP8 (``float-quantized`` / ``naive-quantized``: llm-compressor's
      FP8_DYNAMIC / FP8_BLOCK; channel, block, group or tensor scales).

    The experts are read by :func:`cpumoe.checkpoint_fp8.load_fp8_moe_layer` (its rules and
    refusals: static activation scales, experts kept unquantized, blocks the kernels cannot
    take) and run W8A16 (:func:`cpumoe.fused_moe` on bf16 activations). Other FP8 Linears of
    the checkpoint (attention projections, dense MLPs) are dequantized into ``dtype``
    (``e4m3(code) * scale`` of the code's block), as transformers does on a CPU.

    model_class: default ``AutoModelForCausalLM``. Raises UnsupportedCheckpoint (a ValueError)
    for a checkpoint that is not FP8 (naming its format and the loader that reads it) or lacks a
    tensor, UnsupportedExperts for experts cpumoe cannot take.
    """
    ck = _ck.Checkpoint(path)
    qcfg = ck.quantization_config or {}
    method = qcfg.get("quant_method")
    what = None
    if not qcfg:
        what = ("a float checkpoint (no quantization_config): load it with from_pretrained and "
                "experts_implementation='cpumoe_bf16' (or another backend of "
                "cpumoe.transformers.BACKENDS)")
    elif method == "mxfp4":
        what = "an MXFP4 checkpoint (quant_method 'mxfp4'): load_w4a8 reads it"
    elif method == "compressed-tensors":
        kinds = _compressed_tensors_weights(qcfg)
        if ("float", 8) not in kinds:
            if ("int", 4) in kinds:
                hint = "int4: load_w4a8 reads it"
            elif ("int", 8) in kinds:
                hint = "int8 W8A8: load_w8a8 reads it"
            else:
                hint = "cpumoe has no loader for it"
            what = (f"a compressed-tensors checkpoint without FP8 weights (weights "
                    f"{', '.join(f'{t}{b}' for t, b in sorted(kinds, key=str)) or 'none'}; "
                    f"{hint})")
    elif method != "fp8":
        what = f"quant_method {method!r}: cpumoe has no loader for it"
    if what is not None:
        raise _ck.UnsupportedCheckpoint(f"{path}: not an FP8 checkpoint (HF 'fp8' or "
                                        f"compressed-tensors FP8): {what}")
    return _load_quantized(ck, "fp8", dtype, model_class)


def _gptq_linear(weight_name: str) -> str:
    """The ``.qweight`` tensor of a GPTQ / AWQ Linear whose model weight is ``weight_name``."""
    return weight_name[:-len(".weight")] + ".qweight"


def _not_gptq_awq(qcfg: Optional[dict]) -> Optional[str]:
    """Why a checkpoint whose quantization config is ``qcfg`` is not one :func:`load_quantized`
    reads (naming the loader that reads it), or None for GPTQ / AWQ."""
    method = (qcfg or {}).get("quant_method")
    method = method.lower() if isinstance(method, str) else method
    if method in ("gptq", "awq"):
        return None
    if not qcfg:
        return ("a float checkpoint (no quantization_config): load it with from_pretrained and "
                "experts_implementation='cpumoe_bf16' (or another backend of "
                "cpumoe.transformers.BACKENDS)")
    if method == "mxfp4":
        return "an MXFP4 checkpoint (quant_method 'mxfp4'): load_w4a8 reads it"
    if method == "fp8":
        return "an FP8 checkpoint (quant_method 'fp8'): load_w8a16 reads it"
    if method == "compressed-tensors":
        kinds = _compressed_tensors_weights(qcfg)
        hint = ("load_w8a16 reads it" if ("float", 8) in kinds else
                "load_w4a8 reads it" if ("int", 4) in kinds else
                "load_w8a8 reads it" if ("int", 8) in kinds else "cpumoe has no loader for it")
        return (f"a compressed-tensors checkpoint (weights "
                f"{', '.join(f'{t}{b}' for t, b in sorted(kinds, key=str)) or 'none'}): {hint}")
    return f"quant_method {method!r}: cpumoe has no loader for it"


def load_quantized(path, *, dtype: torch.dtype = torch.bfloat16, model_class: Any = None):
    """A model of a 4-bit GPTQ or AWQ MoE checkpoint with its experts packed from the stored
    codes, scales and zero points (no float copy of the experts, no re-quantization), as
    :func:`load_w4a8` does for compressed-tensors int4:

    - GPTQ: ``quant_method: gptq`` in config.json's quantization_config (or AutoGPTQ's
      ``quantize_config.json``), 4-bit, ``checkpoint_format`` ``gptq`` (v1) or ``gptq_v2``,
      without act-order (``g_idx`` must be ``k // group_size``);
    - AWQ: ``quant_method: awq``, ``version: gemm``, with zero points.

    Each MoE layer's experts are read by :func:`cpumoe.loaders.read_experts` (its rules and
    refusals, :mod:`cpumoe.checkpoint_gptq`; Qwen3-MoE ``...mlp.experts.{e}.{gate,up,down}_proj``
    and Mixtral ``...block_sparse_moe.experts.{e}.{w1,w3,w2}`` names) in cpumoe's ``int4``
    format when every zero point of the layer is 8 (symmetric quantization), else
    ``int4_affine`` (codes and a (scale, -scale * zero) pair per group: exact). The model runs
    on the backend of that format, ``"cpumoe_int4"`` or ``"cpumoe_int4_affine"`` (W4A8: per-token
    int8 activations); when the layers differ, the symmetric ones are stored as int4_affine too
    (codes q + 8, (scale, -8 scale): the same weights), so that one backend runs the model.

    The checkpoint's other GPTQ / AWQ Linears (the attention projections, dense MLPs, a quantized
    ``lm_head``) are dequantized into ``dtype`` by
    :func:`cpumoe.checkpoint_gptq.dequantize_linear` (``scale * (q - zero)`` per group, exact in
    float32) and run by transformers as plain Linears; unquantized tensors (embeddings, norms,
    the router) are loaded in ``dtype``. The model is built on the meta device from config.json
    (without its quantization_config) and materialised without the float experts. GGUF files
    are read by :func:`cpumoe.transformers.load_gguf`.

    model_class: default ``AutoModelForCausalLM``. Raises UnsupportedCheckpoint (a ValueError)
    for a checkpoint that is not GPTQ / AWQ (naming its format and the loader that reads it), a
    GPTQ / AWQ variant cpumoe does not read (act-order, other bits or packings) or a missing
    tensor; UnsupportedExperts for experts cpumoe cannot take.
    """
    try:
        gguf = _loaders.detect_format(path) == "gguf"
    except _ck.UnsupportedCheckpoint:
        gguf = False  # told below, from the quantization config
    if gguf:
        raise _ck.UnsupportedCheckpoint(
            f"{path}: a GGUF file: load_quantized reads GPTQ / AWQ checkpoint folders; "
            f"cpumoe.transformers.load_gguf reads GGUF models")
    ck = _ck.Checkpoint(path)
    qcfg = _gptq.gptq_awq_config(ck)
    why = _not_gptq_awq(qcfg)
    if why is not None:
        raise _ck.UnsupportedCheckpoint(f"{path}: not a GPTQ or AWQ checkpoint: {why}")
    method = qcfg["quant_method"].lower()
    # The likely format, for building the model; the layers read decide (every zero point 8:
    # int4). AWQ always stores zero points; GPTQ's are 8 when it says sym (its default); 8-bit
    # GPTQ is int8_affine.
    likely = "int4" if method == "gptq" and qcfg.get("sym", True) is not False else "int4_affine"
    if qcfg.get("bits") == 8:
        likely = "int8_affine"
    return _load_quantized(ck, method, dtype, model_class, kind=likely)


def _widened(w, fmt: str):
    """A layer (LoadedExperts) of a WIDENING format as the wider ``fmt``, the same weights."""
    w13, s13 = widen_values(w.w13, w.s13, w.weight_format, fmt)
    w2, s2 = widen_values(w.w2, w.s2, w.weight_format, fmt)
    return dataclasses.replace(w, weight_format=fmt, w13=w13, w2=w2, s13=s13, s2=s2)


def _experts_of_checkpoint(ck, kind: str, layer: int, lay: Layout, name: str,
                           requantize: Optional[str] = None):
    """One layer's routed experts read from the checkpoint, in the form whose ``prepack``
    packs them (shapes checked against the model's experts module). ``kind``: the weight format
    (int8, int4, fp8, mxfp4) of the checkpoint's reader, gptq / awq (int4 or int4_affine, as the
    layer's zero points say) or gguf (``ck`` the file's path; the format its types say;
    ``requantize`` as :func:`cpumoe.loaders.read_experts`')."""
    if kind in ("gptq", "awq", "gguf"):
        w = _loaders.read_experts(ck, layer, format=kind, activation=lay.activation,
                                  requantize=requantize)
    elif kind == "int8":
        w = _ck.load_moe_layer(ck, layer, activation=lay.activation)
    elif kind == "int4":
        w = _ck4.load_int4_moe_layer(ck, layer, activation=lay.activation)
    elif kind == "fp8":
        w = _ck8.load_fp8_moe_layer(ck, layer, activation=lay.activation)
    else:
        w = _ck4.load_mxfp4_moe_layer(ck, layer)
        # The checkpoint says swigluoai for its interleaved rows, not its limit / alpha: those
        # of the model's gate (lay.activation) are what the op runs with.
        if _ops.parse_activation(w.activation)[0] != _ops.parse_activation(lay.activation)[0]:
            raise _ck.UnsupportedCheckpoint(
                f"{name}: the checkpoint's MXFP4 experts are {w.activation} (gate and up "
                f"interleaved); the model's gate with {lay.activation}")
    H, I = w.w2.shape[1], w.w13.shape[1] // 2
    if (w.num_experts, H, I) != (lay.E, lay.H, lay.I):
        raise _ck.UnsupportedCheckpoint(
            f"{name}: the checkpoint's experts are E, H, I = {w.num_experts}, {H}, {I}; the "
            f"config says {lay.E}, {lay.H}, {lay.I}")
    if w.b13 is not None and not lay.has_bias:
        raise _ck.UnsupportedCheckpoint(f"{name}: the checkpoint has expert biases the model "
                                        f"does not")
    return w


def _backend_of(kind: str) -> str:
    return next(b for b, k in BACKENDS.items() if k == kind)


def _load_quantized(ck, source: str, dtype: torch.dtype, model_class: Any,
                    kind: Optional[str] = None):
    """load_w8a8 / load_w4a8 / load_w8a16 / load_quantized: the model built on the meta device,
    each experts module packed from the checkpoint (``source``: int8, int4, mxfp4 or fp8, the
    weight format; gptq or awq: int4 or int4_affine as the layers read are, ``kind`` the likely
    one), the other tensors copied in (quantized Linears dequantized)."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(str(ck.root))
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # cpumoe runs the experts; the rest is dequantized
    model, skip = packed_model(
        config, kind or source, dtype, model_class,
        lambda layer, lay, name: _experts_of_checkpoint(ck, source, layer, lay, name))

    def tensor(key: str) -> Optional[np.ndarray]:
        src = _checkpoint_name(ck, key)
        if src is None:
            return None
        if src in ck and ck.dtype(src) == "F8_E4M3":  # an FP8 Linear's weight
            return _ck8.dequantize_fp8_linear(ck, src)
        if src in ck:
            return _ck.load_float_tensor(ck, src)  # float, or a W8A8 Linear's int8 weight
        if _gptq_linear(src) in ck:  # a GPTQ / AWQ Linear's (qweight, qzeros, scales)
            module = src[:-len(".weight")]
            try:
                return _gptq.dequantize_linear(ck, module)
            except _ck.UnsupportedCheckpoint as e:
                raise _ck.UnsupportedCheckpoint(f"{key}: cannot dequantize the "
                                                f"{source.upper()} Linear {module}: "
                                                f"{e}") from None
        return _ck4.dequantize_int4_linear(ck, src[:-len(".weight")])  # an int4 Linear's
    return fill_model(model, skip, tensor)


def packed_model(config: Any, kind: str, dtype: torch.dtype, model_class: Any, read_layer):
    """(model, skip): the model of ``config`` on the backend of weight format ``kind`` (the
    likely one: the layers read decide), built on the meta device, each experts module packed
    from ``read_layer(layer index, layout, module name)`` (a LoadedExperts) and its float expert
    parameters left empty (their names in ``skip``), then materialised on the CPU with every
    other tensor uninitialised (:func:`fill_model` copies them in). Layers of several
    WIDENING formats (int4, int4_affine, int8_affine) are all stored in the widest (one backend
    runs them)."""
    from transformers import AutoModelForCausalLM
    backend = _backend_of(kind)
    cls = model_class or AutoModelForCausalLM
    with torch.device("meta"):
        model = cls.from_config(config, experts_implementation=backend, dtype=dtype)
    mods = experts_modules(model)
    if not mods:
        raise UnsupportedExperts(f"{type(model).__name__}: no experts module dispatching "
                                 f"through transformers' ExpertsInterface")
    skip = set()
    layers = []  # [name, module, layout, layer index, packed]
    for name, m in mods:
        lay = layout_of(m, name, meta_ok=True)
        found = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
        if found is None:
            refuse(m, name, "no decoder layer index in its name (expected ...layers.<L>....)")
        w = read_layer(int(found.group(1)), lay, name)
        layers.append([name, m, lay, int(found.group(1)), w.prepack()])
        del w
    formats = {ent[4].weight_format for ent in layers}
    if len(formats) > 1 and formats <= set(WIDENING):  # e.g. symmetric and asymmetric layers
        wide = widest_format(formats)
        for ent in layers:
            if ent[4].weight_format != wide:
                ent[4] = None
                w = read_layer(ent[3], ent[2], ent[0])
                ent[4] = _widened(w, wide).prepack()
                del w
        formats = {wide}
    if len(formats) > 1:
        raise _ck.UnsupportedCheckpoint(
            f"the layers' experts are in formats {sorted(formats)}: one cpumoe backend runs a "
            f"model, so its layers must share one (of {', '.join(WIDENING)}, the widest holds "
            f"the others)")
    kind = formats.pop()
    for name, m, lay, _, packed in layers:
        for pname in EXPERT_PARAMS:
            if m._parameters.get(pname) is not None:
                m._parameters[pname] = torch.nn.Parameter(torch.empty((0,), dtype=dtype),
                                                          requires_grad=False)
                skip.add(f"{name}.{pname}")
        object.__setattr__(m, STATE_ATTR,
                           {kind: PackedState(kind, packed, lay.activation, name, True)})
    del layers
    if _backend_of(kind) != backend:
        model.set_experts_implementation(_backend_of(kind))
    model.to_empty(device="cpu")
    model.initialize_weights()  # non-persistent buffers (rotary inv_freq), recomputed
    return model, skip


def fill_model(model: Any, skip: set, tensor) -> Any:
    """Copies ``tensor(key)`` (a numpy array, or None where the source has none) into every
    tensor of ``model``'s state dict but those in ``skip``; tied tensors may be absent. Raises
    UnsupportedCheckpoint for a missing tensor or a shape that differs. Returns the model in
    eval mode."""
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    missing = []
    with torch.no_grad():
        for key, t in model.state_dict().items():
            if key in skip:
                continue
            arr = tensor(key)
            if arr is None:
                if key not in tied:  # else tied to another tensor (tie_weights below)
                    missing.append(key)
                continue
            if tuple(arr.shape) != tuple(t.shape):
                raise _ck.UnsupportedCheckpoint(f"{key}: shape {list(arr.shape)} in the "
                                                f"checkpoint, {list(t.shape)} in the model")
            t.copy_(torch.from_numpy(arr))
    if missing:
        raise _ck.UnsupportedCheckpoint(f"checkpoint: missing {len(missing)} tensor(s) of the "
                                        f"model: {', '.join(missing[:8])}")
    model.tie_weights()
    return model.eval()
