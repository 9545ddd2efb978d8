"""Loading GGUF MoE experts as stored (cpumoe.load_experts, cpumoe.checkpoint_gguf): tiny GGUF
files written by the real gguf package (llama.cpp's), each supported type checked against
gguf.quants.dequantize bit for bit and run through the op against the reference; every other
type, and malformed files, refused clearly."""

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


# ---------------------------------------------------------------------------- refusals
def _q4_layer(rng, E=2, H=64, I=32, L=0):
    raw = _layer("Q4_0", rng, E, H, I)
    return {f"{n.format(L)}.weight": (r, Q.Q4_0) for n, r in zip((GATE, UP, DOWN), raw)}


@pytest.mark.parametrize("which,qtype,why", [
    (DOWN, "Q8_0", "8-bit group scales"), (GATE, "Q4_K", "K-quant"), (UP, "F16", "float16"),
    (GATE, "F32", "float32"), (DOWN, "Q4_1", "zero points"), (UP, "Q5_0", "5-bit")])
def test_unsupported_types_are_refused(tmp_path, which, qtype, why):
    rng = np.random.default_rng(1)
    E, H, I = 2, 256, 256  # K-quants need rows of 256
    t = _q4_layer(rng, E, H, I)
    shape = (E, H, I) if which == DOWN else (E, I, H)
    name = f"{which.format(0)}.weight"
    if qtype == "Q4_K":
        t[name] = (rng.integers(0, 256, (*shape[:2], shape[2] // 256 * 144), dtype=np.uint8),
                   Q.Q4_K)
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
