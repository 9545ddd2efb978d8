"""cpumoe.prepack_fp8 and the fused op on FP8 (E4M3, block-scaled) weights against
reference.ref_fused_moe_fp8, on every fp8 path.

Every activation x dtype, with and without bias, block shapes (DeepSeek's 128 x 128, blocks that
leave partial ones at the ends, per channel), on every path this CPU runs; each path
deterministic across thread counts; the BF16 op on the dequantized weights within tolerance;
torch float8_e4m3fn input; argument errors (NaN codes, scales, shapes, blocks, dtypes);
expert map; the quantizer's codes against ml_dtypes' float8_e4m3fn.
"""

from __future__ import annotations

import numpy as np
import pytest

import cpumoe
from cpumoe import quantize as Q
from cpumoe import reference
from conftest import Backend, FloatWeightsProblem, assert_moe_close, op_cases

FP8_PATHS = cpumoe.available_paths("fp8")
# As test_bf16: kernel and reference sum in different orders (fp32 vs float64), which can flip a
# bf16 rounding of the activation; a wrong weight, scale, block or route is far above this.
ATOL_OF_SCALE = 1e-2
RTOL = 1e-2

_SHAPES = ((1, 8, 2, 128, 64), (9, 16, 4, 256, 128), (33, 8, 1, 160, 96))
_BLOCKS = ((128, 128), (32, 64), None, (16, 32))


class Fp8Problem(FloatWeightsProblem):
    """An int8 test problem's layer as FP8 weights (w * scale quantized to E4M3 in blocks)."""

    def __init__(self, backend, block_size=(128, 128), **kw):
        super().__init__(backend, **kw)
        self.block_size = block_size
        self.c13, self.t13 = Q.quantize_fp8(self.w13f, block_size)
        self.c2, self.t2 = Q.quantize_fp8(self.w2f, block_size)

    def prepack(self, **kw):
        return cpumoe.prepack_fp8(self.c13, self.c2, self.t13, self.t2, self.p.b13, self.p.b2,
                                  block_size=self.block_size, **kw)

    def reference(self):
        p = self.p
        return reference.ref_fused_moe_fp8(p.x, self.c13, self.c2, self.t13, self.t2,
                                           p.topk_weights, p.topk_ids, p.activation, p.b13, p.b2,
                                           p.skip_weighted, block_size=self.block_size)


CASES = op_cases(_SHAPES, block_size=_BLOCKS)


@pytest.mark.parametrize("case", CASES)
def test_matches_reference_on_every_path(backend, case):
    prob = Fp8Problem(backend, **case)
    ref = prob.reference()
    for path in FP8_PATHS:
        packed = prob.prepack(isa=path)
        assert packed.path == path and packed.weight_format == "fp8"
        bs = case["block_size"]
        assert packed.block_size == ((1, 0) if bs is None else tuple(bs))
        assert_moe_close(backend, prob.run(packed), ref, atol_of_scale=ATOL_OF_SCALE, rtol=RTOL)


def test_each_path_is_deterministic_across_threads(backend):
    prob = Fp8Problem(backend, T=40, E=8, k=2, H=256, I=128, dtype="bfloat16", bias=True)
    for path in FP8_PATHS:
        packed = prob.prepack(isa=path)
        outs = [backend.numpy(prob.run(packed, num_threads=n)).tobytes() for n in (1, 2, 3)]
        assert outs[0] == outs[1] == outs[2], path


def test_close_to_the_bf16_op_on_the_dequantized_weights(backend):
    prob = Fp8Problem(backend, T=12, E=8, k=2, H=256, I=128, dtype="bfloat16", bias=True)
    B = backend
    w13 = Q.dequantize_fp8(prob.c13, prob.t13, prob.block_size)
    w2 = Q.dequantize_fp8(prob.c2, prob.t2, prob.block_size)
    ref = reference.ref_fused_moe_bf16(prob.p.x, w13, w2, prob.p.topk_weights, prob.p.topk_ids,
                                       prob.p.activation, prob.p.b13, prob.p.b2)
    # The dequantized weights rounded to bf16 lose bits the fp8 op keeps: a few bf16 ulps.
    assert_moe_close(B, prob.run(), ref, atol_of_scale=3e-2, rtol=3e-2)


def test_expert_map_and_skip_weighted(backend):
    prob = Fp8Problem(backend, T=7, E=8, k=1, H=128, I=64, dtype="float32", skip_weighted=True)
    assert_moe_close(backend, prob.run(), prob.reference(), atol_of_scale=ATOL_OF_SCALE,
                     rtol=RTOL)
    p = prob.p
    emap = np.full(16, -1, np.int32)
    emap[::2] = np.arange(8, dtype=np.int32)
    gids = backend.numpy(p.topk_ids).astype(np.int64) * 2
    got = cpumoe.fused_moe(p.x, prob.prepack(), p.topk_weights, backend.asarray(gids, "int64"),
                           skip_weighted=True, expert_map=backend.asarray(emap, "int32"))
    assert_moe_close(backend, got, prob.reference(), atol_of_scale=ATOL_OF_SCALE, rtol=RTOL)


def test_torch_float8_input_is_its_bits():
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8_e4m3fn")
    rng = np.random.default_rng(3)
    E, H, I = 4, 64, 32
    w13 = torch.from_numpy(rng.standard_normal((E, 2 * I, H)).astype(np.float32))
    w2 = torch.from_numpy(rng.standard_normal((E, H, I)).astype(np.float32))
    c13, c2 = w13.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn)
    s13, s2 = torch.ones(E, 1, 1), torch.ones(E, 1, 1)
    packed = cpumoe.prepack_fp8(c13, c2, s13, s2, block_size=(128, 128))
    x = torch.randn(5, H, dtype=torch.bfloat16)
    ids = torch.from_numpy(rng.integers(0, E, (5, 2)).astype(np.int32))
    wts = torch.rand(5, 2)
    got = cpumoe.fused_moe(x, packed, wts, ids)
    ref = reference.ref_fused_moe_fp8(x, c13.view(torch.uint8), c2.view(torch.uint8), s13, s2,
                                      wts, ids)
    assert_moe_close(Backend("torch"), got, ref, atol_of_scale=ATOL_OF_SCALE, rtol=RTOL)
    # The codes as stored: torch's own cast gives the same bits as cpumoe's quantizer.
    assert np.array_equal(c13.view(torch.uint8).numpy(), Q.e4m3_codes(w13.numpy().clip(-448, 448)))


def test_quantizer_matches_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(0)
    v = (rng.standard_normal(20000) * 10.0 ** rng.integers(-5, 3, 20000)).astype(np.float32)
    v = np.concatenate([v, Q.E4M3_VALUES[~np.isnan(Q.E4M3_VALUES)], [0.0, -0.0]]).astype(np.float32)
    want = v.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert np.array_equal(Q.e4m3_codes(v), want)
    codes = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(Q.E4M3_VALUES, codes.view(ml_dtypes.float8_e4m3fn)
                                  .astype(np.float32))


def _layer(E=2, H=64, I=32, block=(32, 32)):
    rng = np.random.default_rng(1)
    c13, t13 = Q.quantize_fp8(rng.standard_normal((E, 2 * I, H)).astype(np.float32), block)
    c2, t2 = Q.quantize_fp8(rng.standard_normal((E, H, I)).astype(np.float32), block)
    return c13, c2, t13, t2


@pytest.mark.parametrize("mutate, err, match", [
    (lambda a: a[0].__setitem__((0, 1, 2), 0x7F), ValueError, "w13: E4M3 code 127 is NaN"),
    (lambda a: a[1].__setitem__((1, 3, 4), 0xFF), ValueError, "w2: E4M3 code 255 is NaN"),
    (lambda a: a[2].__setitem__((0, 0, 0), np.nan), ValueError, "s13: every scale must be finite"),
    (lambda a: a[3].__setitem__((1, 0, 0), -1.0), ValueError,
     "s2: every scale must be finite and >= 0"),
    (lambda a: a[3].__setitem__((0, 1, 0), np.inf), ValueError, "s2: every scale"),
])
def test_bad_values_are_clear_errors(mutate, err, match):
    arrays = list(_layer())
    mutate(arrays)
    with pytest.raises(err, match=match):
        cpumoe.prepack_fp8(*arrays, block_size=(32, 32))


def test_bad_shapes_blocks_and_dtypes():
    c13, c2, t13, t2 = _layer()
    with pytest.raises(ValueError, match=r"s13: .*shape"):
        cpumoe.prepack_fp8(c13, c2, t13[:, :1], t2, block_size=(32, 32))
    with pytest.raises(ValueError, match=r"s13: .*blocks of 128 x 128"):
        cpumoe.prepack_fp8(c13, c2, t13, t2, block_size=(128, 128))
    with pytest.raises(ValueError, match=r"k extent 40 must be a multiple of 32 or span the "
                       r"depth \(H = 64\)"):
        cpumoe.prepack_fp8(c13, c2, np.ones((2, 2, 2), np.float32),
                           np.ones((2, 2, 1), np.float32), block_size=(32, 40))
    with pytest.raises(ValueError, match="block_size: both must be >= 1"):
        cpumoe.prepack_fp8(c13, c2, t13, t2, block_size=(0, 32))
    with pytest.raises(TypeError, match="block_size: must be a pair"):
        cpumoe.prepack_fp8(c13, c2, t13, t2, block_size=32)
    with pytest.raises(TypeError, match="w13"):
        cpumoe.prepack_fp8(c13.astype(np.int8), c2, t13, t2, block_size=(32, 32))
    with pytest.raises(ValueError, match="w2: .*to match w13"):
        cpumoe.prepack_fp8(c13, c2[:, :32], t13, t2, block_size=(32, 32))


def test_block_spanning_the_depth_and_per_channel():
    rng = np.random.default_rng(5)
    E, H, I = 2, 64, 40  # I = 40: a block of 64 spans it (one block), not a multiple of 32
    w13 = rng.standard_normal((E, 2 * I, H)).astype(np.float32)
    w2 = rng.standard_normal((E, H, I)).astype(np.float32)
    x = rng.standard_normal((3, H)).astype(np.float32)
    ids = rng.integers(0, E, (3, 2)).astype(np.int32)
    wts = rng.random((3, 2)).astype(np.float32)
    for block in ((64, 64), None):
        c13, t13 = Q.quantize_fp8(w13, block)
        c2, t2 = Q.quantize_fp8(w2, block)
        packed = cpumoe.prepack_fp8(c13, c2, t13, t2, block_size=block)
        got = cpumoe.fused_moe(x, packed, wts, ids)
        ref = reference.ref_fused_moe_fp8(x, c13, c2, t13, t2, wts, ids, block_size=block)
        np.testing.assert_allclose(got, ref, rtol=1e-2, atol=1e-2 * np.abs(ref).max())
    # Per channel also takes scales [E, N] (compressed-tensors' FP8 channel layout squeezed).
    c13, t13 = Q.quantize_fp8(w13, None)
    c2, t2 = Q.quantize_fp8(w2, None)
    cpumoe.prepack_fp8(c13, c2, t13[..., 0], t2[..., 0], block_size=None)


def test_ops_take_it_where_they_should():
    c13, c2, t13, t2 = _layer()
    packed = cpumoe.prepack_fp8(c13, c2, t13, t2, block_size=(32, 32))
    x = np.zeros((2, 64), np.float32)
    ids = np.zeros((2, 1), np.int32)
    wts = np.ones((2, 1), np.float32)
    assert cpumoe.fused_moe_bf16(x, packed, wts, ids).shape == (2, 64)
    with pytest.raises(TypeError, match="int8 activations"):
        cpumoe.fused_moe_int8(x, packed, wts, ids)
    assert cpumoe.scratch_bytes(4, 1, packed) > 0
    assert "fp8" in cpumoe.FORMATS and "PackedMoeFp8" in repr(packed)
    assert cpumoe.selected_path(op="fp8") in FP8_PATHS


def test_requantize_to_int8_runs_the_w8a8_op_on_the_dequantized_weights(backend):
    prob = Fp8Problem(backend, T=9, E=4, k=2, H=128, I=64, dtype="float32", bias=True)
    q = Q.requantize_fp8(prob.c13, prob.c2, prob.t13, prob.t2, prob.p.b13, prob.p.b2,
                         block_size=prob.block_size)
    assert q.weight_format == "int8"
    w13 = Q.dequantize_fp8(prob.c13, prob.t13, prob.block_size)
    want13, want_s13 = Q.quantize_per_channel(w13)
    assert np.array_equal(np.asarray(q.w13), want13)
    assert np.array_equal(np.asarray(q.s13), want_s13)
    packed = q.prepack()
    assert packed.weight_format == "int8"
    p = prob.p
    ref = reference.ref_fused_moe_int8(p.x, q.w13, q.w2, q.s13, q.s2, p.topk_weights,
                                       p.topk_ids, p.activation, q.b13, q.b2)
    assert_moe_close(backend, prob.run(packed), ref)
