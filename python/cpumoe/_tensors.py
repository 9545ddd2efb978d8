"""Zero-copy views of torch tensors and numpy arrays for the native module.

The extension takes raw addresses and element strides, so it needs neither torch nor numpy; this
module checks what it is handed (type, device, dtype, rank, shape, layout) and raises errors that
name the argument. torch is optional: it is only looked at when a torch tensor comes in.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

import numpy as np

FLOAT_DTYPES = ("float32", "float16", "bfloat16")


def _torch():
    """torch if the caller already imported it (we never import it just to check types)."""
    return sys.modules.get("torch")


@dataclass(frozen=True)
class View:
    """What the native code needs to read or write a tensor in place."""

    obj: Any  # keeps the owner alive for the duration of the call
    address: int
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]  # in elements
    dtype: str  # float32, float16, bfloat16, int8, int32, int64, ...
    framework: str  # "torch" or "numpy"
    writable: bool

    @property
    def ndim(self) -> int:
        return len(self.shape)


def _numpy_dtype_name(dt: np.dtype) -> str:
    # ml_dtypes' bfloat16 has no numpy "kind" of its own; its name is what identifies it.
    return "bfloat16" if dt.name == "bfloat16" else dt.name


def view(name: str, obj: Any) -> View:
    """A View of ``obj`` (torch tensor or numpy array) or TypeError/ValueError naming ``name``."""
    torch = _torch()
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu":
            raise ValueError(f"{name}: must be a CPU tensor, got device {obj.device}")
        if obj.is_sparse or obj.layout != torch.strided:
            raise ValueError(f"{name}: must be a dense strided tensor")
        if obj.is_neg() or obj.is_conj():  # lazy views: the memory does not hold the values
            raise ValueError(f"{name}: is a lazy negated/conjugated view; call resolve_neg() / "
                             f"resolve_conj() first")
        dtype = str(obj.dtype).replace("torch.", "")
        address = obj.data_ptr()
        if address % obj.element_size():
            raise ValueError(f"{name}: data address must be aligned to the element size")
        # torch tensors carry no read-only flag. The native op probes that out's pages are
        # writable (bindings/module.cpp), so a tensor over a read-only mapping is refused; one
        # viewing a numpy array that is only flagged read-only (writable memory) is written, as
        # torch itself would write it (torch warns when such a view is made).
        return View(obj, address, tuple(obj.shape), tuple(obj.stride()), dtype, "torch", True)
    if isinstance(obj, np.ndarray):
        if not obj.dtype.isnative:
            raise TypeError(f"{name}: byte order must be native, got dtype {obj.dtype.str}")
        item = obj.dtype.itemsize
        if any(s % item for s in obj.strides):
            raise ValueError(f"{name}: strides must be multiples of the element size")
        if obj.__array_interface__["data"][0] % item:
            raise ValueError(f"{name}: data address must be aligned to the element size")
        return View(obj, obj.__array_interface__["data"][0], tuple(obj.shape),
                    tuple(s // item for s in obj.strides), _numpy_dtype_name(obj.dtype), "numpy",
                    bool(obj.flags.writeable))
    raise TypeError(f"{name}: expected a torch.Tensor or numpy.ndarray, got {type(obj).__name__}")


def check_dtype(v: View, name: str, allowed: Sequence[str]) -> None:
    if v.dtype not in allowed:
        raise TypeError(f"{name}: dtype must be {' or '.join(allowed)}, got {v.dtype}")


def check_shape(v: View, name: str, shape: Sequence[Optional[int]], what: str = "") -> None:
    """Checks rank and each dimension that is not None."""
    if v.ndim != len(shape) or any(s is not None and s != d for s, d in zip(shape, v.shape)):
        want = "[" + ", ".join("?" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name}: shape must be {want}{what}, got {list(v.shape)}")


def check_rows(v: View, name: str) -> int:
    """2-D with contiguous rows (any row stride >= row length); returns the row stride."""
    rows, cols = v.shape
    if rows == 0:  # empty tensors may carry any strides, (0, 0) included
        return cols
    if cols > 1 and v.strides[1] != 1:
        raise ValueError(f"{name}: rows must be contiguous (stride of the last dim must be 1, "
                         f"got {v.strides[1]})")
    if rows > 1 and v.strides[0] < cols:
        raise ValueError(f"{name}: row stride {v.strides[0]} is smaller than the row length "
                         f"{cols} (overlapping or negatively strided rows)")
    return v.strides[0] if rows > 1 else cols


def contiguous(name: str, obj: Any):
    """A C-contiguous version of obj (copy only when needed): for inputs that are packed anyway."""
    torch = _torch()
    if torch is not None and isinstance(obj, torch.Tensor):
        return obj.contiguous()
    if isinstance(obj, np.ndarray):
        if not obj.dtype.isnative:
            obj = obj.astype(obj.dtype.newbyteorder("="))
        return np.ascontiguousarray(obj)
    raise TypeError(f"{name}: expected a torch.Tensor or numpy.ndarray, got {type(obj).__name__}")


def as_float32(name: str, obj: Any):
    """A contiguous float32 copy/view of a floating tensor (scales, biases: copied at prepack)."""
    v = view(name, contiguous(name, obj))
    check_dtype(v, name, FLOAT_DTYPES + ("float64",))
    torch = _torch()
    if v.framework == "torch":
        return obj.to(torch.float32).contiguous()
    return np.ascontiguousarray(obj, dtype=np.float32)


def empty_like_rows(v: View, rows: int, cols: int):
    """An uninitialised [rows, cols] tensor of v's framework and dtype."""
    if v.framework == "torch":
        torch = _torch()
        return torch.empty((rows, cols), dtype=v.obj.dtype)
    return np.empty((rows, cols), dtype=v.obj.dtype)
