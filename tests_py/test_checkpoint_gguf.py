"""Loading GGUF MoE experts as stored (cpumoe.load_experts, cpumoe.checkpoint_gguf): tiny GGUF
files written by the real gguf package (llama.cpp's), each supported type checked against
gguf.quants.dequantize bit for bit and run through the op against the reference; every other
type, and malformed files, refused clearly; the experts' activation of each architecture."""

from __future__ import annotations

import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

import cpumoe  # noqa: E402
from cpumoe import reference as R  # noqa: E402
from cpumoe.checkpoint import UnsupportedCheckpoint  # noqa: E402
from cpumoe.checkpoint_gguf import GGUF_ACTIVATIONS, GgufUnsupported  # noqa: E402
from cpumoe.checkpoint_gguf import gguf_activation, read_gguf_experts  # noqa: E402
from conftest import Backend, assert_moe_close, random_topk_ids, random_topk_weights  # noqa: E402

GATE, UP, DOWN = "blk.{}.ffn_gate_exps", "blk.{}.ffn_up_exps", "blk.{}.ffn_down_exps"


def test_tensor_names_are_gguf_constants():
    names, MT = gguf.TENSOR_NAMES, gguf.MODEL_TENSOR
    assert names[MT.FFN_GATE_EXP].format(bid=3) == GATE.format(3)
    assert names[MT.FFN_UP_EXP].format(bid=3) == UP.format(3)
    assert names[MT.FFN_DOWN_EXP].format(bid=3) == DOWN.format(3)


def _write(path, tensors, arch="qwen3moe", block_count=2):
    """tensors: name -> (array, raw GGML type or None for a float array as it is)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(block_count)
    for name, (data, qtype) in tensors.items():
        if qtype is None:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _floats(rng, E, N, K):
    return (rng.standard_normal((E, N, K)) / np.sqrt(K)).astype(np.float32)


def _raw_q4_0(rng, E, N, K):
    """Hand-made Q4_0 blocks: fp16 d of either sign (some 0), random nibbles."""
    G = K // 32
    d = (rng.standard_normal((E, N, G)) * 0.02).astype(np.float16)
    d[rng.random((E, N, G)) < 0.05] = 0
    q = rng.integers(0, 16, (E, N, G, 32), dtype=np.uint8)
    qs = (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)
    blocks = np.concatenate([d[..., None].view(np.uint8), qs], axis=-1)  # [E, N, G, 18]
    return blocks.reshape(E, N, G * 18)


def _raw_mxfp4(rng, E, N, K, lo=100, hi=140):
    G = K // 32
    e = rng.integers(lo, hi, (E, N, G, 1), dtype=np.uint8)
    qs = rng.integers(0, 256, (E, N, G, 16), dtype=np.uint8)
    return np.concatenate([e, qs], axis=-1).reshape(E, N, G * 17)


def _f16_bytes(v):
    return np.ascontiguousarray(v.astype("<f2")).view(np.uint8)


def _raw_q4_1(rng, E, N, K):
    """Hand-made Q4_1 blocks: fp16 d of either sign (some 0), fp16 m of either sign, random
    nibbles (element j low in byte j, j + 16 high)."""
    G = K // 32
    d = (rng.standard_normal((E, N, G)) * 0.02).astype(np.float16)
    d[rng.random((E, N, G)) < 0.05] = 0
    m = (rng.standard_normal((E, N, G)) * 0.1).astype(np.float16)
    q = rng.integers(0, 16, (E, N, G, 32), dtype=np.uint8)
    qs = (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)
    blocks = np.concatenate([_f16_bytes(d[..., None]), _f16_bytes(m[..., None]), qs], axis=-1)
    return blocks.reshape(E, N, G * 20)


def _pack_q4_k_scales(sc, m):
    """The 12 scale bytes of Q4_K super-blocks from their 6-bit sc, m [..., 8] (llama.cpp's
    layout: bytes 0-3 sc 0-3 and the top 2 bits of sc 4-7; 4-7 the same for m; 8-11 the low 4
    bits of sc 4-7, of m 4-7 above)."""
    b0 = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    b4 = (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6)
    b8 = (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)
    return np.concatenate([b0, b4, b8], axis=-1).astype(np.uint8)


def _raw_q4_k(rng, E, N, K, d=None, dmin=None):
    """Hand-made Q4_K super-blocks (gguf's numpy has no Q4_K quantizer): fp16 d and dmin of
    either sign (some 0) unless given ([E, N, K / 256]), every 6-bit sc and m value at each of
    the 8 sub-block positions (when E N K / 256 >= 64), random nibbles."""
    S = K // 256
    shape = (E, N, S)
    if d is None:
        d = (rng.standard_normal(shape) * 0.002).astype(np.float16)
        d[rng.random(shape) < 0.05] = 0
    if dmin is None:
        dmin = (rng.standard_normal(shape) * 0.002).astype(np.float16)
        dmin[rng.random(shape) < 0.05] = 0
    n = E * N * S
    sc, m = (np.stack([rng.permutation(np.arange(n) % 64) for _ in range(8)], axis=-1)
             .astype(np.uint8).reshape(*shape, 8) for _ in range(2))
    q = rng.integers(0, 16, (*shape, 4, 2, 32), dtype=np.uint8)  # runs r: sub-blocks 2r, 2r + 1
    qs = (q[..., 0, :] | (q[..., 1, :] << 4)).astype(np.uint8).reshape(*shape, 128)
    blocks = np.concatenate([_f16_bytes(np.asarray(d, np.float16)[..., None]),
                             _f16_bytes(np.asarray(dmin, np.float16)[..., None]),
                             _pack_q4_k_scales(sc, m), qs], axis=-1)  # [E, N, S, 144]
    return blocks.reshape(E, N, S * 144)


def _bits_equal(a, b):
    """Equal float32 arrays bit for bit (signed zeros told apart)."""
    a, b = np.asarray(a), np.asarray(b)
    return (a.dtype == b.dtype == np.float32 and a.shape == b.shape
            and np.array_equal(a.view(np.uint32), b.view(np.uint32)))


def _layer(kind, rng, E, H, I):
    """(gate, up, down) raw blocks of GGML type ``kind`` (by several generators)."""
    shapes = ((E, I, H), (E, I, H), (E, H, I))
    if kind == "Q4_0":
        return [quantize(_floats(rng, *s), Q.Q4_0) if j != 1
                else _raw_q4_0(rng, *s) for j, s in enumerate(shapes)]
    if kind == "MXFP4":
        return [quantize(_floats(rng, *s), Q.MXFP4) if j == 0 else _raw_mxfp4(rng, *s)
                for j, s in enumerate(shapes)]
    return [quantize(_floats(rng, *s), Q.BF16) for s in shapes]


def _routing(T, E, k, H, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((T, H)).astype(np.float32), random_topk_weights(rng, T, k),
            random_topk_ids(rng, T, E, k))


FORMAT_OF = {"Q4_0": "int4", "MXFP4": "mxfp4", "BF16": "bf16"}


@pytest.mark.parametrize("kind", ["Q4_0", "MXFP4", "BF16"])
def test_supported_type_loads_exactly_and_runs(tmp_path, kind):
    E, H, I, L = 4, 128, 64, 1
    rng = np.random.default_rng(3)
    raw = _layer(kind, rng, E, H, I)
    qt = Q[kind]
    path = _write(tmp_path / "m.gguf", {f"{n.format(L)}.weight": (r, qt)
                                        for n, r in zip((GATE, UP, DOWN), raw)})
    lw = read_gguf_experts(path, L)
    assert lw.weight_format == FORMAT_OF[kind] and lw.activation == "silu"
    assert lw.gguf_types == (kind,) * 3 and lw.architecture == "qwen3moe"
    assert (lw.num_experts, lw.hidden, lw.intermediate) == (E, H, I) and lw.b13 is None
    gate, up, down = (dequantize(r, qt) for r in raw)  # gguf's own decoding, float32
    w13, w2 = lw.dequantized()
    w13, w2 = np.asarray(w13, np.float32), np.asarray(w2, np.float32)
    assert np.array_equal(w13[:, :I], gate) and np.array_equal(w13[:, I:], up)  # halves
    assert np.array_equal(w2, down)

    x, tw, ids = _routing(9, E, 2, H)
    ref = R.ref_fused_moe_experts(x, lw, tw, ids, "silu")
    fmt = FORMAT_OF[kind]
    for isa in cpumoe.available_paths(fmt):
        packed = cpumoe.load_experts(path, L, isa=isa, num_threads=1)
        assert packed.weight_format == fmt and packed.num_experts == E
        out = cpumoe.fused_moe(x, packed, tw, ids, activation="silu")
        assert_moe_close(Backend("numpy"), out, ref)
    # format forced; a subset of experts through read_gguf_experts.
    assert cpumoe.load_experts(path, L, format="gguf").weight_format == fmt
    part = read_gguf_experts(path, L, experts=[3, 1])
    assert np.array_equal(part.w2[0], lw.w2[3]) and list(part.expert_map()) == [-1, 1, -1, 0]


@pytest.mark.parametrize("kind", ["Q4_0", "MXFP4"])
def test_load_experts_act_quant(tmp_path, kind):
    """load_experts(act_quant=...): "group" keeps the W4A8 layer with group-wise activations,
    "bf16" runs it W4A16 (the BF16 op's result on gguf's dequantized weights, every path);
    a layer whose format has one activation mode (BF16 here) refuses it by name."""
    E, H, I, L = 4, 128, 64, 1
    rng = np.random.default_rng(5)
    raw = _layer(kind, rng, E, H, I)
    path = _write(tmp_path / "m.gguf", {f"{n.format(L)}.weight": (r, Q[kind])
                                        for n, r in zip((GATE, UP, DOWN), raw)})
    x, tw, ids = _routing(9, E, 2, H, seed=2)
    assert cpumoe.load_experts(path, L, act_quant="group").act_quant == "group"
    gate, up, down = (dequantize(r, Q[kind]) for r in raw)
    ref = R.ref_fused_moe_bf16(x, np.concatenate([gate, up], axis=1), down, tw, ids, "silu")
    for isa in cpumoe.available_paths("fp8"):
        packed = cpumoe.load_experts(path, L, isa=isa, act_quant="bf16")
        assert isinstance(packed, cpumoe.PackedMoeFp8) and packed.code_bits in (4, 8)
        assert_moe_close(Backend("numpy"), cpumoe.fused_moe(x, packed, tw, ids), ref)
    bpath = _write(tmp_path / "b.gguf", {f"{n.format(L)}.weight": (r, Q.BF16) for n, r in
                                         zip((GATE, UP, DOWN), _layer("BF16", rng, E, H, I))})
    with pytest.raises(ValueError, match="act_quant: the bf16 format .* act_quant is for int4"):
        cpumoe.load_experts(bpath, L, act_quant="bf16")


def test_q4_0_scales_of_any_sign_are_exact(tmp_path):
    """Q4_0 blocks with d > 0, d < 0 (llama.cpp's quantizer gives it whenever a block's
    largest-magnitude weight is positive, with q = 0 there: -8 d) and d = 0, in every tensor: the
    values q - 8 and the scales as stored, gguf's decoding exactly."""
    rng = np.random.default_rng(11)
    E, H, I = 2, 96, 64
    raw = [_raw_q4_0(rng, E, n, k) for n, k in ((I, H), (I, H), (H, I))]
    path = _write(tmp_path / "q.gguf", {f"{n.format(0)}.weight": (r, Q.Q4_0)
                                        for n, r in zip((GATE, UP, DOWN), raw)})
    lw = read_gguf_experts(path, 0)
    for v, s in ((lw.w13, lw.s13), (lw.w2, lw.s2)):
        assert v.min() >= -8 and v.max() <= 7 and (s < 0).any() and (s == 0).any()
    w13, w2 = lw.dequantized()
    gate, up, down = (dequantize(r, Q.Q4_0) for r in raw)
    assert np.array_equal(w13, np.concatenate([gate, up], axis=1)) and np.array_equal(w2, down)


def test_mxfp4_decoding_matches_gguf_over_all_scales(tmp_path):
    """Every E8M0 byte but 255 (and the overflowing top ones) with random codes: cpumoe's mxfp4
    of the converted blocks is gguf's MXFP4 dequantization exactly (halved E8M0 x doubled
    E2M1), subnormal scales included."""
    rng = np.random.default_rng(5)
    E, H, I = 1, 64, 256
    raw = [_raw_mxfp4(rng, E, n, k) for n, k in ((I, H), (I, H), (H, I))]
    gate = raw[0].reshape(E, I, H // 32, 17)
    gate[..., 0] = np.minimum(np.arange(I), 250).astype(np.uint8)[None, :, None]
    path = _write(tmp_path / "mx.gguf", {f"{n.format(0)}.weight": (r, Q.MXFP4)
                                         for n, r in zip((GATE, UP, DOWN), raw)})
    lw = read_gguf_experts(path, 0)
    w13, w2 = lw.dequantized()
    assert np.array_equal(w13[:, :I], dequantize(raw[0], Q.MXFP4))
    assert np.array_equal(w2, dequantize(raw[2], Q.MXFP4))


def test_gpt_oss_mxfp4_with_biases(tmp_path):
    E, H, I, L = 4, 64, 64, 0
    rng = np.random.default_rng(8)
    raw = _layer("MXFP4", rng, E, H, I)
    bias = [(rng.standard_normal((E, n)) * 0.1).astype(np.float32) for n in (I, I, H)]
    t = {f"{n.format(L)}.weight": (r, Q.MXFP4) for n, r in zip((GATE, UP, DOWN), raw)}
    t.update({f"{n.format(L)}.bias": (b, None) for n, b in zip((GATE, UP, DOWN), bias)})
    path = _write(tmp_path / "oss.gguf", t, arch="gpt-oss", block_count=1)
    lw = read_gguf_experts(path, L)
    assert lw.activation == "swigluoai" == gguf_activation("gpt-oss")
    assert lw.weight_format == "mxfp4" and lw.architecture == "gpt-oss"
    w13, w2 = lw.dequantized()
    gate, up, down = (dequantize(r, Q.MXFP4) for r in raw)
    assert np.array_equal(w13[:, 0::2], gate) and np.array_equal(w13[:, 1::2], up)  # interleaved
    assert np.array_equal(w2, down)
    assert np.array_equal(lw.b13[:, 0::2], bias[0]) and np.array_equal(lw.b13[:, 1::2], bias[1])
    assert np.array_equal(lw.b2, bias[2])
    x, tw, ids = _routing(7, E, 2, H, seed=2)
    ref = R.ref_fused_moe_experts(x, lw, tw, ids, "swigluoai")
    for isa in cpumoe.available_paths("mxfp4"):
        packed = cpumoe.load_experts(path, L, isa=isa)
        assert packed.has_bias13 and packed.has_bias2
        out = cpumoe.fused_moe(x, packed, tw, ids, activation="swigluoai")
        assert_moe_close(Backend("numpy"), out, ref)


# ---------------------------------------------------------------------------- int4_affine
# Q4_1 and Q4_K load as int4_affine (group_size 32) as stored. Exactness: cpumoe's dequantization
# of the loaded layer (float32 scale * q + min) is gguf.quants.dequantize's bit for bit (no
# rounding apart): Q4_1 is d * q + m on both sides; for Q4_K the scale float(d) * sc and
# float(dmin) * m are exact in float32 (11 significant bits times 6), scale * q is exact (17
# bits times 4), and gguf's d * sc * q - dmin * m rounds once, in the same addition as
# scale * q + (-(dmin * m)).
AFFINE_KINDS = {"Q4_1": ("Q4_1",) * 3, "Q4_K": ("Q4_K",) * 3, "mixed": ("Q4_K", "Q4_1", "Q4_K")}


def _affine_one(kind, rng, j, shape):
    """Raw blocks of tensor j (0 gate, 1 up, 2 down) of type ``kind``: Q4_1 from gguf's own
    quantizer (hand-made for up), Q4_K hand-made."""
    if kind == "Q4_K":
        return _raw_q4_k(rng, *shape)
    return quantize(_floats(rng, *shape), Q.Q4_1) if j != 1 else _raw_q4_1(rng, *shape)


def _affine_layer(kinds, rng, E, H, I):
    """(gate, up, down) raw blocks of GGML types ``kinds``."""
    return [_affine_one(k, rng, j, s)
            for j, (k, s) in enumerate(zip(kinds, ((E, I, H), (E, I, H), (E, H, I))))]


def _expected_pairs(raw, kind):
    """The (scale, min) pairs [E, N, K / 32, 2] decoded here independently of the loader, with
    gguf's own Q4_K scale unpacking (gguf.quants.Q4_K.get_scale_min)."""
    E, N, _ = raw.shape
    if kind == "Q4_1":
        b = raw.reshape(E, N, -1, 20)
        d = b[..., 0:2].copy().view("<f2")[..., 0].astype(np.float32)
        m = b[..., 2:4].copy().view("<f2")[..., 0].astype(np.float32)
        return np.stack([d, m], axis=-1)
    b = raw.reshape(-1, 144)
    d = b[:, 0:2].copy().view("<f2")[:, 0].astype(np.float32)[:, None]
    dmin = b[:, 2:4].copy().view("<f2")[:, 0].astype(np.float32)[:, None]
    sc, m = gguf.quants.Q4_K.get_scale_min(b[:, 4:16].copy())
    pairs = np.stack([d * sc.astype(np.float32), -(dmin * m.astype(np.float32))], axis=-1)
    return pairs.reshape(E, N, -1, 2)


def _affine_file(path, kinds, seed, E, H, I, L):
    """(raw blocks, the file) of layer L with gate / up / down of GGUF types kinds."""
    raw = _affine_layer(kinds, np.random.default_rng(seed), E, H, I)
    return raw, _write(path, {f"{n.format(L)}.weight": (r, Q[k])
                              for n, r, k in zip((GATE, UP, DOWN), raw, kinds)})


@pytest.mark.parametrize("case", list(AFFINE_KINDS))
def test_q4_1_and_q4_k_load_exactly_as_int4_affine(tmp_path, case):
    """Q4_1 (gguf's own quantizer and hand-made blocks), Q4_K (hand-made super-blocks, every
    6-bit sc / m value), and the two mixed in one layer: int4_affine g32 as stored, cpumoe's
    dequantization == gguf.quants.dequantize bit for bit."""
    kinds = AFFINE_KINDS[case]
    E, H, I, L = 3, 256, 256, 1
    raw, path = _affine_file(tmp_path / "a.gguf", kinds, 21, E, H, I, L)
    lw = read_gguf_experts(path, L)
    assert lw.weight_format == "int4_affine" and lw.group_size == 32 and lw.activation == "silu"
    assert lw.gguf_types == kinds and (lw.num_experts, lw.hidden, lw.intermediate) == (E, H, I)
    assert lw.w13.dtype == lw.w2.dtype == np.uint8 and lw.w13.max() <= 15 and lw.w2.max() <= 15
    assert lw.s13.shape == (E, 2 * I, H // 32, 2) and lw.s2.shape == (E, H, I // 32, 2)
    assert lw.s13.dtype == lw.s2.dtype == np.float32
    scales, mins = lw.s13[..., 0], lw.s13[..., 1]
    assert (scales < 0).any() and (scales == 0).any() and (mins < 0).any() and (mins > 0).any()
    assert _bits_equal(lw.s13[:, :I], _expected_pairs(raw[0], kinds[0]))
    assert _bits_equal(lw.s13[:, I:], _expected_pairs(raw[1], kinds[1]))
    assert _bits_equal(lw.s2, _expected_pairs(raw[2], kinds[2]))
    gate, up, down = (dequantize(r, Q[k]) for r, k in zip(raw, kinds))  # float32
    w13, w2 = lw.dequantized()
    assert _bits_equal(w13[:, :I], gate) and _bits_equal(w13[:, I:], up)  # halves
    assert _bits_equal(w2, down)
    assert np.array_equal(cpumoe.quantize.dequantize_weights("int4_affine", lw.w2, lw.s2, 32),
                          w2)
    part = read_gguf_experts(path, L, experts=[2, 0])
    assert np.array_equal(part.w13[0], lw.w13[2]) and np.array_equal(part.s2[1], lw.s2[0])
    # swigluoai named by the caller: gate / up interleaved by row.
    lo = read_gguf_experts(path, L, activation="swigluoai")
    assert lo.activation == "swigluoai"
    assert np.array_equal(lo.w13[:, 0::2], lw.w13[:, :I]) and np.array_equal(
        lo.s13[:, 1::2], lw.s13[:, I:])


def test_q4_k_extreme_super_block_scales_are_exact(tmp_path):
    """Q4_K d / dmin at fp16's extremes (+-65504, +-the smallest subnormal 2^-24, +-0, 2^-14,
    negatives) with every sc / m: the pairs are float(d) * sc and -(float(dmin) * m) exactly (as
    float64 products) and the weights gguf's bit for bit, signed zeros included."""
    rng = np.random.default_rng(9)
    E, H, I = 1, 256, 512
    special = np.array([65504, -65504, 2.0**-24, -(2.0**-24), 0.0, -0.0, 2.0**-14, -3.5e-3],
                       np.float16)
    raw = []
    for n, k in ((I, H), (I, H), (H, I)):
        S = k // 256
        d = special[rng.integers(0, len(special), (E, n, S))]
        dmin = special[rng.integers(0, len(special), (E, n, S))]
        raw.append(_raw_q4_k(rng, E, n, k, d=d, dmin=dmin))
    path = _write(tmp_path / "k.gguf", {f"{n.format(0)}.weight": (r, Q.Q4_K)
                                        for n, r in zip((GATE, UP, DOWN), raw)})
    lw = read_gguf_experts(path, 0)
    b = raw[2].reshape(E, H, -1, 144)
    d64 = b[..., 0:2].copy().view("<f2")[..., 0].astype(np.float64)
    dmin64 = b[..., 2:4].copy().view("<f2")[..., 0].astype(np.float64)
    sc, m = gguf.quants.Q4_K.get_scale_min(b.reshape(-1, 144)[:, 4:16].copy())
    for j in range(8):  # every 6-bit value at every position, through gguf's own unpacking
        assert set(sc[:, j].tolist()) == set(m[:, j].tolist()) == set(range(64))
    sc, m = sc.reshape(E, H, -1, 8), m.reshape(E, H, -1, 8)
    s2 = lw.s2.reshape(E, H, -1, 8, 2).astype(np.float64)
    assert np.array_equal(s2[..., 0], d64[..., None] * sc) and np.array_equal(
        s2[..., 1], -(dmin64[..., None] * m))
    w13, w2 = lw.dequantized()
    assert _bits_equal(w13[:, :I], dequantize(raw[0], Q.Q4_K))
    assert _bits_equal(w13[:, I:], dequantize(raw[1], Q.Q4_K))
    assert _bits_equal(w2, dequantize(raw[2], Q.Q4_K))
    assert (np.signbit(w2) & (w2 == 0)).any()  # -0.0 weights, as gguf's


@pytest.mark.parametrize("case", ["Q4_1", "Q4_K"])
def test_q4_1_and_q4_k_run_like_the_reference(tmp_path, case):
    """The fused op on the loaded int4_affine layer against cpumoe.reference on the same weights
    (needs the int4_affine kernels of the native extension)."""
    kinds = AFFINE_KINDS[case]
    E, H, I, L = 4, 256, 256, 0
    _, path = _affine_file(tmp_path / "r.gguf", kinds, 13, E, H, I, L)
    lw = read_gguf_experts(path, L)
    x, tw, ids = _routing(9, E, 2, H, seed=4)
    ref = R.ref_fused_moe_experts(x, lw, tw, ids, activation="silu")
    paths = cpumoe.available_paths("int4_affine")
    assert paths and paths[-1] == "portable"
    for isa in paths:
        packed = cpumoe.load_experts(path, L, isa=isa, num_threads=1)
        assert packed.weight_format == "int4_affine" and packed.num_experts == E
        out = cpumoe.fused_moe(x, packed, tw, ids, activation="silu")
        assert_moe_close(Backend("numpy"), out, ref)


def test_q4_k_gate_up_with_q6_k_down_is_refused(tmp_path):
    """llama.cpp's Q4_K_M files often store ffn_down_exps as Q6_K: that layer is refused, the
    message saying down is Q6_K (not read as something else)."""
    rng = np.random.default_rng(14)
    E, H, I = 2, 256, 256
    t = {f"{n.format(0)}.weight": (_raw_q4_k(rng, E, I, H), Q.Q4_K) for n in (GATE, UP)}
    down = f"{DOWN.format(0)}.weight"
    t[down] = (rng.integers(0, 256, (E, H, I // 256 * 210), dtype=np.uint8), Q.Q6_K)
    path = _write(tmp_path / "km.gguf", t)
    msg = (f"{down} is Q6_K: cpumoe does not run Q6_K experts yet \\(needs a scale per 16 k.*"
           f"gate / up / down are Q4_K / Q4_K / Q6_K")
    with pytest.raises(GgufUnsupported, match=msg):
        read_gguf_experts(path, 0)
    with pytest.raises(UnsupportedCheckpoint, match=msg):
        cpumoe.load_experts(path, 0)


def _raw_q6_k(rng, E, N, K):
    """Hand-made Q6_K super-blocks (210 bytes: ql 128, qh 64, int8 scales 16, fp16 d): random
    bits with a finite d of either sign."""
    S = K // 256
    body = rng.integers(0, 256, (E, N, S, 208), dtype=np.uint8)
    d = (rng.standard_normal((E, N, S, 1)) * 1e-4).astype(np.float16)
    return np.concatenate([body, _f16_bytes(d)], axis=-1).reshape(E, N, S * 210)


def test_q6_k_down_requantized_on_request(tmp_path):
    """llama.cpp's Q4_K_M layout (Q4_K gate / up, Q6_K down): refused with a hint by default;
    with requantize="int8_affine" the layer is int8_affine, gate / up exactly gguf's weights,
    down gguf's dequantized Q6_K re-quantized to 8-bit groups of 32 (within half a step of each
    group's range / 255), named in ``requantized``; the op runs it as the reference does."""
    rng = np.random.default_rng(18)
    E, H, I = 3, 256, 256
    raw = [_raw_q4_k(rng, E, I, H), _raw_q4_k(rng, E, I, H), _raw_q6_k(rng, E, H, I)]
    kinds = ("Q4_K", "Q4_K", "Q6_K")
    path = _write(tmp_path / "km.gguf", {f"{n.format(0)}.weight": (r, Q[k])
                                         for n, r, k in zip((GATE, UP, DOWN), raw, kinds)})
    with pytest.raises(GgufUnsupported, match="Q6_K.*requantize='int8_affine' reads it"):
        read_gguf_experts(path, 0)
    lw = read_gguf_experts(path, 0, requantize="int8_affine")
    assert lw.weight_format == "int8_affine" and lw.requantized == (f"{DOWN.format(0)}.weight",)
    w13, w2 = lw.dequantized()
    assert _bits_equal(w13[:, :I], dequantize(raw[0], Q.Q4_K))
    assert _bits_equal(w13[:, I:], dequantize(raw[1], Q.Q4_K))
    down = dequantize(raw[2], Q.Q6_K).reshape(E, H, I // 32, 32)
    span = down.max(-1) - down.min(-1)
    err = np.abs(w2.reshape(down.shape) - down).max(-1)
    assert (err <= span / 510 * 1.001 + 1e-12).all()
    assert np.abs(w2.reshape(down.shape) - down).max() > 0  # re-quantized, not exact
    x, tw, ids = _routing(7, E, 2, H, seed=6)
    ref = R.ref_fused_moe_experts(x, lw, tw, ids, activation="silu")
    packed = cpumoe.load_experts(path, 0, requantize="int8_affine", num_threads=1)
    assert packed.weight_format == "int8_affine"
    assert_moe_close(Backend("numpy"), cpumoe.fused_moe(x, packed, tw, ids, activation="silu"), ref)
    with pytest.raises(ValueError, match="requantize: None or 'int8_affine'"):
        read_gguf_experts(path, 0, requantize="int4")


def test_q4_0_with_q4_k_loads_as_int4_affine(tmp_path):
    """A layer of Q4_0 gate / up and Q4_K down is read as int4_affine (the wider), the Q4_0
    values v with scale d as codes v + 8 with (d, -8 d): gguf's weights exactly."""
    rng = np.random.default_rng(15)
    E, H, I = 2, 256, 256
    raw = [quantize(_floats(rng, E, I, H), Q.Q4_0) for _ in range(2)] + [_raw_q4_k(rng, E, H, I)]
    kinds = ("Q4_0", "Q4_0", "Q4_K")
    path = _write(tmp_path / "m.gguf", {f"{n.format(0)}.weight": (r, Q[k])
                                        for n, r, k in zip((GATE, UP, DOWN), raw, kinds)})
    lw = read_gguf_experts(path, 0)
    assert lw.weight_format == "int4_affine" and lw.gguf_types == kinds
    w13, w2 = lw.dequantized()
    assert np.array_equal(w13[:, :I], dequantize(raw[0], Q.Q4_0))
    assert np.array_equal(w13[:, I:], dequantize(raw[1], Q.Q4_0))
    assert _bits_equal(w2, dequantize(raw[2], Q.Q4_K))
    assert cpumoe.load_experts(path, 0).weight_format == "int4_affine"


# ---------------------------------------------------------------------------- int8_affine
# Q8_0, Q5_0, Q5_1 (gguf's own quantizer and hand-made blocks) and Q5_K (hand-made super-blocks)
# load as int8_affine (8-bit codes, a (scale, min) pair per 32 k) as stored: cpumoe's
# dequantization of the loaded layer equals gguf.quants.dequantize (bit for bit for Q5_1 and
# Q5_K; Q8_0 and Q5_0 up to the sign of zero weights: gguf's d * q has no min).
def _raw_q5_k(rng, E, N, K):
    """Hand-made Q5_K super-blocks: Q4_K's d / dmin / scales and low nibbles with the 32 qh
    bytes (bit s of qh[l]: element l of sub-block s's fifth bit) in between."""
    q4 = _raw_q4_k(rng, E, N, K).reshape(E, N, -1, 144)
    qh = rng.integers(0, 256, (*q4.shape[:3], 32), dtype=np.uint8)
    return np.concatenate([q4[..., :16], qh, q4[..., 16:]], axis=-1).reshape(E, N, -1)


def _raw_q5(rng, E, N, K, kind):
    """Hand-made Q5_0 / Q5_1 blocks: random fp16 d (and m) of either sign, qh and nibbles."""
    G = K // 32
    d = (rng.standard_normal((E, N, G, 1)) * 0.01).astype(np.float16)
    head = [_f16_bytes(d)]
    if kind == "Q5_1":
        head.append(_f16_bytes((rng.standard_normal((E, N, G, 1)) * 0.05).astype(np.float16)))
    body = rng.integers(0, 256, (E, N, G, 20), dtype=np.uint8)
    return np.concatenate(head + [body], axis=-1).reshape(E, N, -1)


def _int8_one(kind, rng, j, shape):
    if kind == "Q5_K":
        return _raw_q5_k(rng, *shape)
    if kind in ("Q5_0", "Q5_1") and j == 1:
        return _raw_q5(rng, *shape, kind)
    return quantize(_floats(rng, *shape), Q[kind])


INT8_KINDS = {"Q8_0": ("Q8_0",) * 3, "Q5_0": ("Q5_0",) * 3, "Q5_1": ("Q5_1",) * 3,
              "Q5_K": ("Q5_K",) * 3, "Q4_K+Q5_K": ("Q4_K", "Q4_K", "Q5_K"),
              "Q4_0+Q8_0": ("Q4_0", "Q5_1", "Q8_0")}


@pytest.mark.parametrize("case", list(INT8_KINDS))
def test_8_bit_types_load_exactly_as_int8_affine_and_run(tmp_path, case):
    kinds = INT8_KINDS[case]
    E, H, I, L = 3, 256, 256, 1
    rng = np.random.default_rng(31)
    shapes = ((E, I, H), (E, I, H), (E, H, I))
    raw = [_int8_one(k, rng, j, s) if k not in ("Q4_K", "Q4_0") else
           (_raw_q4_k(rng, *s) if k == "Q4_K" else quantize(_floats(rng, *s), Q.Q4_0))
           for j, (k, s) in enumerate(zip(kinds, shapes))]
    path = _write(tmp_path / "q.gguf", {f"{n.format(L)}.weight": (r, Q[k])
                                        for n, r, k in zip((GATE, UP, DOWN), raw, kinds)})
    lw = read_gguf_experts(path, L)
    assert lw.weight_format == "int8_affine" and lw.group_size == 32 and lw.gguf_types == kinds
    assert lw.w13.dtype == lw.w2.dtype == np.uint8
    assert lw.s13.shape == (E, 2 * I, H // 32, 2) and lw.s2.dtype == np.float32
    if kinds[2] in ("Q8_0", "Q5_K", "Q5_0", "Q5_1"):
        assert lw.w2.max() > 15  # 8-bit (Q8_0) or 5-bit codes
    gate, up, down = (dequantize(r, Q[k]) for r, k in zip(raw, kinds))
    w13, w2 = lw.dequantized()
    exact = _bits_equal if case in ("Q5_1", "Q5_K") else np.array_equal
    assert exact(w13[:, :I], gate) and exact(w13[:, I:], up) and exact(w2, down)
    x, tw, ids = _routing(9, E, 2, H, seed=5)
    ref = R.ref_fused_moe_experts(x, lw, tw, ids, activation="silu")
    paths = cpumoe.available_paths("int8_affine")
    assert paths and paths[-1] == "portable"
    outs = []
    for isa in paths:
        packed = cpumoe.load_experts(path, L, isa=isa, num_threads=1)
        assert packed.weight_format == "int8_affine" and packed.num_experts == E
        outs.append(cpumoe.fused_moe(x, packed, tw, ids, activation="silu"))
        assert_moe_close(Backend("numpy"), outs[-1], ref)
        assert np.array_equal(outs[-1], outs[0]), f"path {isa} differs"


@pytest.mark.parametrize("which,kind,field,value,what", [
    (UP, "Q4_1", 0, np.nan, "Q4_1 block scale d nan"),
    (DOWN, "Q4_1", 2, np.inf, "Q4_1 block min m inf"),
    (GATE, "Q4_K", 0, np.nan, "Q4_K super-block scale d nan"),
    (DOWN, "Q4_K", 2, -np.inf, "Q4_K super-block min scale dmin -inf"),
    (GATE, "Q8_0", 0, np.nan, "Q8_0 block scale d nan"),
    (DOWN, "Q5_1", 2, np.inf, "Q5_1 block min m inf"),
    (UP, "Q5_K", 2, -np.inf, "Q5_K super-block min scale dmin -inf")])
def test_non_finite_affine_scales_are_refused(tmp_path, which, kind, field, value, what):
    rng = np.random.default_rng(16)
    E, H, I = 2, 256, 256
    one = _affine_one if kind in ("Q4_1", "Q4_K") else _int8_one
    t = {f"{n.format(0)}.weight": (one(kind, rng, 1, s), Q[kind])
         for n, s in zip((GATE, UP, DOWN), ((E, I, H), (E, I, H), (E, H, I)))}
    name = f"{which.format(0)}.weight"
    raw = t[name][0]
    blk_k, bsize = gguf.GGML_QUANT_SIZES[Q[kind]]
    b = raw.reshape(E, raw.shape[1], -1, bsize)
    row, blk = 5, (3 if blk_k == 32 else 0)
    b[1, row, blk, field:field + 2] = _f16_bytes(np.array([value], np.float16))
    where = "block" if blk_k == 32 else "super-block"
    fmt = "int4_affine" if kind in ("Q4_1", "Q4_K") else "int8_affine"
    with pytest.raises(GgufUnsupported, match=f"{name}: {what} \\(expert 1, row {row}, {where} "
                                              f"{blk}\\) is not finite; cpumoe's {fmt}"):
        cpumoe.load_experts(_write(tmp_path / "n.gguf", t), 0)


# ---------------------------------------------------------------------------- activations
def test_expert_activation_of_architectures():
    """The table: each architecture one of gguf's with routed expert tensors, each activation one
    of the op's; Mixtral / Qwen / DeepSeek / OLMoE / Granite / DBRX silu, grok gelu (the tanh
    form, as ggml_gelu and Grok's JAX code), gpt-oss swigluoai; anything else refused."""
    arch_of = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    for arch, act in GGUF_ACTIVATIONS.items():
        assert arch in arch_of, arch
        assert gguf.MODEL_TENSOR.FFN_DOWN_EXP in gguf.MODEL_TENSORS[arch_of[arch]], arch
        assert cpumoe.ops.parse_activation(act)[0] in cpumoe.ACTIVATIONS
        assert gguf_activation(arch) == act
    for arch in ("llama", "qwen2moe", "qwen3moe", "deepseek2", "dbrx", "olmoe", "granitemoe"):
        assert gguf_activation(arch) == "silu"
    assert gguf_activation("grok") == "gelu_tanh"
    assert gguf_activation("gpt-oss") == "swigluoai"
    for arch in ("smallthinker", "nemotron_h_moe", "no-such-arch", ""):
        with pytest.raises(GgufUnsupported, match=f"expert activation of architecture "
                                                  f"'{arch}' is not known.*activation="):
            gguf_activation(arch)


def test_unknown_architecture_needs_the_activation(tmp_path):
    rng = np.random.default_rng(17)
    path = _write(tmp_path / "u.gguf", _q4_layer(rng), arch="mystery-moe")
    with pytest.raises(GgufUnsupported, match="expert activation of architecture 'mystery-moe' "
                                              "is not known"):
        read_gguf_experts(path, 0)
    with pytest.raises(UnsupportedCheckpoint, match="'mystery-moe' is not known"):
        cpumoe.load_experts(path, 0)
    lw = read_gguf_experts(path, 0, activation="gelu")
    assert lw.activation == "gelu" and lw.architecture == "mystery-moe"
    assert cpumoe.load_experts(path, 0, activation="silu").weight_format == "int4"
    oss = read_gguf_experts(path, 0, activation="swigluoai(limit=7,alpha=1.702)")
    assert np.array_equal(oss.w13[:, 0::2], lw.w13[:, :32])  # interleaved
    with pytest.raises(ValueError, match="activation: 'relu' is not an activation of cpumoe"):
        read_gguf_experts(path, 0, activation="relu")
    with pytest.raises(ValueError, match="activation: 'silu_clamp'"):  # its limit is required
        read_gguf_experts(path, 0, activation="silu_clamp")
    with pytest.raises(TypeError, match="activation: must be a str"):
        read_gguf_experts(path, 0, activation=1)


def test_grok_experts_run_with_gelu_tanh(tmp_path):
    E, H, I, L = 4, 64, 64, 0
    rng = np.random.default_rng(18)
    raw = _layer("Q4_0", rng, E, H, I)
    path = _write(tmp_path / "grok.gguf", {f"{n.format(L)}.weight": (r, Q.Q4_0)
                                           for n, r in zip((GATE, UP, DOWN), raw)},
                  arch="grok", block_count=1)
    lw = read_gguf_experts(path, L)
    assert lw.activation == "gelu_tanh" and lw.architecture == "grok"
    w13 = lw.dequantized()[0]
    assert np.array_equal(w13[:, :I], dequantize(raw[0], Q.Q4_0))  # halves
    x, tw, ids = _routing(7, E, 2, H, seed=5)
    ref = R.ref_fused_moe_experts(x, lw, tw, ids, lw.activation)
    assert not np.allclose(ref, R.ref_fused_moe_experts(x, lw, tw, ids, "silu"), rtol=0.1,
                           atol=0)
    packed = cpumoe.load_experts(path, L)
    assert_moe_close(Backend("numpy"), cpumoe.fused_moe(x, packed, tw, ids,
                                                        activation=lw.activation), ref)


# ---------------------------------------------------------------------------- refusals
def _q4_layer(rng, E=2, H=64, I=32, L=0):
    raw = _layer("Q4_0", rng, E, H, I)
    return {f"{n.format(L)}.weight": (r, Q.Q4_0) for n, r in zip((GATE, UP, DOWN), raw)}


@pytest.mark.parametrize("which,qtype,why", [
    (GATE, "Q6_K", "a scale per 16 k \\(a K-quant"), (DOWN, "Q6_K", "multiples of 32"),
    (UP, "F16", "float16"), (GATE, "F32", "float32"), (UP, "Q3_K", "3-bit values"),
    (DOWN, "Q2_K", "2-bit values")])
def test_unsupported_types_are_refused(tmp_path, which, qtype, why):
    rng = np.random.default_rng(1)
    E, H, I = 2, 256, 256  # K-quants need rows of 256
    t = _q4_layer(rng, E, H, I)
    shape = (E, H, I) if which == DOWN else (E, I, H)
    name = f"{which.format(0)}.weight"
    if qtype.endswith("_K"):  # gguf's numpy has no K-quant quantizer: any bytes
        blk, nbytes = gguf.GGML_QUANT_SIZES[Q[qtype]]
        t[name] = (rng.integers(0, 256, (*shape[:2], shape[2] // blk * nbytes), dtype=np.uint8),
                   Q[qtype])
    elif qtype in ("F16", "F32"):
        t[name] = (_floats(rng, *shape).astype(np.float16 if qtype == "F16" else np.float32),
                   None)
    else:
        t[name] = (quantize(_floats(rng, *shape), Q[qtype]), Q[qtype])
    path = _write(tmp_path / "m.gguf", t)
    with pytest.raises(UnsupportedCheckpoint, match=f"{name} is {qtype}: cpumoe does not run "
                                                    f"{qtype} experts yet.*{why}"):
        cpumoe.load_experts(path, 0)


def test_mixed_formats_are_refused(tmp_path):
    rng = np.random.default_rng(2)
    t = _q4_layer(rng)
    t[f"{DOWN.format(0)}.weight"] = (_raw_mxfp4(rng, 2, 64, 32), Q.MXFP4)
    path = _write(tmp_path / "m.gguf", t)
    with pytest.raises(UnsupportedCheckpoint, match="Q4_0 / Q4_0 / MXFP4.*one format"):
        cpumoe.load_experts(path, 0)


def test_structure_errors(tmp_path):
    rng = np.random.default_rng(4)
    t = _q4_layer(rng)
    good = _write(tmp_path / "good.gguf", t)
    with pytest.raises(ValueError, match="layer: 5 is out of range.*2 blocks"):
        cpumoe.load_experts(good, 5)
    with pytest.raises(ValueError, match="out of range"):
        cpumoe.load_experts(good, -1)
    with pytest.raises(UnsupportedCheckpoint, match="layer 1 has no MoE experts"):
        cpumoe.load_experts(good, 1)
    with pytest.raises(ValueError, match="format: one of 'gguf'.*'safetensors'"):
        cpumoe.load_experts(good, 0, format="safetensors")

    no_down = dict(t)
    del no_down[f"{DOWN.format(0)}.weight"]
    with pytest.raises(UnsupportedCheckpoint, match="missing blk.0.ffn_down_exps.weight"):
        cpumoe.load_experts(_write(tmp_path / "nd.gguf", no_down), 0)

    bad_up = dict(t)
    bad_up[f"{UP.format(0)}.weight"] = (_raw_q4_0(rng, 2, 64, 64), Q.Q4_0)  # I = 64, not 32
    with pytest.raises(UnsupportedCheckpoint, match=r"shapes .*expected \[E, I, H\]"):
        cpumoe.load_experts(_write(tmp_path / "bu.gguf", bad_up), 0)

    fused = dict(t)
    fused["blk.0.ffn_gate_up_exps.weight"] = (_raw_q4_0(rng, 2, 64, 64), Q.Q4_0)
    with pytest.raises(UnsupportedCheckpoint, match="fused gate_up"):
        cpumoe.load_experts(_write(tmp_path / "fu.gguf", fused), 0)

    only_gate_bias = dict(t)
    only_gate_bias[f"{GATE.format(0)}.bias"] = (np.zeros((2, 32), np.float32), None)
    with pytest.raises(UnsupportedCheckpoint, match="gate and up biases go together"):
        cpumoe.load_experts(_write(tmp_path / "gb.gguf", only_gate_bias), 0)

    data = good.read_bytes()
    for n, cut in (("trunc.gguf", len(data) - 100), ("head.gguf", 20)):
        (tmp_path / n).write_bytes(data[:cut])
        with pytest.raises(UnsupportedCheckpoint, match="not a readable GGUF file"):
            cpumoe.load_experts(tmp_path / n, 0)
        with pytest.raises(UnsupportedCheckpoint, match="not a readable GGUF file"):
            cpumoe.load_experts(tmp_path / n, 0, format="gguf")
    (tmp_path / "x.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(UnsupportedCheckpoint, match="cannot tell its format"):
        cpumoe.load_experts(tmp_path / "x.safetensors", 0)


def test_negative_q4_0_scales_load_and_mxfp4_nan_scales_are_refused(tmp_path):
    rng = np.random.default_rng(6)
    # gguf's own Q4_0 of weights whose largest element is positive (d < 0, q = 0 there): a value
    # like any other now, and the op's result is the reference's.
    t = _q4_layer(rng)
    w = np.abs(_floats(rng, 2, 32, 64)) + 0.01
    t[f"{GATE.format(0)}.weight"] = (quantize(w, Q.Q4_0), Q.Q4_0)
    lw = read_gguf_experts(_write(tmp_path / "neg.gguf", t), 0)
    assert (lw.s13 < 0).any() and np.array_equal(
        lw.dequantized()[0][:, :32], dequantize(t[f"{GATE.format(0)}.weight"][0], Q.Q4_0))
    # MXFP4 E8M0 255.
    raw = _raw_mxfp4(rng, 2, 64, 32)
    raw[1, 5, 0] = 255
    t = {f"{n.format(0)}.weight": (r, Q.MXFP4)
         for n, r in zip((GATE, UP, DOWN), (_raw_mxfp4(rng, 2, 32, 64),
                                            _raw_mxfp4(rng, 2, 32, 64), raw))}
    with pytest.raises(UnsupportedCheckpoint, match="ffn_down_exps.weight: MXFP4 block \\(expert "
                                                    "1, row 5, block 0\\) has E8M0 scale 255"):
        cpumoe.load_experts(_write(tmp_path / "nan.gguf", t), 0)


def test_missing_file_and_missing_gguf_package(tmp_path, monkeypatch):
    assert "load_experts" in cpumoe.__all__
    with pytest.raises(FileNotFoundError):
        cpumoe.load_experts(tmp_path / "none.gguf", 0)
    with pytest.raises(FileNotFoundError):
        cpumoe.load_experts(tmp_path / "none.gguf", 0, format="gguf")
    path = _write(tmp_path / "m.gguf", _q4_layer(np.random.default_rng(0)))
    monkeypatch.setitem(sys.modules, "gguf", None)  # makes `import gguf` raise ImportError
    with pytest.raises(ImportError, match="pip install"):
        cpumoe.load_experts(path, 0)
