"""An experts module's packed layers, one per weight format of cpumoe.FORMATS: made
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
#: The group sizes tried, in order, for a format whose group may be chosen: the first that
#: divides H and I is taken.
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


def _pack_quantized(module: torch.nn.Module, lay: Layout, kind: str, name: Optional[str],
                    b13, b2) -> Any:
    """Any other format of the table: the experts round-to-nearest quantized by
    cpumoe.quantize (its group: INT4_GROUPS' first size the format allows that divides H and I,
    or the format's fixed block), one expert at a time, then packed. A model transformers
    dequantized from a checkpoint in the format (a gpt-oss MXFP4 checkpoint on a CPU) gets the
    checkpoint's values back exactly."""
    if kind not in _quantize.quantized_formats():
        refuse(module, name, f"no quantizer for weight format {kind} in cpumoe.quantize")
    groups = _quantize.group_sizes(kind, lay.H, lay.I, preferred=INT4_GROUPS)
    if not groups:
        refuse(module, name, f"{kind} needs a group size that divides both H = {lay.H} and "
                             f"I = {lay.I} (tried {', '.join(map(str, INT4_GROUPS))} and the "
                             f"format's own)")
    q = _quantize.quantize_experts(
        kind, lambda e: w13_of(module, lay, e).float(), lambda e: w2_of(module, lay, e).float(),
        group_size=groups[0], b13=b13, b2=b2, num_experts=lay.E)
    return q.prepack()


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
            packed = _pack_quantized(module, lay, kind, name, b13, b2)
    state = PackedState(kind, packed, lay.activation, name or "", not keep_float)
    if not keep_float:
        for pname in EXPERT_PARAMS:
            old = module._parameters.get(pname)
            if old is not None:
                module._parameters[pname] = torch.nn.Parameter(old.new_empty((0,)),
                                                               requires_grad=False)
    object.__setattr__(module, STATE_ATTR, {**states(module), kind: state})
    return state
