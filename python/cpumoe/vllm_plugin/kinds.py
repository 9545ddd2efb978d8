"""Which MoE layers cpumoe takes, and in which weight format: the layer's kind ("int8", "int4",
"int4_a16", "mxfp4" or "bf16"), or the reason the layer stays on vLLM's kernel.

A quantized layer's kind is read from its quantization config before vLLM picks its method
(:func:`_quantized_kind`: compressed-tensors W8A8 int8, W4A8 int4, W4A16 pack-quantized int4,
gpt-oss MXFP4); an unquantized layer's once vLLM built it (:func:`_plan`: bf16 where vLLM
selected its CPU backend). :func:`layer_problem` checks what cpumoe's op needs of any layer.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
    UnquantizedFusedMoEMethod)
from vllm.platforms import current_platform

#: vLLM activation value -> cpumoe activation name.
_ACTIVATIONS = {
    MoEActivation.SILU: "silu",
    MoEActivation.GELU: "gelu",
    MoEActivation.GELU_TANH: "gelu_tanh",
    MoEActivation.SWIGLUOAI: "swigluoai",  # gate/up interleaved in w13, as cpumoe expects
}
#: cpumoe's swigluoai constants (cpumoe.reference): clamp limit, alpha, and the 1 added to up.
_SWIGLU = {"swiglu_limit": 7.0, "swiglu_alpha": 1.702, "swiglu_beta": 1.0}
_ALIGN = 8  # cpumoe needs H and I to be multiples of 8


def layer_problem(moe: FusedMoEConfig, layer: Any = None) -> Optional[str]:
    """None if cpumoe's op computes this layer's experts, else the reason it does not."""
    if not moe.is_act_and_mul:
        return "non-gated experts (no act_and_mul): cpumoe's op is gated"
    if moe.activation not in _ACTIVATIONS:
        return (f"activation {moe.activation.value!r} (cpumoe has "
                f"{', '.join(sorted(set(_ACTIVATIONS.values())))})")
    for name, want in _SWIGLU.items():
        got = getattr(layer, name, None) if layer is not None else getattr(moe, name, None)
        if got is None:
            got = getattr(moe, name, None)
        if got is None:
            continue
        if moe.activation != MoEActivation.SWIGLUOAI:
            return f"{name}={got} on a {moe.activation.value} layer (cpumoe's has no clamp)"
        if abs(float(got) - want) > 1e-6:
            return f"swigluoai with {name}={got} (cpumoe's is fixed at {want})"
    if moe.hidden_dim % _ALIGN:
        return f"hidden dim {moe.hidden_dim} is not a multiple of {_ALIGN}"
    if moe.intermediate_size_per_partition % _ALIGN:
        return (f"intermediate dim {moe.intermediate_size_per_partition} (per partition) is "
                f"not a multiple of {_ALIGN}")
    if moe.in_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"activation dtype {moe.in_dtype}"
    if moe.is_lora_enabled:
        return "LoRA on the experts"
    return None


def _plan(layer: RoutedExperts) -> Tuple[Optional[str], str]:
    """(kind, why) for a layer vLLM built: kind "bf16" if cpumoe takes it, else None and the
    reason. (Quantized layers are taken earlier, in _CpumoeLayer._get_quant_method.)"""
    qm = layer.quant_method
    moe = layer.moe_config
    if not current_platform.is_cpu():
        return None, f"the platform is {current_platform.device_name}, not the CPU"
    if not isinstance(qm, UnquantizedFusedMoEMethod):
        return None, f"quantization method {type(qm).__name__} has no cpumoe kernel"
    backend = qm.unquantized_backend
    if backend != UnquantizedMoeBackend.CPU:
        return None, f"vLLM selected its {backend.value} backend, not the CPU one"
    if moe.in_dtype != torch.bfloat16:
        return None, (f"unquantized {moe.in_dtype} weights: cpumoe's BF16 op takes bf16 "
                      f"weights (serve with dtype=bfloat16)")
    problem = layer_problem(moe, layer)
    if problem is not None:
        return None, problem
    return "bf16", ""


def _ct_scheme(layer: RoutedExperts, prefix: str, quant_config: Any) -> Optional[Dict]:
    """The compressed-tensors scheme dict of a MoE layer (expert 0's projections, as vLLM's
    CompressedTensorsMoEMethod.get_moe_method reads them: "weights", "input_activations",
    "format"), or None if ``quant_config`` is not compressed-tensors, the layer is ignored or
    its projections differ."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig)
    if not isinstance(quant_config, CompressedTensorsConfig):
        return None
    quant_config._add_fused_moe_to_target_scheme_map()
    names = [n for n in (layer.ckpt_gate_proj_name, layer.ckpt_up_proj_name,
                         layer.ckpt_down_proj_name) if n is not None]
    schemes = [quant_config.get_scheme_dict(layer, f"{prefix}.0.{n}") for n in names]
    scheme = schemes[0]
    if scheme is None or scheme.get("weights") is None or any(s != scheme for s in schemes):
        return None
    return scheme


def _is_gpt_oss_mxfp4(quant_config: Any) -> bool:
    """Whether ``quant_config`` is a gpt-oss MXFP4 checkpoint's (vLLM's GptOssMxfp4Config)."""
    from vllm.model_executor.layers.quantization.mxfp4 import GptOssMxfp4Config
    return isinstance(quant_config, GptOssMxfp4Config)


def _ct_kind(quant_config: Any, scheme: Dict, moe: FusedMoEConfig) -> Tuple[Optional[str], str]:
    """(kind, "") if cpumoe's int8 op computes this compressed-tensors scheme: "int8" (W8A8),
    "int4" (W4A8, int-quantized) or "int4_a16" (W4A16 pack-quantized, run with int8
    activations); else (None, why) for a scheme cpumoe could run but not as given, or (None, "")
    for one it has no kernel for (vLLM's own method then decides)."""
    from compressed_tensors.quantization import QuantizationStrategy, QuantizationType
    wq, iq = scheme["weights"], scheme.get("input_activations")
    if wq.type != QuantizationType.INT or (iq is not None and iq.type != QuantizationType.INT):
        return None, ""  # FP8 / FP4: vLLM's _is_dynamic_token_w8a8 looks at the bits only
    if iq is not None and quant_config._is_dynamic_token_w8a8(wq, iq):
        if wq.strategy != QuantizationStrategy.CHANNEL or not (
                iq.strategy == QuantizationStrategy.TOKEN and iq.dynamic and iq.symmetric):
            return None, (f"W8A8 with {wq.strategy} weights and {iq.strategy} "
                          f"{'dynamic' if iq.dynamic else 'static'} activations (cpumoe's "
                          f"int8 op: channel weights, dynamic symmetric per-token activations)")
        return "int8", ""
    if wq.num_bits != 4 or wq.dynamic:
        return None, ""
    if iq is None:  # W4A16 (vLLM's WNA16 method): pack-quantized int32 words
        kind, name = "int4_a16", "W4A16 int4"
        fmt = scheme.get("format")  # vLLM's get_scheme_dict: the group's, else the config's
        if fmt != "pack-quantized":
            return None, f"{name}: format {fmt!r} (cpumoe reads 'pack-quantized')"
    elif quant_config._is_dynamic_token_w4a8_int(wq, iq):
        kind, name = "int4", "W4A8 int4"
    else:
        return None, ""
    from cpumoe.checkpoint_w4 import int4_scheme_problem
    problem = int4_scheme_problem({"weights": wq.model_dump(mode="json"), "input_activations":
                                   None if iq is None else iq.model_dump(mode="json")})
    if problem is not None:
        return None, f"{name}: {problem}"
    g = wq.group_size
    for what, dim in (("hidden", moe.hidden_dim),
                      ("intermediate (per partition)", moe.intermediate_size_per_partition)):
        if dim % g:
            return None, f"{name}: {what} dim {dim} is not a multiple of group_size {g}"
    return kind, ""


def _quantized_kind(layer: RoutedExperts, prefix: str, quant_config: Any,
                    moe: FusedMoEConfig) -> Tuple[Optional[str], Dict, str]:
    """(kind, scheme, "") for a quantized layer cpumoe takes (a key of _method_classes());
    otherwise (None, scheme, why), why "" where cpumoe has no kernel for the quantization."""
    if _is_gpt_oss_mxfp4(quant_config):
        kind, scheme, why = "mxfp4", {}, ""
    else:
        scheme = _ct_scheme(layer, prefix, quant_config)
        if scheme is None:
            return None, {}, ""
        kind, why = _ct_kind(quant_config, scheme, moe)
    if kind is not None:
        why = ((layer_problem(moe, layer) if current_platform.is_cpu()
                else f"the platform is {current_platform.device_name}, not the CPU") or "")
    return (None if why else kind), scheme, why
