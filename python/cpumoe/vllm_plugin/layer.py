"""The vLLM side of the plugin (imports vLLM): the routed-experts layer that hands its experts to
cpumoe, and cpumoe's experts classes for vLLM's modular MoE kernel.

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
  gets vLLM's WNA16 method's parameters with the same experts, which unpack the int32 words;
* a gpt-oss MXFP4 layer gets vLLM's gpt-oss MXFP4 method (parameters, loader) with
  :class:`CpumoeMxfp4Experts` (vLLM's own CPU MXFP4 experts need AMX);
* an unquantized bf16 layer for which vLLM selected its CPU backend keeps vLLM's method, whose
  experts class becomes :class:`CpumoeBf16Experts`.

The method's own ``process_weights_after_loading`` then builds vLLM's modular kernel around
cpumoe's experts, whose ``process_weights_after_loading`` prepacks the layer's weights (and frees
vLLM's copies), and whose ``apply`` calls the fused op with vLLM's top-k ids, weights and expert
map.
"""

from __future__ import annotations

import os
import threading
from fractions import Fraction
from typing import Any, Dict, Optional, Tuple

import torch

import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (FUSED_MOE_UNQUANTIZED_CONFIG,
                                                         FusedMoEConfig,
                                                         FusedMoEParallelConfig,
                                                         FusedMoEQuantConfig)
from vllm.model_executor.layers.fused_moe.oracle.int8 import Int8MoeBackend
from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
    UnquantizedFusedMoEMethod)
from vllm.model_executor.layers.quantization.utils.quant_utils import (QuantKey,
                                                                       kInt8DynamicTokenSym,
                                                                       kInt8StaticChannelSym)
from vllm.model_executor.utils import replace_parameter
from vllm.platforms import current_platform

import cpumoe
from cpumoe import ops as _ops

# A child of vLLM's logger: vLLM's handler and format, and VLLM_LOGGING_LEVEL, apply.
logger = init_logger("vllm.plugins.cpumoe")

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

_lock = threading.Lock()
#: This process's cpumoe layers: layer name -> {"kind", "path", "kernel", "calls", "tokens"}.
_LAYERS: Dict[str, Dict[str, Any]] = {}


def stats() -> Dict[str, Any]:
    """What cpumoe did in this process: its pid and, per layer it took, the op kind, path,
    kernel and the number of calls and tokens the kernel ran (for tests, e.g. through
    ``vllm.LLM.apply_model``)."""
    with _lock:
        return {"pid": os.getpid(), "layers": {k: dict(v) for k, v in _LAYERS.items()}}


def reset_counts() -> None:
    """Zeroes the call and token counters of every layer (e.g. after a warm-up)."""
    with _lock:
        for v in _LAYERS.values():
            v["calls"] = 0
            v["tokens"] = 0


# ---------------------------------------------------------------------------- support checks
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


# ---------------------------------------------------------------------------- experts classes
class _CpumoeExperts(mk.FusedMoEExpertsModular):
    """Shared part of cpumoe's experts: vLLM's modular-kernel interface around the fused op.

    Standard activation format, unquantized inputs (cpumoe quantizes per token itself), the
    top-k weighting and reduction done by the op (TopKWeightAndReduceNoOP), global ids with
    vLLM's expert map.
    """

    kind = ""

    def __init__(self, moe_config: FusedMoEConfig, quant_config: FusedMoEQuantConfig,
                 max_num_tokens: Optional[int] = None, num_dispatchers: Optional[int] = None):
        super().__init__(moe_config, quant_config, max_num_tokens, num_dispatchers)
        self.packed: Any = None
        self.layer_name = "?"
        self._act = _ACTIVATIONS.get(moe_config.activation, "")
        self._stats: Dict[str, Any] = {}
        self._emap_src: Optional[torch.Tensor] = None
        self._emap: Optional[torch.Tensor] = None

    # -- capabilities (what vLLM's selection asks of an experts class)
    @property
    def expects_unquantized_inputs(self) -> bool:
        return True

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    @staticmethod
    def _supports_current_device() -> bool:
        return current_platform.is_cpu()

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation in _ACTIVATIONS

    @staticmethod
    def _supports_parallel_config(moe_parallel_config: FusedMoEParallelConfig) -> bool:
        return True

    def supports_expert_map(self) -> bool:
        return True

    # -- weights
    def _prepack(self, layer: torch.nn.Module) -> Any:
        raise NotImplementedError

    def _format_name(self) -> str:
        """The layer's format in the log line."""
        return {"int8": "W8A8 int8", "bf16": "bf16"}[self.kind]

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.layer_name = getattr(layer, "layer_name", "?")
        self.packed = p = self._prepack(layer)
        # vLLM's copies are no longer read: keep 3-D placeholders of the right E and H (the
        # modular kernel and the layer's repr read their shapes; moe_problem_size below does
        # not), and let the weights' memory go. (A W4A16 layer has none until here.)
        for name in ("w13_weight", "w2_weight"):
            old = getattr(layer, name, None)
            empty = torch.empty((p.num_experts, 0, p.hidden),
                                dtype=torch.int8 if old is None else old.dtype)
            if old is None:
                layer.register_parameter(name, torch.nn.Parameter(empty, requires_grad=False))
            else:
                replace_parameter(layer, name, empty)
        self._stats = {"kind": self.kind, "path": p.path, "kernel": p.kernel, "calls": 0,
                       "tokens": 0}
        with _lock:
            _LAYERS[self.layer_name] = self._stats
        logger.info("cpumoe: %s runs on cpumoe (%s, path %s, kernel %s; E=%d H=%d I=%d top-%d "
                    "%s%s)", self.layer_name, self._format_name(), p.path, p.kernel,
                    p.num_experts, p.hidden, p.intermediate,
                    self.moe_config.experts_per_token, self._act,
                    ", expert map" if getattr(layer, "expert_map", None) is not None else "")

    # -- forward
    def moe_problem_size(self, a1: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                         topk_ids: torch.Tensor) -> Tuple[int, int, int, int, int]:
        p = self.packed
        return p.num_experts, a1.size(0), 2 * p.intermediate, p.hidden, topk_ids.size(1)

    def workspace_shapes(self, M: int, N: int, K: int, topk: int, global_num_experts: int,
                         local_num_experts: int,
                         expert_tokens_meta: Optional[mk.ExpertTokensMetadata],
                         activation: MoEActivation):
        # The op keeps its own per-thread scratch; only the output is vLLM's.
        return (0,), (0,), (M, K)

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceNoOP()

    def _expert_map(self, expert_map: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if expert_map is None:
            return None
        if expert_map is not self._emap_src:  # converted once per map tensor
            self._emap_src = expert_map
            self._emap = expert_map.to(torch.int32).contiguous()
        return self._emap

    def apply(self, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor,
              w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              activation: MoEActivation, global_num_experts: int,
              expert_map: Optional[torch.Tensor], a1q_scale: Optional[torch.Tensor],
              a2_scale: Optional[torch.Tensor], workspace13: torch.Tensor,
              workspace2: torch.Tensor, expert_tokens_meta: Optional[mk.ExpertTokensMetadata],
              apply_router_weight_on_input: bool) -> None:
        act = _ACTIVATIONS.get(activation)
        if act is None:
            raise ValueError(f"cpumoe ({self.layer_name}): activation {activation.value!r}")
        if topk_weights.dtype != torch.float32:
            topk_weights = topk_weights.float()
        # apply_router_weight_on_input (top-1): vLLM's prepare step already scaled x by the
        # router weight, so the op must not weight again (its skip_weighted).
        # Every weight format but bf16 runs on the int8 op (int8 activations).
        fn = cpumoe.fused_moe_bf16 if self.kind == "bf16" else cpumoe.fused_moe_int8
        fn(hidden_states, self.packed, topk_weights.contiguous(), topk_ids.contiguous(), act,
           bool(apply_router_weight_on_input), out=output,
           expert_map=self._expert_map(expert_map))
        st = self._stats
        st["calls"] += 1
        st["tokens"] += hidden_states.size(0)


def _bias(layer: torch.nn.Module, name: str) -> Optional[torch.Tensor]:
    b = getattr(layer, name, None)
    return None if b is None else b.data


class CpumoeInt8Experts(_CpumoeExperts):
    """W8A8 int8 experts (int8 per-channel weights, dynamic per-token int8 activations) on
    cpumoe's int8 op."""

    kind = "int8"

    @staticmethod
    def _supports_quant_scheme(weight_key: Optional[QuantKey],
                               activation_key: Optional[QuantKey]) -> bool:
        return (weight_key, activation_key) == (kInt8StaticChannelSym, kInt8DynamicTokenSym)

    def _prepack(self, layer: torch.nn.Module) -> Any:
        return _ops.prepack(layer.w13_weight.data, layer.w2_weight.data,
                            layer.w13_weight_scale.data, layer.w2_weight_scale.data,
                            _bias(layer, "w13_bias"), _bias(layer, "w2_bias"))


class CpumoeInt4Experts(_CpumoeExperts):
    """W4A8 experts (int4 weights with a scale per group of inputs, dynamic per-token int8
    activations) on cpumoe's int8 op: the layer's ``w13_weight`` / ``w2_weight`` hold the int4
    values as int8 (compressed-tensors' int-quantized W4A8, as vLLM's W4A8 int8 method loads
    them), the scales [E, N, K / g] give the group size."""

    kind = "int4"

    @staticmethod
    def _supports_quant_scheme(weight_key: Optional[QuantKey],
                               activation_key: Optional[QuantKey]) -> bool:
        from vllm.model_executor.layers.quantization.utils import quant_utils as qu
        keys = [getattr(qu, f"kInt4W4A8StaticGroup{g}Sym") for g in ("32", "64", "128", "")]
        return activation_key is None and weight_key in keys

    def _prepack(self, layer: torch.nn.Module) -> Any:
        s13, s2 = layer.w13_weight_scale.data, layer.w2_weight_scale.data
        words = getattr(layer, "w13_weight_packed", None)
        if words is not None and words.dtype == torch.int32 and words.numel():
            # W4A16 pack-quantized: int32 words of eight values + 8 each (vLLM's WNA16 names).
            from cpumoe.checkpoint_w4 import unpack_int4
            self.source = "W4A16 checkpoint, int8 activations"
            E, N13, H = s13.size(0), s13.size(1), words.size(2) * 8
            N2, I = s2.size(1), layer.w2_weight_packed.size(2) * 8
            w13 = torch.from_numpy(unpack_int4(words.numpy().reshape(E * N13, -1), H))
            w2 = torch.from_numpy(unpack_int4(layer.w2_weight_packed.data.numpy()
                                              .reshape(E * N2, -1), I))
            w13, w2 = w13.reshape(E, N13, H), w2.reshape(E, N2, I)
            for name in ("w13_weight_packed", "w2_weight_packed"):
                replace_parameter(layer, name, torch.empty(0, dtype=torch.int32))
        else:
            w13, w2 = layer.w13_weight.data, layer.w2_weight.data
        return _ops.prepack_int4(w13, w2, s13.float(), s2.float(), _bias(layer, "w13_bias"),
                                 _bias(layer, "w2_bias"),
                                 group_size=w13.size(2) // max(1, s13.size(2)))

    def _format_name(self) -> str:
        src = getattr(self, "source", "")
        return f"W4A8 int4 g{self.packed.group_size}" + (f" ({src})" if src else "")


class CpumoeMxfp4Experts(_CpumoeExperts):
    """gpt-oss's MXFP4 experts (E2M1 weights, an E8M0 scale per 32 inputs, bf16 biases) on
    cpumoe's int8 op: the activations are quantized to int8 per token (the checkpoint is
    W4A16; vLLM's own CPU MXFP4 experts, bf16 activations, need AMX)."""

    kind = "mxfp4"

    @staticmethod
    def _supports_quant_scheme(weight_key: Optional[QuantKey],
                               activation_key: Optional[QuantKey]) -> bool:
        from vllm.model_executor.layers.quantization.utils.quant_utils import kMxfp4Static
        return (weight_key, activation_key) == (kMxfp4Static, None)

    def _prepack(self, layer: torch.nn.Module) -> Any:
        # vLLM's parameters: uint8 [E, N, K / 2] (two codes a byte, low nibble first) and
        # [E, N, K / 32]: gpt-oss's blocks [E, N, K / 32, 16] with the last two dims merged.
        qc = self.quant_config
        consts = (qc.gemm1_alpha, qc.gemm1_beta, qc.gemm1_clamp_limit)
        want = (_SWIGLU["swiglu_alpha"], _SWIGLU["swiglu_beta"], _SWIGLU["swiglu_limit"])
        if self._act == "swigluoai" and any(c is not None and abs(c - w) > 1e-6
                                            for c, w in zip(consts, want)):
            raise ValueError(f"cpumoe ({self.layer_name}): swigluoai alpha/beta/limit "
                             f"{consts}, cpumoe's are fixed at {want}")
        w13, w2 = layer.w13_weight.data, layer.w2_weight.data
        E, N13, H = w13.size(0), w13.size(1), w13.size(2) * 2
        I = w2.size(2) * 2
        return _ops.prepack_mxfp4(w13.view(E, N13, H // 32, 16), layer.w13_weight_scale.data,
                                  w2.view(E, H, I // 32, 16), layer.w2_weight_scale.data,
                                  _bias(layer, "w13_bias"), _bias(layer, "w2_bias"))

    def _format_name(self) -> str:
        return "W4A8 mxfp4 (W4A16 checkpoint, int8 activations)"


class CpumoeBf16Experts(_CpumoeExperts):
    """Unquantized bf16 experts on cpumoe's BF16 op."""

    kind = "bf16"

    @staticmethod
    def _supports_quant_scheme(weight_key: Optional[QuantKey],
                               activation_key: Optional[QuantKey]) -> bool:
        return (weight_key, activation_key) == (None, None)

    def _prepack(self, layer: torch.nn.Module) -> Any:
        return _ops.prepack_bf16(layer.w13_weight.data, layer.w2_weight.data,
                                 _bias(layer, "w13_bias"), _bias(layer, "w2_bias"))


#: Experts classes swapped into a method vLLM built (_plan's kinds; the quantized layers get
#: cpumoe's methods instead).
_EXPERTS = {"bf16": CpumoeBf16Experts}


# ---------------------------------------------------------------------------- the layer
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


def _method_classes() -> Dict[str, type]:
    """cpumoe's quantized MoE methods, by kind: vLLM's compressed-tensors W8A8 int8, W4A8 int8
    and WNA16 methods and its gpt-oss MXFP4 method (their parameters and weight loading) with
    cpumoe's experts, made without vLLM's backend selection (which finds no W8A8 kernel on x86
    CPUs without AMX, none for swigluoai or an expert map, no W4A8 kernel on x86 and no W4A16 or
    MXFP4 kernel on x86 without AMX)."""
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
            self.symmetric = True
            self.num_bits = 4
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

    _METHODS.update(int8=CpumoeW8A8Int8MoEMethod, int4=CpumoeW4A8Int8MoEMethod,
                    int4_a16=CpumoeW4A16Int4MoEMethod, mxfp4=CpumoeGptOssMxfp4MoEMethod)
    return _METHODS


_METHODS: Dict[str, type] = {}


class _CpumoeLayer:
    """Mixed in before vLLM's RoutedExperts (or a model's subclass of it): cpumoe's experts where
    cpumoe supports the layer (see the module doc); otherwise exactly vLLM's layer."""

    def _get_quant_method(self, prefix: str, quant_config: Any,
                          moe_config: FusedMoEConfig) -> Any:
        kind, scheme, self._cpumoe_why = _quantized_kind(self, prefix, quant_config, moe_config)
        if kind is not None:
            return _method_classes()[kind](scheme.get("weights"),
                                           scheme.get("input_activations"), moe_config)
        return super()._get_quant_method(prefix, quant_config, moe_config)

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        qm = self.quant_method
        if isinstance(qm, tuple(_method_classes().values())):
            return  # taken; logged with its path once the weights are packed
        kind, why = _plan(self)
        if kind is None:
            logger.info("cpumoe: %s stays on vLLM's kernel: %s", self.layer_name,
                        self._cpumoe_why or why)
            return
        vllm_cls = getattr(qm, "experts_cls", None)
        qm.experts_cls = _EXPERTS[kind]
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
