"""torch custom ops: ``torch.ops.cpumoe.fused_moe_int8`` (vLLM's schema), ``cpumoe::fused_moe``
(its functional twin) and ``cpumoe::prepack_int8``.

Importing this module registers the ops with ``torch.library`` (it imports torch; ``import cpumoe``
alone never does). The ops have fake (meta) implementations, so ``torch.compile(fullgraph=True)``
traces a model that calls them: the op stays one node of the graph and runs the native kernel.

**The op** has the schema of vLLM's CPU op ``torch.ops._C.cpu_fused_moe_int8``, plus one trailing
optional argument, so a call written for vLLM works unchanged::

    cpumoe::fused_moe_int8(Tensor(a0!) output, Tensor input, Tensor w13, Tensor w2,
        Tensor w13_scale, Tensor w2_scale, Tensor? w13_bias, Tensor? w2_bias,
        Tensor topk_weights, Tensor topk_id, bool skip_weighted, str act, str isa,
        Tensor? expert_map=None) -> ()

It writes ``output`` [T, H] (same dtype as ``input``) in place; shapes and dtypes as in
:func:`cpumoe.fused_moe_int8`. ``w13`` selects the weights, in one of two ways:

1. *Handle* (recommended): ``w13`` is the int64 [2] tensor returned by :func:`prepack_int8`
   (``[HANDLE_MAGIC, id]``, a key into this module's registry of packed layers). The scales and
   biases were packed with the weights, so ``w2``, ``w13_scale``, ``w2_scale``, ``w13_bias``,
   ``w2_bias`` and ``isa`` are ignored (pass the handle again, or the old tensors: vLLM's
   ``apply`` passes ``layer.w2_weight`` and the scale parameters, which is fine). The unpacked
   weights can be freed after prepacking. The packed layer lives until :func:`release`.
2. *Raw weights* (drop-in for callers that hold unpacked weights): ``w13`` int8 [E, 2I, H],
   ``w2`` int8 [E, H, I], scales [E, 2I] / [E, H] (or with a trailing 1), optional biases. The op
   prepacks on first use and caches the packed layer, keyed by the ``data_ptr``, shape and dtype
   of all six tensors and ``isa``; an entry is used only while the tensors it was made from are
   alive (so no other tensor can have taken their memory) and the version counters of the ones
   passed (bumped by in-place writes, shared with views) are unchanged, and it is dropped when
   the ``w13`` it was made from is garbage collected. This keeps the raw weights *and* the packed
   copy in memory: use a handle to hold only the packed one.

``act``: an activation spec of :func:`cpumoe.parse_activation` (the names of vLLM's
``MoEActivation.value`` that cpumoe has, optionally with parameters).
``isa`` (raw mode only): a cpumoe path name (``portable``, ``neon_i8mm``, ...) caps the path;
``""``, ``"auto"`` and vLLM's names ``"neon"``, ``"vec"``, ``"amx"`` mean the best path of this
CPU (on x86 ``"amx"`` is also our top path name: as a cap it allows every path). ``expert_map``: optional int32 [E_global], global expert id ->
local id or -1 (slots of experts held elsewhere contribute nothing); ``topk_id`` then holds
global ids. ``skip_weighted`` (k == 1 only): the router weight is already in ``input``.

Differences from vLLM's op: vLLM's ``w13``/``w2`` are its own prepacked int8 tensors (same shape
as the unpacked ones), ours are a handle or the unpacked weights; vLLM reads biases in the input
dtype, we take any float dtype; vLLM needs H and I to be multiples of 32, we need 8.

``cpumoe::fused_moe`` is the functional twin (same arguments without ``output``; returns a new
[T, H] tensor) and :func:`fused_moe` calls one or the other from Python; both trace.

**The public functions** :func:`cpumoe.fused_moe_int8` and :func:`cpumoe.fused_moe_bf16` on torch
tensors run through ``cpumoe::fused_moe_packed`` (and ``cpumoe::fused_moe_packed_out`` with
``out=``): the packed layer object itself is not a tensor, so the op takes a key (the object's
``id``, looked up in a weak registry of live packed layers). Under ``torch.compile`` the key is
a constant of the graph, guarded on the identity of the packed object, so
``torch.compile(fullgraph=True)`` of code that calls the public functions works. Eager calls on
plain tensors skip the op and call the kernel directly (same result; the dispatcher would add
15-30 us per call).

Inference only: the ops have no autograd formula. Run them under ``torch.inference_mode()`` or
``torch.no_grad()`` (as engines do); tracing a graph that needs their backward (e.g. compiling
with grad enabled while ``topk_weights`` comes from a router that requires grad) raises.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import OrderedDict
from typing import Dict, Optional, Tuple

import torch

from . import _C
from . import ops as _ops

__all__ = [
    "HANDLE_MAGIC",
    "fused_moe",
    "fused_moe_functional",
    "fused_moe_int8",
    "fused_moe_packed",
    "is_handle",
    "packed_of",
    "prepack_int8",
    "register_packed",
    "release",
]

#: First element of a handle tensor (ASCII "cpumoe8"), so a handle is never mistaken for data.
HANDLE_MAGIC = 0x63_70_75_6D_6F_65_38

_VLLM_ISA_NAMES = ("", "auto", "neon", "vec", "vec16", "amx")
_lock = threading.Lock()
_registry: Dict[int, _ops.PackedMoe] = {}
_ids = itertools.count(1)


# ---------------------------------------------------------------------------- handles
def register_packed(packed: _ops.PackedMoe) -> torch.Tensor:
    """Registers a :class:`cpumoe.PackedMoe`; returns its handle, an int64 [2] CPU tensor."""
    if not isinstance(packed, _ops.PackedMoe):
        raise TypeError(f"packed: expected cpumoe.PackedMoe, got {type(packed).__name__}")
    with _lock:
        hid = next(_ids)
        _registry[hid] = packed
    return torch.tensor([HANDLE_MAGIC, hid], dtype=torch.int64)


def is_handle(t: object) -> bool:
    """True if ``t`` looks like a handle (int64 [2] CPU tensor starting with HANDLE_MAGIC)."""
    return (isinstance(t, torch.Tensor) and t.dtype == torch.int64 and tuple(t.shape) == (2,)
            and t.device.type == "cpu" and int(t[0]) == HANDLE_MAGIC)


def packed_of(handle: torch.Tensor) -> _ops.PackedMoe:
    """The PackedMoe of a handle; ValueError for a non-handle or a released handle."""
    if not is_handle(handle):
        raise ValueError("w13: not a cpumoe handle (expected the int64 [2] tensor from "
                         "prepack_int8/register_packed)")
    hid = int(handle[1])
    with _lock:
        packed = _registry.get(hid)
    if packed is None:
        raise ValueError(f"w13: cpumoe handle {hid} was released (or never registered)")
    return packed


def release(handle: torch.Tensor) -> bool:
    """Drops the registry's reference to a handle's packed layer (its memory is freed once no
    PackedMoe object refers to it). Returns False if it was not registered."""
    if not is_handle(handle):
        raise ValueError("handle: not a cpumoe handle")
    with _lock:
        return _registry.pop(int(handle[1]), None) is not None


def _registry_size() -> int:  # for tests
    with _lock:
        return len(_registry)


# ---------------------------------------------------------------------------- isa names
def _isa_cap(isa: str) -> Optional[str]:
    if not isinstance(isa, str):
        raise TypeError(f"isa: must be a str, got {type(isa).__name__}")
    if isa in _C.isa_ladder():
        return isa
    if isa in _VLLM_ISA_NAMES:
        return None
    raise ValueError(f"isa: must be one of {', '.join(_C.isa_ladder())} (a cap), or '', 'auto', "
                     f"'neon', 'vec' (best path); got {isa!r}")


# ---------------------------------------------------------------------------- raw-weight cache
_CACHE_MAX = 64
_raw_cache: "OrderedDict[tuple, Tuple[_ops.PackedMoe, tuple, tuple]]" = OrderedDict()


def _version(t: torch.Tensor) -> int:
    try:
        return int(t._version)
    except RuntimeError:  # inference tensors keep no version counter
        return -1


def _raw_packed(w13, w2, s13, s2, b13, b2, isa: Optional[str]) -> _ops.PackedMoe:
    tensors = (w13, w2, s13, s2, b13, b2)
    key = tuple((t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype) if t is not None
                else None for t in tensors) + (isa,)
    versions = tuple(_version(t) if t is not None else 0 for t in tensors)
    with _lock:
        hit = _raw_cache.get(key)
        if hit is not None:
            packed, refs, old_versions = hit
            # The tensors the entry was packed from must still be alive (so their memory was
            # not reused by another tensor); the ones passed now may be aliases of them.
            if all(r is None or r() is not None for r in refs) and old_versions == versions:
                _raw_cache.move_to_end(key)
                return packed
    packed = _ops.prepack(w13, w2, s13, s2, b13, b2, isa=isa)
    refs = tuple(weakref.ref(t) if t is not None else None for t in tensors)
    with _lock:
        _raw_cache[key] = (packed, refs, versions)
        _raw_cache.move_to_end(key)
        while len(_raw_cache) > _CACHE_MAX:
            _raw_cache.popitem(last=False)
    weakref.finalize(w13, _drop_raw, key, refs[0])
    return packed


def _drop_raw(key: tuple, ref) -> None:
    with _lock:
        hit = _raw_cache.get(key)
        if hit is not None and hit[1][0] is ref:
            del _raw_cache[key]


def _raw_cache_size() -> int:  # for tests
    with _lock:
        return len(_raw_cache)


# ---------------------------------------------------------------------------- the ops
@torch.library.custom_op("cpumoe::prepack_int8", mutates_args=())
def prepack_int8(w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
                 w2_scale: torch.Tensor, w13_bias: Optional[torch.Tensor],
                 w2_bias: Optional[torch.Tensor], isa: str) -> torch.Tensor:
    """Packs a layer (as :func:`cpumoe.prepack`) and returns its handle, int64 [2].

    w13 int8 [E, 2I, H], w2 int8 [E, H, I], w13_scale [E, 2I] / w2_scale [E, H] float (or with
    a trailing 1), biases optional float [E, 2I] / [E, H]; isa as in the module doc ("" = best).
    The inputs are copied: free them afterwards. Call :func:`release` when the layer goes away.
    Not a pure function (each call registers a new handle): call it at load time, outside the
    compiled region.
    """
    packed = _ops.prepack(w13, w2, w13_scale, w2_scale, w13_bias, w2_bias, isa=_isa_cap(isa))
    return register_packed(packed)


@prepack_int8.register_fake
def _prepack_int8_fake(w13, w2, w13_scale, w2_scale, w13_bias, w2_bias, isa):
    return w13.new_empty((2,), dtype=torch.int64)


@torch.library.custom_op("cpumoe::fused_moe_int8", mutates_args=("output",))
def fused_moe_int8(output: torch.Tensor, input: torch.Tensor, w13: torch.Tensor,
                   w2: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor,
                   w13_bias: Optional[torch.Tensor], w2_bias: Optional[torch.Tensor],
                   topk_weights: torch.Tensor, topk_id: torch.Tensor, skip_weighted: bool,
                   act: str, isa: str, expert_map: Optional[torch.Tensor] = None) -> None:
    """The fused W8A8 MoE into ``output`` [T, H]; see the module doc for the arguments."""
    if w13.dtype == torch.int64 and w13.dim() == 1:
        packed = packed_of(w13)
    else:
        packed = _raw_packed(w13, w2, w13_scale, w2_scale, w13_bias, w2_bias, _isa_cap(isa))
    _ops.fused_moe_int8(input, packed, topk_weights, topk_id, act, skip_weighted, out=output,
                        expert_map=expert_map)


@fused_moe_int8.register_fake
def _fused_moe_int8_fake(output, input, w13, w2, w13_scale, w2_scale, w13_bias, w2_bias,
                         topk_weights, topk_id, skip_weighted, act, isa, expert_map=None):
    torch._check(output.dim() == 2 and input.dim() == 2,
                 lambda: "output and input must be [T, H]")
    torch._check(output.dtype == input.dtype, lambda: "output must have input's dtype")
    return None


@torch.library.custom_op("cpumoe::fused_moe", mutates_args=())
def fused_moe_functional(input: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                         w13_scale: torch.Tensor, w2_scale: torch.Tensor,
                         w13_bias: Optional[torch.Tensor], w2_bias: Optional[torch.Tensor],
                         topk_weights: torch.Tensor, topk_id: torch.Tensor, skip_weighted: bool,
                         act: str, isa: str,
                         expert_map: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Functional twin of ``cpumoe::fused_moe_int8``: the same arguments without ``output``;
    returns a new [T, H] tensor of input's dtype (no auto_functionalize step under compile)."""
    output = torch.empty((input.shape[0], input.shape[1]), dtype=input.dtype)
    fused_moe_int8(output, input, w13, w2, w13_scale, w2_scale, w13_bias, w2_bias, topk_weights,
                   topk_id, skip_weighted, act, isa, expert_map)
    return output


@fused_moe_functional.register_fake
def _fused_moe_functional_fake(input, w13, w2, w13_scale, w2_scale, w13_bias, w2_bias,
                               topk_weights, topk_id, skip_weighted, act, isa, expert_map=None):
    torch._check(input.dim() == 2, lambda: "input must be [T, H]")
    return input.new_empty((input.shape[0], input.shape[1]))


def fused_moe(input: torch.Tensor, w13: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu", skip_weighted: bool = False, *,
              w2: Optional[torch.Tensor] = None, w13_scale: Optional[torch.Tensor] = None,
              w2_scale: Optional[torch.Tensor] = None, w13_bias: Optional[torch.Tensor] = None,
              w2_bias: Optional[torch.Tensor] = None, isa: str = "",
              expert_map: Optional[torch.Tensor] = None,
              output: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The op from Python: returns a new [T, H] tensor of input's dtype (``cpumoe::fused_moe``),
    or writes ``output`` when given (``cpumoe::fused_moe_int8``). ``w13`` is a handle (then
    w2/scales/biases are not needed) or the raw int8 weights (then ``w2``, ``w13_scale`` and
    ``w2_scale`` are required)."""
    w2 = w13 if w2 is None else w2  # handle mode: not read
    w13_scale = w13 if w13_scale is None else w13_scale
    w2_scale = w13 if w2_scale is None else w2_scale
    if output is None:
        return torch.ops.cpumoe.fused_moe(input, w13, w2, w13_scale, w2_scale, w13_bias,
                                          w2_bias, topk_weights, topk_ids, skip_weighted,
                                          activation, isa, expert_map)
    torch.ops.cpumoe.fused_moe_int8(output, input, w13, w2, w13_scale, w2_scale, w13_bias,
                                    w2_bias, topk_weights, topk_ids, skip_weighted, activation,
                                    isa, expert_map)
    return output


# ---------------------------------------------------------------------------- packed-object ops
# Live PackedMoe / PackedMoeW4 / PackedMoeBf16 objects by id(): the key the public functions pass to the op.
# Weak, so the op never keeps a layer alive; an id reused by a new object is re-registered by the
# call that passes it (the entry of a dead object is gone by then).
_live: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()


@torch.compiler.assume_constant_result
def _packed_key(packed) -> int:
    """Registers ``packed`` and returns its key. Under torch.compile this runs once at trace time
    and the key becomes a constant (the caller's id(packed) guards the object's identity)."""
    key = id(packed)
    if _live.get(key) is not packed:
        with _lock:
            _live[key] = packed
    return key


def _packed_by_key(key: int):
    packed = _live.get(int(key))
    if packed is None:
        raise ValueError(f"packed: no live cpumoe.PackedMoe/PackedMoeW4/PackedMoeBf16 has key {key} (the "
                         f"layer was freed, or the key was not made by cpumoe)")
    return packed


def _run_packed(out: Optional[torch.Tensor], input: torch.Tensor, packed: int,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str,
                skip_weighted: bool, expert_map: Optional[torch.Tensor],
                num_threads: int) -> torch.Tensor:
    obj = _packed_by_key(packed)
    return _ops.run_op(_ops.native_op(obj), input, obj, topk_weights, topk_ids, activation,
                       skip_weighted, out, expert_map, None if num_threads <= 0 else num_threads)


def _check_fake(input: torch.Tensor, packed: int, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> None:
    obj = _packed_by_key(packed)
    torch._check(input.dim() == 2 and input.shape[1] == obj.hidden,
                 lambda: f"x: shape must be [?, {obj.hidden}] (H = {obj.hidden} of the packed "
                         f"weights), got {list(input.shape)}")
    torch._check(topk_ids.dim() == 2 and topk_ids.shape[0] == input.shape[0],
                 lambda: f"topk_ids: shape must be [T, k] with T = {input.shape[0]}")
    torch._check(topk_weights.shape == topk_ids.shape,
                 lambda: "topk_weights: must have the shape of topk_ids")


@torch.library.custom_op("cpumoe::fused_moe_packed", mutates_args=())
def _fused_moe_packed_op(input: torch.Tensor, packed: int, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor, activation: str, skip_weighted: bool,
                         expert_map: Optional[torch.Tensor], num_threads: int) -> torch.Tensor:
    """The public fused_moe_int8/bf16 on a packed layer given by its key; a new [T, H] tensor.
    num_threads <= 0: torch's thread count."""
    return _run_packed(None, input, packed, topk_weights, topk_ids, activation, skip_weighted,
                       expert_map, num_threads)


@_fused_moe_packed_op.register_fake
def _fused_moe_packed_fake(input, packed, topk_weights, topk_ids, activation, skip_weighted,
                           expert_map, num_threads):
    _check_fake(input, packed, topk_weights, topk_ids)
    return input.new_empty((input.shape[0], input.shape[1]))


@torch.library.custom_op("cpumoe::fused_moe_packed_out", mutates_args=("out",))
def _fused_moe_packed_out_op(out: torch.Tensor, input: torch.Tensor, packed: int,
                             topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                             activation: str, skip_weighted: bool,
                             expert_map: Optional[torch.Tensor], num_threads: int) -> None:
    """As cpumoe::fused_moe_packed, written into ``out`` [T, H]."""
    _run_packed(out, input, packed, topk_weights, topk_ids, activation, skip_weighted,
                expert_map, num_threads)


@_fused_moe_packed_out_op.register_fake
def _fused_moe_packed_out_fake(out, input, packed, topk_weights, topk_ids, activation,
                               skip_weighted, expert_map, num_threads):
    _check_fake(input, packed, topk_weights, topk_ids)
    torch._check(out.dtype == input.dtype, lambda: "out: must have x's dtype")
    return None


def fused_moe_packed(x: torch.Tensor, packed, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, activation: str = "silu",
                     skip_weighted: bool = False, out: Optional[torch.Tensor] = None,
                     expert_map: Optional[torch.Tensor] = None,
                     num_threads: Optional[int] = None) -> torch.Tensor:
    """:func:`cpumoe.fused_moe_int8` / :func:`cpumoe.fused_moe_bf16` (by the type of ``packed``)
    through the custom ops; those functions call this for torch tensors."""
    key = _packed_key(packed)
    torch._check(id(packed) == key)  # a guard on the packed object's identity under compile
    nt = 0 if num_threads is None else num_threads
    if out is None:
        return _fused_moe_packed_op(x, key, topk_weights, topk_ids, activation, skip_weighted,
                                    expert_map, nt)
    _fused_moe_packed_out_op(out, x, key, topk_weights, topk_ids, activation, skip_weighted,
                             expert_map, nt)
    return out
