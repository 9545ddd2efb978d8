"""cpumoe as an experts backend of Hugging Face ``transformers`` (version 5 and later).

``import cpumoe.transformers`` registers four backends with transformers' own registry
(``transformers.integrations.moe.ExpertsInterface``)::

    import cpumoe.transformers
    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="cpumoe")
    out = model.generate(**inputs)

``"cpumoe"``
    W8A8: the fused ``gate_up_proj`` / ``down_proj`` weights of each experts module are quantized
    per output channel (symmetric int8, fp32 scales), packed with :func:`cpumoe.prepack` the
    first time the module runs (or at :func:`quantize`), and the float copies released; each
    call runs :func:`cpumoe.fused_moe_int8` (per-token int8 activations).
``"cpumoe_bf16"``
    :func:`cpumoe.fused_moe_bf16` on the model's weights (rounded to bf16 if the model is fp32),
    packed once (:func:`pack_bf16`); the float copies are released the same way.
``"cpumoe_int4"`` / ``"cpumoe_mxfp4"``
    W4A8: the experts quantized round-to-nearest to int4 (a scale per group of 128, else 64 or
    32 inputs: the first dividing H and I) or to MXFP4, packed at 4 bits per weight, run by
    :func:`cpumoe.fused_moe_int8` (per-token int8 activations). A gpt-oss model loaded from its
    MXFP4 checkpoint (transformers dequantizes the experts on a CPU) gets the checkpoint's
    values back exactly with ``"cpumoe_mxfp4"``: half the bytes of W8A8 and no extra error in
    the weights.

Any model whose experts class uses transformers' ``@use_experts_implementation`` works if its
experts are gated (a fused ``gate_up_proj``) and their gating is one of cpumoe's activations:
the gating is recognised by running the module's own ``_apply_gate`` on probe values, which
also tells whether gate and up are concatenated halves or interleaved, so Qwen2/3-MoE,
Mixtral, OLMoE, DeepSeek-V2/V3 (``act_fn`` silu) and gpt-oss (clamped swiglu with
alpha 1.702 and limit 7.0: cpumoe's ``swigluoai``) are taken as they are, biases included.
The router stays the model's (cpumoe gets its ``top_k_index`` / ``top_k_weights``), and so do
shared experts (DeepSeek's ``shared_experts`` are a separate MLP of the MoE block).

Experts cpumoe cannot take raise :class:`UnsupportedExperts` (a ValueError) naming the module
and the reason (an activation it lacks, H or I not a multiple of 8, no gate, expert
parallelism, a post-expert norm, non-float or non-CPU weights); there is no fallback.

:func:`load_w8a8` builds the model of a compressed-tensors W8A8 checkpoint with its experts read
from the int8 tensors straight into packed layers; :func:`load_w4a8` that of a compressed-tensors
int4 (pack-quantized) or gpt-oss MXFP4 checkpoint, the experts packed at 4 bits from the
checkpoint's codes and scales (no float copy of them: what lets a 4-bit model load in the memory
its 4-bit weights take).

Inference only: the backward of a cpumoe call raises. ``torch.compile`` of the model works
once its experts are packed (call :func:`quantize` / :func:`pack_bf16`, or run it once, before
compiling): the op is one node of the graph.
"""

from __future__ import annotations

import dataclasses
import gc
import re
from typing import Any, List, NoReturn, Optional, Tuple

import numpy as np
import torch
from transformers.integrations.moe import ExpertsInterface

from . import ops as _ops
from . import reference as _reference

__all__ = [
    "BACKENDS",
    "UnsupportedExperts",
    "experts_modules",
    "load_w4a8",
    "load_w8a8",
    "pack_bf16",
    "prepare",
    "quantize",
]

#: The experts_implementation names registered here, and the weight format each packs (int8,
#: int4 and mxfp4 run fused_moe_int8, bf16 fused_moe_bf16).
BACKENDS = {"cpumoe": "int8", "cpumoe_bf16": "bf16", "cpumoe_int4": "int4",
            "cpumoe_mxfp4": "mxfp4"}
#: cpumoe_int4's group sizes, the first that divides H and I taken.
INT4_GROUPS = (128, 64, 32)

_ALIGN = 8  # H and I: multiples of this (the op's requirement)
_STATE = "_cpumoe_state"  # attribute of an experts module: {kind: _State} of its packed layers


class UnsupportedExperts(ValueError):
    """An experts module cpumoe cannot run (the message names the module and the reason)."""


@dataclasses.dataclass
class _State:
    kind: str  # a value of BACKENDS
    packed: Any  # PackedMoe, PackedMoeBf16 or PackedMoeW4
    activation: str
    name: str
    float_released: bool


# ---------------------------------------------------------------------------- naming
def _module_name(module: torch.nn.Module) -> str:
    """The dotted path of ``module`` in the model that holds it, found through the parents'
    ``_modules`` dicts (only used to name a module in an error: a gc walk, not fast)."""
    parts: List[str] = []
    node = module
    seen = set()
    while id(node) not in seen:
        seen.add(id(node))
        parent = None
        for ref in gc.get_referrers(node):
            if not isinstance(ref, dict):
                continue
            for owner in gc.get_referrers(ref):
                owner_mod = owner if isinstance(owner, torch.nn.Module) else None
                if owner_mod is None and isinstance(owner, dict):
                    owner_mod = next((o for o in gc.get_referrers(owner)
                                      if isinstance(o, torch.nn.Module)
                                      and o.__dict__ is owner), None)
                if owner_mod is not None and owner_mod._modules is ref:
                    key = next(k for k, v in ref.items() if v is node)
                    parts.append(key)
                    parent = owner_mod
                    break
            if parent is not None:
                break
        if parent is None:
            break
        node = parent
    path = ".".join(reversed(parts))
    return f"{path} ({type(module).__name__})" if path else type(module).__name__


def _fail(module: torch.nn.Module, name: Optional[str], reason: str) -> NoReturn:
    raise UnsupportedExperts(f"cpumoe cannot take the experts {name or _module_name(module)}: "
                             f"{reason}")


# ---------------------------------------------------------------------------- the layout
def _probe_gating(module: torch.nn.Module, inter: int) -> Optional[Tuple[str, bool]]:
    """(cpumoe activation, gate/up interleaved) that reproduce the module's ``_apply_gate``, or
    None. Probe gate/up values span [-9, 9], past gpt-oss's clamp limit (7), so its constants
    must agree too."""
    gen = torch.Generator().manual_seed(1234)
    rows = 16
    g = (torch.rand(rows, inter, generator=gen) * 18 - 9).float()
    u = (torch.rand(rows, inter, generator=gen) * 18 - 9).float()
    halves = torch.cat([g, u], dim=1)
    inter_l = torch.stack([g, u], dim=2).reshape(rows, 2 * inter)  # gate even, up odd
    for interleaved, h in ((False, halves), (True, inter_l)):
        try:
            with torch.no_grad():
                got = module._apply_gate(h.clone())
        except Exception:  # noqa: BLE001 - a gate that does not take this layout
            continue
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != (rows, inter):
            continue
        got = got.float().numpy()
        for act in _ops.ACTIVATIONS:
            h_op = inter_l if act == "swigluoai" else halves  # the op's own layout per act
            want = _reference._activation(act, h_op.numpy(), inter)
            if np.allclose(got, want, rtol=1e-4, atol=1e-5):
                return act, interleaved
    return None


def _row_order(inter: int, src_interleaved: bool, dst_interleaved: bool):
    """Index of w13's rows taking the source gate/up order to the op's (None: same order)."""
    if src_interleaved == dst_interleaved:
        return None
    i = torch.arange(inter)
    if dst_interleaved:  # halves -> gate0, up0, gate1, up1, ...
        return torch.stack([i, i + inter], dim=1).reshape(-1)
    return torch.cat([2 * i, 2 * i + 1])  # interleaved -> gate rows, then up rows


@dataclasses.dataclass
class _Layout:
    E: int
    H: int
    I: int
    activation: str
    order: Optional[torch.Tensor]
    transposed: bool
    has_bias: bool


def _layout(module: torch.nn.Module, name: Optional[str], meta_ok: bool = False) -> _Layout:
    """Checks that cpumoe can take the module's experts and how its weights map to the op's
    (meta_ok: shapes only, the weights come from a checkpoint)."""
    if not getattr(module, "has_gate", True) or not hasattr(module, "gate_up_proj"):
        _fail(module, name, "its experts have no gate (no fused gate_up_proj); cpumoe's op is a "
                            "gated MLP")
    if getattr(module, "has_post_expert_norm", False):
        _fail(module, name, "a norm after each expert (has_post_expert_norm) is not supported")
    if getattr(module, "_is_expert_parallel", False):
        _fail(module, name, "expert parallelism (sentinel expert ids) is not supported")
    gu, dn = module.gate_up_proj, getattr(module, "down_proj", None)
    for pname, t in (("gate_up_proj", gu), ("down_proj", dn)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            _fail(module, name, f"{pname} is not a 3-D [E, ., .] tensor (got "
                                f"{type(t).__name__} {list(getattr(t, 'shape', []))})")
        if t.device.type != "cpu" and not (meta_ok and t.device.type == "meta"):
            _fail(module, name, f"{pname} is on {t.device}, not the CPU")
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            _fail(module, name, f"{pname} has dtype {t.dtype}; cpumoe packs float32/bfloat16/"
                                f"float16 weights (already quantized experts are not supported)")
    transposed = bool(getattr(module, "is_transposed", False))
    E, a, b = gu.shape
    I2, H = (b, a) if transposed else (a, b)
    if I2 % 2:
        _fail(module, name, f"gate_up_proj has an odd gate+up width {I2}")
    I = I2 // 2
    want_dn = (E, I, H) if transposed else (E, H, I)
    if tuple(dn.shape) != want_dn:
        _fail(module, name, f"down_proj has shape {list(dn.shape)}, expected {list(want_dn)}")
    if H % _ALIGN or I % _ALIGN:
        _fail(module, name, f"hidden size H = {H} and intermediate size I = {I} must be "
                            f"multiples of {_ALIGN}")
    probe = _probe_gating(module, I)
    if probe is None:
        act = getattr(module, "act_fn", None)
        what = f"act_fn {type(act).__name__}" if act is not None else "its _apply_gate"
        _fail(module, name, f"its gating ({what}) matches none of cpumoe's activations "
                            f"({', '.join(_ops.ACTIVATIONS)}, gate/up halves or interleaved)")
    activation, interleaved = probe
    has_bias = bool(getattr(module, "has_bias", False))
    if has_bias:
        b13, b2 = getattr(module, "gate_up_proj_bias", None), getattr(module, "down_proj_bias",
                                                                      None)
        if (not isinstance(b13, torch.Tensor) or tuple(b13.shape) != (E, 2 * I)
                or not isinstance(b2, torch.Tensor) or tuple(b2.shape) != (E, H)):
            _fail(module, name, f"biases must be gate_up_proj_bias [E, 2I] = [{E}, {2 * I}] and "
                                f"down_proj_bias [E, H] = [{E}, {H}]")
    order = _row_order(I, interleaved, activation == "swigluoai")
    return _Layout(E, H, I, activation, order, transposed, has_bias)


def _w13_of(module: torch.nn.Module, lay: _Layout, e: int) -> torch.Tensor:
    """Expert e's gate+up weights [2I, H] in the op's row order."""
    w = module.gate_up_proj[e]
    w = w.t() if lay.transposed else w
    return w if lay.order is None else w[lay.order]


def _w2_of(module: torch.nn.Module, lay: _Layout, e: int) -> torch.Tensor:
    w = module.down_proj[e]
    return w.t() if lay.transposed else w


def _biases(module: torch.nn.Module, lay: _Layout):
    if not lay.has_bias:
        return None, None
    b13 = module.gate_up_proj_bias.detach().float()
    b13 = b13 if lay.order is None else b13[:, lay.order]
    return b13.contiguous(), module.down_proj_bias.detach().float().contiguous()


def _quantize_rows(w: torch.Tensor):
    """Symmetric per-row int8 (amax / 127, round half to even), as cpumoe.reference does."""
    w = w.float()
    amax = w.abs().amax(dim=-1)
    s = torch.clamp(amax, min=_reference.CHANNEL_AMAX_FLOOR) / 127.0
    q = torch.round(w / s[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, s


def _pack_w4(module: torch.nn.Module, lay: _Layout, kind: str, name: Optional[str], b13,
             b2) -> Any:
    """W4A8: the experts round-to-nearest quantized to int4 (symmetric, a scale per group of
    INT4_GROUPS' first size dividing H and I) or to MXFP4 (cpumoe.reference's quantizers), one
    expert at a time, then packed. A model loaded from an MXFP4 checkpoint (transformers
    dequantizes gpt-oss's experts on a CPU) gets its checkpoint's values back exactly."""
    E, H, I = lay.E, lay.H, lay.I
    if kind == "mxfp4":
        if H % 32 or I % 32:
            _fail(module, name, f"MXFP4 needs H = {H} and I = {I} to be multiples of 32")
        q13 = torch.empty((E, 2 * I, H // 32, 16), dtype=torch.uint8)
        t13 = torch.empty((E, 2 * I, H // 32), dtype=torch.uint8)
        q2 = torch.empty((E, H, I // 32, 16), dtype=torch.uint8)
        t2 = torch.empty((E, H, I // 32), dtype=torch.uint8)
        for e in range(E):
            q13[e], t13[e] = _reference.quantize_mxfp4(_w13_of(module, lay, e).float())
            q2[e], t2[e] = _reference.quantize_mxfp4(_w2_of(module, lay, e).float())
        return _ops.prepack_mxfp4(q13, t13, q2, t2, b13, b2)
    g = next((g for g in INT4_GROUPS if H % g == 0 and I % g == 0), None)
    if g is None:
        _fail(module, name, f"none of the int4 group sizes {', '.join(map(str, INT4_GROUPS))} "
                            f"divides both H = {H} and I = {I}")
    q13 = torch.empty((E, 2 * I, H), dtype=torch.int8)
    t13 = torch.empty((E, 2 * I, H // g), dtype=torch.float32)
    q2 = torch.empty((E, H, I), dtype=torch.int8)
    t2 = torch.empty((E, H, I // g), dtype=torch.float32)
    for e in range(E):
        q13[e], t13[e] = _reference.quantize_int4(_w13_of(module, lay, e).float(), g)
        q2[e], t2[e] = _reference.quantize_int4(_w2_of(module, lay, e).float(), g)
    return _ops.prepack_int4(q13, q2, t13, t2, b13, b2, group_size=g)


def _states(module: torch.nn.Module) -> dict:
    """kind -> _State of the module's packed layers (one per op it was packed for)."""
    return getattr(module, _STATE, None) or {}


def _released_by(module: torch.nn.Module) -> Optional[_State]:
    return next((s for s in _states(module).values() if s.float_released), None)


def _pack(module: torch.nn.Module, kind: str, name: Optional[str], keep_float: bool) -> _State:
    st = _states(module).get(kind)
    if st is not None:
        return st
    gone = _released_by(module)
    if gone is not None:
        _fail(module, name or gone.name, f"its float weights were released when it was packed "
                                         f"for the {gone.kind} op; load the model again (or "
                                         f"pack with keep_float_weights=True) to use another "
                                         f"cpumoe backend")
    lay = _layout(module, name)
    E, H, I = lay.E, lay.H, lay.I
    b13, b2 = _biases(module, lay)
    with torch.no_grad():
        if kind == "int8":
            w13 = torch.empty((E, 2 * I, H), dtype=torch.int8)
            w2 = torch.empty((E, H, I), dtype=torch.int8)
            s13 = torch.empty((E, 2 * I), dtype=torch.float32)
            s2 = torch.empty((E, H), dtype=torch.float32)
            for e in range(E):  # one expert at a time: no float32 copy of the whole layer
                w13[e], s13[e] = _quantize_rows(_w13_of(module, lay, e))
                w2[e], s2[e] = _quantize_rows(_w2_of(module, lay, e))
            packed = _ops.prepack(w13, w2, s13, s2, b13, b2)
            del w13, w2
        elif kind == "bf16":
            w13 = torch.empty((E, 2 * I, H), dtype=torch.bfloat16)
            w2 = torch.empty((E, H, I), dtype=torch.bfloat16)
            for e in range(E):
                w13[e] = _w13_of(module, lay, e)
                w2[e] = _w2_of(module, lay, e)
            packed = _ops.prepack_bf16(w13, w2, b13, b2)
            del w13, w2
        else:
            packed = _pack_w4(module, lay, kind, name, b13, b2)
    state = _State(kind, packed, lay.activation, name or "", not keep_float)
    if not keep_float:
        for pname in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
            old = module._parameters.get(pname)
            if old is not None:
                module._parameters[pname] = torch.nn.Parameter(old.new_empty((0,)),
                                                               requires_grad=False)
    object.__setattr__(module, _STATE, {**_states(module), kind: state})
    return state


# ---------------------------------------------------------------------------- the backends
class _InferenceOnly(torch.autograd.Function):
    """Gives a cpumoe output a grad_fn whose backward raises (instead of gradients that would
    silently miss the experts)."""

    @staticmethod
    def forward(ctx, x, run):
        return run(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("cpumoe experts backends are inference-only (no backward); run the "
                           "model under torch.no_grad() / torch.inference_mode(), or train with "
                           "another experts_implementation")


def _forward(module, hidden_states, top_k_index, top_k_weights, kind, op):
    st = _states(module).get(kind)
    if st is None:
        if torch.compiler.is_compiling():
            raise RuntimeError("cpumoe: pack the experts before torch.compile (call "
                               "cpumoe.transformers.quantize(model) / pack_bf16(model), or run "
                               "the model once)")
        st = _pack(module, kind, None, keep_float=False)
    x = hidden_states
    flat = x.dim() != 2  # the MoE blocks pass [T, H]; anything else is flattened and restored
    shape = x.shape
    if flat:
        x = x.reshape(-1, shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    ids, tw = top_k_index, top_k_weights
    if ids.dim() != 2:
        ids = ids.reshape(x.shape[0], -1)
    if ids.dtype not in (torch.int32, torch.int64):
        ids = ids.to(torch.int64)
    if tw.dim() != 2:
        tw = tw.reshape(x.shape[0], -1)
    tw = tw.to(torch.float32).contiguous()  # the op's router weights: fp32 (often bf16 here)
    ids = ids.contiguous()

    def run(x_):
        return op(x_, st.packed, tw, ids, st.activation)

    if x.requires_grad and torch.is_grad_enabled() and not torch.compiler.is_compiling():
        out = _InferenceOnly.apply(x, run)
    else:
        out = run(x)
    return out.reshape(shape) if flat else out


def _forward_int8(self, hidden_states, top_k_index, top_k_weights):
    return _forward(self, hidden_states, top_k_index, top_k_weights, "int8", _ops.fused_moe_int8)


def _forward_bf16(self, hidden_states, top_k_index, top_k_weights):
    return _forward(self, hidden_states, top_k_index, top_k_weights, "bf16", _ops.fused_moe_bf16)


def _forward_int4(self, hidden_states, top_k_index, top_k_weights):
    return _forward(self, hidden_states, top_k_index, top_k_weights, "int4", _ops.fused_moe_int8)


def _forward_mxfp4(self, hidden_states, top_k_index, top_k_weights):
    return _forward(self, hidden_states, top_k_index, top_k_weights, "mxfp4",
                    _ops.fused_moe_int8)


ExpertsInterface.register("cpumoe", _forward_int8)
ExpertsInterface.register("cpumoe_bf16", _forward_bf16)
ExpertsInterface.register("cpumoe_int4", _forward_int4)
ExpertsInterface.register("cpumoe_mxfp4", _forward_mxfp4)


# ---------------------------------------------------------------------------- whole models
def experts_modules(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
    """(name, module) of each experts module of ``model`` that dispatches through the
    ExpertsInterface (the classes decorated with ``@use_experts_implementation``)."""
    return [(n, m) for n, m in model.named_modules()
            if hasattr(m, "is_concatenated") and hasattr(m, "_is_expert_parallel")
            and hasattr(m, "_apply_gate")]


def prepare(model: torch.nn.Module, backend: str = "cpumoe", *,
            keep_float_weights: bool = False) -> List[str]:
    """Packs every experts module of ``model`` for ``backend`` (a key of BACKENDS) now
    (instead of at their first call) and switches the model to it
    (``model.set_experts_implementation``). Returns the names of the packed modules.

    keep_float_weights: keep the float ``gate_up_proj`` / ``down_proj`` (by default they are
    released: the packed copy is all the backend needs; the model then runs only with this
    backend). Raises UnsupportedExperts (naming the module) before changing anything if one of
    the modules cannot be taken.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: one of {', '.join(BACKENDS)}; got {backend!r}")
    kind = BACKENDS[backend]
    mods = experts_modules(model)
    if not mods:
        raise UnsupportedExperts(f"{type(model).__name__}: no experts module dispatching "
                                 f"through transformers' ExpertsInterface")
    for name, m in mods:  # all checks first: no half-converted model on error
        if kind not in _states(m):
            gone = _released_by(m)
            if gone is not None:
                _fail(m, name, f"its float weights were released when it was packed for the "
                               f"{gone.kind} op")
            _layout(m, name)
    for name, m in mods:
        _pack(m, kind, name, keep_float_weights)
    if getattr(model.config, "_experts_implementation", None) != backend:
        model.set_experts_implementation(backend)
    return [n for n, _ in mods]


def quantize(model: torch.nn.Module, *, keep_float_weights: bool = False) -> List[str]:
    """W8A8: quantizes and packs every experts module for the "cpumoe" backend (see
    :func:`prepare`)."""
    return prepare(model, "cpumoe", keep_float_weights=keep_float_weights)


def pack_bf16(model: torch.nn.Module, *, keep_float_weights: bool = False) -> List[str]:
    """Packs every experts module for the "cpumoe_bf16" backend (see :func:`prepare`)."""
    return prepare(model, "cpumoe_bf16", keep_float_weights=keep_float_weights)


# ---------------------------------------------------------------------------- W8A8 checkpoints
_EXPERT_PARAMS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


# The checkpoint names a model tensor may have besides its own: Mixtral's original MoE block
# name (transformers renames ".block_sparse_moe." to ".mlp." when it loads such checkpoints).
_CHECKPOINT_ALIASES = ((".mlp.", ".block_sparse_moe."),)


def _checkpoint_name(ck, key: str) -> Optional[str]:
    """The checkpoint's name of the model tensor ``key`` (an int4 Linear's ``.weight`` is there
    as ``.weight_packed``, which load_float_tensor dequantizes), or None."""
    def there(name: str) -> bool:
        return name in ck or (name.endswith(".weight") and name + "_packed" in ck)
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
    from . import checkpoint as _ck
    ck = _ck.Checkpoint(path)
    if (ck.quantization_config or {}).get("quant_method") != "compressed-tensors":
        raise _ck.UnsupportedCheckpoint(f"{path}: config.json has no compressed-tensors "
                                        f"quantization_config")
    return _load_quantized(ck, "int8", dtype, model_class)


def load_w4a8(path, *, dtype: torch.dtype = torch.bfloat16, model_class: Any = None):
    """A model of a 4-bit MoE checkpoint with its experts packed at 4 bits, as
    :func:`load_w8a8` does for W8A8 (the experts never exist in float: a bf16 copy would take
    four times their bytes), on the backend of the checkpoint's format:

    - ``"cpumoe_int4"``: a compressed-tensors int4 checkpoint (``format: pack-quantized``,
      symmetric group scales: llm-compressor's W4A16, or W4A8), the experts read by
      :func:`cpumoe.checkpoint_w4.load_int4_moe_layer` with the config's group size; other
      int4 Linears (attention, if the recipe quantized it) dequantized into ``dtype``;
    - ``"cpumoe_mxfp4"``: a gpt-oss MXFP4 checkpoint (``quant_method: mxfp4``, the release
      layout), read by :func:`cpumoe.checkpoint_w4.load_mxfp4_moe_layer`.

    The experts run W4A8 (:func:`cpumoe.fused_moe_int8`: per-token int8 activations, also for
    a W4A16 checkpoint). Raises UnsupportedCheckpoint (a ValueError) for another format or a
    missing tensor, UnsupportedExperts for experts cpumoe cannot take.
    """
    from . import checkpoint as _ck
    ck = _ck.Checkpoint(path)
    method = (ck.quantization_config or {}).get("quant_method")
    if method not in ("compressed-tensors", "mxfp4"):
        raise _ck.UnsupportedCheckpoint(f"{path}: config.json's quantization_config is not "
                                        f"compressed-tensors int4 or mxfp4 (quant_method "
                                        f"{method!r})")
    return _load_quantized(ck, "mxfp4" if method == "mxfp4" else "int4", dtype, model_class)


def _experts_of_checkpoint(ck, kind: str, layer: int, lay: _Layout, name: str):
    """One layer's routed experts read from the checkpoint, in the form whose ``prepack``
    packs them (shapes checked against the model's experts module)."""
    from . import checkpoint as _ck
    from . import checkpoint_w4 as _ck4
    if kind == "int8":
        w = _ck.load_moe_layer(ck, layer, activation=lay.activation)
    elif kind == "int4":
        w = _ck4.load_int4_moe_layer(ck, layer, activation=lay.activation)
    else:
        w = _ck4.load_mxfp4_moe_layer(ck, layer)
        if w.activation != lay.activation:
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


def _load_quantized(ck, kind: str, dtype: torch.dtype, model_class: Any):
    """load_w8a8 / load_w4a8: the model built on the meta device, each experts module packed
    from the checkpoint (``kind``: int8, int4 or mxfp4), the other tensors copied in."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from . import checkpoint as _ck
    backend = next(b for b, k in BACKENDS.items() if k == kind)
    config = AutoConfig.from_pretrained(str(ck.root))
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # cpumoe runs the experts; the rest is dequantized
    cls = model_class or AutoModelForCausalLM
    with torch.device("meta"):
        model = cls.from_config(config, experts_implementation=backend, dtype=dtype)
    mods = experts_modules(model)
    if not mods:
        raise UnsupportedExperts(f"{type(model).__name__}: no experts module dispatching "
                                 f"through transformers' ExpertsInterface")
    skip = set()
    for name, m in mods:
        lay = _layout(m, name, meta_ok=True)
        found = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
        if found is None:
            _fail(m, name, "no decoder layer index in its name (expected ...layers.<L>....)")
        w = _experts_of_checkpoint(ck, kind, int(found.group(1)), lay, name)
        packed = w.prepack()
        del w
        for pname in _EXPERT_PARAMS:
            if m._parameters.get(pname) is not None:
                m._parameters[pname] = torch.nn.Parameter(torch.empty((0,), dtype=dtype),
                                                          requires_grad=False)
                skip.add(f"{name}.{pname}")
        object.__setattr__(m, _STATE, {kind: _State(kind, packed, lay.activation, name, True)})
    model.to_empty(device="cpu")
    model.initialize_weights()  # non-persistent buffers (rotary inv_freq), recomputed
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    missing = []
    with torch.no_grad():
        for key, t in model.state_dict().items():
            if key in skip:
                continue
            src = _checkpoint_name(ck, key)
            if src is None and key in tied:
                continue  # tied to another tensor (tie_weights below)
            if src is None:
                missing.append(key)
                continue
            arr = _ck.load_float_tensor(ck, src)
            if tuple(arr.shape) != tuple(t.shape):
                raise _ck.UnsupportedCheckpoint(f"{key}: shape {list(arr.shape)} in the "
                                                f"checkpoint, {list(t.shape)} in the model")
            t.copy_(torch.from_numpy(arr))
    if missing:
        raise _ck.UnsupportedCheckpoint(f"checkpoint: missing {len(missing)} tensor(s) of the "
                                        f"model: {', '.join(missing[:8])}")
    model.tie_weights()
    return model.eval()
