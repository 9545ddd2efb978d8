"""The experts backends registered with transformers' ExpertsInterface (each call packs the
module the first time, then runs cpumoe's op), and :func:`prepare` for a whole model."""

from __future__ import annotations

from typing import List, Tuple

import torch
from transformers.integrations.moe import ExpertsInterface

from .. import ops as _ops
from .layout import UnsupportedExperts, refuse, layout_of
from .packing import BACKENDS, pack_module, released_by, states


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


def _forward(module, hidden_states, top_k_index, top_k_weights, kind):
    st = states(module).get(kind)
    if st is None:
        if torch.compiler.is_compiling():
            raise RuntimeError("cpumoe: pack the experts before torch.compile (call "
                               "cpumoe.transformers.quantize(model) / pack_bf16(model), or run "
                               "the model once)")
        st = pack_module(module, kind, None, keep_float=False)
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
        return _ops.fused_moe(x_, st.packed, tw, ids, activation=st.activation)

    if x.requires_grad and torch.is_grad_enabled() and not torch.compiler.is_compiling():
        out = _InferenceOnly.apply(x, run)
    else:
        out = run(x)
    return out.reshape(shape) if flat else out


def _backend_forward(kind):
    """The registered forward of the backend that packs weight format ``kind``."""
    def forward(self, hidden_states, top_k_index, top_k_weights):
        return _forward(self, hidden_states, top_k_index, top_k_weights, kind)
    forward.__name__ = forward.__qualname__ = f"_forward_{kind}"
    return forward


for _backend, _kind in BACKENDS.items():
    ExpertsInterface.register(_backend, _backend_forward(_kind))


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
        if kind not in states(m):
            gone = released_by(m)
            if gone is not None:
                refuse(m, name, f"its float weights were released when it was packed for the "
                               f"{gone.kind} op")
            layout_of(m, name)
    for name, m in mods:
        pack_module(m, kind, name, keep_float_weights)
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
