"""cpumoe: fused W8A8 int8 (and BF16) Mixture-of-Experts kernels for CPUs.

Typical use::

    packed = cpumoe.prepack(w13, w2, s13, s2)              # once per layer
    out = cpumoe.fused_moe_int8(x, packed, topk_weights, topk_ids, activation="silu")

    packed16 = cpumoe.prepack_bf16(w13_bf16, w2_bf16)      # unquantized bf16 checkpoints
    out = cpumoe.fused_moe_bf16(x, packed16, topk_weights, topk_ids, activation="silu")

Works on torch tensors and on numpy arrays (``ml_dtypes.bfloat16`` for bf16); torch is optional.
"""

from . import _C
from . import reference
from .ops import (ACTIVATIONS, PackedMoe, PackedMoeBf16, available_paths, bf16_kernels,
                  cpu_features, fused_moe_bf16, fused_moe_int8, kernels, prepack, prepack_bf16,
                  scratch_bytes, selected_path)
from .reference import quantize_per_channel, quantize_per_token

__version__ = "0.1.0"

__all__ = [
    "ACTIVATIONS",
    "PackedMoe",
    "PackedMoeBf16",
    "available_paths",
    "bf16_kernels",
    "cpu_features",
    "fused_moe_bf16",
    "fused_moe_int8",
    "kernels",
    "prepack",
    "prepack_bf16",
    "quantize_per_channel",
    "quantize_per_token",
    "reference",
    "scratch_bytes",
    "selected_path",
]

# Engine integration, imported on first use (cpumoe.torch_ops imports torch; `import cpumoe`
# never does): torch_ops (torch.ops.cpumoe.*), experts (Int8Experts), checkpoint (loading).
_LAZY_SUBMODULES = ("checkpoint", "experts", "torch_ops")


def __getattr__(name):
    if name in _LAZY_SUBMODULES:
        import importlib
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
