"""cpumoe.fused_moe_bf16 (the BF16 op) against reference.ref_fused_moe_bf16, on every bf16 path.

Every activation x dtype, with and without bias, on every path this CPU runs (the paths of the
bf16 kernels: e.g. avx512_bf16 / avx2 / portable on x86, neon_bf16 / portable on Arm); each path
deterministic across thread counts; the W8A8 op within tolerance on every int8 path of the same
layer; argument errors; expert map.
"""

from __future__ import annotations

import numpy as np
import pytest

import cpumoe
from cpumoe import reference
from conftest import FloatWeightsProblem, assert_moe_close, op_cases

BF16_PATHS = cpumoe.available_paths("bf16")
INT8_PATHS = cpumoe.available_paths("int8")

# Two fp32 summation orders (kernel vs float64 reference) differ by ulps, which can flip a bf16
# rounding of the activation: far below this tolerance, while a wrong weight, bias or route is
# far above it.
ATOL_OF_SCALE = 1e-2
RTOL = 1e-2

_SHAPES = ((1, 8, 2, 128, 64), (9, 16, 4, 256, 128), (33, 8, 1, 64, 256))


class Bf16Problem(FloatWeightsProblem):
    """An int8 test problem's layer as bf16 weights (w * scale rounded to bf16)."""

    def __init__(self, backend, **kw):
        super().__init__(backend, **kw)
        self.w13 = backend.asarray(self.w13f, "bfloat16")
        self.w2 = backend.asarray(self.w2f, "bfloat16")

    def prepack(self, **kw):
        return cpumoe.prepack_bf16(self.w13, self.w2, self.p.b13, self.p.b2, **kw)

    def reference(self):
        p = self.p
        return reference.ref_fused_moe_bf16(p.x, self.w13, self.w2, p.topk_weights, p.topk_ids,
                                            p.activation, p.b13, p.b2, p.skip_weighted)


CASES = op_cases(_SHAPES)


@pytest.mark.parametrize("case", CASES)
def test_matches_reference_on_every_path(backend, case):
    prob = Bf16Problem(backend, **case)
    ref = prob.reference()
    for path in BF16_PATHS:
        packed = prob.prepack(isa=path)
        assert packed.path == path
        out = prob.run(packed, num_threads=1)
        assert backend.dtype_name(out) == case["dtype"]
        assert_moe_close(backend, out, ref, atol_of_scale=ATOL_OF_SCALE, rtol=RTOL)
        again = prob.run(packed, num_threads=3)
        assert np.array_equal(backend.bits(out), backend.bits(again)), \
            f"{path}: the result depends on the thread count"


def test_deep_layers_and_many_tokens(backend):
    # gpt-oss's H = 2880 as the depth of GEMM1 and of GEMM2 (not a multiple of the column
    # tiles; the other side kept small so the qemu run stays short), swigluoai with bias; and a
    # batch larger than one internal chunk of 16384 slots.
    for kw in (dict(T=5, E=3, k=2, H=2880, I=200, activation="swigluoai", bias=True),
               dict(T=5, E=3, k=2, H=200, I=2880, activation="swigluoai", bias=True),
               dict(T=4200, E=8, k=4, H=64, I=32, activation="silu", bias=False)):
        prob = Bf16Problem(backend, dtype="bfloat16", **kw)
        assert_moe_close(backend, prob.run(), prob.reference(), atol_of_scale=ATOL_OF_SCALE,
                         rtol=RTOL)


def test_int8_op_within_tolerance_of_bf16_op_on_every_path(backend):
    # The W8A8 op approximates the bf16 layer it was quantized from: every int8 path agrees with
    # the BF16 op on the same layer within the quantization error (a few % of the output scale).
    prob = Bf16Problem(backend, T=16, E=8, k=2, H=256, I=128, dtype="bfloat16", bias=True)
    want = prob.run()
    for path in INT8_PATHS:
        got = prob.p.run(prob.p.prepack(isa=path))
        assert_moe_close(backend, got, want, atol_of_scale=6e-2, rtol=6e-2)


def test_skip_weighted_expert_map_out_and_empty(backend):
    prob = Bf16Problem(backend, T=7, E=8, k=1, H=64, I=64, dtype="float32", skip_weighted=True)
    packed = prob.prepack()
    assert_moe_close(backend, prob.run(packed), prob.reference(), atol_of_scale=ATOL_OF_SCALE,
                     rtol=RTOL)
    # Expert map: all 8 local experts as globals 8..15 of 16; ids shifted by 8 give the same.
    p = prob.p
    B = backend
    ids = B.numpy(p.topk_ids).astype(np.int32)
    emap = np.full(16, -1, np.int32)
    emap[8:] = np.arange(8, dtype=np.int32)
    shifted = cpumoe.fused_moe_bf16(p.x, packed, p.topk_weights, B.asarray(ids + 8),
                                    skip_weighted=True, expert_map=B.asarray(emap))
    assert np.array_equal(B.bits(shifted), B.bits(prob.run(packed)))
    # out= is written and returned; T = 0 gives an empty result.
    out = B.empty((7, 64), "float32")
    assert prob.run(packed, out=out) is out
    empty = cpumoe.fused_moe_bf16(B.empty((0, 64), "float32"), packed,
                                  B.empty((0, 1), "float32"), B.asarray(np.zeros((0, 1), np.int64)),
                                  skip_weighted=True)
    assert tuple(empty.shape) == (0, 64)


def test_packed_bf16_object(backend):
    prob = Bf16Problem(backend, T=1, E=4, k=1, H=64, I=32, bias=True)
    packed = prob.prepack()
    assert isinstance(packed, cpumoe.PackedMoeBf16)
    assert (packed.num_experts, packed.hidden, packed.intermediate) == (4, 64, 32)
    assert packed.has_bias13 and packed.has_bias2
    assert packed.path == cpumoe.selected_path(op="bf16")
    assert packed.kernel in [k["name"] for k in cpumoe.bf16_kernels()]
    assert packed.packed_bytes >= 4 * 3 * 64 * 32 * 2
    assert "PackedMoeBf16(E=4" in repr(packed)
    assert cpumoe.scratch_bytes(16, 2, packed) > 0
    assert cpumoe.available_paths("bf16")[-1] == "portable"


def test_errors(backend):
    prob = Bf16Problem(backend, T=3, E=4, k=2, H=64, I=32)
    B = backend
    p = prob.p
    with pytest.raises(TypeError, match="w13"):
        cpumoe.prepack_bf16(p.w13, prob.w2)  # int8 weights belong to prepack()
    with pytest.raises(ValueError, match="w2"):
        cpumoe.prepack_bf16(prob.w13, B.asarray(np.zeros((4, 64, 16), np.float32), "bfloat16"))
    with pytest.raises(ValueError, match="isa"):
        cpumoe.prepack_bf16(prob.w13, prob.w2, isa="no_such_isa")
    packed = prob.prepack()
    with pytest.raises(TypeError, match="PackedMoeBf16"):
        cpumoe.fused_moe_bf16(p.x, p.prepack(), p.topk_weights, p.topk_ids)
    with pytest.raises(TypeError, match="PackedMoe"):
        cpumoe.fused_moe_int8(p.x, packed, p.topk_weights, p.topk_ids)
    bad_ids = B.numpy(p.topk_ids).copy()
    bad_ids[1, 1] = 4
    with pytest.raises(ValueError, match="topk_ids"):
        cpumoe.fused_moe_bf16(p.x, packed, p.topk_weights, B.asarray(bad_ids))
    with pytest.raises(ValueError, match="activation"):
        cpumoe.fused_moe_bf16(p.x, packed, p.topk_weights, p.topk_ids, activation="relu")
    with pytest.raises(ValueError, match="x"):
        cpumoe.fused_moe_bf16(B.empty((3, 32), "float32"), packed, p.topk_weights, p.topk_ids)
    with pytest.raises(ValueError, match="out"):
        cpumoe.fused_moe_bf16(p.x, packed, p.topk_weights, p.topk_ids, out=p.x)


def test_nan_token_gives_nan_row(backend):
    prob = Bf16Problem(backend, T=4, E=4, k=2, H=64, I=32, dtype="float32")
    B = backend
    x = B.numpy(prob.p.x).copy()
    x[2, 7] = np.nan
    out = B.numpy(prob.run(x=B.asarray(x)))
    assert np.isnan(out[2]).all()
    assert np.isfinite(np.delete(out, 2, axis=0)).all()
