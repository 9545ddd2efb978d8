"""Loading 4-bit MoE layers (cpumoe.checkpoint_w4): a compressed-tensors int4 checkpoint written
by the real compressed-tensors package (pack-quantized), and a gpt-oss MXFP4 layer whose layout
is checked against transformers' own gpt-oss dequantization; both run through the op and match
the reference."""

from __future__ import annotations

import json

import numpy as np
import pytest

import cpumoe
from cpumoe import reference as R
from cpumoe.checkpoint import UnsupportedCheckpoint
from cpumoe.checkpoint_w4 import (dequantize_int4_linear, load_int4_moe_layer,
                                  load_mxfp4_moe_layer)
from conftest import BACKEND_NAME, assert_moe_close, random_topk_ids, random_topk_weights

# The compressed-tensors writer and transformers' decoder are torch code: the numpy backend's run
# must not import torch (test_features checks), so those tests need the torch backend.
needs_torch = pytest.mark.skipif(BACKEND_NAME != "torch", reason="needs the torch backend")


def _routing(T, E, k, H, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((T, H)).astype(np.float32), random_topk_weights(rng, T, k),
            random_topk_ids(rng, T, E, k))


def _expert_linears(E, H, I, layer, weight, dtype=None):
    """A module tree holding qwen3-named expert Linears (``model.layers.{layer}.mlp.experts.{e}.
    {gate,up,down}_proj``) whose weights ``weight(proj, n, k)`` gives: what compressed-tensors
    quantizes."""
    import torch
    root = torch.nn.Module()
    node = root
    for name in ("model", "layers", str(layer), "mlp", "experts"):
        node.add_module(name, torch.nn.Module())
        node = getattr(node, name)
    for e in range(E):
        ex = torch.nn.Module()
        for proj, (n, k) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            lin = torch.nn.Linear(k, n, bias=False, dtype=dtype)
            lin.weight.data = weight(proj, n, k).to(lin.weight.dtype)
            ex.add_module(proj, lin)
        node.add_module(str(e), ex)
    return root


def _apply_scheme(root, scheme, g):
    """compressed-tensors' quantization ``scheme`` with group size ``g`` on every Linear."""
    import compressed_tensors.quantization as ct_quant
    scheme.weights.group_size = g
    ct_quant.apply_quantization_config(root, ct_quant.QuantizationConfig(
        config_groups={"group_0": scheme}))


def _save_pack_quantized(root, folder):
    """compressed-tensors' pack-quantized compression of ``root`` written to ``folder`` with its
    config; returns the compressed state."""
    from compressed_tensors.compressors import ModelCompressor
    from safetensors.torch import save_file
    comp = ModelCompressor.from_pretrained_model(root, quantization_format="pack-quantized")
    comp.compress_model(root)
    state = {k: v.contiguous() for k, v in root.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    comp.update_config(str(folder))
    return state


def _write_int4_checkpoint(folder, E=4, H=128, I=64, g=32, preset="W4A16", layer=1):
    """Expert Linears (qwen3 naming) quantized and packed by compressed-tensors itself: a group
    minmax scale (amax / 7.5, as its observer has it) per 32 k, then ModelCompressor's
    pack-quantized format and its config. Returns the float weights [E, N, K] per projection."""
    torch = pytest.importorskip("torch")
    ct_quant = pytest.importorskip("compressed_tensors.quantization")

    gen = torch.Generator().manual_seed(5)
    floats = {p: [] for p in ("gate_proj", "up_proj", "down_proj")}

    def weight(proj, n, k):
        floats[proj].append(torch.randn(n, k, generator=gen) / k ** 0.5)
        return floats[proj][-1].clone()
    root = _expert_linears(E, H, I, layer, weight)
    _apply_scheme(root, ct_quant.preset_name_to_scheme(preset, ["Linear"]), g)
    with torch.no_grad():
        for m in root.modules():
            if hasattr(m, "weight_scale"):
                w = m.weight.reshape(m.weight.shape[0], -1, g)
                m.weight_scale.copy_(w.abs().amax(dim=2) / 7.5)
    _save_pack_quantized(root, folder)
    return {p: torch.stack(v).numpy() for p, v in floats.items()}


@needs_torch
@pytest.mark.parametrize("preset,g", [("W4A16", 32), ("W4A8", 64)])
def test_compressed_tensors_int4_checkpoint(tmp_path, preset, g):
    torch = pytest.importorskip("torch")
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.torch import load_file

    E, H, I = 4, 128, 64
    floats = _write_int4_checkpoint(tmp_path, E, H, I, g, preset)
    lw = load_int4_moe_layer(tmp_path, 1)
    assert lw.weight_format == "int4" and lw.group_size == g and lw.num_experts == E
    # The values are compressed-tensors' own unpacking of what it wrote.
    st = load_file(str(tmp_path / "model.safetensors"))
    key = "model.layers.1.mlp.experts.2.up_proj"
    theirs = unpack_from_int32(st[key + ".weight_packed"], 4, torch.Size([I, H])).numpy()
    assert np.array_equal(lw.w13[2, I:], theirs)
    assert np.array_equal(lw.s13[2, I:], st[key + ".weight_scale"].float().numpy())
    # A pack-quantized Linear read as a float weight (what an engine runs in float, e.g. an
    # int4 checkpoint's attention): its values times its group scales.
    got = dequantize_int4_linear(tmp_path, key)
    assert got.dtype == np.float32 and got.shape == (I, H)
    assert np.array_equal(got, R.dequantize_int4(theirs, lw.s13[2, I:], g))
    # ... and dequantize back close to the float weights (int4: within half a step of the group).
    deq = R.dequantize_int4(lw.w2, lw.s2, g)
    step = np.repeat(lw.s2, g, axis=-1)
    assert (np.abs(deq - floats["down_proj"]) <= 0.5 * step + 1e-6).all()
    # The op on the loaded layer matches the reference on the same values, on every path.
    x, tw, ids = _routing(9, E, 2, H)
    ref = R.ref_fused_moe_int4(x, lw.w13, lw.w2, lw.s13, lw.s2, tw, ids, group_size=g)
    packed = lw.prepack()
    assert packed.weight_format == "int4" and packed.group_size == g
    for path in cpumoe.available_paths("int4"):
        out = cpumoe.fused_moe_int8(x, lw.prepack(isa=path), tw, ids)
        assert_moe_close(cpumoe_backend_numpy(), out, ref)
    # Expert parallelism: experts 1 and 3 only.
    part = load_int4_moe_layer(tmp_path, 1, experts=[3, 1])
    assert np.array_equal(part.w13[0], lw.w13[3]) and part.expert_ids == [3, 1]
    assert list(part.expert_map()) == [-1, 1, -1, 0]


def cpumoe_backend_numpy():
    from conftest import Backend
    return Backend("numpy")


@needs_torch
def test_int4_checkpoint_errors(tmp_path):
    pytest.importorskip("torch")
    _write_int4_checkpoint(tmp_path, 2, 64, 32, 32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(ValueError, match="group_size: 64 given"):
        load_int4_moe_layer(tmp_path, 1, group_size=64)
    with pytest.raises(UnsupportedCheckpoint, match="no int4"):
        load_int4_moe_layer(tmp_path, 0)
    with pytest.raises(UnsupportedCheckpoint, match="missing model.layers.1.mlp.experts.9"):
        dequantize_int4_linear(tmp_path, "model.layers.1.mlp.experts.9.up_proj")
    q = cfg["quantization_config"]
    q["config_groups"]["group_0"]["weights"]["symmetric"] = False
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedCheckpoint, match="symmetric"):
        load_int4_moe_layer(tmp_path, 1)
    q["config_groups"]["group_0"]["weights"]["symmetric"] = True
    q["config_groups"]["group_0"]["weights"]["num_bits"] = 8
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedCheckpoint, match="num_bits"):
        load_int4_moe_layer(tmp_path, 1)
    # Without the config check the group size must be given.
    with pytest.raises(ValueError, match="group_size: not in a config"):
        load_int4_moe_layer(tmp_path, 1, check_config=False)
    assert load_int4_moe_layer(tmp_path, 1, check_config=False, group_size=32).num_experts == 2


def _write_asym_int4_checkpoint(folder, E=3, H=128, I=64, g=32, preset="W4A16_ASYM",
                                 layer=1, zero="minmax"):
    """Expert Linears (qwen3 naming, bf16 like a real model: bf16 scales) quantized asymmetric
    by compressed-tensors itself: its ``calculate_qparams`` on each group's min / max (scale,
    int8 zero point in [-8, 7]), then ModelCompressor's pack-quantized format (the zero points
    packed with ``pack_to_int32(..., packed_dim=0)``) and its config. ``zero="symmetric"``: every
    zero point 0 (an asymmetric config over symmetric data). Returns the compressed state."""
    torch = pytest.importorskip("torch")
    ct_quant = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.quantization.utils import calculate_qparams

    gen = torch.Generator().manual_seed(11)

    def weight(proj, n, k):  # shifted groups: zero points away from 0
        w = torch.randn(n, k, generator=gen) / k ** 0.5
        return w + torch.rand(n, k // g, 1, generator=gen).repeat(1, 1, g).reshape(n, k) * 0.2
    root = _expert_linears(E, H, I, layer, weight, torch.bfloat16)
    if preset == "W4A8_ASYM":  # W4A8 with asymmetric weights
        scheme = ct_quant.preset_name_to_scheme("W4A8", ["Linear"])
        scheme.weights.symmetric = False
    else:
        scheme = ct_quant.preset_name_to_scheme(preset, ["Linear"])
    _apply_scheme(root, scheme, g)
    with torch.no_grad():
        for m in root.modules():
            if hasattr(m, "weight_zero_point"):
                wg = m.weight.reshape(m.weight.shape[0], -1, g)
                if zero == "symmetric":
                    m.weight_scale.copy_(wg.abs().amax(dim=2) / 7.5)
                    m.weight_zero_point.zero_()
                    continue
                s, z = calculate_qparams(wg.amin(dim=2), wg.amax(dim=2),
                                         m.quantization_scheme.weights)
                m.weight_scale.copy_(s)
                m.weight_zero_point.copy_(z)
    return _save_pack_quantized(root, folder)


def _ct_dequantize(state, module, g, dtype):
    """compressed-tensors' own decompression of one pack-quantized Linear (its unpacking of the
    values and zero points, then its ``dequantize``: (q - zp) * scale in the scales' dtype)."""
    import torch
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", strategy="group", group_size=g, symmetric=False))
    sd = {k[len(module) + 1:]: v for k, v in state.items() if k.startswith(module + ".")}
    sd["weight_scale"] = sd["weight_scale"].to(dtype)
    return PackedQuantizationCompressor.decompress(sd, scheme)["weight"].to(torch.float32).numpy()


@needs_torch
@pytest.mark.parametrize("preset,g", [("W4A16_ASYM", 32), ("W4A8_ASYM", 64)])
def test_compressed_tensors_asymmetric_int4_checkpoint(tmp_path, preset, g):
    """symmetric: false -> int4_affine: codes and (scale, -scale * (zp + 8)) whose weights are
    compressed-tensors' dequantization exactly; the op matches the reference on every path."""
    torch = pytest.importorskip("torch")
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    E, H, I = 3, 128, 64
    state = _write_asym_int4_checkpoint(tmp_path, E, H, I, g, preset)
    cfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert cfg["config_groups"]["group_0"]["weights"]["symmetric"] is False
    key = "model.layers.1.mlp.experts.2.up_proj"
    assert state[key + ".weight_zero_point"].dtype == torch.int32
    assert tuple(state[key + ".weight_zero_point"].shape) == (I // 8, H // g)  # packed along out
    lw = load_int4_moe_layer(tmp_path, 1)
    assert lw.weight_format == "int4_affine" and lw.group_size == g and lw.num_experts == E
    assert lw.w13.dtype == np.uint8 and lw.s13.shape == (E, 2 * I, H // g, 2)
    # codes: the stored nibbles, compressed-tensors' own unpacking + 8
    q = unpack_from_int32(state[key + ".weight_packed"], 4, torch.Size([I, H])).numpy()
    assert np.array_equal(lw.w13[2, I:], q.astype(np.int16) + 8)
    zp = unpack_from_int32(state[key + ".weight_zero_point"], 4, torch.Size([I, H // g]),
                           packed_dim=0).numpy()
    assert zp.min() >= -8 and zp.max() <= 7 and np.any(zp != 0)
    s = state[key + ".weight_scale"].float().numpy()
    assert np.array_equal(lw.s13[2, I:, :, 0], s)
    assert np.array_equal(lw.s13[2, I:, :, 1], -s * (zp + 8))
    # The loaded weights are the package's dequantization exactly (fp32 on the bf16 scales: its
    # formula without rounding), and in the model dtype bit for bit as it runs it.
    deq13 = cpumoe.quantize.dequantize_int4_affine(lw.w13, lw.s13, g)
    deq2 = cpumoe.quantize.dequantize_int4_affine(lw.w2, lw.s2, g)
    for e in range(E):
        for proj, got in (("gate_proj", deq13[e, :I]), ("up_proj", deq13[e, I:]),
                          ("down_proj", deq2[e])):
            m = f"model.layers.1.mlp.experts.{e}.{proj}"
            assert np.array_equal(got, _ct_dequantize(state, m, g, torch.float32)), m
            assert np.array_equal(torch.from_numpy(got).to(torch.bfloat16).float().numpy(),
                                  _ct_dequantize(state, m, g, torch.bfloat16)), m
    # ... and a non-expert Linear read as a float weight the same way
    assert np.array_equal(dequantize_int4_linear(tmp_path, key),
                          _ct_dequantize(state, key, g, torch.float32))
    # The op on the loaded layer matches the reference on the same values, on every path.
    x, tw, ids = _routing(9, E, 2, H)
    ref = R.ref_fused_moe_int4_affine(x, lw.w13, lw.w2, lw.s13, lw.s2, tw, ids, group_size=g)
    assert np.array_equal(ref, R.ref_fused_moe_experts(x, lw, tw, ids))
    assert cpumoe.available_paths("int4_affine")
    for path in cpumoe.available_paths("int4_affine"):
        packed = lw.prepack(isa=path, num_threads=1)
        assert packed.weight_format == "int4_affine" and packed.group_size == g
        assert_moe_close(cpumoe_backend_numpy(), cpumoe.fused_moe(x, packed, tw, ids), ref)
    # through the one entry point too
    from cpumoe import loaders
    assert loaders.read_experts(tmp_path, 1).weight_format == "int4_affine"
    # swigluoai interleaves gate / up rows; expert parallelism
    il = load_int4_moe_layer(tmp_path, 1, activation="swigluoai")
    assert np.array_equal(il.w13[:, 1::2], lw.w13[:, I:])
    assert np.array_equal(il.s13[:, 0::2], lw.s13[:, :I])
    part = load_int4_moe_layer(tmp_path, 1, experts=[2, 0])
    assert np.array_equal(part.s2[0], lw.s2[2]) and np.array_equal(part.w13[1], lw.w13[0])
    # Without the config check, compressed-tensors' packed zero points are read as such.
    nc = load_int4_moe_layer(tmp_path, 1, check_config=False, group_size=g)
    assert nc.weight_format == "int4_affine" and np.array_equal(nc.s2, lw.s2)


@needs_torch
def test_asymmetric_config_with_zero_zero_points_stays_int4(tmp_path):
    """symmetric: false but every zero point 0 (stored nibble 8): the layer is symmetric int4,
    the same values and scales compressed-tensors dequantizes."""
    torch = pytest.importorskip("torch")
    E, H, I, g = 2, 64, 64, 32
    state = _write_asym_int4_checkpoint(tmp_path, E, H, I, g, zero="symmetric")
    key = "model.layers.1.mlp.experts.1.down_proj"
    assert (state[key + ".weight_zero_point"] == 0x88888888 - (1 << 32)).all()
    lw = load_int4_moe_layer(tmp_path, 1)
    assert lw.weight_format == "int4" and lw.w2.dtype == np.int8
    assert np.array_equal(R.dequantize_int4(lw.w2[1], lw.s2[1], g),
                          _ct_dequantize(state, key, g, torch.float32))


def _rewrite_tensors(folder, edit):
    from safetensors.numpy import load_file, save_file
    t = dict(load_file(str(folder / "model.safetensors")))
    edit(t)
    save_file(t, str(folder / "model.safetensors"))


@needs_torch
def test_asymmetric_int4_zero_point_errors(tmp_path):
    pytest.importorskip("torch")
    from safetensors.numpy import load_file
    _write_asym_int4_checkpoint(tmp_path, 2, 64, 32, 32)
    zname = "model.layers.1.mlp.experts.1.down_proj.weight_zero_point"
    good = load_file(str(tmp_path / "model.safetensors"))
    zp = good[zname]
    assert zp.shape == (8, 1) and zp.dtype == np.int32  # [ceil(64 / 8), 32 / 32]

    def restore(t):
        t.clear()
        t.update(good)

    # missing under symmetric: false
    _rewrite_tensors(tmp_path, lambda t: t.pop(zname))
    with pytest.raises(UnsupportedCheckpoint, match=f"missing {zname}"):
        load_int4_moe_layer(tmp_path, 1)
    # unpacked (int8 [out, groups], values in [-8, 7]): not compressed-tensors' packing
    _rewrite_tensors(tmp_path, lambda t: (restore(t), t.__setitem__(
        zname, np.ones((64, 1), np.int8))))
    with pytest.raises(UnsupportedCheckpoint, match=f"{zname}: dtype I8, expected I32"):
        load_int4_moe_layer(tmp_path, 1)
    # packed along in instead of out / one group too many
    for bad in (np.zeros((64, 1), np.int32), np.zeros((8, 2), np.int32)):
        _rewrite_tensors(tmp_path, lambda t: (restore(t), t.__setitem__(zname, bad)))
        with pytest.raises(UnsupportedCheckpoint,
                           match=rf"{zname}: shape \[{bad.shape[0]}, {bad.shape[1]}\], "
                                 rf"expected \[8, 1\].*packs zero points"):
            load_int4_moe_layer(tmp_path, 1)
    # A config saying symmetric: true over nonzero zero points is refused, naming the tensor.
    _rewrite_tensors(tmp_path, restore)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = True
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedCheckpoint, match=r"experts\.0\.gate_proj\.weight_zero_point: "
                                                    r"nonzero zero points .* symmetric: true"):
        load_int4_moe_layer(tmp_path, 1)
    # Non-finite scales of an affine layer name the tensor.
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = False
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    sname = "model.layers.1.mlp.experts.0.up_proj.weight_scale"

    def nan_scale(t):
        s = t[sname].copy()
        s[3, 1] = np.nan
        t[sname] = s
    _rewrite_tensors(tmp_path, nan_scale)
    with pytest.raises(UnsupportedCheckpoint, match=f"{sname}: 1 non-finite"):
        load_int4_moe_layer(tmp_path, 1)


def _write_gpt_oss_layer(folder, E=4, H=64, I=64, layer=0, bias=True):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(7)
    w13 = (rng.standard_normal((E, 2 * I, H)) / np.sqrt(H)).astype(np.float32)
    w2 = (rng.standard_normal((E, H, I)) / np.sqrt(I)).astype(np.float32)
    b13, e13 = R.quantize_mxfp4(w13)
    b2, e2 = R.quantize_mxfp4(w2)
    p = f"model.layers.{layer}.mlp.experts."
    t = {p + "gate_up_proj_blocks": b13, p + "gate_up_proj_scales": e13,
         p + "down_proj_blocks": b2, p + "down_proj_scales": e2}
    if bias:
        t[p + "gate_up_proj_bias"] = (rng.standard_normal((E, 2 * I)) * 0.1).astype(np.float32)
        t[p + "down_proj_bias"] = (rng.standard_normal((E, H)) * 0.1).astype(np.float32)
    save_file(t, str(folder / "model.safetensors"))
    return t


def test_gpt_oss_mxfp4_layer(tmp_path):
    pytest.importorskip("safetensors")
    E, H, I = 4, 64, 64
    t = _write_gpt_oss_layer(tmp_path, E, H, I)
    lw = load_mxfp4_moe_layer(tmp_path, 0)
    assert lw.weight_format == "mxfp4" and lw.activation == "swigluoai"
    p = "model.layers.0.mlp.experts."
    assert np.array_equal(lw.w13, t[p + "gate_up_proj_blocks"])
    x, tw, ids = _routing(7, E, 2, H)
    ref = R.ref_fused_moe_mxfp4(x, lw.w13, lw.s13, lw.w2, lw.s2, tw, ids, activation="swigluoai",
                                b13=lw.b13, b2=lw.b2)
    for path in cpumoe.available_paths("int4"):
        out = cpumoe.fused_moe_int8(x, lw.prepack(isa=path), tw, ids, activation="swigluoai")
        assert_moe_close(cpumoe_backend_numpy(), out, ref)
    part = load_mxfp4_moe_layer(tmp_path, 0, experts=[2])
    assert part.num_experts == 1 and np.array_equal(part.s2[0], lw.s2[2])
    with pytest.raises(UnsupportedCheckpoint, match="missing"):
        load_mxfp4_moe_layer(tmp_path, 1)


@needs_torch
def test_mxfp4_decoding_matches_transformers_gpt_oss():
    """Our reading of gpt-oss's blocks (low nibble = even k, E8M0 2^(e - 127)) against
    transformers' own gpt-oss dequantization, bit for bit."""
    torch = pytest.importorskip("torch")
    mx = pytest.importorskip("transformers.integrations.mxfp4")
    rng = np.random.default_rng(2)
    blocks = rng.integers(0, 256, (3, 40, 4, 16), dtype=np.uint8)
    scales = rng.integers(110, 140, (3, 40, 4), dtype=np.uint8)
    theirs = mx._convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                            dtype=torch.float32)  # [E, K, N]
    ours = R.dequantize_mxfp4(blocks, scales)                      # [E, N, K]
    assert np.array_equal(ours, theirs.transpose(1, 2).numpy())


def test_int4_linear_as_float(tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.numpy import save_file
    words = np.full((4, 2), 0x77777777 + 0x11111111, np.uint32).view(np.int32)  # all 8 -> 0
    save_file({"a.weight_packed": words, "a.weight_scale": np.ones((4, 3), np.float32),
               "b.weight_packed": words, "b.weight_scale": np.ones((4, 2), np.float32),
               "b.weight_zero_point": np.ones((4, 2), np.int8),
               "c.weight_packed": words, "c.weight_scale": np.full((4, 2), 0.5, np.float32)},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UnsupportedCheckpoint, match="3 groups do not divide in = 16"):
        dequantize_int4_linear(tmp_path, "a")
    with pytest.raises(UnsupportedCheckpoint, match="nonzero zero points"):
        dequantize_int4_linear(tmp_path, "b")
    w = dequantize_int4_linear(tmp_path, "c")
    assert w.shape == (4, 16) and not w.any()  # code 8 is the value 0
