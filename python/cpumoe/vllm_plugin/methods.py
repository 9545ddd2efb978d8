"""cpumoe's quantized MoE methods, by kind: vLLM's compressed-tensors W8A8 int8, W4A8 int8,
WNA16 and W8A8 FP8 methods, its GPTQ and AWQ MoE methods (AutoGPTQMoEMethod, AutoAWQMoEMethod),
its gpt-oss MXFP4 method and its (HF) FP8 method (their parameters and weight loading) with
cpumoe's experts, made without vLLM's backend selection. Their
``process_weights_after_loading`` builds vLLM's modular kernel around cpumoe's experts
(:func:`_modular_kernel`).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any, Dict, Optional

import torch

import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.config import (FUSED_MOE_UNQUANTIZED_CONFIG,
                                                         FusedMoEConfig,
                                                         FusedMoEQuantConfig)
from vllm.model_executor.layers.fused_moe.oracle.int8 import Int8MoeBackend
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

from .experts import (CpumoeFp8Experts, CpumoeGptqAwqExperts, CpumoeInt4Experts,
                      CpumoeInt8Experts, CpumoeMxfp4Experts)


def _modular_kernel(method: Any, layer: RoutedExperts) -> mk.FusedMoEKernel:
    """vLLM's modular kernel of ``method`` (its quant config) around cpumoe's experts class:
    vLLM's prepare/finalize for the layer (no quantization of the inputs: cpumoe's experts
    expect them unquantized), then the experts prepack the layer's weights."""
    from vllm.model_executor.layers.fused_moe.all2all_utils import maybe_make_prepare_finalize
    method.moe_quant_config = method.get_fused_moe_quant_config(layer)
    prepare_finalize = maybe_make_prepare_finalize(
        moe=method.moe, quant_config=method.moe_quant_config,
        routing_tables=layer._expert_routing_tables(), allow_new_interface=True,
        use_monolithic=False)
    assert prepare_finalize is not None
    experts = method.experts_cls(moe_config=method.moe, quant_config=method.moe_quant_config)
    kernel = mk.FusedMoEKernel(prepare_finalize, experts)
    experts.process_weights_after_loading(layer)
    return kernel


def method_classes() -> Dict[str, type]:
    """cpumoe's quantized MoE methods, by kind: vLLM's compressed-tensors W8A8 int8, W4A8 int8,
    WNA16 and W8A8 FP8 methods, its GPTQ and AWQ MoE methods, its gpt-oss MXFP4 method and its
    (HF) FP8 method (their parameters and weight loading) with cpumoe's experts, made without
    vLLM's backend selection (which finds no W8A8 kernel on x86 CPUs without AMX, none for
    swigluoai or an expert map, no W4A8 kernel on x86, no W4A16 (compressed-tensors, GPTQ or
    AWQ), MXFP4 or block FP8 kernel on x86 without AMX, and no CPU FP8 kernel at all for channel
    or tensor scales)."""
    global _METHODS
    if _METHODS:
        return _METHODS
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        CompressedTensorsMoEMethod)
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe\
        .compressed_tensors_moe_w4a8_int8 import CompressedTensorsW4A8Int8MoEMethod
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe\
        .compressed_tensors_moe_w8a8_int8 import CompressedTensorsW8A8Int8MoEMethod
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe\
        .compressed_tensors_moe_wna16 import CompressedTensorsWNA16MoEMethod
    from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend
    from vllm.model_executor.layers.quantization.mxfp4 import GptOssMxfp4MoEMethod
    from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe\
        .compressed_tensors_moe_w8a8_fp8 import CompressedTensorsW8A8Fp8MoEMethod
    from vllm.model_executor.layers.quantization.auto_awq import AutoAWQMoEMethod
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQMoEMethod

    class CpumoeW8A8Int8MoEMethod(CompressedTensorsW8A8Int8MoEMethod):
        def __init__(self, weight_quant: Any, input_quant: Any, moe: FusedMoEConfig):
            CompressedTensorsMoEMethod.__init__(self, moe)
            self.weight_quant = weight_quant
            self.input_quant = input_quant
            self.static_input_scales = False
            self.int8_backend = Int8MoeBackend.CPU  # no layout conversion, CPU quant config
            self.experts_cls = CpumoeInt8Experts

    class _Fp32Scales:
        def create_weights(self, layer: torch.nn.Module, *args: Any, **kw: Any) -> None:
            super().create_weights(layer, *args, **kw)
            # vLLM keeps int4 group scales in bf16 (for its kernels); cpumoe's are fp32, so a
            # checkpoint's fp32 scales load without rounding. Same loader attributes.
            for name in ("w13_weight_scale", "w2_weight_scale"):
                old = getattr(layer, name)
                new = torch.nn.Parameter(old.data.float(), requires_grad=False)
                new.__dict__.update(old.__dict__)
                layer.register_parameter(name, new)

    class _Modular:
        """cpumoe's experts in vLLM's modular kernel, built after loading."""

        def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> FusedMoEQuantConfig:
            # cpumoe's experts read the layer's weights, scales and biases themselves and take
            # unquantized inputs: nothing for vLLM's prepare step to do.
            return FUSED_MOE_UNQUANTIZED_CONFIG

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            self.moe_kernel = _modular_kernel(self, layer)

        def apply(self, layer: RoutedExperts, x: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, shared_experts: Any,
                  shared_experts_input: Optional[torch.Tensor]) -> torch.Tensor:
            return self.moe_kernel.apply(
                x, layer.w13_weight, layer.w2_weight, topk_weights=topk_weights,
                topk_ids=topk_ids, activation=layer.activation,
                global_num_experts=layer.global_num_experts, expert_map=layer.expert_map,
                apply_router_weight_on_input=layer.apply_router_weight_on_input,
                shared_experts=shared_experts, shared_experts_input=shared_experts_input)

    class CpumoeW4A8Int8MoEMethod(_Fp32Scales, _Modular, CompressedTensorsW4A8Int8MoEMethod):
        def __init__(self, weight_quant: Any, input_quant: Any, moe: FusedMoEConfig):
            CompressedTensorsMoEMethod.__init__(self, moe)
            self.has_bias = moe.has_bias
            self.weight_quant = weight_quant
            self.input_quant = input_quant
            self.static_input_scales = False
            self.group_size = weight_quant.group_size
            self.backend = None
            self.experts_cls = CpumoeInt4Experts

    class CpumoeW4A16Int4MoEMethod(_Fp32Scales, _Modular, CompressedTensorsWNA16MoEMethod):
        def __init__(self, weight_quant: Any, input_quant: Any, moe: FusedMoEConfig):
            CompressedTensorsMoEMethod.__init__(self, moe)
            self.weight_quant = weight_quant
            self.input_quant = input_quant
            self.symmetric = weight_quant.symmetric  # False: vLLM's create_weights adds the
            self.num_bits = 4                         # packed zero points (int4_affine)
            self.packed_factor = Fraction(32, 4)
            self.strategy = weight_quant.strategy
            self.group_size = weight_quant.group_size
            self.wna16_backend = None
            self.is_marlin = self.is_transposed = False
            self.input_dtype = torch.bfloat16
            self.experts_cls = CpumoeInt4Experts

    class CpumoeGptOssMxfp4MoEMethod(_Modular, GptOssMxfp4MoEMethod):
        def __init__(self, weight_quant: Any, input_quant: Any, moe: FusedMoEConfig):
            FusedMoEMethodBase.__init__(self, moe)  # vLLM's __init__ selects its backend
            self.weight_dtype = "gpt_oss_mxfp4"  # read by GptOssRoutedExperts.weight_loader
            self.mxfp4_backend = Mxfp4MoeBackend.CPU  # its layout: H, I rounded up to 32
            self.experts_cls = CpumoeMxfp4Experts
            self.max_capture_size = moe.max_capture_size
            self._cache_permute_indices = {}
            self.moe_kernel = None
            self.w13_precision_config = self.w2_precision_config = None

        def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> FusedMoEQuantConfig:
            return GptOssMxfp4MoEMethod.get_fused_moe_quant_config(self, layer)

    class CpumoeFp8MoEMethod(_Modular, Fp8MoEMethod):
        """vLLM's FP8 method (HF quant_method fp8): its E4M3 parameters, block or per-tensor
        scales and loader; cpumoe's W8A16 experts read them as loaded (no conversion)."""

        def __init__(self, quant_config: Any, input_quant: Any, moe: FusedMoEConfig):
            FusedMoEMethodBase.__init__(self, moe)  # vLLM's __init__ selects its backend
            self.quant_config = quant_config
            self.weight_block_size = quant_config.weight_block_size
            self.block_quant = self.weight_block_size is not None
            self.weight_scale_name = "weight_scale_inv" if self.block_quant else "weight_scale"
            self.weight_scale_refine = None  # kinds: I (per partition) is a multiple of bn
            self.moe_block_shape = self.weight_block_size
            self.fp8_backend = None
            self.experts_cls = CpumoeFp8Experts

        @property
        def supports_eplb(self) -> bool:
            return False  # the weights live packed in cpumoe's layer, not in vLLM's parameters

    class CpumoeCtFp8MoEMethod(_Modular, CompressedTensorsW8A8Fp8MoEMethod):
        """vLLM's compressed-tensors W8A8 FP8 method (its parameters: ``w13_weight_scale``
        per tensor, channel or block) with cpumoe's W8A16 experts."""

        def __init__(self, weight_quant: Any, input_quant: Any, moe: FusedMoEConfig):
            CompressedTensorsMoEMethod.__init__(self, moe)
            self.weight_quant = weight_quant
            self.input_quant = input_quant
            block = weight_quant.strategy == "block"
            self.weight_block_size = weight_quant.block_structure if block else None
            self.block_quant = block
            self.static_input_scales = False  # kinds: dynamic activations only
            self.fp8_backend = None
            self.experts_cls = CpumoeFp8Experts

        @property
        def supports_eplb(self) -> bool:
            return False

    class _GptqAwq(_Modular):
        """vLLM's GPTQ / AWQ MoE parameters (``w13_qweight``, ``w13_scales``, ``w13_qzeros``,
        ... as its AutoGPTQMoEMethod / AutoAWQMoEMethod create and load them) with
        :class:`CpumoeGptqAwqExperts`, which read the codes and zero points as the checkpoint
        holds them (GPTQ v1 zeros + 1, gptq_v2 and AWQ as stored)."""

        def __init__(self, quant_config: Any, input_quant: Any, moe: FusedMoEConfig):
            FusedMoEMethodBase.__init__(self, moe)  # vLLM's __init__ selects its backend
            self.quant_config = quant_config
            self.input_dtype = None  # read by create_weights (bf16 / fp16 activations)
            self.use_marlin = False
            self.wna16_moe_backend = None
            self.experts_cls = CpumoeGptqAwqExperts

        def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                           intermediate_size_per_partition: int, params_dtype: torch.dtype,
                           **kw: Any) -> None:
            super().create_weights(layer, num_experts, hidden_size,
                                   intermediate_size_per_partition, params_dtype, **kw)
            # vLLM keeps the group scales in the model dtype: a checkpoint's fp16 scales
            # would be rounded to bf16. cpumoe's are fp32 (exact). Same loader attributes.
            for name in ("w13_scales", "w2_scales"):
                old = getattr(layer, name)
                new = torch.nn.Parameter(old.data.float(), requires_grad=False)
                new.__dict__.update(old.__dict__)
                layer.register_parameter(name, new)
            qc = self.quant_config
            full = qc.full_config or {}
            fmt = str(full.get("checkpoint_format", full.get("format", "gptq"))).lower()
            layer.cpumoe_gptq_awq = {
                "method": self.method, "group_size": qc.group_size,
                "zero_offset": {"gptq": 1, "gptq_v2": 0}.get(fmt, 1) if self.method == "gptq"
                else 0,
                "checkpoint_format": fmt if self.method == "gptq" else "gemm",
                "bits": qc.weight_bits}

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            # As vLLM's GPTQ method: expert biases the checkpoint did not hold are dropped (its
            # create_weights registers zeros for them).
            loaded = getattr(layer, "_loaded_expert_biases", None)
            for name in ("w13_bias", "w2_bias"):
                if loaded is not None and name not in loaded and \
                        getattr(layer, name, None) is not None:
                    layer.register_parameter(name, None)
            super().process_weights_after_loading(layer)

    class CpumoeGptqMoEMethod(_GptqAwq, AutoGPTQMoEMethod):
        """vLLM's GPTQ MoE method (4- and 8-bit; its parameters, ``w13_qweight`` [E, H / 8, 2I]
        packed along K, ``w13_qzeros`` [E, G, 2I / 8] along N (8-bit: / 4), and loader) with
        cpumoe's experts."""

        method = "gptq"

    class CpumoeAwqMoEMethod(_GptqAwq, AutoAWQMoEMethod):
        """vLLM's AWQ MoE method (its parameters, ``w13_qweight`` [E, H, 2I / 8] and
        ``w13_qzeros`` [E, G, 2I / 8] packed along N in AWQ's order, and loader) with cpumoe's
        experts."""

        method = "awq"

    _METHODS.update(int8=CpumoeW8A8Int8MoEMethod, int4=CpumoeW4A8Int8MoEMethod,
                    int4_a16=CpumoeW4A16Int4MoEMethod, mxfp4=CpumoeGptOssMxfp4MoEMethod,
                    fp8=CpumoeFp8MoEMethod, fp8_ct=CpumoeCtFp8MoEMethod,
                    gptq=CpumoeGptqMoEMethod, awq=CpumoeAwqMoEMethod)
    return _METHODS


_METHODS: Dict[str, type] = {}
