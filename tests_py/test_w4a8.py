"""The W4A8 ops (cpumoe.prepack_int4 / prepack_mxfp4 + fused_moe_int8) against the reference
(cpumoe.reference.ref_fused_moe_int4 / ref_fused_moe_mxfp4), on every path, and their argument
errors.

The weights are made as checkpoints make them (cpumoe.reference.quantize_int4 / quantize_mxfp4
of N(0, 1/sqrt(fan_in)) floats), so scales and codes have realistic spreads. The same tolerance as
W8A8 (conftest.MOE_ATOL_OF_SCALE): the two sides differ only in the activation's last bits, which
the requantization between the GEMMs can turn into one int8 step.
"""

from __future__ import annotations

import functools
import itertools
import os

import numpy as np
import pytest

import cpumoe
from cpumoe import quantize as Q
from cpumoe import reference as R
from conftest import (BACKEND_NAME, activation_specs, assert_moe_close, random_topk_ids,
                      random_topk_weights)


@functools.lru_cache(maxsize=16)
def _float_weights(E, H, I, seed=0):
    rng = np.random.default_rng([seed, E, H, I, 4])
    w13 = (rng.standard_normal((E, 2 * I, H), dtype=np.float32) / np.float32(np.sqrt(H)))
    w2 = (rng.standard_normal((E, H, I), dtype=np.float32) / np.float32(np.sqrt(I)))
    b13 = (rng.standard_normal((E, 2 * I)) * 0.1).astype(np.float32)
    b2 = (rng.standard_normal((E, H)) * 0.1).astype(np.float32)
    return w13, w2, b13, b2


@functools.lru_cache(maxsize=16)
def w4_weights(fmt, E, H, I, g=32, seed=0):
    """(w13, w2, s13, s2) in the prepack function's input form, and (b13, b2)."""
    w13, w2, b13, b2 = _float_weights(E, H, I, seed)
    if fmt == "mxfp4":
        q13, e13 = R.quantize_mxfp4(w13)
        q2, e2 = R.quantize_mxfp4(w2)
        return (q13, e13, q2, e2), (b13, b2)
    quant = {"int4_affine": R.quantize_int4_affine,
             "int8_affine": R.quantize_int8_affine}.get(fmt, R.quantize_int4)
    v13, s13 = quant(w13, g)
    v2, s2 = quant(w2, g)
    return (v13, v2, s13, s2), (b13, b2)


class W4Problem:
    def __init__(self, backend, fmt, T, E, k, H, I, g=32, dtype="float32", activation="silu",
                 bias=False, seed=0, act_quant="row"):
        self.B, self.fmt, self.g, self.activation = backend, fmt, g, activation
        self.act_quant = act_quant
        rng = np.random.default_rng([seed, T, E, k, H, I])
        self.T, self.H = T, H
        self.weights, biases = w4_weights(fmt, E, H, I, g)
        self.biases = tuple(backend.asarray(b, copy=False) for b in biases) if bias else (None,
                                                                                          None)
        self.x = backend.asarray(rng.standard_normal((T, H), dtype=np.float32), dtype)
        self.ids = backend.asarray(random_topk_ids(rng, T, E, k))
        self.tw = backend.asarray(random_topk_weights(rng, T, k))

    def prepack(self, **kw):
        w = [self.B.asarray(a, copy=False) for a in self.weights]
        kw.setdefault("act_quant", self.act_quant)
        if self.fmt == "mxfp4":
            return cpumoe.prepack_mxfp4(*w, *self.biases, **kw)
        prepack = {"int4_affine": cpumoe.prepack_int4_affine,
                   "int8_affine": cpumoe.prepack_int8_affine}.get(self.fmt, cpumoe.prepack_int4)
        return prepack(*w, *self.biases, group_size=self.g, **kw)

    def run(self, packed=None, **kw):
        # fused_moe: W4A8 layers, and the PackedMoeFp8 of act_quant="bf16"
        return cpumoe.fused_moe(self.x, packed or self.prepack(), self.tw, self.ids,
                                activation=self.activation, **kw)

    def reference(self):
        b13, b2 = self.biases
        if self.fmt == "mxfp4":
            return R.ref_fused_moe_mxfp4(self.x, *self.weights, self.tw, self.ids,
                                         activation=self.activation, b13=b13, b2=b2,
                                         act_quant=self.act_quant)
        ref = {"int4_affine": R.ref_fused_moe_int4_affine,
               "int8_affine": R.ref_fused_moe_int8_affine}.get(self.fmt, R.ref_fused_moe_int4)
        return ref(self.x, *self.weights, self.tw, self.ids, activation=self.activation,
                   b13=b13, b2=b2, group_size=self.g, act_quant=self.act_quant)


FORMATS = (("int4", 32), ("int4", 64), ("int4", 128), ("mxfp4", 32), ("int4_affine", 32),
           ("int4_affine", 128), ("int8_affine", 32), ("int8_affine", 64))
SHAPES = ((1, 8, 2, 256, 128), (7, 16, 4, 128, 256), (64, 8, 4, 256, 256), (33, 8, 1, 128, 128))
CASES = [pytest.param(dict(fmt=f, g=g, T=s[0], E=s[1], k=s[2], H=s[3], I=s[4], dtype=dt,
                           activation=act, bias=bias),
                      id=f"{f}-g{g}-T{s[0]}E{s[1]}k{s[2]}H{s[3]}I{s[4]}-{dt}-{act}"
                         f"{'-bias' if bias else ''}")
         for i, ((f, g), dt, act, bias) in enumerate(itertools.product(
             FORMATS, ("float32", "bfloat16", "float16"), activation_specs(), (False, True)))
         if i % 3 == (i // 12) % 3  # a third, every activation with every format and dtype
         for s in (SHAPES[i % len(SHAPES)],)]


@pytest.mark.parametrize("case", CASES)
def test_matches_reference_on_every_path(backend, case):
    p = W4Problem(backend, **case)
    packed = p.prepack()
    assert packed.weight_format == case["fmt"]
    assert packed.group_size == case["g"]
    out = p.run(packed)
    assert backend.dtype_name(out) == case["dtype"]
    assert_moe_close(backend, out, p.reference())
    for path in cpumoe.available_paths(case["fmt"])[1:]:
        other = p.run(p.prepack(isa=path))
        assert np.array_equal(backend.bits(other), backend.bits(out)), f"path {path} differs"


GROUP_CASES = [pytest.param(dict(fmt=f, g=g, T=s[0], E=s[1], k=s[2], H=s[3], I=s[4], dtype=dt,
                                 activation=act, bias=i % 2 == 0),
                            id=f"{f}-g{g}-T{s[0]}-{dt}-{act}")
               for i, ((f, g), dt, act) in enumerate(itertools.product(
                   FORMATS, ("float32", "bfloat16"), ("silu", "swigluoai")))
               if i % 2 == 0 or f.endswith("_affine")
               for s in (SHAPES[i % len(SHAPES)],)]


@pytest.mark.parametrize("case", GROUP_CASES)
def test_group_activations_match_reference_on_every_path(backend, case):
    """act_quant="group": the activations quantized per weight group, against the reference
    of that mode, the same bits on every path; and not the row mode's result."""
    p = W4Problem(backend, act_quant="group", **case)
    packed = p.prepack()
    assert packed.act_quant == "group"
    out = p.run(packed)
    assert_moe_close(backend, out, p.reference())
    for path in cpumoe.available_paths(case["fmt"])[1:]:
        other = p.run(p.prepack(isa=path))
        assert np.array_equal(backend.bits(other), backend.bits(out)), f"path {path} differs"
    if max(case["H"], case["I"]) > case["g"]:  # else one group per row: the row mode
        by_row = p.run(p.prepack(act_quant="row"))
        assert not np.array_equal(backend.bits(by_row), backend.bits(out))


def test_group_activations_are_closer_to_the_float_layer(backend):
    """Tokens whose magnitudes vary along H (a few large channels, as real hidden states
    have): per-group scales keep the small channels that one row scale rounds away."""
    p = W4Problem(backend, "int4", 32, 8, 2, 256, 256, g=32, seed=3)
    x = backend.numpy(p.x).astype(np.float32)
    x[:, ::37] *= 30.0  # outlier channels
    p.x = backend.asarray(x)
    w13, w2, s13, s2 = p.weights
    f13 = w13.astype(np.float32) * np.repeat(s13, 32, axis=-1)
    f2 = w2.astype(np.float32) * np.repeat(s2, 32, axis=-1)
    exact = R.ref_fused_moe_bf16(x, f13, f2, backend.numpy(p.tw), backend.numpy(p.ids))
    exact = np.asarray(exact, np.float64)
    err = {}
    for mode in ("row", "group"):
        out = backend.numpy(p.run(p.prepack(act_quant=mode))).astype(np.float64)
        err[mode] = np.linalg.norm(out - exact) / np.linalg.norm(exact)
    assert err["group"] < 0.8 * err["row"], err


def test_act_quant_errors(backend):
    p = W4Problem(backend, "int4", 1, 2, 1, 128, 128)
    with pytest.raises(ValueError, match="act_quant: must be 'row', 'group', 'bf16' for int4"):
        p.prepack(act_quant="token")
    for fmt in ("int4_affine", "int8_affine"):  # bf16 mode: not for the affine formats
        with pytest.raises(ValueError, match=f"must be 'row', 'group' for {fmt}, got 'bf16'.*"
                                             f"mins need the int8"):
            W4Problem(backend, fmt, 1, 2, 1, 128, 128).prepack(act_quant="bf16")
    with pytest.raises(ValueError, match="act_quant"):
        R.ref_fused_moe_int4(np.ones((1, 128), np.float32), *p.weights, np.ones((1, 1),
                             np.float32), np.zeros((1, 1), np.int32), act_quant="col")
    assert p.prepack().act_quant == "row"


def test_w4a16_errors_and_code_bits(backend):
    """The W4A16 form: 4-bit codes where the path keeps them (``code_bits`` 4 on AVX-512 and
    the portable path, half the packed bytes of the E4M3 form), negative scales kept, and a
    non-finite scale (mxfp4's E8M0 255) a clear error."""
    p = W4Problem(backend, "int4", 4, 8, 2, 256, 128, g=32)
    sizes = {}
    for path in cpumoe.available_paths("fp8"):
        packed = p.prepack(act_quant="bf16", isa=path)
        assert packed.code_bits in (4, 8), path
        sizes[packed.code_bits] = packed.packed_bytes
    assert cpumoe.available_paths("fp8")[-1] == "portable"
    assert 4 in sizes  # the portable path keeps 4-bit codes
    if 8 in sizes:
        assert sizes[4] < 0.6 * sizes[8], sizes
    m = W4Problem(backend, "mxfp4", 4, 8, 2, 256, 128)
    b13, e13, b2, e2 = (Q.to_numpy(a).copy() for a in m.weights)
    e13[0, 0, 0] = 255
    with pytest.raises(ValueError, match="s13: every scale must be finite"):
        cpumoe.prepack_mxfp4(b13, e13, b2, e2, act_quant="bf16")


@pytest.mark.parametrize("fmt,g", [("int4", 32), ("int4", 128), ("mxfp4", 32)])
def test_bf16_activations_mode(backend, fmt, g):
    """act_quant="bf16" (W4A16): a PackedMoeFp8 of the same weights with (1, g) blocks, the
    BF16 op's result on the dequantized weights (within its tolerance) on every path, and
    much closer to the float layer than the W4A8 modes."""
    p = W4Problem(backend, fmt, 24, 8, 2, 256, 128, g=g, bias=True, activation="swigluoai",
                  dtype="bfloat16")
    packed = p.prepack(act_quant="bf16")
    assert isinstance(packed, cpumoe.PackedMoeFp8) and packed.weight_format == "fp8"
    if fmt == "mxfp4":
        b13, e13, b2, e2 = p.weights
        d13, d2 = R.dequantize_mxfp4(b13, e13), R.dequantize_mxfp4(b2, e2)
    else:
        d13, d2 = (R.dequantize_int4(v, sc, g) for v, sc in zip(p.weights[:2], p.weights[2:]))
    x, tw, ids = (backend.numpy(a) for a in (p.x, p.tw, p.ids))
    ref = R.ref_fused_moe_bf16(p.x, backend.asarray(d13), backend.asarray(d2), p.tw, p.ids,
                               activation="swigluoai", b13=p.biases[0], b2=p.biases[1])
    outs = [p.run(p.prepack(act_quant="bf16", isa=path)) for path in cpumoe.available_paths("fp8")]
    for out in outs:
        assert_moe_close(backend, out, ref)
    exact = R.ref_fused_moe_bf16(x.astype(np.float32), d13, d2, tw, ids, activation="swigluoai",
                                 b13=backend.numpy(p.biases[0]), b2=backend.numpy(p.biases[1]))
    exact = np.asarray(exact, np.float64)
    err = {m: np.linalg.norm(backend.numpy(p.run(p.prepack(act_quant=m))).astype(np.float64)
                             - exact) / np.linalg.norm(exact) for m in ("row", "bf16")}
    assert err["bf16"] < 0.5 * err["row"], err


@pytest.mark.skipif(bool(os.environ.get("QEMU_CPU")),
                    reason="minutes under qemu; the kernels' K = 2880 runs are in tests_cpp")
def test_gpt_oss_shape_mxfp4(backend):
    """gpt-oss's width (H = I = 2880: groups of 32 and 64, not 128), swigluoai with biases."""
    p = W4Problem(backend, "mxfp4", 3, 1, 1, 2880, 2880, activation="swigluoai", bias=True,
                  dtype="bfloat16")
    assert_moe_close(backend, p.run(), p.reference())
    q = W4Problem(backend, "int4", 3, 1, 1, 2880, 2880, g=64, activation="swigluoai", bias=True,
                  dtype="bfloat16")
    assert_moe_close(backend, q.run(), q.reference())


def test_threads_out_and_expert_map(backend):
    p = W4Problem(backend, "int4", 40, 8, 2, 128, 128, g=32, dtype="bfloat16")
    packed = p.prepack()
    base = p.run(packed, num_threads=1)
    for nt in (2, 3):
        assert np.array_equal(backend.bits(p.run(packed, num_threads=nt)), backend.bits(base))
    out = backend.empty((40, 128), "bfloat16")
    assert p.run(packed, out=out) is out
    assert np.array_equal(backend.bits(out), backend.bits(base))
    # Expert parallelism: the global ids map to this rank's 8 experts, or -1 for a 9th elsewhere.
    emap = backend.asarray(np.array([0, 1, 2, 3, 4, 5, 6, 7, -1], np.int32))
    got = p.run(packed, expert_map=emap)
    assert np.array_equal(backend.bits(got), backend.bits(base))


def test_packed_bytes_half_of_w8a8():
    E, H, I = 4, 512, 256
    (v13, v2, s13, s2), _ = w4_weights("int4", E, H, I, 128)
    p4 = cpumoe.prepack_int4(v13, v2, s13, s2, group_size=128)
    p8 = cpumoe.prepack(v13, v2, np.ones((E, 2 * I), np.float32), np.ones((E, H), np.float32))
    weights = E * 3 * H * I
    assert weights // 2 <= p4.packed_bytes - weights // 128 * 4 <= weights // 2 + 64 * 1024
    assert p4.packed_bytes < 0.55 * p8.packed_bytes
    assert "int4" in repr(p4) and p4.path in cpumoe.available_paths("int4")


def test_mxfp4_nan_scale_gives_nan_rows():
    (b13, e13, b2, e2), _ = w4_weights("mxfp4", 4, 128, 64)
    e13 = e13.copy()
    e13[1, 3, 2] = 255  # expert 1: NaN (E8M0 255)
    packed = cpumoe.prepack_mxfp4(b13, e13, b2, e2)
    x = np.random.default_rng(3).standard_normal((4, 128)).astype(np.float32)
    ids = np.array([[1], [0], [1], [2]], np.int32)
    out = cpumoe.fused_moe_int8(x, packed, np.ones((4, 1), np.float32), ids)
    assert np.isnan(out[[0, 2]]).all() and np.isfinite(out[[1, 3]]).all()
    ref = R.ref_fused_moe_mxfp4(x, b13, e13, b2, e2, np.ones((4, 1), np.float32), ids)
    assert np.isnan(ref[[0, 2]]).all()


def test_scratch_bytes_covers_a_call():
    (v13, v2, s13, s2), _ = w4_weights("int4", 8, 128, 128, 32)
    packed = cpumoe.prepack_int4(v13, v2, s13, s2, group_size=32)
    x = np.ones((50, 128), np.float32)
    cpumoe._C.release_thread_scratch()  # this thread's block from earlier, larger calls
    ids = np.tile(np.arange(4, dtype=np.int32), (50, 1))
    cpumoe.fused_moe_int8(x, packed, np.ones((50, 4), np.float32), ids, num_threads=2)
    assert 0 < cpumoe._C.thread_scratch_bytes() <= cpumoe.scratch_bytes(50, 4, packed,
                                                                        num_threads=2)


# ---------------------------------------------------------------------------- errors
def test_int4_bad_inputs_are_clear_errors():
    (v13, v2, s13, s2), _ = w4_weights("int4", 2, 128, 64, 32)

    def bad(exc, match, *a, **kw):
        with pytest.raises(exc, match=match):
            cpumoe.prepack_int4(*a, **kw)

    v = v13.copy()
    v[0, 1, 2] = 8
    bad(ValueError, r"^w13: int4 values must be in \[-8, 7\]", v, v2, s13, s2)
    v = v2.copy()
    v[1, 0, 0] = -9
    bad(ValueError, r"^w2: int4 values", v13, v, s13, s2)
    (w13, w2b, t13, t2), _ = w4_weights("int4", 8, 128, 64, 32)
    v = w13.copy()
    v[7, 127, 127] = 8  # the last of 131072 values: past the range check's first 64 K chunk
    bad(ValueError, r"^w13: int4 values must be in \[-8, 7\] \(element 131071 is 8\)", v, w2b,
        t13, t2)
    bad(ValueError, "^group_size: 128 must divide I = 64", v13, v2, s13, s2, group_size=128)
    bad(ValueError, "^group_size: must be a positive multiple of 32", v13, v2, s13, s2,
        group_size=48)
    bad(ValueError, "^group_size", v13, v2, s13, s2, group_size=0)
    bad(ValueError, r"^s13: .*shape", v13, v2, s13[:, :, :2], s2)
    bad(ValueError, r"^s2: .*shape", v13, v2, s13, s2.reshape(2, 128, 2)[:, :, :1])
    bad(ValueError, "^s13: every scale must be finite",
        v13, v2, np.where(s13 > 0, np.nan, s13).astype(np.float32), s2)
    s = s2.copy()
    s[0, 0, 0] = np.inf
    bad(ValueError, "^s2: every scale", v13, v2, s13, s)
    bad(TypeError, "^w13: dtype must be int8", v13.astype(np.float32), v2, s13, s2)
    bad(TypeError, "^w2: dtype must be int8", v13, v2.astype(np.int16), s13, s2)
    bad(ValueError, "^w13: shape", v13[0], v2, s13, s2)
    bad(ValueError, "^w2: ", v13, v2[:, :, :32], s13, s2)


def test_int4_affine_bad_inputs_are_clear_errors():
    (c13, c2, p13, p2), _ = w4_weights("int4_affine", 2, 128, 64, 32)

    def bad(exc, match, *a, **kw):
        with pytest.raises(exc, match=match):
            cpumoe.prepack_int4_affine(*a, **kw)

    c = c13.copy()
    c[0, 1, 2] = 16
    bad(ValueError, r"^w13: int4_affine codes must be in \[0, 15\] \(element 130 is 16\)", c,
        c2, p13, p2)
    bad(TypeError, "^w13: dtype must be uint8", c13.view(np.int8), c2, p13, p2)
    bad(ValueError, r"^s13: .*shape", c13, c2, p13[..., 0], p2)  # scales without their mins
    bad(ValueError, r"^s2: .*shape", c13, c2, p13, p2[:, :, :1])
    p = p2.copy()
    p[1, 2, 1, 1] = np.nan  # a min
    bad(ValueError, "^s2: every scale must be finite", c13, c2, p13, p)
    p = p13.copy()
    p[0, 0, 0] = (3e38, 1e38)  # min + 8 * scale overflows
    bad(ValueError, "^s13: min \\+ 8 \\* scale overflows fp32 at group 0", c13, c2, p, p2)
    bad(ValueError, "^group_size: 128 must divide I = 64", c13, c2, p13, p2, group_size=128)
    with pytest.raises(ValueError, match="int4_affine codes"):
        R.ref_fused_moe_int4_affine(np.ones((1, 128), np.float32), c13 | 16, c2, p13, p2,
                                    np.ones((1, 1), np.float32), np.zeros((1, 1), np.int32))


def test_int4_affine_quantizer_is_min_max():
    """quantize_int4_affine: min and (max - min) / 15 per group; values on the grid round-trip;
    the packed op of the dequantized weights is the same as of the codes (same layer)."""
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 16, (3, 64), dtype=np.uint8)
    codes[:, ::32] = 0
    codes[:, 1::32] = 15
    w = codes.astype(np.float32) * np.float32(0.5) - np.float32(3.0)
    q, sm = R.quantize_int4_affine(w, 32)
    assert q.dtype == np.uint8 and sm.shape == (3, 2, 2)
    assert np.array_equal(q, codes) and (sm[..., 0] == 0.5).all() and (sm[..., 1] == -3).all()
    assert np.array_equal(R.dequantize_int4_affine(q, sm, 32), w)
    flat = np.full((1, 32), 2.5, np.float32)  # a constant group: scale 1, every code 0
    q, sm = R.quantize_int4_affine(flat, 32)
    assert (q == 0).all() and sm.tolist() == [[[1.0, 2.5]]]


def test_int8_affine_bad_inputs_are_clear_errors():
    """int8_affine: every uint8 code is a value; each plane's scale (16 * scale) and offset
    (min + 128 * scale, 8 * scale) must be finite fp32; the shapes and dtypes as int4_affine."""
    (c13, c2, p13, p2), _ = w4_weights("int8_affine", 2, 128, 64, 32)

    def bad(exc, match, *a, **kw):
        with pytest.raises(exc, match=match):
            cpumoe.prepack_int8_affine(*a, **kw)

    assert cpumoe.prepack_int8_affine(c13 | 0xF0, c2, p13, p2).weight_format == "int8_affine"
    bad(TypeError, "^w13: dtype must be uint8", c13.view(np.int8), c2, p13, p2)
    bad(ValueError, r"^s13: .*shape", c13, c2, p13[..., 0], p2)
    p = p13.copy()
    p[0, 0, 1] = (3e37, 0.0)  # 16 * scale overflows
    bad(ValueError, r"^s13: 16 \* scale or min \+ 128 \* scale overflows fp32 at group 1", c13,
        c2, p, p2)
    p = p2.copy()
    p[0, 0, 0, 1] = np.inf
    bad(ValueError, "^s2: every scale must be finite", c13, c2, p13, p)
    bad(ValueError, "^group_size: 128 must divide I = 64", c13, c2, p13, p2, group_size=128)
    with pytest.raises(TypeError, match="int8_affine codes"):
        R.ref_fused_moe_int8_affine(np.ones((1, 128), np.float32), c13.view(np.int8), c2, p13,
                                    p2, np.ones((1, 1), np.float32), np.zeros((1, 1), np.int32))


def test_int8_affine_is_close_to_the_float_layer():
    """8-bit codes: the op's error against the float layer of the dequantized weights is the
    int8 activations' (about W8A8's), well under int4_affine's on the same float weights."""
    E, H, I, T = 4, 256, 128, 16
    rng = np.random.default_rng(5)
    x = rng.standard_normal((T, H), dtype=np.float32)
    ids = random_topk_ids(rng, T, E, 2)
    tw = random_topk_weights(rng, T, 2)
    errs = {}
    for fmt in ("int8_affine", "int4_affine"):
        (c13, c2, p13, p2), _ = w4_weights(fmt, E, H, I, 32)
        deq = R.dequantize_int8_affine if fmt == "int8_affine" else R.dequantize_int4_affine
        w13, w2 = deq(c13, p13, 32), deq(c2, p2, 32)
        prepack = cpumoe.prepack_int8_affine if fmt == "int8_affine" else \
            cpumoe.prepack_int4_affine
        got = cpumoe.fused_moe_int8(x, prepack(c13, c2, p13, p2, group_size=32), tw, ids)
        want = _float_layer(x, w13, w2, tw, ids)  # fp64, on the dequantized weights
        errs[fmt] = float(np.abs(got - want).max() / np.abs(want).max())
        fl = _float_layer(x, *_float_weights(E, H, I, 0)[:2], tw, ids)  # the unquantized layer
        errs[fmt + "/float"] = float(np.abs(got - fl).max() / np.abs(fl).max())
    assert errs["int8_affine"] < 0.03, errs
    assert errs["int8_affine/float"] < 0.5 * errs["int4_affine/float"], errs


def _float_layer(x, w13, w2, tw, ids):
    x64 = x.astype(np.float64)
    out = np.zeros_like(x64)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t]):
            h = w13[e].astype(np.float64) @ x64[t]
            g, u = h[:inter], h[inter:]
            a = g / (1 + np.exp(-g)) * u
            out[t] += tw[t, j] * (w2[e].astype(np.float64) @ a)
    return out


def test_mxfp4_bad_inputs_are_clear_errors():
    (b13, e13, b2, e2), _ = w4_weights("mxfp4", 2, 128, 64)

    def bad(exc, match, *a):
        with pytest.raises(exc, match=match):
            cpumoe.prepack_mxfp4(*a)

    bad(TypeError, "^w13_blocks: dtype must be uint8", b13.view(np.int8), e13, b2, e2)
    bad(TypeError, "^w2_scales: dtype must be uint8", b13, e13, b2, e2.astype(np.float32))
    bad(ValueError, r"^w13_blocks: shape must be \[E, 2I, H / 32, 16\]", b13[..., :8], e13, b2,
        e2)
    bad(ValueError, "^w2_blocks: ", b13, e13, b2[:, :64], e2)
    bad(ValueError, "^w13_scales: ", b13, e13[:, :, :1], b2, e2)
    bad(ValueError, "^w2_scales: ", b13, e13, b2, e2[:1])


def test_reference_rejects_out_of_range_int4():
    (v13, v2, s13, s2), _ = w4_weights("int4", 2, 128, 64, 32)
    v = v13.astype(np.int8) * 2
    with pytest.raises(ValueError, match="int4 values"):
        R.ref_fused_moe_int4(np.ones((1, 128), np.float32), v, v2, s13, s2,
                             np.ones((1, 1), np.float32), np.zeros((1, 1), np.int32))


def test_quantizers_round_trip():
    """quantize_int4 / quantize_mxfp4 of values already on their grid are exact."""
    rng = np.random.default_rng(9)
    v = rng.integers(-7, 8, (3, 64), dtype=np.int8)
    v[:, ::32] = 7  # every group reaches 7: its scale is exactly the unit
    w = v.astype(np.float32) * np.float32(0.25)
    q, s = R.quantize_int4(w, 32)
    assert np.array_equal(q, v) and np.allclose(s, 0.25)
    assert np.array_equal(R.dequantize_int4(q, s, 32), w)
    # Ties between two magnitudes go to the even code: 0.75 (codes 1, 2) -> 1.0, 1.25 -> 1.0,
    # 5 (codes 6, 7) -> 4.
    tb, ts = R.quantize_mxfp4(np.array([[6.0, 0.75, 1.25, 5.0, -0.25] + [0.0] * 27], np.float32))
    assert ts[0, 0] == 127
    assert np.array_equal(R.dequantize_mxfp4(tb, ts)[0, :5], [6.0, 1.0, 1.0, 4.0, -0.0])
    codes = rng.integers(0, 16, (3, 64))
    codes[:, ::32] = 7  # +6 in every group: exponent 0 relative to 2^(e - 127)
    vals = R.MXFP4_VALUES[codes] * np.float32(4.0)
    blocks, scales = R.quantize_mxfp4(vals)
    assert np.array_equal(R.dequantize_mxfp4(blocks, scales), vals)
    assert (scales == 129).all()


# ---------------------------------------------------------------------------- Int4Experts
def _pack_int4_words(v: np.ndarray) -> np.ndarray:
    """compressed-tensors' int32 packing of int4 values [..., K] (K a multiple of 8): with the
    package when it is installed (the real format), else the same layout written out here."""
    try:
        if BACKEND_NAME != "torch":  # the numpy backend's run must not import torch
            raise ImportError
        import torch
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    except ImportError:
        u = (v.astype(np.int16) + 8).astype(np.uint8)
        b = (u[..., 0::2] | (u[..., 1::2] << 4)).astype(np.uint8)
        return np.ascontiguousarray(b).view("<i4")
    return pack_to_int32(torch.from_numpy(np.ascontiguousarray(v)), 4).numpy()


def test_int4_experts_vllm_names(backend):
    import types
    from cpumoe.experts import Int4Experts
    E, H, I, g, T, k = 8, 256, 128, 64, 11, 2
    (v13, v2, s13, s2), (b13, b2) = w4_weights("int4", E, H, I, g)
    layer = types.SimpleNamespace(
        w13_weight_packed=backend.asarray(_pack_int4_words(v13)),
        w2_weight_packed=backend.asarray(_pack_int4_words(v2)),
        w13_weight_scale=backend.asarray(s13), w2_weight_scale=backend.asarray(s2),
        w13_bias=backend.asarray(b13), w2_bias=backend.asarray(b2))
    ex = Int4Experts(H, I, E, k, "silu", group_size=g)
    ok, why = Int4Experts.is_supported_config(H, I, E, k, "bfloat16", "silu",
                                              {"weights": {"num_bits": 8, "type": "int",
                                                           "symmetric": True,
                                                           "strategy": "channel"}})
    assert not ok and "num_bits" in why
    ex.process_weights_after_loading(layer)
    assert ex.packed.weight_format == "int4" and ex.packed.group_size == g
    assert tuple(layer.w13_weight_packed.shape) == (0,)  # the loaded copy is freed
    rng = np.random.default_rng(4)
    x = backend.asarray(rng.standard_normal((T, H), dtype=np.float32), "bfloat16")
    ids = backend.asarray(random_topk_ids(rng, T, E, k))
    tw = backend.asarray(random_topk_weights(rng, T, k))
    out = ex.apply(x, tw, ids)
    ref = R.ref_fused_moe_int4(x, v13, v2, s13, s2, tw, ids, b13=b13, b2=b2, group_size=g)
    assert_moe_close(backend, out, ref)
    with pytest.raises(ValueError, match="group_size"):
        Int4Experts(H, I, E, k, group_size=48)
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        Int4Experts(H, 96, E, k, group_size=64)
