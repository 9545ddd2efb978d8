"""Which MoE layers cpumoe takes, and in which weight format: the layer's kind ("int8", "int4",
"int4_a16", "gptq", "awq", "mxfp4", "fp8", "fp8_ct" or "bf16"), or the reason the layer stays on
vLLM's kernel.

A quantized layer's kind is read from its quantization config before vLLM picks its method
(:func:`quantized_kind`: compressed-tensors W8A8 int8, W4A8 int4, W4A16 pack-quantized int4,
4-bit GPTQ and AWQ (vLLM's AutoGPTQConfig / AutoAWQConfig), gpt-oss MXFP4, HF ``quant_method:
fp8`` and compressed-tensors FP8 E4M3 weights); an
unquantized layer's once vLLM built it (:func:`plan_layer`: bf16 where vLLM selected its CPU
backend). :func:`layer_problem` checks what cpumoe's op needs of any layer.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from cpumoe import ops as _ops
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
    UnquantizedFusedMoEMethod)
from vllm.platforms import current_platform

#: vLLM activation -> cpumoe activation name (its parameters: activation_of). vLLM spells the
#: activations cpumoe shares with it as cpumoe does (SILU with a swiglu_limit is silu_clamp,
#: DeepSeek-V4's clamped SwiGLU; SWIGLUOAI interleaves gate/up in w13 as cpumoe does;
#: SWIGLUOAI_UNINTERLEAVE and SWIGLUSTEP are not cpumoe's).
VLLM_ACTIVATIONS = {a: a.value for a in MoEActivation if a.value in _ops.ACTIVATIONS}
_ALIGN = 8  # cpumoe needs H and I to be multiples of 8


def _param(name: str, moe: Any, layer: Any = None, quant_config: Any = None,
           qc_name: str = "") -> Optional[float]:
    """A gated activation's parameter as vLLM's activation step reads it: the quantization
    config's gemm1_* first, then the layer's (or the MoE config's) swiglu_*."""
    for obj, attr in ((quant_config, qc_name), (layer, name), (moe, name)):
        got = getattr(obj, attr, None) if obj is not None and attr else None
        if got is not None:
            return float(got)
    return None


def activation_of(moe: Any, layer: Any = None,
                  quant_config: Any = None) -> Tuple[Optional[str], str]:
    """(the cpumoe activation spec that computes the layer's activation exactly as vLLM would,
    "") or (None, why not). vLLM's SILU with a swiglu_limit is silu(min(g, L)) * clamp(u, -L, L)
    (cpumoe's silu_clamp); SWIGLUOAI takes limit (default 7) and alpha (default 1.702) with
    beta 1; a parameter cpumoe would not apply is a reason, never dropped."""
    act = moe.activation
    base = VLLM_ACTIVATIONS.get(act)
    if base is None:
        return None, (f"activation {act.value!r} (cpumoe has "
                      f"{', '.join(sorted(set(VLLM_ACTIVATIONS.values())))}, silu with a "
                      f"swiglu_limit)")
    limit = _param("swiglu_limit", moe, layer, quant_config, "gemm1_clamp_limit")
    alpha = _param("swiglu_alpha", moe, layer, quant_config, "gemm1_alpha")
    beta = _param("swiglu_beta", moe, layer, quant_config, "gemm1_beta")
    try:
        if base == "swigluoai":
            if beta is not None and beta != 1.0:
                return None, f"swigluoai with swiglu_beta={beta} (cpumoe's adds 1 to up)"
            return _ops.activation_spec("swigluoai", limit=limit, alpha=alpha), ""
        if base == "silu" and limit is not None:
            if (alpha is not None and alpha != 1.0) or (beta is not None and beta != 0.0):
                return None, (f"silu with swiglu_limit={limit}, swiglu_alpha={alpha}, "
                              f"swiglu_beta={beta} (cpumoe's silu_clamp has alpha 1, beta 0)")
            return _ops.activation_spec("silu_clamp", limit=limit), ""
    except ValueError as e:  # a limit cpumoe cannot run (<= 0, NaN)
        return None, f"{act.value} with swiglu_limit={limit}, swiglu_alpha={alpha}: {e}"
    for name, got in (("swiglu_limit", limit), ("swiglu_alpha", alpha), ("swiglu_beta", beta)):
        if got is not None:
            return None, f"{name}={got} on a {act.value} layer (cpumoe's {base} has no clamp)"
    return base, ""


def layer_problem(moe: FusedMoEConfig, layer: Any = None) -> Optional[str]:
    """None if cpumoe's op computes this layer's experts, else the reason it does not."""
    if not moe.is_act_and_mul:
        return "non-gated experts (no act_and_mul): cpumoe's op is gated"
    spec, why = activation_of(moe, layer)
    if spec is None:
        return why
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


def plan_layer(layer: RoutedExperts) -> Tuple[Optional[str], str]:
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
    activations), or its fp8 op: "fp8_ct" (FP8 weights per tensor, channel or block, dynamic
    activations, run in bf16); else (None, why) for a scheme cpumoe could run but not as given,
    or (None, "") for one it has no kernel for (vLLM's own method then decides)."""
    from compressed_tensors.quantization import QuantizationStrategy, QuantizationType
    wq, iq = scheme["weights"], scheme.get("input_activations")
    if (wq.type == QuantizationType.FLOAT and wq.num_bits == 8 and iq is not None
            and quant_config._is_fp8_w8a8(wq, iq)):  # vLLM's W8A8 FP8 method's layers
        S = QuantizationStrategy
        if not iq.dynamic:
            return None, ("FP8 with static activation scales (cpumoe's fp8 op keeps the "
                          "activations bf16: dynamic checkpoints only)")
        if (wq.strategy, iq.strategy) not in ((S.TENSOR, S.TENSOR), (S.CHANNEL, S.TOKEN)) and (
                wq.strategy != S.BLOCK):
            return None, ""  # vLLM's method refuses it
        if wq.strategy == S.BLOCK:
            bn, bk = wq.block_structure
            I = moe.intermediate_size_per_partition
            if I % bn or (moe.moe_parallel_config.tp_size > 1 and I % bk):
                return None, (f"FP8 blocks {bn}x{bk}: intermediate dim {I} (per partition) is "
                              f"not a multiple of them")
            if bk % 32 and bk < max(moe.hidden_dim, I):
                return None, f"FP8 blocks {bn}x{bk}: cpumoe needs block_k a multiple of 32"
        return "fp8_ct", ""
    if wq.type != QuantizationType.INT or (iq is not None and iq.type != QuantizationType.INT):
        return None, ""  # FP4 / FP8 W8A16: vLLM's _is_dynamic_token_w8a8 looks at the bits only
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
    # W4A16 may be asymmetric (zero points: cpumoe's int4_affine); W4A8's int-quantized int8
    # values have no zero points in vLLM's method.
    problem = int4_scheme_problem({"weights": wq.model_dump(mode="json"), "input_activations":
                                   None if iq is None else iq.model_dump(mode="json")},
                                  asymmetric=iq is None)
    if problem is not None:
        return None, f"{name}: {problem}"
    g = wq.group_size
    for what, dim in (("hidden", moe.hidden_dim),
                      ("intermediate (per partition)", moe.intermediate_size_per_partition)):
        if dim % g:
            return None, f"{name}: {what} dim {dim} is not a multiple of group_size {g}"
    return kind, ""


def _fp8_kind(layer: RoutedExperts, prefix: str, quant_config: Any,
              moe: FusedMoEConfig) -> Tuple[Optional[str], str, bool]:
    """(kind, why, handled) for vLLM's Fp8Config (HF ``quant_method: fp8``): "fp8" for E4M3
    weights with block scales (``weight_block_size``) or a scale per tensor, dynamic activations
    (cpumoe's fp8 op keeps them bf16: W8A16); handled False if ``quant_config`` is no Fp8Config
    or the layer is not vLLM's Fp8MoEMethod's (an ignored layer, ``store_dtype: mxfp4``)."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
    if not isinstance(quant_config, Fp8Config):
        return None, "", False
    if quant_config.store_dtype == "mxfp4" or is_layer_skipped(
            prefix=prefix, ignored_layers=quant_config.ignored_layers,
            fused_mapping=quant_config.packed_modules_mapping,
            match_mode=quant_config.ignored_layers_match_mode):
        return None, "", False
    if not quant_config.is_checkpoint_fp8_serialized:
        return None, "", True
    if quant_config.activation_scheme != "dynamic":
        return None, (f"FP8 with {quant_config.activation_scheme} activation scales (cpumoe's "
                      f"fp8 op keeps the activations bf16: dynamic checkpoints only)"), True
    block = quant_config.weight_block_size
    if block is not None:
        bn, bk = block
        I = moe.intermediate_size_per_partition
        if I % bn or (moe.moe_parallel_config.tp_size > 1 and I % bk):
            return None, (f"FP8 blocks {bn}x{bk}: intermediate dim {I} (per partition) is not "
                          f"a multiple of them"), True
        if bk % 32 and bk < max(moe.hidden_dim, I):
            return None, f"FP8 blocks {bn}x{bk}: cpumoe needs block_k a multiple of 32", True
    return "fp8", "", True


#: GPTQ ``checkpoint_format`` -> what is added to a stored zero nibble (cpumoe.checkpoint_gptq's
#: convention: v1, AutoGPTQ's, stores z - 1; GPTQModel's gptq_v2 stores z).
_GPTQ_ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}


def _gptq_awq_kind(layer: RoutedExperts, prefix: str, quant_config: Any,
                   moe: FusedMoEConfig) -> Tuple[Optional[str], str, bool, Any]:
    """(kind, why, handled, config) for vLLM's AutoGPTQConfig / AutoAWQConfig (HF
    ``quant_method: gptq`` / ``awq``; vLLM 0.32 gives their MoE layers AutoGPTQMoEMethod /
    AutoAWQMoEMethod, whose CPU experts, CPUExpertsInt4, need x86 with AMX): "gptq" or "awq" for
    4-bit weights cpumoe's int4 formats hold (int4 when every zero point is 8, else
    int4_affine) with ``config`` the layer's (GPTQ: after its ``dynamic`` per-module
    overrides); handled False if ``quant_config`` is neither or vLLM leaves the layer
    unquantized (GPTQ ``dynamic`` "-:" match, AWQ ``modules_to_not_convert``)."""
    from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig
    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
    if isinstance(quant_config, AutoGPTQConfig):
        import copy
        from vllm.model_executor.layers.quantization.utils.gptq_utils import (
            get_dynamic_override, override_config)
        if get_dynamic_override(quant_config, layer_name=prefix) is False:
            return None, "", False, None  # vLLM's get_moe_quant_method: unquantized
        cfg = copy.deepcopy(quant_config)
        if prefix:
            try:
                override_config(cfg, prefix=prefix)
            except ValueError:  # vLLM's own method raises the same
                return None, "", True, None
        name, bits, g = "GPTQ", cfg.weight_bits, cfg.group_size
        full = cfg.full_config or {}
        fmt = full.get("checkpoint_format", full.get("format", "gptq"))
        fmt = fmt.lower() if isinstance(fmt, str) else fmt
        if fmt not in _GPTQ_ZERO_OFFSET:
            return None, (f"GPTQ checkpoint_format {fmt!r} (cpumoe reads 'gptq' and "
                          f"'gptq_v2')"), True, cfg
        if cfg.desc_act:
            return None, "GPTQ desc_act (act-order groups) is not supported", True, cfg
        kind = "gptq"
    elif isinstance(quant_config, AutoAWQConfig):
        if is_layer_skipped(prefix, quant_config.modules_to_not_convert or [],
                            match_mode="substring"):
            return None, "", False, None  # vLLM: unquantized
        cfg = quant_config
        name, bits, g = "AWQ", cfg.weight_bits, cfg.group_size
        version = (cfg.full_config or {}).get("version", "gemm")
        version = version.lower() if isinstance(version, str) else version
        if version != "gemm":
            return None, (f"AWQ version {version!r} (cpumoe reads the 'gemm' packing)"), True, cfg
        if not cfg.zero_point:
            return None, "AWQ zero_point: false (cpumoe reads AWQ with zero points)", True, cfg
        kind = "awq"
    else:
        return None, "", False, None
    if bits != 4 and not (kind == "gptq" and bits == 8):
        return None, (f"{name} {bits}-bit weights (cpumoe's GPTQ path is 4- and 8-bit, its AWQ "
                      f"path 4-bit)"), True, cfg
    if not isinstance(g, int) or not (g == -1 or g > 0) or (kind == "awq" and g == -1):
        return None, f"{name} group_size {g!r}", True, cfg
    from cpumoe.checkpoint import UnsupportedCheckpoint
    from cpumoe.checkpoint_gptq import _common_group
    H, I = moe.hidden_dim, moe.intermediate_size_per_partition
    for what, dim in (("hidden", H), ("intermediate (per partition)", I)):
        if dim % 32 or (g > 0 and dim % g):
            return None, (f"{name}: {what} dim {dim} is not a multiple of 32 and of "
                          f"group_size {g}"), True, cfg
    try:
        _common_group(g, H, I, name)
    except UnsupportedCheckpoint as e:
        return None, str(e), True, cfg
    return kind, "", True, cfg


def quantized_kind(layer: RoutedExperts, prefix: str, quant_config: Any,
                    moe: FusedMoEConfig) -> Tuple[Optional[str], Dict, str]:
    """(kind, scheme, "") for a quantized layer cpumoe takes (a key of method_classes());
    otherwise (None, scheme, why), why "" where cpumoe has no kernel for the quantization."""
    fp8_kind, fp8_why, fp8 = _fp8_kind(layer, prefix, quant_config, moe)
    w4_kind, w4_why, w4, w4_config = _gptq_awq_kind(layer, prefix, quant_config, moe)
    if _is_gpt_oss_mxfp4(quant_config):
        kind, scheme, why = "mxfp4", {}, ""
    elif fp8:  # the method takes the Fp8Config where the others take the weights' scheme
        kind, scheme, why = fp8_kind, {"weights": quant_config}, fp8_why
    elif w4:  # GPTQ / AWQ: the layer's config (GPTQ's dynamic overrides applied)
        kind, scheme, why = w4_kind, {"weights": w4_config}, w4_why
    else:
        scheme = _ct_scheme(layer, prefix, quant_config)
        if scheme is None:
            return None, {}, ""
        kind, why = _ct_kind(quant_config, scheme, moe)
    if kind is not None:
        why = ((layer_problem(moe, layer) if current_platform.is_cpu()
                else f"the platform is {current_platform.device_name}, not the CPU") or "")
    return (None if why else kind), scheme, why
