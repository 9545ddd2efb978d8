"""The vLLM side of the plugin (imports vLLM): the routed-experts layer that hands its experts to
cpumoe, and its installation in vLLM.

:func:`install` registers :class:`CpumoeRoutedExperts` as vLLM's out-of-tree ``RoutedExperts``
(and a cpumoe twin of each in-tree subclass, e.g. gpt-oss's). That layer lets vLLM build
everything as usual (parameters, weight loading, router), with these changes where cpumoe supports
the layer:

* a compressed-tensors W8A8 int8 layer gets vLLM's W8A8 int8 MoE method with
  :class:`CpumoeInt8Experts` as its experts, chosen before vLLM's Int8 backend selection (which
  finds no kernel on x86 without AMX, nor for swigluoai or an expert map);
* a compressed-tensors W4A8 int4 layer (int-quantized group-wise int4 weights, dynamic per-token
  int8 activations) gets vLLM's W4A8 int8 MoE method (its parameters and loader; the group
  scales kept in fp32) with :class:`CpumoeInt4Experts` in a modular kernel (vLLM's own W4A8
  experts are KleidiAI's, Arm only, without expert parallelism); a W4A16 pack-quantized one
  gets vLLM's WNA16 method's parameters with the same experts, which unpack the int32 words
  (and its zero points, ``symmetric: false``: int4_affine);
* a 4-bit GPTQ or AWQ layer (HF ``quant_method: gptq`` / ``awq``) gets vLLM's AutoGPTQMoEMethod
  / AutoAWQMoEMethod (parameters, loader; the group scales kept in fp32) with
  :class:`CpumoeGptqAwqExperts`, which read the words, zero points and scales as the checkpoint
  holds them into cpumoe's int4 (symmetric) or int4_affine format (vLLM's own CPU experts for
  them, CPUExpertsInt4, need AMX);
* a gpt-oss MXFP4 layer gets vLLM's gpt-oss MXFP4 method (parameters, loader) with
  :class:`CpumoeMxfp4Experts` (vLLM's own CPU MXFP4 experts need AMX);
* an FP8 layer (HF ``quant_method: fp8``, or compressed-tensors FP8 with dynamic activations)
  gets vLLM's FP8 method (or its compressed-tensors W8A8 FP8 method) with
  :class:`CpumoeFp8Experts`, which pack the loaded E4M3 weights and scales for cpumoe's fp8 op
  (bf16 activations; vLLM's own CPU FP8 experts need AMX and 128x128 blocks);
* an unquantized bf16 layer for which vLLM selected its CPU backend keeps vLLM's method, whose
  experts class becomes :class:`CpumoeBf16Experts`.

The method's own ``process_weights_after_loading`` then builds vLLM's modular kernel around
cpumoe's experts, whose ``process_weights_after_loading`` prepacks the layer's weights (and frees
vLLM's copies), and whose ``apply`` calls the fused op with vLLM's top-k ids, weights and expert
map.

The parts, one job a module: :mod:`.kinds` (which layers cpumoe takes, in which weight format),
:mod:`.experts` (cpumoe's experts classes for vLLM's modular kernel, and :func:`stats`),
:mod:`.methods` (the quantized MoE methods). This module re-exports their public names.
"""

from __future__ import annotations

from typing import Any, Dict

from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

import cpumoe
from cpumoe import ops as _ops

from . import experts as _experts
from .experts import *  # noqa: F401,F403  (re-exported: experts.__all__, its classes and stats)
from .experts import EXPERT_CLASSES
from .kinds import plan_layer, quantized_kind, layer_problem
from .methods import method_classes

__all__ = [*_experts.__all__, "CpumoeRoutedExperts", "install", "layer_problem"]

# A child of vLLM's logger: vLLM's handler and format, and VLLM_LOGGING_LEVEL, apply.
logger = init_logger("vllm.plugins.cpumoe")


class _CpumoeLayer:
    """Mixed in before vLLM's RoutedExperts (or a model's subclass of it): cpumoe's experts where
    cpumoe supports the layer (see the module doc); otherwise exactly vLLM's layer."""

    def _get_quant_method(self, prefix: str, quant_config: Any,
                          moe_config: FusedMoEConfig) -> Any:
        kind, scheme, self._cpumoe_why = quantized_kind(self, prefix, quant_config, moe_config)
        if kind is not None:
            return method_classes()[kind](scheme.get("weights"),
                                           scheme.get("input_activations"), moe_config)
        return super()._get_quant_method(prefix, quant_config, moe_config)

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        qm = self.quant_method
        if isinstance(qm, tuple(method_classes().values())):
            return  # taken; logged with its path once the weights are packed
        kind, why = plan_layer(self)
        if kind is None:
            logger.info("cpumoe: %s stays on vLLM's kernel: %s", self.layer_name,
                        self._cpumoe_why or why)
            return
        vllm_cls = getattr(qm, "experts_cls", None)
        qm.experts_cls = EXPERT_CLASSES[kind]
        logger.debug("cpumoe: %s: experts %s -> %s", self.layer_name,
                     getattr(vllm_cls, "__name__", vllm_cls), qm.experts_cls.__name__)


class CpumoeRoutedExperts(_CpumoeLayer, RoutedExperts):
    """vLLM's RoutedExperts with cpumoe's experts (registered in its place by :func:`install`)."""


#: Models whose MoE layer is a subclass of RoutedExperts (vLLM instantiates the subclass, so it
#: needs a replacement of its own): module, class name.
_SUBCLASSES = (("vllm.model_executor.models.gpt_oss", "GptOssRoutedExperts"),
               ("vllm.model_executor.models.dbrx", "DbrxExperts"),
               ("vllm.model_executor.models.transformers.moe", "TransformersRoutedExperts"))


def _replacements() -> Dict[str, type]:
    """{vLLM class name: its cpumoe replacement} for RoutedExperts and the known subclasses."""
    import importlib
    out: Dict[str, type] = {RoutedExperts.__name__: CpumoeRoutedExperts}
    for module, name in _SUBCLASSES:
        try:
            base = getattr(importlib.import_module(module), name)
        except Exception as e:  # noqa: BLE001 - a model module vLLM cannot import here
            logger.debug("cpumoe: %s.%s not replaced (%s)", module, name, e)
            continue
        out[name] = type(f"Cpumoe{name}", (_CpumoeLayer, base),
                         {"__doc__": f"vLLM's {name} with cpumoe's experts.",
                          "__module__": __name__})
    return out


def install() -> bool:
    """Registers cpumoe's layers as vLLM's out-of-tree replacements of RoutedExperts and its
    in-tree subclasses (once per process). False if another plugin already replaced
    RoutedExperts (cpumoe then stays off)."""
    from vllm.model_executor.custom_op import op_registry_oot
    current = op_registry_oot.get(RoutedExperts.__name__)
    if current is not None and issubclass(current, _CpumoeLayer):
        return True
    if current is not None:
        logger.warning("cpumoe: RoutedExperts is already replaced by %s; cpumoe stays off",
                       current)
        return False
    for name, cls in _replacements().items():
        if name not in op_registry_oot:
            RoutedExperts.register_oot(cls, name=name)
    logger.info("cpumoe %s: vLLM's CPU MoE layers run on cpumoe (%s=1; int8 path %s, bf16 "
                "path %s)", cpumoe.__version__, "CPUMOE_VLLM", _ops.selected_path(),
                _ops.selected_path(op="bf16"))
    return True
