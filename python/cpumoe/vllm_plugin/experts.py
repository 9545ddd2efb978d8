"""cpumoe's experts classes for vLLM's modular MoE kernel (``FusedMoEExpertsModular``), one per
weight format, and the bookkeeping of the layers they run (:func:`stats`).

An experts object's ``process_weights_after_loading`` prepacks the layer's weights (and frees
vLLM's copies) and records the layer; its ``apply`` calls the fused op with vLLM's top-k ids,
weights and expert map, and counts the calls and tokens.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Dict, Optional, Tuple

import torch

import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (FusedMoEConfig,
                                                         FusedMoEParallelConfig,
                                                         FusedMoEQuantConfig)
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP
from vllm.model_executor.layers.quantization.utils.quant_utils import (QuantKey,
                                                                       kInt8DynamicTokenSym,
                                                                       kInt8StaticChannelSym)
from vllm.model_executor.utils import replace_parameter
from vllm.platforms import current_platform

import cpumoe
from cpumoe import ops as _ops

from .kinds import VLLM_ACTIVATIONS, activation_of

__all__ = ["CpumoeBf16Experts", "CpumoeFp8Experts", "CpumoeGptqAwqExperts", "CpumoeInt4Experts",
           "CpumoeInt8Experts", "CpumoeMxfp4Experts", "gptq_awq_layer", "reset_counts",
           "stats"]

# A child of vLLM's logger: vLLM's handler and format, and VLLM_LOGGING_LEVEL, apply.
logger = init_logger("vllm.plugins.cpumoe")

_lock = threading.Lock()
#: This process's cpumoe layers: layer name -> {"kind", "path", "kernel", "calls", "tokens"}.
_LAYERS: Dict[str, Dict[str, Any]] = {}


#: How the 4-bit layers (int4, GPTQ / AWQ, MXFP4) treat their activations: "int8" (quantized
#: per token: the W4A8 op, the default), "group" (int8 per weight group) or "bf16" (W4A16: not
#: quantized, the FP8 kernels on the 4-bit codes; symmetric weights only, asymmetric layers keep
#: int8 and say so). 8-bit GPTQ layers take int8 or group.
W4_ACT_ENV = "CPUMOE_VLLM_W4_ACT"
_W4_ACT = {"": "row", "int8": "row", "group": "group", "bf16": "bf16"}
_ACT_TEXT = {"row": "int8 activations", "group": "int8 activations per group",
             "bf16": "bf16 activations"}


def w4_act_quant(bf16_ok: bool = True) -> Tuple[str, str]:
    """(the prepack's act_quant, the log's words) under CPUMOE_VLLM_W4_ACT; ``bf16_ok`` False
    (an affine layer): "bf16" falls back to "row". ValueError for another value."""
    v = os.environ.get(W4_ACT_ENV, "").strip().lower()
    if v not in _W4_ACT:
        raise ValueError(f"{W4_ACT_ENV}={v!r}: must be int8 (the default), group or bf16")
    mode = _W4_ACT[v]
    if mode == "bf16" and not bf16_ok:
        return "row", "int8 activations: bf16 ones need symmetric 4-bit weights"
    return mode, _ACT_TEXT[mode]


def _w4_name(p: Any, fmt: str, group: int, source: str) -> str:
    """The log's name of a 4-bit layer of format ``fmt`` packed as ``p`` (W4A8, or W4A16 as a
    PackedMoeFp8)."""
    if isinstance(p, cpumoe.PackedMoeFp8):
        return f"W4A16 {fmt} g{group}, {p.code_bits}-bit codes ({source})"
    return f"W4A8 {p.weight_format} g{p.group_size}" + (f" ({source})" if source else "")


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
        # The spec with the layer's parameters (the quantization config's gemm1_* first), or
        # None and why: apply() then refuses (layer_problem already kept such layers on vLLM's
        # kernel unless the quantization config changed them).
        self._act, self._act_why = activation_of(moe_config, quant_config=quant_config)
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
        return activation in VLLM_ACTIVATIONS

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
        # The activation vLLM passes is the layer's (its parameters are in self._act's spec: a
        # SILU layer with a swiglu_limit runs silu_clamp); another one is refused, not mapped.
        act = self._act
        built_for = getattr(self.moe_config, "activation", activation)
        if act is None or activation not in VLLM_ACTIVATIONS or activation != built_for:
            raise ValueError(f"cpumoe ({self.layer_name}): activation {activation.value!r}: "
                             f"{self._act_why or f'the layer runs {act}'}")
        if topk_weights.dtype != torch.float32:
            topk_weights = topk_weights.float()
        # apply_router_weight_on_input (top-1): vLLM's prepare step already scaled x by the
        # router weight, so the op must not weight again (its skip_weighted).
        # bf16, fp8 (W8A16) and the 4-bit layers packed W4A16 (CPUMOE_VLLM_W4_ACT=bf16) run on
        # the BF16 op, the packed kind says which; the other formats on the int8 op.
        bf16_op = isinstance(self.packed, (cpumoe.PackedMoeBf16, cpumoe.PackedMoeFp8))
        fn = cpumoe.fused_moe_bf16 if bf16_op else cpumoe.fused_moe_int8
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
        act_quant, acts = w4_act_quant()
        self.source = "" if act_quant == "row" else f"W4A8 checkpoint, {acts}"
        if words is not None and words.dtype == torch.int32 and words.numel():
            # W4A16 pack-quantized: int32 words of eight values + 8 each (vLLM's WNA16 names).
            from cpumoe.checkpoint_w4 import unpack_int4
            self.source = f"W4A16 checkpoint, {acts}"
            E, N13, H = s13.size(0), s13.size(1), words.size(2) * 8
            N2, I = s2.size(1), layer.w2_weight_packed.size(2) * 8
            w13 = torch.from_numpy(unpack_int4(words.numpy().reshape(E * N13, -1), H))
            w2 = torch.from_numpy(unpack_int4(layer.w2_weight_packed.data.numpy()
                                              .reshape(E * N2, -1), I))
            w13, w2 = w13.reshape(E, N13, H), w2.reshape(E, N2, I)
            for name in ("w13_weight_packed", "w2_weight_packed"):
                replace_parameter(layer, name, torch.empty(0, dtype=torch.int32))
            z13 = getattr(layer, "w13_weight_zero_point", None)
            if z13 is not None:  # symmetric: false (vLLM's WNA16 method made the parameters)
                z13 = _ct_zero_points(z13.data, N13, s13.size(2), "w13", self.layer_name)
                z2 = _ct_zero_points(layer.w2_weight_zero_point.data, N2, s2.size(2), "w2",
                                     self.layer_name)
                for name in ("w13_weight_zero_point", "w2_weight_zero_point"):
                    replace_parameter(layer, name, torch.empty(0, dtype=torch.int32))
                if not ((z13 == 8).all() and (z2 == 8).all()):
                    act_quant, acts = w4_act_quant(bf16_ok=False)
                    self.source = f"W4A16 asymmetric checkpoint, {acts}"
                    return _affine_from_zero_points(w13, w2, s13, s2, z13, z2, layer,
                                                    act_quant)
        else:
            w13, w2 = layer.w13_weight.data, layer.w2_weight.data
        self.group = w13.size(2) // max(1, s13.size(2))
        return _ops.prepack_int4(w13, w2, s13.float(), s2.float(), _bias(layer, "w13_bias"),
                                 _bias(layer, "w2_bias"), group_size=self.group,
                                 act_quant=act_quant)

    def _format_name(self) -> str:
        return _w4_name(self.packed, "int4", getattr(self, "group", 0),
                        getattr(self, "source", ""))


def _ct_zero_points(words: torch.Tensor, n: int, groups: int, what: str, name: str) -> Any:
    """compressed-tensors' packed zero points as vLLM's WNA16 method loads them, int32
    [E, n / 8, groups] (row 8 r + i at bits 4i of word [e, r, group]) -> the stored nibbles
    zp + 8, int16 numpy [E, n, groups]."""
    E = words.size(0)
    if tuple(words.shape) != (E, n // 8, groups) or words.dtype != torch.int32:
        raise ValueError(f"cpumoe ({name}): {what}_weight_zero_point {words.dtype} "
                         f"{list(words.shape)}, expected int32 {[E, n // 8, groups]}")
    nib = _fields(words.transpose(1, 2).contiguous())  # [E, groups, n / 8, 8]
    return nib.reshape(E, groups, n).transpose(0, 2, 1).astype("int16")


def _affine_from_zero_points(w13: torch.Tensor, w2: torch.Tensor, s13: torch.Tensor,
                             s2: torch.Tensor, z13: Any, z2: Any, layer: torch.nn.Module,
                             act_quant: str = "row") -> Any:
    """int4 values q (int8 in [-8, 7]) with group scales s and stored zero points zs = zp + 8 ->
    the packed int4_affine layer: codes q + 8, (s, -s * zs) per group, so s * code + min is
    (q - zp) * s (exact for fp16 / bf16 scales)."""
    import numpy as np
    pairs = []
    for s, z in ((s13, z13), (s2, z2)):
        sf = s.float().numpy()
        if not np.isfinite(sf).all():
            raise ValueError("cpumoe: non-finite W4A16 group scales")
        pairs.append(np.stack([sf, np.float32(0) - sf * z.astype(np.float32)], axis=-1))
    codes = [(t.numpy().astype(np.int16) + 8).astype(np.uint8) for t in (w13, w2)]
    return _ops.prepack_int4_affine(codes[0], codes[1], pairs[0], pairs[1],
                                    _bias(layer, "w13_bias"), _bias(layer, "w2_bias"),
                                    group_size=w13.size(2) // max(1, s13.size(2)),
                                    act_quant=act_quant)


def _fields(words: torch.Tensor, bits: int = 4) -> Any:
    """int32 [..., M] -> uint8 numpy [..., M, 32 / bits]: field i is bits (bits * i) onward of
    each word (cpumoe.checkpoint.fields)."""
    from cpumoe.checkpoint import fields
    return fields(words.numpy(), bits)


def gptq_awq_layer(method: str, w13_qweight: torch.Tensor, w2_qweight: torch.Tensor,
                   w13_scales: torch.Tensor, w2_scales: torch.Tensor, w13_qzeros: torch.Tensor,
                   w2_qzeros: torch.Tensor, group_size: int, zero_offset: int = 0,
                   name: str = "?", bits: int = 4) -> Tuple[str, int, Any, Any, Any, Any]:
    """A GPTQ / AWQ MoE layer as vLLM's AutoGPTQMoEMethod / AutoAWQMoEMethod load it -> cpumoe's
    prepack input: (format, g, w13, w2, s13, s2), numpy.

    vLLM's parameters (E experts, w13's N = 2I: gate then up, w2's N = H; K the other depth;
    G = K / group_size groups, one for group_size -1): GPTQ ``w*_qweight`` int32 [E, K / 8, N]
    (k = 8 r + i at bits 4i of word [r, n]); AWQ ``w*_qweight`` int32 [E, K, N / 8] (nibble i of
    word [k, c] holds n = 8 c + (0, 2, 4, 6, 1, 3, 5, 7)[i]); ``w*_qzeros`` int32 [E, G, N / 8]
    packed along N the same way (GPTQ: in order; its v1 stores z - 1: ``zero_offset`` 1);
    ``w*_scales`` [E, G, N]. The weight is ``s * (q - z)`` per group.

    "int4" when every zero point is 8 (values q - 8, scales), else "int4_affine" (codes q,
    (s, -s * z) pairs: exact for fp16 / bf16 scales), with cpumoe's group size g: the largest
    multiple of 32 dividing the checkpoint's groups and both depths
    (:mod:`cpumoe.checkpoint_gptq`'s rule). ``bits`` 8 (GPTQ only: four codes per word, packed
    as above with 4 for 8): "int8_affine", the same pairs."""
    import numpy as np
    from cpumoe.checkpoint_gptq import AWQ_ORDER, _common_group
    rev = list(np.argsort(AWQ_ORDER))
    E = w13_qweight.size(0)

    def codes(qw):  # -> uint8 [E, N, K]
        nib = _fields(qw, bits)
        if method == "gptq":  # [E, K / p, N, p] -> [E, N, K / p, p] (p = 32 / bits)
            return np.ascontiguousarray(nib.transpose(0, 2, 1, 3)).reshape(E, qw.size(2), -1)
        # AWQ: [E, K, N / 8, 8] in AWQ's order -> [E, K, N] -> [E, N, K]
        return np.ascontiguousarray(nib[..., rev].reshape(E, qw.size(1), -1).transpose(0, 2, 1))

    def zeros(qz):  # -> int16 [E, G, N]
        nib = _fields(qz, bits)
        if method == "awq":
            nib = nib[..., rev]
        return nib.reshape(E, qz.size(1), -1).astype(np.int16) + np.int16(zero_offset)

    c13, c2 = codes(w13_qweight), codes(w2_qweight)
    N13, H = c13.shape[1], c13.shape[2]
    I = c2.shape[2]
    z13, z2 = zeros(w13_qzeros), zeros(w2_qzeros)
    s13 = w13_scales.detach().float().numpy()
    s2 = w2_scales.detach().float().numpy()
    for what, s, z, n, k in (("w13_scales", s13, z13, N13, H), ("w2_scales", s2, z2, H, I)):
        G = 1 if group_size == -1 else k // group_size
        if s.shape != (E, G, n) or z.shape != (E, G, n):
            raise ValueError(f"cpumoe ({name}): {what} / qzeros of shapes {list(s.shape)} / "
                             f"{list(z.shape)}, expected {[E, G, n]} (group_size {group_size})")
        if not np.isfinite(s).all():
            raise ValueError(f"cpumoe ({name}): {what}: non-finite group scales")
    g = _common_group(group_size, H, I, f"cpumoe ({name})")

    def regrid(per_group, k):  # [E, G, N] per checkpoint group -> [E, N, k / g]
        ge = k if group_size == -1 else group_size
        return np.ascontiguousarray(per_group[:, (np.arange(k // g) * g) // ge].transpose(0, 2, 1))

    if bits == 4 and (z13 == 8).all() and (z2 == 8).all():
        return ("int4", g, (c13.astype(np.int8) - np.int8(8)), (c2.astype(np.int8) - np.int8(8)),
                regrid(s13, H), regrid(s2, I))
    pairs = []
    for s, z, k in ((s13, z13, H), (s2, z2, I)):
        pairs.append(np.stack([regrid(s, k), regrid(np.float32(0) - s * z.astype(np.float32), k)],
                              axis=-1))
    return "int4_affine" if bits == 4 else "int8_affine", g, c13, c2, pairs[0], pairs[1]


class CpumoeGptqAwqExperts(_CpumoeExperts):
    """4-bit GPTQ and AWQ experts (vLLM's AutoGPTQMoEMethod / AutoAWQMoEMethod parameters: int32
    words, group scales, packed zero points) on cpumoe's int8 op with int8 activations:
    :func:`gptq_awq_layer` turns them into int4 (every zero point 8) or int4_affine; what the
    checkpoint is (GPTQ or AWQ, its group size and zero-point offset) is in the layer's
    ``cpumoe_gptq_awq`` (set by cpumoe's method)."""

    kind = "int4"

    @staticmethod
    def _supports_quant_scheme(weight_key: Optional[QuantKey],
                               activation_key: Optional[QuantKey]) -> bool:
        from vllm.model_executor.layers.quantization.utils import quant_utils as qu
        return activation_key is None and weight_key in (qu.kInt4Static, qu.kInt4StaticAsym,
                                                         qu.kInt8Static)

    def _prepack(self, layer: torch.nn.Module) -> Any:
        info = layer.cpumoe_gptq_awq
        self.kind = info["method"]
        fmt, g, w13, w2, s13, s2 = gptq_awq_layer(
            info["method"], layer.w13_qweight.data, layer.w2_qweight.data,
            layer.w13_scales.data, layer.w2_scales.data, layer.w13_qzeros.data,
            layer.w2_qzeros.data, info["group_size"], info["zero_offset"], self.layer_name,
            info.get("bits", 4))
        fn = getattr(_ops, f"prepack_{fmt}")  # int4, int4_affine or int8_affine
        act_quant, acts = w4_act_quant(bf16_ok=fmt == "int4")
        self.group = g
        packed = fn(w13, w2, s13, s2, _bias(layer, "w13_bias"), _bias(layer, "w2_bias"),
                    group_size=g, act_quant=act_quant)
        label = {"gptq": "GPTQ v1", "gptq_v2": "GPTQ v2"}.get(info["checkpoint_format"],
                                                            "AWQ GEMM")
        if info.get("bits", 4) == 8:
            label += " 8-bit"
        ck_g = "" if info["group_size"] == g else f" group_size {info['group_size']}"
        self.source = f"{label} checkpoint{ck_g}, {acts}"
        for name in ("w13_qweight", "w2_qweight", "w13_qzeros", "w2_qzeros", "w13_scales",
                     "w2_scales"):
            replace_parameter(layer, name, torch.empty(0, dtype=getattr(layer, name).dtype))
        return packed

    def _format_name(self) -> str:
        p = self.packed
        if not isinstance(p, cpumoe.PackedMoeFp8) and p.weight_format == "int8_affine":
            return f"W8A8 int8_affine g{p.group_size} ({getattr(self, 'source', '')})"
        return _w4_name(p, "int4", self.group, getattr(self, "source", ""))


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
        if self._act is None:  # the quantization config's alpha / beta / limit
            raise ValueError(f"cpumoe ({self.layer_name}): {self._act_why}")
        w13, w2 = layer.w13_weight.data, layer.w2_weight.data
        E, N13, H = w13.size(0), w13.size(1), w13.size(2) * 2
        I = w2.size(2) * 2
        act_quant, self.acts = w4_act_quant()
        return _ops.prepack_mxfp4(w13.view(E, N13, H // 32, 16), layer.w13_weight_scale.data,
                                  w2.view(E, H, I // 32, 16), layer.w2_weight_scale.data,
                                  _bias(layer, "w13_bias"), _bias(layer, "w2_bias"),
                                  act_quant=act_quant)

    def _format_name(self) -> str:
        src = f"W4A16 checkpoint, {getattr(self, 'acts', 'int8 activations')}"
        if isinstance(self.packed, cpumoe.PackedMoeFp8):
            return _w4_name(self.packed, "mxfp4", 32, src)
        return f"W4A8 mxfp4 ({src})"


class CpumoeFp8Experts(_CpumoeExperts):
    """FP8 experts (E4M3 weights with fp32 block scales, HF ``weight_block_size``, or a scale per
    channel or tensor) on cpumoe's fp8 op with bf16 activations (W8A16): vLLM's FP8 methods
    load ``w13_weight`` / ``w2_weight`` (float8_e4m3fn) and the scales: HF fp8's
    ``w13_weight_scale_inv`` / ``w2_weight_scale_inv`` [E, ceil(N / bn), ceil(K / bk)] (per
    tensor ``w13_weight_scale`` [E, 2], one per shard, and ``w2_weight_scale`` [E]),
    compressed-tensors' ``w13_weight_scale`` / ``w2_weight_scale`` (blocks as HF's, channels
    [E, N, 1], tensors as HF's). They are packed as they are (no float copy of the weights)."""

    kind = "fp8"

    @staticmethod
    def _supports_quant_scheme(weight_key: Optional[QuantKey],
                               activation_key: Optional[QuantKey]) -> bool:
        from vllm.model_executor.layers.quantization.utils import quant_utils as qu
        return weight_key in (qu.kFp8Static128BlockSym, qu.kFp8StaticChannelSym,
                              qu.kFp8StaticTensorSym)

    def _prepack(self, layer: torch.nn.Module) -> Any:
        w13, w2 = layer.w13_weight.data, layer.w2_weight.data
        E, N13, H = w13.shape
        # HF fp8 names its block scales weight_scale_inv, compressed-tensors weight_scale.
        suffix = "weight_scale_inv" if hasattr(layer, "w13_weight_scale_inv") else "weight_scale"
        s13 = getattr(layer, f"w13_{suffix}").data.float()
        s2 = getattr(layer, f"w2_{suffix}").data.float()
        block = getattr(layer, "weight_block_size", None)
        if block is not None:
            block = (int(block[0]), int(block[1]))
            self.source = f"blocks {block[0]}x{block[1]}"
        elif s13.numel() == E * N13:  # compressed-tensors channel scales [E, N, 1]
            self.source = "a scale per channel"
        else:  # per tensor: a scale per shard of w13 ([E, 2]) and per w2 ([E]), as row scales
            s13 = s13.reshape(E, -1)
            s13 = s13.repeat_interleave(N13 // s13.size(1), dim=1)
            s2 = s2.reshape(E, 1).expand(E, H).contiguous()
            self.source = "a scale per tensor"
        return _ops.prepack_fp8(w13, w2, s13, s2, _bias(layer, "w13_bias"),
                                _bias(layer, "w2_bias"), block_size=block)

    def _format_name(self) -> str:
        return f"W8A16 fp8, {getattr(self, 'source', '')}"


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


#: Experts classes swapped into a method vLLM built (plan_layer's kinds; the quantized layers get
#: cpumoe's methods instead).
EXPERT_CLASSES = {"bf16": CpumoeBf16Experts}
