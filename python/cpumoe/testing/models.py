"""Random MoE checkpoints for the vLLM tests and benchmark (no downloads).

* :func:`save_tiny` builds a tiny random Qwen3-MoE, Mixtral or gpt-oss model with ``transformers``
  (``from_config``) and writes it with ``save_pretrained`` in bf16: the checkpoint vLLM reads.
* :func:`save_w8a8` turns such a bf16 checkpoint into a compressed-tensors W8A8 one (the way
  llm-compressor saves a W8A8 MoE model): the ``compressed-tensors`` package quantizes and
  compresses every per-expert projection (int8 weights, ``weight_scale`` [out, 1] from the
  channel's max, ``format: int-quantized``, dynamic per-token int8 activations) and writes the
  ``quantization_config``; attention, router, embeddings and norms stay bf16 and are listed in
  ``ignore``. :func:`save_w4a8` and :func:`save_w4a16` do the same with the W4A8 and W4A16
  presets (int4 weights, a scale per group of inputs), :func:`save_w4a16_asym` with W4A16_ASYM
  (zero points too) and :func:`save_w4_dequantized` turns an int4 one back into bf16 (its
  reference); :func:`save_int4_grid` makes a bf16 checkpoint whose experts the int4 ones made
  from it hold exactly (their reference).
* :func:`save_fp8` writes such a checkpoint's experts in the HF "fp8" layout (DeepSeek-V3,
  Qwen3-*-FP8: ``weight_scale_inv`` per 128 x 128 block), quantized by transformers' own FP8
  op; :func:`save_fp8_compressed` in compressed-tensors' FP8 (channel, block, group or tensor
  scales), quantized and compressed by compressed-tensors.
* :func:`save_mxfp4` writes a bf16 gpt-oss checkpoint's experts in the MXFP4 layout of OpenAI's
  release; :func:`save_mxfp4_dequantized` turns that back into bf16, exactly (its reference).
* :func:`save_qwen3_bench` writes the benchmark's model (Qwen3-30B-A3B width) layer by layer,
  without building it in memory (9.7 GB of bf16 experts at 8 layers).

Needs torch, transformers, safetensors and (for W8A8) compressed-tensors: the vLLM venv has them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, Optional, Union

import torch

PathLike = Union[str, Path]

#: family -> (transformers config class, kwargs of the tiny model). 2 layers, 16 experts, top-4,
#: hidden 256 (vLLM's CPU kernels need H and I to be multiples of 32), head_dim 64.
TINY = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=16,
        num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])),
    "mixtral": ("MixtralConfig", dict(
        hidden_size=256, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, num_local_experts=16, num_experts_per_tok=4)),
    "gpt_oss": ("GptOssConfig", dict(
        hidden_size=256, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, num_local_experts=16, num_experts_per_tok=4, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"])),
}

#: A per-expert projection weight of a saved checkpoint: prefix, expert id, projection name.
_EXPERT_KEY = re.compile(r"^(.*\.experts)\.(\d+)\.([A-Za-z0-9_]+)\.weight$")


def tiny_config(family: str, vocab_size: int = 1024, num_layers: int = 2, **over):
    """The transformers config of a tiny random model of ``family`` (a key of :data:`TINY`)."""
    import transformers
    if family not in TINY:
        raise ValueError(f"family: one of {', '.join(TINY)}, got {family!r}")
    cls_name, kw = TINY[family]
    args = dict(vocab_size=vocab_size, num_hidden_layers=num_layers,
                max_position_embeddings=512, tie_word_embeddings=False)
    args.update(kw)
    args.update(over)
    if family == "gpt_oss":
        args["layer_types"] = [("sliding_attention", "full_attention")[i % 2]
                               for i in range(num_layers)]
    return getattr(transformers, cls_name)(**args)


def save_tiny(family: str, folder: PathLike, seed: int = 0, init_std: float = 0.05,
              lm_head_std: float = 0.2, **config_over) -> Path:
    """Builds a random ``family`` model (weights ~ N(0, init_std), biases too for gpt-oss; the
    output head ~ N(0, lm_head_std), so that the next-token distribution is peaked and greedy
    choices are rarely ties of bf16 logits) and saves it in bf16 to ``folder`` (config.json +
    model.safetensors). Returns the folder."""
    from transformers import AutoModelForCausalLM
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = tiny_config(family, **config_over)
    config.initializer_range = init_std
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_bias") or name.endswith(".sinks"):
                p.normal_(0.0, init_std)  # zero at init: give them values so they matter
            elif name == "lm_head.weight":
                p.normal_(0.0, lm_head_std)
    model.to(torch.bfloat16).save_pretrained(str(folder))
    return folder


def _read_safetensors(folder: Path) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    tensors: Dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    if not tensors:
        raise FileNotFoundError(f"{folder}: no *.safetensors file")
    return tensors


#: The compressed-tensors preset of each quantized checkpoint kind, the largest magnitude of its
#: integer weights (the scale of a channel or group is its max |w| over this), and the format
#: compressed-tensors infers for it (what llm-compressor writes).
_PRESETS = {"w8a8": ("W8A8", 127, "int-quantized"), "w4a8": ("W4A8", 7, "int-quantized"),
            "w4a16": ("W4A16", 7, "pack-quantized"),
            "w4a16_asym": ("W4A16_ASYM", None, "pack-quantized")}


def _minmax_scales(w: torch.Tensor, groups: int, qmax: int) -> torch.Tensor:
    """Symmetric scales [rows, groups] of a weight [rows, cols]: each group's max |w| / qmax
    (one group: per channel), what a min-max observer sets."""
    wg = w.float().reshape(w.shape[0], groups, -1)
    return wg.abs().amax(dim=2).clamp_min(1e-12) / qmax


def save_w8a8(src: PathLike, dst: PathLike) -> Path:
    """Writes ``dst``: the bf16 checkpoint ``src`` (per-expert ``experts.{e}.{proj}.weight`` keys,
    as transformers saves Qwen3-MoE and Mixtral) with every expert projection W8A8 int8 through
    compressed-tensors, everything else unchanged and ignored by the quantization config."""
    return _save_quantized(src, dst, "w8a8")


def save_w4a8(src: PathLike, dst: PathLike, group_size: int = 128) -> Path:
    """As :func:`save_w8a8`, with compressed-tensors' W4A8 preset: int4 weights with one scale
    per ``group_size`` inputs (max |w| of the group / 7), dynamic per-token int8 activations,
    ``format: int-quantized`` (the 4-bit values stored as int8, what compressed-tensors infers
    for W4A8 and what vLLM's W4A8 int8 MoE method reads)."""
    return _save_quantized(src, dst, "w4a8", group_size)


def save_w4a16(src: PathLike, dst: PathLike, group_size: int = 128) -> Path:
    """As :func:`save_w4a8`, with compressed-tensors' W4A16 preset: int4 group weights, no
    activation quantization, ``format: pack-quantized`` (int32 words of eight 4-bit values:
    ``weight_packed``, ``weight_scale``, ``weight_shape``), the layout of the int4 MoE
    checkpoints llm-compressor publishes (vLLM's WNA16 MoE method reads it)."""
    return _save_quantized(src, dst, "w4a16", group_size)


def save_w4a16_asym(src: PathLike, dst: PathLike, group_size: int = 128) -> Path:
    """As :func:`save_w4a16` with compressed-tensors' W4A16_ASYM preset (``symmetric: false``):
    each group's scale and zero point from its min and max by compressed-tensors'
    ``calculate_qparams``, the zero points packed beside the words (``weight_zero_point``)."""
    return _save_quantized(src, dst, "w4a16_asym", group_size)


def save_w4_dequantized(src: PathLike, dst: PathLike) -> Path:
    """Writes ``dst``: the compressed-tensors int4 (pack-quantized) checkpoint ``src`` with its
    expert projections dequantized ((q - zp) * scale, :func:`cpumoe.checkpoint_w4.
    dequantize_int4_linear`) and rounded to bf16, everything else as stored, no quantization
    config: the bf16 model holding the checkpoint's weights."""
    from safetensors.torch import save_file
    from cpumoe.checkpoint_w4 import dequantize_int4_linear
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = _read_safetensors(src)
    modules = sorted({k[:-len(".weight_packed")] for k in tensors
                      if k.endswith(".weight_packed")})
    for m in modules:
        for suffix in (".weight_packed", ".weight_scale", ".weight_shape", ".weight_zero_point"):
            tensors.pop(m + suffix, None)
        tensors[m + ".weight"] = torch.from_numpy(dequantize_int4_linear(src, m)).to(
            torch.bfloat16)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def _experts_as_linears(tensors: Dict[str, torch.Tensor], src: Path) -> torch.nn.Module:
    """Pops every per-expert projection weight (``experts.{e}.{proj}.weight``) of ``tensors``
    into a module tree of float32 Linears named as the keys: what compressed-tensors quantizes."""
    root = torch.nn.Module()
    expert_keys = [k for k in tensors if _EXPERT_KEY.match(k)]
    if not expert_keys:
        raise ValueError(f"{src}: no per-expert projection weights (experts.{{e}}.*.weight); "
                         f"fused-expert checkpoints (gpt-oss) are not supported here")
    for key in expert_keys:
        w = tensors.pop(key)
        node = root
        *parents, leaf = key[: -len(".weight")].split(".")
        for p in parents:
            if not hasattr(node, p):
                node.add_module(p, torch.nn.Module())
            node = getattr(node, p)
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.float32)
        lin.weight.data = w.float().contiguous()
        node.add_module(leaf, lin)
    return root


def _save_quantized(src: PathLike, dst: PathLike, kind: str,
                    group_size: Optional[int] = None) -> Path:
    import compressed_tensors.quantization as ctq
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import save_file
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = _read_safetensors(src)
    root = _experts_as_linears(tensors, src)
    preset, qmax, fmt = _PRESETS[kind]
    scheme = ctq.preset_name_to_scheme(preset, ["Linear"])
    if group_size is not None:
        scheme.weights.group_size = group_size
    # Every Linear but the expert projections stays in bf16: attention, router, lm_head.
    ignore = ["lm_head", "re:.*self_attn.*", "re:.*mlp\\.gate$", "re:.*block_sparse_moe\\.gate$"]
    qcfg = ctq.QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore)
    ctq.apply_quantization_config(root, qcfg)
    with torch.no_grad():
        for m in root.modules():
            if qmax is None and hasattr(m, "weight_zero_point"):  # asymmetric: min and max
                wg = m.weight.float().reshape(m.weight.shape[0], m.weight_scale.shape[1], -1)
                sc, zp = calculate_qparams(wg.amin(dim=2), wg.amax(dim=2),
                                           m.quantization_scheme.weights)
                m.weight_scale.copy_(sc)
                m.weight_zero_point.copy_(zp)
            elif hasattr(m, "weight_scale"):  # a minmax observer's scale (what calibration sets)
                # [out, 1] per channel, [out, in / g] per group.
                m.weight_scale.copy_(_minmax_scales(m.weight, m.weight_scale.shape[1], qmax))
    compressor = ModelCompressor.from_pretrained_model(root, quantization_format=fmt)
    compressor.compress_model(root)
    out = {k: v.contiguous() for k, v in root.state_dict().items()}
    out.update({k: v.contiguous() for k, v in tensors.items()})
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    # The compressor infers its config from the quantized modules only: give it the ignore list
    # (what vLLM reads to leave attention and router in bf16).
    compressor.quantization_config.ignore = ignore
    compressor.update_config(str(dst))
    return dst


def save_int4_grid(src: PathLike, dst: PathLike, group_size: int = 128) -> Path:
    """Writes ``dst``: the bf16 checkpoint ``src`` with every per-expert projection weight moved
    onto an int4 grid, exactly representable in bf16: each group of ``group_size`` inputs of a
    row becomes ``q * 2^e`` with integer q in [-7, 7] and max |q| = 7 (2^e the power of two
    nearest max |w| / 7). :func:`save_w4a8` of such a checkpoint is lossless (its scales, max
    |w| / 7, are the 2^e), so serving the two differs only by the int8 activations. Everything
    else is copied."""
    from safetensors.torch import save_file
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = _read_safetensors(src)
    keys = [k for k in tensors if _EXPERT_KEY.match(k)]
    if not keys:
        raise ValueError(f"{src}: no per-expert projection weights (experts.{{e}}.*.weight)")
    for key in keys:
        w = tensors[key].float()
        rows, cols = w.shape
        if cols % group_size:
            raise ValueError(f"{key}: {cols} inputs are not a multiple of group {group_size}")
        g = w.reshape(rows, cols // group_size, group_size)
        amax = g.abs().amax(dim=2, keepdim=True).clamp_min(1e-30)
        scale = torch.exp2(torch.round(torch.log2(amax / 7)))
        q = torch.round(g / scale).clamp(-7, 7)
        # The largest |w| of each group becomes exactly +-7 (so max |w| / 7 is the 2^e).
        top = g.abs().argmax(dim=2, keepdim=True)
        sign = torch.where(torch.gather(g, 2, top) < 0, -1.0, 1.0)
        q.scatter_(2, top, 7 * sign)
        tensors[key] = (q * scale).reshape(rows, cols).to(torch.bfloat16)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


# ---------------------------------------------------------------------------- FP8
#: The modules an FP8 checkpoint keeps in bf16 (transformers' modules_to_not_convert patterns:
#: regexes matched from the start of a module name up to a boundary, or suffixes).
FP8_NOT_CONVERTED = ["lm_head", "model.embed_tokens", "model.layers.*.self_attn",
                     "model.layers.*.mlp.gate", "model.layers.*.block_sparse_moe.gate"]


def save_fp8(src: PathLike, dst: PathLike, block_size=(128, 128), scale_fmt: str = "float",
             activation_scheme: str = "dynamic", modules_to_not_convert=None,
             linears: bool = False) -> Path:
    """Writes ``dst``: the bf16 checkpoint ``src`` with every per-expert projection in the HF
    "fp8" layout of DeepSeek-V3 and Qwen3-*-FP8 (transformers' ``FineGrainedFP8Config``):
    ``<proj>.weight`` float8_e4m3fn and ``<proj>.weight_scale_inv`` [ceil(N / bn), ceil(K / bk)]
    float32 (float8_e8m0fnu with ``scale_fmt="ue8m0"``; one scale per matrix with
    ``block_size=None``), quantized by transformers' own ``Fp8Quantize`` (the op its FP8
    quantizer applies to each weight). That quantizer cannot run through ``from_pretrained`` on
    a machine without a GPU (transformers 5: "A GPU or XPU is needed for FP8 quantization"), so
    the op is applied to the tensors directly; transformers loads the result on a CPU
    (dequantizing it). A matrix whose sides the block does not divide is left bf16 by that op,
    as transformers does. ``linears``: every other 2-D ``.weight`` that modules_to_not_convert
    does not cover is quantized too (attention projections, as in DeepSeek-V3's release; pass a
    modules_to_not_convert without ``self_attn``). config.json gets the config's ``to_dict()``."""
    from safetensors.torch import save_file
    from transformers import FineGrainedFP8Config
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    cfg = FineGrainedFP8Config(
        weight_block_size=None if block_size is None else list(block_size),
        scale_fmt=scale_fmt, activation_scheme=activation_scheme,
        modules_to_not_convert=list(FP8_NOT_CONVERTED if modules_to_not_convert is None
                                    else modules_to_not_convert))
    quantize = FineGrainedFP8HfQuantizer(cfg).get_quantize_ops()
    out: Dict[str, torch.Tensor] = {}
    from cpumoe.checkpoint_fp8 import not_converted_pattern

    def quantized(name: str, t: torch.Tensor) -> bool:
        if _EXPERT_KEY.match(name):
            return True
        return (linears and name.endswith(".weight") and t.ndim == 2
                and not_converted_pattern(cfg.modules_to_not_convert,
                                          name[:-len(".weight")]) is None)

    for name, t in _read_safetensors(src).items():
        if quantized(name, t):
            out.update(quantize.convert({name: t}))
        else:
            out[name] = t
    save_file({k: v.contiguous() for k, v in out.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = cfg.to_dict()
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def save_fp8_compressed(src: PathLike, dst: PathLike, strategy: str = "channel",
                        block_size=(128, 128), group_size: int = 128,
                        activations: Optional[str] = "dynamic") -> Path:
    """Writes ``dst``: the bf16 checkpoint ``src`` with every per-expert projection FP8 through
    compressed-tensors (what llm-compressor's FP8_DYNAMIC / FP8_BLOCK recipes save): weights
    ``num_bits: 8, type: float`` with ``strategy`` "channel" (FP8_DYNAMIC), "block"
    (FP8_BLOCK, ``block_structure`` = block_size), "group" (group_size) or "tensor"; each scale
    from the weights' min / max by compressed-tensors' own ``calculate_qparams`` (what its
    min-max observer computes), then compressed by ``ModelCompressor`` (float8_e4m3fn
    ``weight``, ``weight_scale``). ``activations``: "dynamic" (the preset's dynamic FP8
    activations; format float-quantized), "static" (per-tensor static FP8, as the FP8 preset;
    a calibrated scale cpumoe refuses) or None (weight-only; format naive-quantized)."""
    import compressed_tensors.quantization as ctq
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import save_file
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = _read_safetensors(src)
    root = _experts_as_linears(tensors, src)
    scheme = ctq.preset_name_to_scheme("FP8_BLOCK" if strategy == "block" else "FP8_DYNAMIC",
                                       ["Linear"])
    if strategy == "block":
        scheme.weights.block_structure = list(block_size)
    elif strategy == "group":
        scheme.weights.strategy, scheme.weights.group_size = "group", group_size
    elif strategy == "tensor":
        scheme.weights.strategy = "tensor"
    elif strategy != "channel":
        raise ValueError(f"strategy: channel, block, group or tensor; got {strategy!r}")
    if activations == "static":
        scheme.input_activations = ctq.QuantizationArgs(
            num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False)
    elif activations is None:
        scheme.input_activations = None
    elif activations != "dynamic":
        raise ValueError(f"activations: 'dynamic', 'static' or None; got {activations!r}")
    ignore = ["lm_head", "re:.*self_attn.*", "re:.*mlp\\.gate$", "re:.*block_sparse_moe\\.gate$"]
    ctq.apply_quantization_config(root, ctq.QuantizationConfig(config_groups={"group_0": scheme},
                                                               ignore=ignore))
    with torch.no_grad():
        for m in root.modules():
            if not hasattr(m, "weight_scale"):
                continue
            w = m.weight.float()
            n, k = w.shape
            if strategy == "channel":
                lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
            elif strategy == "group":
                wg = w.reshape(n, k // group_size, group_size)
                lo, hi = wg.amin(dim=2), wg.amax(dim=2)
            elif strategy == "block":
                bn, bk = block_size
                nb, kb = -(-n // bn), -(-k // bk)
                wp = torch.nn.functional.pad(w, (0, kb * bk - k, 0, nb * bn - n))
                wb = wp.reshape(nb, bn, kb, bk)
                lo, hi = wb.amin(dim=(1, 3)), wb.amax(dim=(1, 3))
            else:
                lo, hi = w.amin().reshape(1), w.amax().reshape(1)
            scale, _ = calculate_qparams(lo, hi, m.quantization_scheme.weights)
            m.weight_scale.copy_(scale.reshape(m.weight_scale.shape))
            if activations == "static":
                m.input_scale.fill_(0.01)  # a calibrated activation scale
    compressor = ModelCompressor.from_pretrained_model(root)
    compressor.compress_model(root)
    out = {k: v.contiguous() for k, v in root.state_dict().items()}
    out.update({k: v.contiguous() for k, v in tensors.items()})
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text((src / "config.json").read_text())
    compressor.quantization_config.ignore = ignore
    compressor.update_config(str(dst))
    return dst


#: openai/gpt-oss-{20b,120b}'s quantization_config, as released.
GPT_OSS_MXFP4_CONFIG = {"modules_to_not_convert": ["model.layers.*.self_attn",
                                                   "model.layers.*.mlp.router",
                                                   "model.embed_tokens", "lm_head"],
                        "quant_method": "mxfp4"}
#: A fused expert tensor of a bf16 gpt-oss checkpoint (transformers: x @ W, W [E, in, out]).
_GPT_OSS_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def save_mxfp4(src: PathLike, dst: PathLike) -> Path:
    """Writes ``dst``: the bf16 gpt-oss checkpoint ``src`` (as transformers saves it: fused
    ``mlp.experts.gate_up_proj`` [E, H, 2I], gate / up interleaved by column, and ``down_proj``
    [E, I, H], plus ``_bias``) with its experts in the MXFP4 layout of OpenAI's gpt-oss release,
    which vLLM's gpt-oss loader and :func:`cpumoe.checkpoint_w4.load_mxfp4_moe_layer` read:
    ``{proj}_blocks`` uint8 [E, out, in / 32, 16] (two E2M1 codes a byte, the low nibble the
    even k), ``{proj}_scales`` uint8 [E, out, in / 32] (E8M0), ``{proj}_bias`` bf16 unchanged;
    quantized by :func:`cpumoe.quantize.quantize_mxfp4`. Everything else is copied, and
    config.json gets the release's ``quantization_config``."""
    from safetensors.torch import save_file
    from cpumoe.reference import quantize_mxfp4
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    if config.get("model_type") != "gpt_oss" or config.get("quantization_config"):
        raise ValueError(f"{src}: expected an unquantized gpt_oss checkpoint")
    out: Dict[str, torch.Tensor] = {}
    for name, t in _read_safetensors(src).items():
        m = _GPT_OSS_EXPERT.match(name)
        if m is None:
            out[name] = t.contiguous()
            continue
        # The release stores W^T: output channels by row (gate_up's stay interleaved).
        blocks, scales = quantize_mxfp4(t.float().transpose(1, 2).contiguous())
        out[f"{name}_blocks"], out[f"{name}_scales"] = blocks.contiguous(), scales.contiguous()
    if not any(k.endswith("_blocks") for k in out):
        raise ValueError(f"{src}: no fused gpt-oss expert tensors (mlp.experts.gate_up_proj)")
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = dict(GPT_OSS_MXFP4_CONFIG)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def save_mxfp4_dequantized(src: PathLike, dst: PathLike) -> Path:
    """Writes ``dst``: the MXFP4 gpt-oss checkpoint ``src`` (:func:`save_mxfp4`) as bf16, its
    experts dequantized (exact: every E2M1 value times a power of two is a bf16), in the layout
    :func:`save_tiny` writes. Served side by side with ``src``, the two differ only by the
    activations (bf16 against cpumoe's per-token int8)."""
    from safetensors.torch import save_file
    from cpumoe.reference import dequantize_mxfp4
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = _read_safetensors(src)
    out: Dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith("_scales") and name[: -len("_scales")] + "_blocks" in tensors:
            continue
        if name.endswith("_blocks"):
            base = name[: -len("_blocks")]
            w = torch.from_numpy(dequantize_mxfp4(t.numpy(), tensors[base + "_scales"].numpy()))
            out[base] = w.transpose(1, 2).to(torch.bfloat16).contiguous()  # back to [E, in, out]
        else:
            out[name] = t.contiguous()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


# ---------------------------------------------------------------------------- benchmark model
def qwen3_bench_config(num_layers: int = 8, vocab_size: int = 2048):
    """Qwen3-30B-A3B's width (H 2048, 128 experts of I 768, top-8, 32 heads of 128, 4 KV
    heads) with ``num_layers`` layers and a cut vocabulary."""
    import transformers
    return transformers.Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_hidden_layers=num_layers, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-6)


def _quantized_config_dict(kind: str) -> dict:
    """The quantization_config of a checkpoint of :data:`_PRESETS` ``kind`` (compressed-tensors'
    preset, int-quantized: what :func:`save_w8a8` / :func:`save_w4a8` write)."""
    import compressed_tensors.quantization as ctq
    scheme = ctq.preset_name_to_scheme(_PRESETS[kind][0], ["Linear"])
    qcfg = ctq.QuantizationConfig(
        config_groups={"group_0": scheme}, format="int-quantized",
        quantization_status="compressed",
        ignore=["lm_head", "re:.*self_attn.*", "re:.*mlp\\.gate$"])
    return qcfg.model_dump(exclude_none=True, mode="json")


def save_qwen3_bench(folder: PathLike, quant: Optional[str] = None, num_layers: int = 8,
                     seed: int = 0, std: float = 0.02, config=None, pool: int = 16) -> Path:
    """Writes a random Qwen3-MoE checkpoint (:func:`qwen3_bench_config` unless ``config``), one
    safetensors file per layer, in bf16 (``quant`` None) or with "w8a8" int8 experts and
    per-channel scales or "w4a8" int4 experts (int8 storage) and scales per 128 inputs, in
    compressed-tensors' int-quantized layout. Generated and written a layer at a time.

    The experts of a layer are copies of ``pool`` random ones (expert e holds pool[e % pool]):
    each has its own memory, as in a real model, and the weights' values do not change the
    time of a dense kernel, so drawing 128 x 3 random matrices per layer would only make the
    checkpoint slower to write."""
    from safetensors.torch import save_file
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = config if config is not None else qwen3_bench_config(num_layers)
    H, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    def expert_weights(shape) -> list:
        """pool entries of (weight, scale or None) for one projection."""
        out = []
        for _ in range(min(pool, E)):
            w = rnd(*shape)
            if quant is None:
                out.append((w, None))
                continue
            qmax = _PRESETS[quant][1]
            g = shape[1] if quant == "w8a8" else 128  # the preset's channel / group
            scale = _minmax_scales(w, shape[1] // g, qmax)
            wg = w.float().reshape(shape[0], shape[1] // g, g)
            q = torch.round(wg / scale[:, :, None]).clamp(-qmax, qmax).to(torch.int8)
            out.append((q.reshape(shape), scale))
        return out

    weight_map: Dict[str, str] = {}

    def write(name: str, tensors: Dict[str, torch.Tensor]) -> None:
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})

    write("model-embed.safetensors", {
        "model.embed_tokens.weight": rnd(cfg.vocab_size, H),
        "model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
        "lm_head.weight": rnd(cfg.vocab_size, H)})
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}"
        t = {f"{p}.input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
             f"{p}.post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
             f"{p}.self_attn.q_proj.weight": rnd(nh * hd, H),
             f"{p}.self_attn.k_proj.weight": rnd(nkv * hd, H),
             f"{p}.self_attn.v_proj.weight": rnd(nkv * hd, H),
             f"{p}.self_attn.o_proj.weight": rnd(H, nh * hd),
             f"{p}.self_attn.q_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
             f"{p}.self_attn.k_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
             f"{p}.mlp.gate.weight": rnd(E, H)}
        for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            bank = expert_weights(shape)
            for e in range(E):
                w, scale = bank[e % len(bank)]
                key = f"{p}.mlp.experts.{e}.{proj}"
                t[f"{key}.weight"] = w.clone()
                if scale is not None:
                    t[f"{key}.weight_scale"] = scale.clone()
        write(f"model-layer{layer:03d}.safetensors", t)
        del t
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    config = cfg.to_dict()
    config["architectures"] = ["Qwen3MoeForCausalLM"]
    config["torch_dtype"] = "bfloat16"
    if quant is not None:
        if quant not in ("w8a8", "w4a8"):
            raise ValueError(f"quant: None, 'w8a8' or 'w4a8', got {quant!r}")
        config["quantization_config"] = _quantized_config_dict(quant)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def checkpoint_bytes(folder: PathLike) -> int:
    """Total size of the safetensors files of a checkpoint folder."""
    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))


def quantization_of(folder: PathLike) -> Optional[dict]:
    """The checkpoint's quantization_config (None for a float checkpoint)."""
    return json.loads((Path(folder) / "config.json").read_text()).get("quantization_config")
