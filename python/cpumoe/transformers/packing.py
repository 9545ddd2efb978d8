"""An experts module's packed layers, one per weight format (int8, bf16, int4, mxfp4): made
from its float weights one expert at a time, kept on the module, its float weights released
unless asked to keep them."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from .. import ops as _ops
from .. import quantize as _quantize
from .layout import biases_of, refuse, Layout, layout_of, w2_of, w13_of

#: The experts_implementation names registered here, and the weight format each packs: one per
#: format of the extension's table (cpumoe.FORMATS), "cpumoe" for int8, "cpumoe_<format>" else.
BACKENDS = {("cpumoe" if f == "int8" else f"cpumoe_{f}"): f for f in _ops.FORMATS}
#: cpumoe_int4's group sizes, the first that divides H and I taken.
INT4_GROUPS = (128, 64, 32)

#: Attribute of an experts module: {kind: PackedState} of its packed layers.
STATE_ATTR = "_cpumoe_state"
# The experts module's float parameters, released once packed.
EXPERT_PARAMS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


@dataclasses.dataclass
class PackedState:
    kind: str  # a value of BACKENDS
    packed: Any  # PackedMoe, PackedMoeBf16 or PackedMoeW4
    activation: str
    name: str
    float_released: bool


def _quantize_rows(w: torch.Tensor):
    """Symmetric per-row int8 (amax / 127, round half to even), as cpumoe.reference does."""
    w = w.float()
    amax = w.abs().amax(dim=-1)
    s = torch.clamp(amax, min=_quantize.CHANNEL_AMAX_FLOOR) / 127.0
    q = torch.round(w / s[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, s


def _pack_w4(module: torch.nn.Module, lay: Layout, kind: str, name: Optional[str], b13,
             b2) -> Any:
    """W4A8: the experts round-to-nearest quantized to int4 (symmetric, a scale per group of
    INT4_GROUPS' first size dividing H and I) or to MXFP4 (cpumoe.reference's quantizers), one
    expert at a time, then packed. A model loaded from an MXFP4 checkpoint (transformers
    dequantizes gpt-oss's experts on a CPU) gets its checkpoint's values back exactly."""
    E, H, I = lay.E, lay.H, lay.I
    if kind == "mxfp4":
        if H % 32 or I % 32:
            refuse(module, name, f"MXFP4 needs H = {H} and I = {I} to be multiples of 32")
        q13 = torch.empty((E, 2 * I, H // 32, 16), dtype=torch.uint8)
        t13 = torch.empty((E, 2 * I, H // 32), dtype=torch.uint8)
        q2 = torch.empty((E, H, I // 32, 16), dtype=torch.uint8)
        t2 = torch.empty((E, H, I // 32), dtype=torch.uint8)
        for e in range(E):
            q13[e], t13[e] = _quantize.quantize_mxfp4(w13_of(module, lay, e).float())
            q2[e], t2[e] = _quantize.quantize_mxfp4(w2_of(module, lay, e).float())
        return _ops.prepack_mxfp4(q13, t13, q2, t2, b13, b2)
    if kind != "int4":  # a format of the table whose quantizer is not written here yet
        refuse(module, name, f"no packer for weight format {kind} in cpumoe.transformers")
    g = next((g for g in INT4_GROUPS if H % g == 0 and I % g == 0), None)
    if g is None:
        refuse(module, name, f"none of the int4 group sizes {', '.join(map(str, INT4_GROUPS))} "
                            f"divides both H = {H} and I = {I}")
    q13 = torch.empty((E, 2 * I, H), dtype=torch.int8)
    t13 = torch.empty((E, 2 * I, H // g), dtype=torch.float32)
    q2 = torch.empty((E, H, I), dtype=torch.int8)
    t2 = torch.empty((E, H, I // g), dtype=torch.float32)
    for e in range(E):
        q13[e], t13[e] = _quantize.quantize_int4(w13_of(module, lay, e).float(), g)
        q2[e], t2[e] = _quantize.quantize_int4(w2_of(module, lay, e).float(), g)
    return _ops.prepack_int4(q13, q2, t13, t2, b13, b2, group_size=g)


def states(module: torch.nn.Module) -> dict:
    """kind -> PackedState of the module's packed layers (one per op it was packed for)."""
    return getattr(module, STATE_ATTR, None) or {}


def released_by(module: torch.nn.Module) -> Optional[PackedState]:
    return next((s for s in states(module).values() if s.float_released), None)


def pack_module(module: torch.nn.Module, kind: str, name: Optional[str],
                keep_float: bool) -> PackedState:
    st = states(module).get(kind)
    if st is not None:
        return st
    gone = released_by(module)
    if gone is not None:
        refuse(module, name or gone.name, f"its float weights were released when it was packed "
                                         f"for the {gone.kind} op; load the model again (or "
                                         f"pack with keep_float_weights=True) to use another "
                                         f"cpumoe backend")
    lay = layout_of(module, name)
    E, H, I = lay.E, lay.H, lay.I
    b13, b2 = biases_of(module, lay)
    with torch.no_grad():
        if kind == "int8":
            w13 = torch.empty((E, 2 * I, H), dtype=torch.int8)
            w2 = torch.empty((E, H, I), dtype=torch.int8)
            s13 = torch.empty((E, 2 * I), dtype=torch.float32)
            s2 = torch.empty((E, H), dtype=torch.float32)
            for e in range(E):  # one expert at a time: no float32 copy of the whole layer
                w13[e], s13[e] = _quantize_rows(w13_of(module, lay, e))
                w2[e], s2[e] = _quantize_rows(w2_of(module, lay, e))
            packed = _ops.prepack(w13, w2, s13, s2, b13, b2)
            del w13, w2
        elif kind == "bf16":
            w13 = torch.empty((E, 2 * I, H), dtype=torch.bfloat16)
            w2 = torch.empty((E, H, I), dtype=torch.bfloat16)
            for e in range(E):
                w13[e] = w13_of(module, lay, e)
                w2[e] = w2_of(module, lay, e)
            packed = _ops.prepack_bf16(w13, w2, b13, b2)
            del w13, w2
        else:
            packed = _pack_w4(module, lay, kind, name, b13, b2)
    state = PackedState(kind, packed, lay.activation, name or "", not keep_float)
    if not keep_float:
        for pname in EXPERT_PARAMS:
            old = module._parameters.get(pname)
            if old is not None:
                module._parameters[pname] = torch.nn.Parameter(old.new_empty((0,)),
                                                               requires_grad=False)
    object.__setattr__(module, STATE_ATTR, {**states(module), kind: state})
    return state
