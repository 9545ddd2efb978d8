"""Loading GPTQ (v1 and v2) and AWQ (GEMM) MoE layers (cpumoe.checkpoint_gptq) and the one entry
point cpumoe.loaders: tiny checkpoints packed here from random codes, zero points and scales by an
independent routine written from the formats' documentation (AutoGPTQ's QuantLinear.pack,
GPTQModel's v2 zero points, AutoAWQ's WQLinear_GEMM.from_linear), checked to dequantize exactly
and to run through the op as the reference does; malformed or unsupported ones refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("safetensors")
from safetensors.numpy import save_file  # noqa: E402

import cpumoe  # noqa: E402
from cpumoe import loaders  # noqa: E402
from cpumoe import reference as R  # noqa: E402
from cpumoe.checkpoint import UnsupportedCheckpoint  # noqa: E402
from cpumoe.checkpoint_gptq import (dequantize_linear, load_awq_moe_layer,  # noqa: E402
                                    load_gptq_moe_layer, load_quantized_moe_layer)
from conftest import Backend, assert_moe_close, random_topk_ids, random_topk_weights  # noqa: E402

# AutoAWQ's order_map: nibble i (bits 4i) of a word holds output column 8 c + ORDER[i].
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
NAMES = {"qwen3": ("model.layers.{L}.mlp.experts.{e}.", ("gate_proj", "up_proj", "down_proj")),
         "mixtral": ("model.layers.{L}.block_sparse_moe.experts.{e}.", ("w1", "w3", "w2"))}


# ---------------------------------------------------------------------------- packing (independent)
def pack_along_rows(v, bits=4):
    """[R, C] b-bit values -> int32 [R / p, C] (p = 32 / b): row p r + i at bits b i of word
    [r, c] (GPTQ's qweight, from [K, N])."""
    p = 32 // bits
    words = np.zeros((v.shape[0] // p, v.shape[1]), np.uint32)
    for i in range(p):
        words |= v[i::p].astype(np.uint32) << np.uint32(bits * i)
    return words.view(np.int32)


def pack_along_cols(v, order=tuple(range(8)), bits=4):
    """[R, C] b-bit values -> int32 [R, C / p]: field i of word [r, c] holds column p c +
    order[i] (GPTQ's qzeros in order; AWQ's qweight / qzeros in AWQ's order)."""
    p = 32 // bits
    words = np.zeros((v.shape[0], v.shape[1] // p), np.uint32)
    for i, o in enumerate(order[:p]):
        words |= v[:, o::p].astype(np.uint32) << np.uint32(bits * i)
    return words.view(np.int32)


def test_packers_follow_the_documented_layouts():
    seq = np.arange(8, dtype=np.uint8)
    assert pack_along_rows(seq[:, None]).view(np.uint32)[0, 0] == 0x76543210
    assert pack_along_cols(seq[None, :]).view(np.uint32)[0, 0] == 0x76543210
    # AWQ: column 1 is in nibble 4, column 2 in nibble 1, ...
    assert pack_along_cols(seq[None, :], ORDER).view(np.uint32)[0, 0] == 0x75316420
    assert pack_along_rows(seq[:4, None], 8).view(np.uint32)[0, 0] == 0x03020100
    assert pack_along_cols(seq[None, :4], bits=8).view(np.uint32)[0, 0] == 0x03020100


# ---------------------------------------------------------------------------- checkpoints
def _linear(rng, kind, n, k, g, zero_mode, bias, bits=4):
    """One Linear [n, k]: tensors as the checkpoint kind stores them and its documented float
    weight (float32 of s * (q - z), exact)."""
    ge = k if g == -1 else g
    G = -(-k // ge)
    top = 1 << bits
    q = rng.integers(0, top, (n, k), dtype=np.uint8)
    if zero_mode == "sym":
        z = np.full((G, n), top // 2, np.int64)
    elif kind == "gptq":  # v1 keeps z - 1 in a field: z in [1, 2^bits]
        z = rng.integers(1, top + 1, (G, n))
    else:
        z = rng.integers(0, top, (G, n))
    s = (rng.standard_normal((G, n)) * 0.02).astype(np.float16)
    gi = np.arange(k) // ge
    w = (s.astype(np.float64)[gi].T * (q.astype(np.float64) - z[gi].T)).astype(np.float32)
    t = {}
    if kind in ("gptq", "gptq_v2"):
        stored = (z - 1) if kind == "gptq" else z
        t["qweight"] = pack_along_rows(q.T, bits)
        t["qzeros"] = pack_along_cols(stored.astype(np.uint8), bits=bits)
        t["scales"] = s
        if kind == "gptq":
            t["g_idx"] = gi.astype(np.int32)
    else:  # awq
        t["qweight"] = pack_along_cols(np.ascontiguousarray(q.T), ORDER)
        t["qzeros"] = pack_along_cols(z.astype(np.uint8), ORDER)
        t["scales"] = s
    b = None
    if bias:
        b = (rng.standard_normal(n) * 0.1).astype(np.float16)
        t["bias"] = b
    return t, w, b


def _config(kind, g, **over):
    if kind == "awq":
        q = {"quant_method": "awq", "bits": 4, "group_size": g, "zero_point": True,
             "version": "gemm"}
    else:
        q = {"quant_method": "gptq", "bits": 4, "group_size": g, "desc_act": False,
             "sym": True, "checkpoint_format": kind}
    q.update(over)
    return {"model_type": "qwen3_moe", "quantization_config": q}


def write_checkpoint(folder, kind, *, E=3, H=64, I=32, g=32, zeros="asym", layout="qwen3",
                     bias=False, layer=1, seed=0, config=None, sym_projs=(), bits=4):
    """A checkpoint folder of kind "gptq" (v1), "gptq_v2" or "awq"; ``zeros``: "sym" (all 8) or
    "asym" (random), projections in ``sym_projs`` symmetric either way. Returns (tensors,
    expected w13 [E, 2I, H], expected w2 [E, H, I], b13, b2) (float32; biases or None)."""
    rng = np.random.default_rng(seed)
    prefix, projs = NAMES[layout]
    tensors = {}
    w13 = np.empty((E, 2 * I, H), np.float32)
    w2 = np.empty((E, H, I), np.float32)
    b13 = np.empty((E, 2 * I), np.float32) if bias else None
    b2 = np.empty((E, H), np.float32) if bias else None
    for e in range(E):
        for j, (proj, (n, k)) in enumerate(zip(projs, ((I, H), (I, H), (H, I)))):
            mode = "sym" if (zeros == "sym" or j in sym_projs) else "asym"
            t, w, b = _linear(rng, kind, n, k, g, mode, bias, bits)
            for suffix, arr in t.items():
                tensors[prefix.format(L=layer, e=e) + proj + "." + suffix] = arr
            if j < 2:
                w13[e, j * I:(j + 1) * I] = w
                if bias:
                    b13[e, j * I:(j + 1) * I] = b
            else:
                w2[e] = w
                if bias:
                    b2[e] = b
    # A dense Linear and a norm beside the experts, as in a real checkpoint.
    tensors[f"model.layers.{layer}.self_attn.o_proj.qweight"] = pack_along_rows(
        rng.integers(0, 16, (H, H), dtype=np.uint8))
    tensors[f"model.layers.{layer}.input_layernorm.weight"] = np.ones(H, np.float16)
    save_file(tensors, str(folder / "model.safetensors"))
    cfg = config if config is not None else _config(kind, g, bits=bits)
    (folder / "config.json").write_text(json.dumps(cfg))
    return tensors, w13, w2, b13, b2


def _routing(T, E, k, H, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((T, H)).astype(np.float32), random_topk_weights(rng, T, k),
            random_topk_ids(rng, T, E, k))


def _loader(kind):
    return load_awq_moe_layer if kind == "awq" else load_gptq_moe_layer


# ---------------------------------------------------------------------------- exact loading
@pytest.mark.parametrize("kind", ["gptq", "gptq_v2", "awq"])
@pytest.mark.parametrize("zeros", ["sym", "asym"])
def test_layer_dequantizes_exactly(tmp_path, kind, zeros):
    E, H, I = 3, 64, 32
    _, w13, w2, _, _ = write_checkpoint(tmp_path, kind, E=E, H=H, I=I, zeros=zeros)
    lw = _loader(kind)(tmp_path, 1)
    want = "int4" if zeros == "sym" else "int4_affine"
    assert lw.weight_format == want and lw.group_size == 32 and lw.activation == "silu"
    assert (lw.num_experts, lw.hidden, lw.intermediate) == (E, H, I)
    assert lw.quant_method == ("awq" if kind == "awq" else "gptq") and lw.layout == "qwen3"
    assert lw.b13 is None and lw.b2 is None and lw.expert_ids == [0, 1, 2]
    if zeros == "sym":
        assert lw.w13.dtype == np.int8 and lw.w13.min() >= -8 and lw.w13.max() <= 7
        assert lw.s13.shape == (E, 2 * I, H // 32) and lw.s13.dtype == np.float32
    else:
        assert lw.w13.dtype == np.uint8 and lw.w13.max() <= 15
        assert lw.s13.shape == (E, 2 * I, H // 32, 2) and lw.s2.shape == (E, H, I // 32, 2)
    d13, d2 = lw.dequantized()
    assert np.array_equal(d13, w13) and np.array_equal(d2, w2)
    # the dispatcher reads the same
    same = load_quantized_moe_layer(tmp_path, 1)
    assert same.weight_format == want and np.array_equal(same.w13, lw.w13)


@pytest.mark.parametrize("kind", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("zeros", ["sym", "asym"])
def test_8_bit_gptq_loads_exactly_as_int8_affine_and_runs(tmp_path, kind, zeros):
    """8-bit GPTQ (4 codes per word; v1 zero points stored - 1 in a byte): int8_affine codes q
    and (s, -s z) per group, s * (q - z) exactly; the op against the reference on every path."""
    E, H, I = 3, 64, 64
    _, w13, w2, b13, _ = write_checkpoint(tmp_path, kind, E=E, H=H, I=I, zeros=zeros, bits=8,
                                          bias=(kind == "gptq"))
    lw = load_gptq_moe_layer(tmp_path, 1)
    assert lw.weight_format == "int8_affine" and lw.group_size == 32
    assert lw.w13.dtype == np.uint8 and lw.w13.max() > 15
    assert lw.s13.shape == (E, 2 * I, H // 32, 2)
    d13, d2 = lw.dequantized()
    assert np.array_equal(d13, w13) and np.array_equal(d2, w2)
    if zeros == "sym":
        assert np.all(lw.s13[..., 1] == -128 * lw.s13[..., 0])
    got = dequantize_linear(tmp_path, "model.layers.1.mlp.experts.2.up_proj")
    assert np.array_equal(got, w13[2, I:])
    x, tw, ids = _routing(9, E, 2, H)
    ref = R.ref_fused_moe_experts(x, lw, tw, ids)
    for isa in cpumoe.available_paths("int8_affine"):
        out = cpumoe.fused_moe(x, lw.prepack(isa=isa, num_threads=1), tw, ids)
        assert_moe_close(Backend("numpy"), out, ref)
    assert loaders.load_experts(tmp_path, 1, num_threads=1).weight_format == "int8_affine"
    with pytest.raises(ValueError, match="requantize: only for GGUF files \\(this is 'gptq'"):
        loaders.read_experts(tmp_path, 1, requantize="int8_affine")


def test_one_asymmetric_matrix_makes_the_layer_affine(tmp_path):
    # gate and up symmetric, down asymmetric: one format for the layer, int4_affine.
    _, w13, w2, _, _ = write_checkpoint(tmp_path, "gptq", sym_projs=(0, 1))
    lw = load_gptq_moe_layer(tmp_path, 1)
    assert lw.weight_format == "int4_affine"
    assert np.all(lw.s13[..., 1] == -8 * lw.s13[..., 0])  # the symmetric ones: min = -8 s
    d13, d2 = lw.dequantized()
    assert np.array_equal(d13, w13) and np.array_equal(d2, w2)


def test_v1_zero_sixteen_and_v2_zero_zero(tmp_path):
    """v1's stored nibble 15 is the zero point 16 (stored + 1, AutoGPTQ), v2's 0 is 0."""
    for kind, z in (("gptq", 16), ("gptq_v2", 0)):
        folder = tmp_path / kind
        folder.mkdir()
        write_checkpoint(folder, kind)
        from safetensors.numpy import load_file
        tensors = load_file(str(folder / "model.safetensors"))
        name = "model.layers.1.mlp.experts.0.down_proj"
        stored = np.full((1, 64 // 8), 0xFFFFFFFF if kind == "gptq" else 0, np.uint32)
        tensors[name + ".qzeros"] = stored.view(np.int32)
        save_file(tensors, str(folder / "model.safetensors"))
        lw = load_gptq_moe_layer(folder, 1)
        s = lw.s2[0, :, 0, 0]
        assert np.array_equal(lw.s2[0, :, 0, 1], np.float32(0) - s * np.float32(z))
        q = lw.w2[0, :, :32].astype(np.float32)
        ref = tensors[name + ".scales"].astype(np.float64)[0][:, None] * (q - z)
        assert np.array_equal(lw.dequantized(0)[1][:, :32], ref.astype(np.float32))


@pytest.mark.parametrize("g", [64, -1])
def test_group_sizes_regridded_exactly(tmp_path, g):
    """g = 64 with I = 32 (down: one partial group) and g = -1 (one group over K, H != I): the
    layer takes 32, each new group inside one of the checkpoint's."""
    _, w13, w2, _, _ = write_checkpoint(tmp_path, "gptq_v2", g=g, H=64, I=32)
    lw = load_gptq_moe_layer(tmp_path, 1)
    assert lw.group_size == 32 and lw.checkpoint_group_size == g
    d13, d2 = lw.dequantized()
    assert np.array_equal(d13, w13) and np.array_equal(d2, w2)


def test_mixtral_names_bias_and_expert_subset(tmp_path):
    E, H, I = 3, 64, 64
    _, w13, w2, b13, b2 = write_checkpoint(tmp_path, "awq", E=E, H=H, I=I, layout="mixtral",
                                           bias=True, layer=0)
    lw = load_awq_moe_layer(tmp_path, 0)
    assert lw.layout == "mixtral" and lw.weight_format == "int4_affine"
    assert np.array_equal(lw.b13, b13) and np.array_equal(lw.b2, b2)
    d13, d2 = lw.dequantized()
    assert np.array_equal(d13, w13) and np.array_equal(d2, w2)
    part = load_awq_moe_layer(tmp_path, 0, experts=[2, 0])
    assert part.expert_ids == [2, 0] and list(part.expert_map()) == [1, -1, 0]
    assert np.array_equal(part.w13[0], lw.w13[2]) and np.array_equal(part.s2[1], lw.s2[0])
    # swigluoai: gate and up rows interleaved
    il = load_awq_moe_layer(tmp_path, 0, activation="swigluoai")
    assert np.array_equal(il.w13[:, 0::2], lw.w13[:, :I])
    assert np.array_equal(il.w13[:, 1::2], lw.w13[:, I:])


def test_dequantize_linear(tmp_path):
    tensors, w13, _, _, _ = write_checkpoint(tmp_path, "gptq")
    got = dequantize_linear(tmp_path, "model.layers.1.mlp.experts.1.up_proj")
    assert got.dtype == np.float32 and np.array_equal(got, w13[1, 32:])
    # A Linear with a bias (Qwen2-MoE's attention projections): the weight, the bias left alone.
    _, b13w, _, _, _ = write_checkpoint(tmp_path, "gptq", bias=True)
    got = dequantize_linear(tmp_path, "model.layers.1.mlp.experts.1.up_proj")
    assert np.array_equal(got, b13w[1, 32:])


# ---------------------------------------------------------------------------- the op
@pytest.mark.parametrize("kind,zeros", [("gptq", "sym"), ("gptq_v2", "sym"), ("gptq", "asym"),
                                        ("gptq_v2", "asym"), ("awq", "asym")])
def test_fused_op_matches_reference(tmp_path, kind, zeros):
    E, H, I = 3, 64, 64
    write_checkpoint(tmp_path, kind, E=E, H=H, I=I, zeros=zeros, bias=(kind == "gptq"))
    lw = _loader(kind)(tmp_path, 1)
    x, tw, ids = _routing(9, E, 2, H)
    ref = R.ref_fused_moe_experts(x, lw, tw, ids)
    for isa in cpumoe.available_paths(lw.weight_format):
        packed = lw.prepack(isa=isa, num_threads=1)
        assert packed.weight_format == lw.weight_format and packed.num_experts == E
        out = cpumoe.fused_moe(x, packed, tw, ids)
        assert_moe_close(Backend("numpy"), out, ref)
    packed = loaders.load_experts(tmp_path, 1, num_threads=1)
    assert packed.weight_format == lw.weight_format
    assert_moe_close(Backend("numpy"), cpumoe.fused_moe(x, packed, tw, ids), ref)


# ---------------------------------------------------------------------------- refusals
def _rewrite(folder, edit):
    from safetensors.numpy import load_file
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


def _set_config(folder, **over):
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"].update(over)
    (folder / "config.json").write_text(json.dumps(cfg))


EX = "model.layers.1.mlp.experts."


def test_act_order_refused(tmp_path):
    write_checkpoint(tmp_path, "gptq")
    perm = np.random.default_rng(1).permutation(64)

    def edit(t):
        t[EX + "1.gate_proj.g_idx"] = (perm // 32).astype(np.int32)
    _rewrite(tmp_path, edit)
    _set_config(tmp_path, desc_act=True)
    with pytest.raises(UnsupportedCheckpoint, match=r"experts\.1\.gate_proj\.g_idx.*act-order"):
        load_gptq_moe_layer(tmp_path, 1)
    # desc_act without any g_idx: the permutation is unknown
    _rewrite(tmp_path, lambda t: [t.pop(k) for k in list(t) if k.endswith(".g_idx")])
    with pytest.raises(UnsupportedCheckpoint, match=r"missing .*experts\.0\.gate_proj\.g_idx"):
        load_gptq_moe_layer(tmp_path, 1)


@pytest.mark.parametrize("over,match", [
    ({"bits": 3}, "bits 3: cpumoe reads 4 and 8-bit GPTQ"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({"group_size": 16}, "group_size 16.*multiple of 32"),
    ({"group_size": 0}, "group_size 0"),
    ({"quant_method": "hqq"}, "quant_method 'hqq'"),
    ({"dynamic": {"-:.*experts.*": {}}}, r"dynamic.*skips it"),
    ({"dynamic": {r"+:.*experts\.1\..*": {"bits": 8}}}, r"experts\.1\..*overrides.*bits 8"),
])
def test_gptq_config_refused(tmp_path, over, match):
    write_checkpoint(tmp_path, "gptq")
    _set_config(tmp_path, **over)
    with pytest.raises(UnsupportedCheckpoint, match=match):
        load_quantized_moe_layer(tmp_path, 1)


def test_harmless_dynamic_override_read(tmp_path):
    # GPTQModel's per-module overrides: one repeating the layer's bits / group size is fine.
    write_checkpoint(tmp_path, "gptq_v2")
    _set_config(tmp_path, dynamic={r".*experts\.0\..*": {"bits": 4, "sym": False},
                                   r"-:.*self_attn.*": {}})
    assert load_gptq_moe_layer(tmp_path, 1).weight_format == "int4_affine"


@pytest.mark.parametrize("over,match", [
    ({"version": "gemv"}, "version 'gemv'"),
    ({"zero_point": False}, "zero_point False"),
    ({"bits": 3}, "bits 3"),
    ({"bits": 8}, "bits 8: cpumoe reads 4-bit AWQ"),
])
def test_awq_config_refused(tmp_path, over, match):
    write_checkpoint(tmp_path, "awq")
    _set_config(tmp_path, **over)
    with pytest.raises(UnsupportedCheckpoint, match=match):
        load_awq_moe_layer(tmp_path, 1)


def test_awq_modules_to_not_convert_are_substrings(tmp_path):
    """AWQ's list matches by substring: ["gate"] (the router) names the experts' gate_proj too,
    whose tensors are quantized: they are read. A listed expert stored in float is refused."""
    write_checkpoint(tmp_path, "awq")
    _set_config(tmp_path, modules_to_not_convert=["gate"])
    assert load_awq_moe_layer(tmp_path, 1).weight_format in ("int4", "int4_affine")
    _set_config(tmp_path, modules_to_not_convert=["experts.2.down_proj"])

    def to_float(t):
        for suffix in (".qweight", ".qzeros", ".scales"):
            t.pop(EX + "2.down_proj" + suffix)
        t[EX + "2.down_proj.weight"] = np.zeros((64, 32), np.float16)  # [H, I]
    _rewrite(tmp_path, to_float)
    with pytest.raises(UnsupportedCheckpoint, match=r"experts\.2\.down_proj: listed in .*"
                                                    r"modules_to_not_convert"):
        load_awq_moe_layer(tmp_path, 1)


def test_tensor_problems_refused(tmp_path):
    write_checkpoint(tmp_path, "gptq")
    _rewrite(tmp_path, lambda t: t.pop(EX + "2.up_proj.qzeros"))
    with pytest.raises(UnsupportedCheckpoint, match=r"missing " + EX + r"2\.up_proj\.qzeros"):
        load_gptq_moe_layer(tmp_path, 1)

    write_checkpoint(tmp_path, "gptq")

    def nan(t):
        t[EX + "1.down_proj.scales"] = t[EX + "1.down_proj.scales"].copy()
        t[EX + "1.down_proj.scales"][0, 5] = np.nan
    _rewrite(tmp_path, nan)
    with pytest.raises(UnsupportedCheckpoint, match=EX + r"1\.down_proj\.scales: 1 non-finite"):
        load_gptq_moe_layer(tmp_path, 1)

    write_checkpoint(tmp_path, "gptq")
    _rewrite(tmp_path, lambda t: t.update({EX + "2.down_proj.qweight":
                                           t[EX + "2.down_proj.qweight"][:, :56].copy()}))
    with pytest.raises(UnsupportedCheckpoint, match=EX + r"2\.down_proj\.qweight: shape"):
        load_gptq_moe_layer(tmp_path, 1)

    write_checkpoint(tmp_path, "awq")
    _rewrite(tmp_path, lambda t: t.update({EX + "0.gate_proj.scales":
                                           t[EX + "0.gate_proj.scales"].astype(np.int32)}))
    with pytest.raises(UnsupportedCheckpoint, match=EX + r"0\.gate_proj\.scales: dtype I32"):
        load_awq_moe_layer(tmp_path, 1)

    write_checkpoint(tmp_path, "awq")  # an expert the quantizer left in float

    def unquantized(t):
        for s in ("qweight", "qzeros", "scales"):
            t.pop(EX + "1.up_proj." + s)
        t[EX + "1.up_proj.weight"] = np.zeros((32, 64), np.float16)
    _rewrite(tmp_path, unquantized)
    with pytest.raises(UnsupportedCheckpoint, match=r"1\.up_proj\.qweight.*left unquantized"):
        load_awq_moe_layer(tmp_path, 1)


def test_truncated_file_and_missing_layer_refused(tmp_path):
    write_checkpoint(tmp_path, "gptq_v2")
    with pytest.raises(UnsupportedCheckpoint, match=r"layer 0: no GPTQ experts"):
        load_gptq_moe_layer(tmp_path, 0)
    with pytest.raises(UnsupportedCheckpoint, match="quant_method 'gptq', expected 'awq'"):
        load_awq_moe_layer(tmp_path, 1)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(UnsupportedCheckpoint, match=r"model\.safetensors.*truncated"):
        load_gptq_moe_layer(tmp_path, 1)
    with pytest.raises(UnsupportedCheckpoint, match=r"model\.safetensors.*truncated"):
        loaders.load_experts(tmp_path, 1)


# ---------------------------------------------------------------------------- loaders
def test_loaders_detect_and_read(tmp_path):
    for kind, method in (("gptq", "gptq"), ("gptq_v2", "gptq"), ("awq", "awq")):
        folder = tmp_path / kind
        folder.mkdir()
        write_checkpoint(folder, kind, zeros="sym")
        assert loaders.detect_format(folder) == method
        assert loaders.detect_format(folder / "model.safetensors") == method
        lw = loaders.read_experts(folder, 1)
        assert lw.weight_format == "int4" and lw.quant_method == method
        assert np.array_equal(lw.w2, _loader(kind)(folder, 1).w2)
        part = loaders.read_experts(folder, 1, format=method, experts=[1])
        assert part.expert_ids == [1] and np.array_equal(part.w13[0], lw.w13[1])
        packed = loaders.load_experts(folder, 1, format=method, num_threads=1)
        assert packed.weight_format == "int4" and packed.num_experts == 3
    # AutoGPTQ's quantize_config.json instead of a quantization_config in config.json
    folder = tmp_path / "autogptq"
    folder.mkdir()
    cfg = _config("gptq", 32)
    write_checkpoint(folder, "gptq", config={"model_type": "qwen3_moe"})
    q = dict(cfg["quantization_config"])
    q.pop("quant_method")
    (folder / "quantize_config.json").write_text(json.dumps(q))
    assert loaders.detect_format(folder) == "gptq"
    assert loaders.read_experts(folder, 1).weight_format == "int4_affine"


def test_loaders_compressed_tensors_int4(tmp_path):
    """A compressed-tensors pack-quantized layer (values + 8 in nibbles along in, per row)."""
    from cpumoe.checkpoint_w4 import load_int4_moe_layer
    rng = np.random.default_rng(4)
    E, H, I, g = 2, 64, 32, 32
    t = {}
    for e in range(E):
        for proj, (n, k) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            m = f"{EX}{e}.{proj}."
            t[m + "weight_packed"] = pack_along_cols(rng.integers(0, 16, (n, k), dtype=np.uint8))
            t[m + "weight_scale"] = (rng.random((n, k // g)) * 0.01).astype(np.float16)
            t[m + "weight_shape"] = np.array([n, k], np.int64)
    save_file(t, str(tmp_path / "model.safetensors"))
    w = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": g}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": w}}}}))
    assert loaders.detect_format(tmp_path) == "compressed-tensors"
    lw = loaders.read_experts(tmp_path, 1)
    ref = load_int4_moe_layer(tmp_path, 1)
    assert lw.weight_format == "int4" and np.array_equal(lw.w13, ref.w13)
    assert loaders.load_experts(tmp_path, 1, num_threads=1).weight_format == "int4"


def test_loaders_gguf_file(tmp_path):
    gguf = pytest.importorskip("gguf")
    from cpumoe.checkpoint_gguf import read_gguf_experts
    rng = np.random.default_rng(5)
    E, H, I, L = 2, 64, 32, 0
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(1)
    for name, (n, k) in (("ffn_gate_exps", (I, H)), ("ffn_up_exps", (I, H)),
                         ("ffn_down_exps", (H, I))):
        f = (rng.standard_normal((E, n, k)) / np.sqrt(k)).astype(np.float32)
        q4 = gguf.GGMLQuantizationType.Q4_0
        w.add_tensor(f"blk.{L}.{name}.weight", gguf.quants.quantize(f, q4), raw_dtype=q4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert loaders.detect_format(path) == "gguf"
    lw = loaders.read_experts(path, L)
    assert lw.weight_format == "int4"
    assert np.array_equal(lw.w13, read_gguf_experts(path, L).w13)
    assert loaders.load_experts(path, L, num_threads=1).weight_format == "int4"


def test_loaders_refusals(tmp_path):
    write_checkpoint(tmp_path, "gptq")
    with pytest.raises(ValueError, match="format: one of 'gguf', 'gptq', 'awq'"):
        loaders.load_experts(tmp_path, 1, format="safetensors")
    _set_config(tmp_path, quant_method="hqq")
    with pytest.raises(UnsupportedCheckpoint, match="quant_method 'hqq'.*'gptq', 'awq'"):
        loaders.load_experts(tmp_path, 1)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    with pytest.raises(UnsupportedCheckpoint, match="cannot tell its format"):
        loaders.detect_format(tmp_path)
    odd = tmp_path / "weights.bin"
    odd.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(UnsupportedCheckpoint, match="not a GGUF file"):
        loaders.load_experts(odd, 0)
    with pytest.raises(FileNotFoundError):
        loaders.detect_format(tmp_path / "nothing")
