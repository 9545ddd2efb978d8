"""Which experts modules cpumoe takes, and how their weights map to the op's: the gating found
by probing the module's own ``_apply_gate``, the gate/up row order, transposed weights, biases;
errors name the module."""

from __future__ import annotations

import dataclasses
import gc
from typing import List, NoReturn, Optional, Tuple

import numpy as np
import torch

from .. import ops as _ops
from .. import reference as _reference

_ALIGN = 8  # H and I: multiples of this (the op's requirement)


class UnsupportedExperts(ValueError):
    """An experts module cpumoe cannot run (the message names the module and the reason)."""


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
