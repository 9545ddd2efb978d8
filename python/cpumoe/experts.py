"""An experts class for inference engines, in the style of vLLM's ``FusedMoEExperts`` (no vLLM
import): ask :meth:`Int8Experts.supports_current_device` and :meth:`Int8Experts.is_supported_config`,
build one per MoE layer, call :meth:`Int8Experts.process_weights_after_loading` once the layer's
weights are loaded (prepacks them, frees the unpacked copies), then :meth:`Int8Experts.apply` in
the forward pass.

The layer is any object with the attributes vLLM's compressed-tensors W8A8 MoE method creates:

==================== ================================================================
``w13_weight``       int8 [E, 2I, H]: gate rows [0, I), up rows [I, 2I) (swigluoai: even
                     rows gate, odd rows up)
``w2_weight``        int8 [E, H, I]
``w13_weight_scale`` float [E, 2I] or [E, 2I, 1] (``w13_scale`` is accepted too)
``w2_weight_scale``  float [E, H] or [E, H, 1] (``w2_scale`` too)
``w13_bias``         optional float [E, 2I] (absent or None: no bias)
``w2_bias``          optional float [E, H]
==================== ================================================================

Works on torch tensors (a ``torch.nn.Module`` or any object) and on numpy arrays. With torch,
``apply`` goes through the ``torch.ops.cpumoe.fused_moe_int8`` custom op, so a model that calls it
compiles with ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Optional, Tuple

import numpy as np

from . import ops as _ops

__all__ = ["Int4Experts", "Int8Experts", "topk_softmax"]

#: quant_scheme strings accepted by is_supported_config (all mean: int8 weights with static
#: symmetric per-output-channel scales, int8 activations with dynamic symmetric per-token scales).
QUANT_SCHEMES = ("w8a8_int8", "int8_w8a8", "w8a8")

_DTYPES = ("float32", "float16", "bfloat16")
_ALIGN = 8  # H and I must be multiples of this (the op's requirement)


def _torch():
    return sys.modules.get("torch")


def _is_torch(t: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(t, torch.Tensor)


def _dtype_name(dtype: Any) -> str:
    """'bfloat16' for torch.bfloat16, np.float16, 'fp16', ml_dtypes.bfloat16, ..."""
    if isinstance(dtype, str):
        s = dtype.replace("torch.", "").lower()
        return {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                "float": "float32"}.get(s, s)
    torch = _torch()
    if torch is not None and isinstance(dtype, torch.dtype):
        return str(dtype).replace("torch.", "")
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)


def _activation_name(activation: Any) -> str:
    """'silu' for "silu", "SiLU", or an enum member whose value is "silu" (vLLM MoEActivation)."""
    value = getattr(activation, "value", activation)
    return str(value).lower()


def _quant_scheme_reason(quant_scheme: Any) -> Optional[str]:
    """None if quant_scheme is W8A8 int8 (channel weights, dynamic token activations)."""
    if isinstance(quant_scheme, str):
        if quant_scheme.lower() in QUANT_SCHEMES:
            return None
        return (f"quant_scheme {quant_scheme!r} is not supported (one of {', '.join(QUANT_SCHEMES)}"
                f", or a compressed-tensors config group)")
    if isinstance(quant_scheme, dict):  # a compressed-tensors config group
        from .checkpoint import scheme_problem
        return scheme_problem(quant_scheme)
    return f"quant_scheme: expected a str or a compressed-tensors config group dict, got " \
           f"{type(quant_scheme).__name__}"


def topk_softmax(router_logits: Any, topk: int, renormalize: bool = True):
    """Softmax routing: (topk_weights float32 [T, k], topk_ids int32 [T, k]) from router logits
    [T, E] (torch or numpy). With ``renormalize`` the k weights of a token sum to 1."""
    if _is_torch(router_logits):
        torch = _torch()
        probs = torch.softmax(router_logits.float(), dim=-1)
        w, ids = torch.topk(probs, topk, dim=-1)
        if renormalize:
            w = w / w.sum(dim=-1, keepdim=True)
        return w.to(torch.float32).contiguous(), ids.to(torch.int32).contiguous()
    logits = np.asarray(router_logits, dtype=np.float32)
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs = e / e.sum(axis=-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :topk]
    w = np.take_along_axis(probs, ids, axis=-1)
    if renormalize:
        w = w / w.sum(axis=-1, keepdims=True)
    return np.ascontiguousarray(w, np.float32), np.ascontiguousarray(ids, np.int32)


class Int8Experts:
    """Fused W8A8 int8 MoE experts of one layer, on the best cpumoe path of this CPU.

    Args:
      hidden: H. intermediate: I (per expert, per tensor-parallel rank). num_experts: E, the
        experts held here (local). topk: k, experts per token.
      activation: an activation spec of :func:`cpumoe.ops.parse_activation` (a name of
        ``cpumoe.ACTIVATIONS``, with parameters where it takes them; or an enum with that value).
      expert_map: optional int [E_global] (global id -> local id, or -1 for an expert held
        elsewhere), for expert parallelism; ``apply`` then takes global topk ids.
      isa: cap the kernel path (e.g. "portable"); default: the best this CPU runs.
      num_threads: default: torch's count for torch tensors, else OpenMP's.
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int, topk: int,
                 activation: Any = "silu", *, expert_map: Any = None, isa: Optional[str] = None,
                 num_threads: Optional[int] = None):
        act = _activation_name(activation)
        # With expert parallelism k may exceed the local expert count: check k against E_global.
        n_global = num_experts if expert_map is None else int(np.shape(expert_map)[0])
        ok, reason = self.is_supported_config(hidden, intermediate, n_global, topk,
                                              "float32", act, self._default_scheme())
        if not ok:
            raise ValueError(f"{type(self).__name__}: {reason}")
        self.hidden = int(hidden)
        self.intermediate = int(intermediate)
        self.num_experts = int(num_experts)
        self.topk = int(topk)
        self.activation = act
        self.isa = isa
        self.num_threads = num_threads
        self.packed: Optional[_ops.PackedMoe] = None
        self.handle = None  # torch: the int64 [2] handle of cpumoe.torch_ops
        self.expert_map = None
        self._op = None
        self._finalizer = None
        if expert_map is not None:
            self.set_expert_map(expert_map)

    # ------------------------------------------------------------------ capability queries
    @staticmethod
    def supports_current_device() -> bool:
        """True if cpumoe runs on this CPU (its portable path runs on any CPU the extension was
        built for; :meth:`has_fast_path` says whether an ISA-specific kernel is available)."""
        try:
            return len(_ops.available_paths()) > 0
        except Exception:  # noqa: BLE001 - e.g. a bad CPUMOE_ISA value
            return False

    @staticmethod
    def has_fast_path() -> bool:
        """True if a kernel other than the portable one is selected on this CPU."""
        try:
            return _ops.selected_path() != "portable"
        except Exception:  # noqa: BLE001
            return False

    @staticmethod
    def supports_expert_map() -> bool:
        return True

    def _default_scheme(self) -> Any:
        return "w8a8_int8"

    @staticmethod
    def _scheme_reason(quant_scheme: Any) -> Optional[str]:
        return _quant_scheme_reason(quant_scheme)

    @classmethod
    def is_supported_config(cls, hidden: int, intermediate: int, num_experts: int, topk: int,
                            dtype: Any, activation: Any,
                            quant_scheme: Any) -> Tuple[bool, Optional[str]]:
        """(True, None), or (False, the reason) for a layer config.

        num_experts: all experts of the layer (with expert parallelism, the global count).

        dtype: the activation dtype (torch/numpy dtype or name): float32, float16 or bfloat16.
        activation: an activation spec or an enum whose value is one (cpumoe.activations();
        interleaved gate/up where the table says so). quant_scheme: "w8a8_int8" (or "int8_w8a8", "w8a8"), or a compressed-tensors
        config group dict (``weights`` / ``input_activations``).
        """
        for name, v in (("hidden", hidden), ("intermediate", intermediate),
                        ("num_experts", num_experts), ("topk", topk)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                return False, f"{name} must be a positive int, got {v!r}"
        if hidden % _ALIGN:
            return False, f"hidden dim must be a multiple of {_ALIGN}, got {hidden}"
        if intermediate % _ALIGN:
            return False, f"intermediate dim must be a multiple of {_ALIGN}, got {intermediate}"
        if topk > num_experts:
            return False, f"topk {topk} exceeds num_experts {num_experts}"
        dt = _dtype_name(dtype)
        if dt not in _DTYPES:
            return False, f"activation dtype must be float32, float16 or bfloat16, got {dt}"
        act = _activation_name(activation)
        try:
            _ops.parse_activation(act)
        except ValueError as e:
            return False, str(e)
        reason = cls._scheme_reason(quant_scheme)
        if reason is not None:
            return False, reason
        return True, None

    @classmethod
    def from_config(cls, moe_config: Any, **kw) -> "Int8Experts":
        """Builds from a vLLM-style ``FusedMoEConfig`` (duck-typed: ``hidden_dim``,
        ``intermediate_size_per_partition``, ``num_local_experts``, ``experts_per_token``,
        ``activation``)."""
        return cls(moe_config.hidden_dim, moe_config.intermediate_size_per_partition,
                   moe_config.num_local_experts, moe_config.experts_per_token,
                   getattr(moe_config, "activation", "silu"), **kw)

    # ------------------------------------------------------------------ weights
    def set_expert_map(self, expert_map: Any) -> None:
        """Sets (or with None clears) the global -> local expert map, int [E_global]."""
        if expert_map is None:
            self.expert_map = None
            return
        if _is_torch(expert_map):
            em = expert_map.to(_torch().int32).contiguous()
            vals = em.numpy()
        else:
            em = np.ascontiguousarray(expert_map, dtype=np.int32)
            vals = em
        if vals.ndim != 1 or vals.size == 0:
            raise ValueError(f"expert_map: must be 1-D [E_global], got shape {list(vals.shape)}")
        if ((vals < -1) | (vals >= self.num_experts)).any():
            raise ValueError(f"expert_map: entries must be -1 or local ids in "
                             f"[0, {self.num_experts})")
        self.expert_map = em

    def process_weights_after_loading(self, layer: Any) -> None:
        """Prepacks the layer's weights once and frees the unpacked copies.

        Reads ``w13_weight``, ``w2_weight``, ``w13_weight_scale``, ``w2_weight_scale`` and the
        optional ``w13_bias``/``w2_bias`` (shapes in the module doc); then replaces each with an
        empty tensor/array of its dtype (a ``torch.nn.Parameter`` where it was one), except
        ``w13_weight``, which becomes the torch handle (int64 [2]) of the packed layer with
        torch tensors. Memory is returned once nothing else refers to the old tensors.
        """
        w13 = getattr(layer, "w13_weight")
        w2 = getattr(layer, "w2_weight")
        s13_name = "w13_weight_scale" if hasattr(layer, "w13_weight_scale") else "w13_scale"
        s2_name = "w2_weight_scale" if hasattr(layer, "w2_weight_scale") else "w2_scale"
        s13, s2 = getattr(layer, s13_name), getattr(layer, s2_name)
        b13 = getattr(layer, "w13_bias", None)
        b2 = getattr(layer, "w2_bias", None)
        want13 = (self.num_experts, 2 * self.intermediate, self.hidden)
        if tuple(w13.shape) != want13:
            raise ValueError(f"w13_weight: shape must be {list(want13)}, got {list(w13.shape)}")
        packed = _ops.prepack(w13, w2, s13, s2, b13, b2, isa=self.isa,
                              num_threads=self.num_threads)
        torch_mode = _is_torch(w13)
        self._set_packed(packed, torch_mode)
        del w13, w2, s13, s2, b13, b2
        for name in ("w13_weight", "w2_weight", s13_name, s2_name, "w13_bias", "w2_bias"):
            _free(layer, name)
        if torch_mode:
            _replace(layer, "w13_weight", self.handle)

    def _set_packed(self, packed: _ops.PackedMoe, torch_mode: bool) -> None:
        self.release()
        self.packed = packed
        if torch_mode:
            from . import torch_ops
            self.handle = torch_ops.register_packed(packed)
            self._op = _torch().ops.cpumoe.fused_moe_int8
            self._finalizer = weakref.finalize(self, torch_ops.release, self.handle)

    def load_packed(self, packed: _ops.PackedMoe, torch_mode: Optional[bool] = None) -> None:
        """Uses an already packed layer (e.g. from :mod:`cpumoe.checkpoint`). ``torch_mode``
        (default: torch is imported) makes ``apply`` go through the torch custom op."""
        if (packed.num_experts, packed.hidden, packed.intermediate) != (
                self.num_experts, self.hidden, self.intermediate):
            raise ValueError(f"packed: E, H, I = {packed.num_experts}, {packed.hidden}, "
                             f"{packed.intermediate}; this layer has {self.num_experts}, "
                             f"{self.hidden}, {self.intermediate}")
        self._set_packed(packed, _torch() is not None if torch_mode is None else torch_mode)

    def release(self) -> None:
        """Frees the packed weights held by this object (apply fails afterwards)."""
        if self._finalizer is not None:
            self._finalizer()  # releases the torch handle
            self._finalizer = None
        self.packed = None
        self.handle = None
        self._op = None

    # ------------------------------------------------------------------ forward
    def apply(self, hidden_states: Any, topk_weights: Any, topk_ids: Any, *,
              w1: Any = None, w2: Any = None, activation: Any = None, expert_map: Any = None,
              apply_router_weight_on_input: bool = False, output: Any = None) -> Any:
        """The layer's MoE output, [T, H] in hidden_states' dtype.

        hidden_states: [T, H] float32/float16/bfloat16 (torch or numpy); topk_weights float32
        [T, k]; topk_ids int32/int64 [T, k], local expert ids, or global ids with an expert map.
        w1: the handle (``layer.w13_weight`` after process_weights_after_loading) or None for
        this object's; w2 is ignored (vLLM's apply passes both). activation: default the
        layer's. expert_map: overrides the one set at construction (int32 [E_global]).
        apply_router_weight_on_input (k == 1 only): x is multiplied by its router weight (in
        x's dtype) before the experts, which then do not weight their output.
        output: optional [T, H] to write into.
        Inference only (no backward): with torch, call it under inference_mode()/no_grad().
        """
        del w2
        if self.packed is None:
            raise RuntimeError(f"{type(self).__name__}.apply: call "
                               f"process_weights_after_loading (or load_packed) first")
        act = self.activation if activation is None else _activation_name(activation)
        emap = self.expert_map if expert_map is None else expert_map
        x = hidden_states
        if apply_router_weight_on_input:
            if topk_ids.shape[1] != 1:
                raise ValueError("apply_router_weight_on_input: only with topk == 1")
            x = x * (topk_weights.to(x.dtype) if _is_torch(x) else topk_weights.astype(x.dtype))
        if _is_torch(x) and not isinstance(self.packed, _ops.PackedMoeW4):
            if self._op is None:
                raise RuntimeError("Int8Experts.apply: got torch tensors, but the weights were "
                                   "packed from numpy arrays (use load_packed(torch_mode=True))")
            handle = self.handle if w1 is None else w1
            torch = _torch()
            if emap is not None and not _is_torch(emap):
                emap = torch.from_numpy(np.ascontiguousarray(emap, dtype=np.int32))
            elif emap is not None and emap.dtype != torch.int32:
                emap = emap.to(torch.int32)
            skip = bool(apply_router_weight_on_input)
            if output is None:
                return torch.ops.cpumoe.fused_moe(x, handle, handle, handle, handle, None, None,
                                                  topk_weights, topk_ids, skip, act, "", emap)
            self._op(output, x, handle, handle, handle, handle, None, None, topk_weights,
                     topk_ids, skip, act, "", emap)
            return output
        return _ops.fused_moe_int8(x, self.packed, topk_weights, topk_ids, act,
                                   bool(apply_router_weight_on_input), out=output,
                                   expert_map=emap, num_threads=self.num_threads)

    __call__ = apply

    def __repr__(self) -> str:
        state = repr(self.packed) if self.packed is not None else "not loaded"
        return (f"{type(self).__name__}(H={self.hidden}, I={self.intermediate}, E={self.num_experts}, "
                f"k={self.topk}, {self.activation}, {state})")


class Int4Experts(Int8Experts):
    """Fused W4A8 MoE experts of one layer (int4 group-quantized weights, int8 activations):
    :class:`Int8Experts` with vLLM's compressed-tensors WNA16 MoE attribute names.

    ``process_weights_after_loading`` reads ``w13_weight_packed`` int32 [E, 2I, H / 8] and
    ``w2_weight_packed`` int32 [E, H, I / 8] (compressed-tensors' packing: eight 4-bit fields
    per word, element i at bits 4i, each the value + 8), ``w13_weight_scale`` [E, 2I, H / g],
    ``w2_weight_scale`` [E, H, I / g], optional ``w13_bias`` / ``w2_bias``.

    Args: as Int8Experts, plus ``group_size`` (g, from the checkpoint's config: a multiple of 32
    dividing H and I). With torch tensors ``apply`` calls :func:`cpumoe.fused_moe_int8`, which
    compiles as one custom op under torch.compile.
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int, topk: int,
                 activation: Any = "silu", *, group_size: int = 128, **kw):
        if not isinstance(group_size, int) or group_size < 32 or group_size % 32:
            raise ValueError(f"Int4Experts: group_size must be a positive multiple of 32, got "
                             f"{group_size!r}")
        self.group_size = group_size
        super().__init__(hidden, intermediate, num_experts, topk, activation, **kw)
        for name, dim in (("hidden", self.hidden), ("intermediate", self.intermediate)):
            if dim % group_size:
                raise ValueError(f"Int4Experts: {name} {dim} is not a multiple of group_size "
                                 f"{group_size}")

    def _default_scheme(self) -> Any:
        return {"weights": {"num_bits": 4, "type": "int", "symmetric": True,
                            "strategy": "group", "group_size": self.group_size}}

    @staticmethod
    def _scheme_reason(quant_scheme: Any) -> Optional[str]:
        if isinstance(quant_scheme, str):
            if quant_scheme.lower() in ("w4a8_int4", "int4", "w4a16"):
                return None
            return f"quant_scheme {quant_scheme!r} is not int4 (w4a8_int4, or a config group)"
        if isinstance(quant_scheme, dict):
            from .checkpoint_w4 import int4_scheme_problem
            return int4_scheme_problem(quant_scheme)
        return f"quant_scheme: expected a str or a config group dict, got " \
               f"{type(quant_scheme).__name__}"

    def process_weights_after_loading(self, layer: Any) -> None:
        """Unpacks and prepacks the layer's int4 weights once, then frees the loaded copies."""
        from .checkpoint_w4 import unpack_int4
        E, H, I, g = self.num_experts, self.hidden, self.intermediate, self.group_size
        torch_mode = _is_torch(getattr(layer, "w13_weight_packed"))
        arrays = {}
        for name, shape in (("w13_weight_packed", (E, 2 * I, H // 8)),
                            ("w2_weight_packed", (E, H, I // 8)),
                            ("w13_weight_scale", (E, 2 * I, H // g)),
                            ("w2_weight_scale", (E, H, I // g))):
            t = getattr(layer, name)
            if tuple(t.shape) != shape:
                raise ValueError(f"{name}: shape must be {list(shape)}, got {list(t.shape)}")
            a = t.detach().float().numpy() if name.endswith("scale") and torch_mode else (
                t.detach().numpy() if torch_mode else np.asarray(t))
            arrays[name] = a
        for name in ("w13_weight_packed", "w2_weight_packed"):
            if arrays[name].dtype != np.int32:
                raise TypeError(f"{name}: dtype must be int32, got {arrays[name].dtype}")
        v13 = unpack_int4(arrays["w13_weight_packed"].reshape(E * 2 * I, -1), H)
        v2 = unpack_int4(arrays["w2_weight_packed"].reshape(E * H, -1), I)
        packed = _ops.prepack_int4(v13.reshape(E, 2 * I, H), v2.reshape(E, H, I),
                                   arrays["w13_weight_scale"], arrays["w2_weight_scale"],
                                   getattr(layer, "w13_bias", None),
                                   getattr(layer, "w2_bias", None), group_size=g, isa=self.isa,
                                   num_threads=self.num_threads)
        self._set_packed(packed, torch_mode)
        del arrays, v13, v2
        for name in ("w13_weight_packed", "w2_weight_packed", "w13_weight_scale",
                     "w2_weight_scale", "w13_bias", "w2_bias"):
            _free(layer, name)

    def _set_packed(self, packed: Any, torch_mode: bool) -> None:
        self.release()
        self.packed = packed  # apply goes through cpumoe.fused_moe_int8 (no raw handle)


def _free(layer: Any, name: str) -> None:
    """Replaces layer.<name> (if set) with an empty tensor/array of the same dtype."""
    old = getattr(layer, name, None)
    if old is None:
        return
    if _is_torch(old):
        empty = old.new_empty((0,))
    else:
        empty = np.empty((0,), dtype=np.asarray(old).dtype)
    _replace(layer, name, empty)


def _replace(layer: Any, name: str, value: Any) -> None:
    torch = _torch()
    if torch is not None and isinstance(layer, torch.nn.Module) and _is_torch(value):
        if name in layer._parameters:
            layer._parameters[name] = torch.nn.Parameter(value, requires_grad=False)
            return
        if name in layer._buffers:
            layer._buffers[name] = value
            return
    setattr(layer, name, value)

