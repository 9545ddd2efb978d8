"""Which experts modules cpumoe takes, and how their weights map to the op's: the gating (the
activations and parameters the module declares, confirmed by probing its own ``_apply_gate``),
the gate/up row order, transposed weights, biases; errors name the module."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import math
from typing import Dict, List, NoReturn, Optional, Tuple

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


def refuse(module: torch.nn.Module, name: Optional[str], reason: str) -> NoReturn:
    raise UnsupportedExperts(f"cpumoe cannot take the experts {name or _module_name(module)}: "
                             f"{reason}")


# ---------------------------------------------------------------------------- the gating
# The module attributes (then its config's) that declare each parameter of an activation: what
# gpt-oss, MiniMax-M3, DeepSeek-V4, GLM5-Next, HY-V4 and Step3p7 read in their _apply_gate.
_DECLARED = {"limit": ("limit", "swiglu_limit"), "alpha": ("alpha", "swiglu_alpha")}
# A probe point matches when |got - want| <= _PROBE_C * eps * (|want| + |g| * (|u| + 1)), eps
# that of the probe's dtype, want the float64 reference on the same (dtype-rounded) inputs. A
# correct gate rounds its output (eps/2 |want|) and a few intermediates: act(g) before the
# product with u, 1 + erf / 1 + tanh cancelling for negative g (eps/2 |g| |u| each), a sigmoid of
# a rounded argument (|x| sigmoid'(x) <= 0.23: eps/8 |g| (|u| + 1)); together under
# 2 eps (|want| + |g| (|u| + 1)), so 4 leaves room for a few ulps of torch's exp / erf / tanh. A
# clamp the candidate lacks (or has at another limit) moves the output by about 32 eps |want| at
# the points just past the limit (hence L (1 + 32 eps)) and by |g| or |u| itself further out.
_PROBE_C = 4.0
_PROBE_MODERATE = (1.0, -1.0, 3.3, -3.3)  # where the other input of a pair sits
_PROBE_DECADES = (-3, 4)  # |values| from 1e-3 to 1e4, 4 per decade


def _declared(module: torch.nn.Module) -> Dict[str, List[float]]:
    """Parameter -> the distinct values the module, then its config, declares (Step3p7's
    float("inf") included: it clamps nothing)."""
    out: Dict[str, List[float]] = {}
    for param, attrs in _DECLARED.items():
        vals: List[float] = []
        for owner in (module, getattr(module, "config", None)):
            for attr in attrs:
                v = getattr(owner, attr, None) if owner is not None else None
                if isinstance(v, torch.Tensor) and v.numel() == 1:
                    v = v.item()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v) \
                        and float(v) not in vals:
                    vals.append(float(v))
        out[param] = vals
    return out


def _candidates(declared: Dict[str, List[float]]) -> List[str]:
    """The activation specs the module may compute: cpumoe's activations without parameters
    first (so a Step3p7 layer with limit inf is plain silu), then each parameterized one with
    every combination of the declared values (a parameter not declared: its default, if it has
    one); a clamp only with a declared limit."""
    plain, params = [], []
    for act in _ops.activations():
        names = list(act["params"])
        if not names:
            plain.append(act["name"])
            continue
        if "limit" in names and not declared.get("limit"):
            continue
        choices = [declared.get(p) or ([] if d is None else [d]) for p, d in act["params"].items()]
        for combo in itertools.product(*choices):
            try:
                params.append(_ops.activation_spec(act["name"], **dict(zip(names, combo))))
            except (TypeError, ValueError):  # a declared value the op refuses (limit <= 0)
                continue
    return list(dict.fromkeys(plain + params))  # declared twice (limit, swiglu_limit): once


def _probe_pairs(limits: List[float], dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """Probe (gate, up) values in ``dtype``: the gate over both signs of 1e-3 .. 1e4
    (log-spaced) and of points around each finite declared limit L (L (1 +- 32 eps), L / 2, 2 L)
    with up at moderate values, then the same with the roles swapped."""
    eps = torch.finfo(dtype).eps
    mags = list(np.logspace(*_PROBE_DECADES, 4 * (_PROBE_DECADES[1] - _PROBE_DECADES[0]) + 1))
    for lim in limits:
        if math.isfinite(lim) and lim > 0:
            mags += [lim * (1 - 32 * eps), lim, lim * (1 + 32 * eps), lim / 2, 2 * lim]
    sweep = torch.tensor([0.0] + mags + [-m for m in mags], dtype=torch.float64)
    sweep = sweep[sweep.abs() <= torch.finfo(dtype).max / 16]  # fp16: no overflow of g * u
    mod = torch.tensor(_PROBE_MODERATE, dtype=torch.float64)
    s, m = sweep.repeat_interleave(len(mod)), mod.repeat(len(sweep))
    return torch.cat([s, m]).to(dtype), torch.cat([m, s]).to(dtype)


@dataclasses.dataclass
class _Miss:
    """How a candidate missed: how many probe points are outside the bound, and the one of
    them nearest zero."""
    bad: int
    spec: str
    interleaved: bool
    g: float
    u: float
    got: float
    want: float


def _check(got: np.ndarray, want: np.ndarray, g: np.ndarray, u: np.ndarray, eps: float,
           spec: str, interleaved: bool) -> Optional[_Miss]:
    """None if ``got`` matches ``want`` at every probe point (the bound of _PROBE_C), else the
    miss, shown at its point nearest zero (where the gate starts to differ)."""
    with np.errstate(invalid="ignore", over="ignore"):
        bound = _PROBE_C * eps * (np.abs(want) + np.abs(g) * (np.abs(u) + 1.0))
        bad = ~(np.abs(got.astype(np.float64) - want) <= bound)  # NaN / inf: bad
    bad &= ~(np.isnan(got) & np.isnan(want))
    if not bad.any():
        return None
    i = int(np.argmin(np.where(bad, np.abs(g) + np.abs(u), np.inf)))
    return _Miss(int(bad.sum()), spec, interleaved, float(g[i]), float(u[i]), float(got[i]),
                 float(want[i]))


def _probe_gating(module: torch.nn.Module, inter: int, dtype: torch.dtype):
    """(activation spec, gate/up interleaved in the module) of the first candidate spec whose
    reference reproduces the module's ``_apply_gate`` at every probe point, in ``dtype`` (the
    module's) and in float32 (where the bound is tight enough to tell apart what bf16 cannot:
    the erf gelu from its tanh form or quick_gelu; skipped only if the gate does not run in float32); else
    (None, the closest miss)."""
    declared = _declared(module)
    specs = _candidates(declared)
    ok: Dict[torch.dtype, Optional[set]] = {}
    closest: Optional[_Miss] = None
    for dt in dict.fromkeys((dtype, torch.float32)):
        g, u = _probe_pairs(declared["limit"], dt)
        rows = -(-g.numel() // inter)
        pad = rows * inter - g.numel()
        g = torch.cat([g, g.new_zeros(pad)]).reshape(rows, inter)
        u = torch.cat([u, u.new_zeros(pad)]).reshape(rows, inter)
        halves = torch.cat([g, u], dim=1)
        inter_l = torch.stack([g, u], dim=2).reshape(rows, 2 * inter)  # gate even, up odd
        gf, uf = g.float().numpy().ravel(), u.float().numpy().ravel()
        ok[dt] = None  # None: the gate did not run in this dtype
        for interleaved, h in ((False, halves), (True, inter_l)):
            try:
                with torch.no_grad():
                    got = module._apply_gate(h.clone())
            except Exception:  # noqa: BLE001 - a gate that does not take this layout
                continue
            if not isinstance(got, torch.Tensor) or tuple(got.shape) != (rows, inter):
                continue
            got = got.detach().float().numpy().ravel()
            ok[dt] = ok[dt] or set()
            for spec in specs:
                h_op = (inter_l if _ops.activation_interleaved(spec) else halves).float().numpy()
                want = _reference.gated_activation(spec, h_op, inter).ravel()
                miss = _check(got, want, gf, uf, torch.finfo(dt).eps, spec, interleaved)
                if miss is None:
                    ok[dt].add((spec, interleaved))
                elif closest is None or miss.bad < closest.bad:
                    closest = miss
    if ok[dtype] is None:  # the gate runs on no probe tensor of the module's dtype
        return None, None
    found = next(((s, il) for s in specs for il in (False, True)
                  if all(m is None or (s, il) in m for m in ok.values())), None)
    return found, (None if found else closest)


def _what_it_computes(module: torch.nn.Module) -> str:
    """The module's gating as it declares it, for messages."""
    act = getattr(module, "act_fn", None)
    parts = [f"act_fn {type(act).__name__}" if act is not None else "its own _apply_gate"]
    hidden_act = getattr(getattr(module, "config", None), "hidden_act", None)
    if isinstance(hidden_act, str):
        parts.append(f"hidden_act {hidden_act!r}")
    for param, vals in _declared(module).items():
        if vals:
            parts.append(f"{param} {', '.join(f'{v:g}' for v in vals)}")
    return ", ".join(parts)


def _refuse_gating(module: torch.nn.Module, name: Optional[str], closest: Optional[_Miss]):
    have = " | ".join(f"{a['name']} = {a['formula']}" for a in _ops.activations())
    why = "; its _apply_gate did not run on a [T, 2I] tensor of its dtype"
    if closest is not None:
        layout = "gate/up interleaved" if closest.interleaved else "gate/up halves"
        why = (f"; closest: {closest.spec} ({layout}), off at {closest.bad} probe points, e.g. at "
               f"gate={closest.g:.6g}, up={closest.u:.6g} it gives {closest.got:.6g}, "
               f"{closest.spec} gives {closest.want:.6g}")
    refuse(module, name, f"its gating ({_what_it_computes(module)}) matches none of cpumoe's "
                        f"activations ({have}) in either gate/up layout{why}")


def _row_order(inter: int, src_interleaved: bool, dst_interleaved: bool):
    """Index of w13's rows taking the source gate/up order to the op's (None: same order)."""
    if src_interleaved == dst_interleaved:
        return None
    i = torch.arange(inter)
    if dst_interleaved:  # halves -> gate0, up0, gate1, up1, ...
        return torch.stack([i, i + inter], dim=1).reshape(-1)
    return torch.cat([2 * i, 2 * i + 1])  # interleaved -> gate rows, then up rows


# ---------------------------------------------------------------------------- the layout
@dataclasses.dataclass
class Layout:
    E: int
    H: int
    I: int
    activation: str  # the op's canonical spec, e.g. "silu_clamp(limit=10)"
    order: Optional[torch.Tensor]
    transposed: bool
    has_bias: bool


def layout_of(module: torch.nn.Module, name: Optional[str], meta_ok: bool = False) -> Layout:
    """Checks that cpumoe can take the module's experts and how its weights map to the op's
    (meta_ok: shapes only, the weights come from a checkpoint)."""
    if not getattr(module, "has_gate", True) or not hasattr(module, "gate_up_proj"):
        refuse(module, name, "its experts have no gate (no fused gate_up_proj); cpumoe's op is a "
                            "gated MLP")
    if getattr(module, "has_post_expert_norm", False):
        refuse(module, name, "a norm after each expert (has_post_expert_norm) is not supported")
    if getattr(module, "_is_expert_parallel", False):
        refuse(module, name, "expert parallelism (sentinel expert ids) is not supported")
    gu, dn = module.gate_up_proj, getattr(module, "down_proj", None)
    for pname, t in (("gate_up_proj", gu), ("down_proj", dn)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            refuse(module, name, f"{pname} is not a 3-D [E, ., .] tensor (got "
                                f"{type(t).__name__} {list(getattr(t, 'shape', []))})")
        if t.device.type != "cpu" and not (meta_ok and t.device.type == "meta"):
            refuse(module, name, f"{pname} is on {t.device}, not the CPU")
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            refuse(module, name, f"{pname} has dtype {t.dtype}; cpumoe packs float32/bfloat16/"
                                f"float16 weights (already quantized experts are not supported)")
    transposed = bool(getattr(module, "is_transposed", False))
    E, a, b = gu.shape
    I2, H = (b, a) if transposed else (a, b)
    if I2 % 2:
        refuse(module, name, f"gate_up_proj has an odd gate+up width {I2}")
    I = I2 // 2
    want_dn = (E, I, H) if transposed else (E, H, I)
    if tuple(dn.shape) != want_dn:
        refuse(module, name, f"down_proj has shape {list(dn.shape)}, expected {list(want_dn)}")
    if H % _ALIGN or I % _ALIGN:
        refuse(module, name, f"hidden size H = {H} and intermediate size I = {I} must be "
                            f"multiples of {_ALIGN}")
    found, closest = _probe_gating(module, I, gu.dtype)
    if found is None:
        _refuse_gating(module, name, closest)
    activation, interleaved = found
    has_bias = bool(getattr(module, "has_bias", False))
    if has_bias:
        b13, b2 = getattr(module, "gate_up_proj_bias", None), getattr(module, "down_proj_bias",
                                                                      None)
        if (not isinstance(b13, torch.Tensor) or tuple(b13.shape) != (E, 2 * I)
                or not isinstance(b2, torch.Tensor) or tuple(b2.shape) != (E, H)):
            refuse(module, name, f"biases must be gate_up_proj_bias [E, 2I] = [{E}, {2 * I}] and "
                                f"down_proj_bias [E, H] = [{E}, {H}]")
    order = _row_order(I, interleaved, _ops.activation_interleaved(activation))
    return Layout(E, H, I, activation, order, transposed, has_bias)


def w13_of(module: torch.nn.Module, lay: Layout, e: int) -> torch.Tensor:
    """Expert e's gate+up weights [2I, H] in the op's row order."""
    w = module.gate_up_proj[e]
    w = w.t() if lay.transposed else w
    return w if lay.order is None else w[lay.order]


def w2_of(module: torch.nn.Module, lay: Layout, e: int) -> torch.Tensor:
    w = module.down_proj[e]
    return w.t() if lay.transposed else w


def biases_of(module: torch.nn.Module, lay: Layout):
    if not lay.has_bias:
        return None, None
    b13 = module.gate_up_proj_bias.detach().float()
    b13 = b13 if lay.order is None else b13[:, lay.order]
    return b13.contiguous(), module.down_proj_bias.detach().float().contiguous()
