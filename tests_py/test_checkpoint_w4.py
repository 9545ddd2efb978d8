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


def _write_int4_checkpoint(folder, E=4, H=128, I=64, g=32, preset="W4A16", layer=1):
    """Expert Linears (qwen3 naming) quantized and packed by compressed-tensors itself: a group
    minmax scale (amax / 7.5, as its observer has it) per 32 k, then ModelCompressor's
    pack-quantized format and its config. Returns the float weights [E, N, K] per projection."""
    torch = pytest.importorskip("torch")
    ct_quant = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.compressors import ModelCompressor
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(5)
    root = torch.nn.Module()
    floats = {p: [] for p in ("gate_proj", "up_proj", "down_proj")}
    node = root
    for name in ("model", "layers", str(layer), "mlp", "experts"):
        node.add_module(name, torch.nn.Module())
        node = getattr(node, name)
    for e in range(E):
        ex = torch.nn.Module()
        for proj, (n, k) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            lin = torch.nn.Linear(k, n, bias=False)
            lin.weight.data = torch.randn(n, k, generator=gen) / k ** 0.5
            floats[proj].append(lin.weight.data.clone())
            ex.add_module(proj, lin)
        node.add_module(str(e), ex)
    scheme = ct_quant.preset_name_to_scheme(preset, ["Linear"])
    scheme.weights.group_size = g
    ct_quant.apply_quantization_config(root, ct_quant.QuantizationConfig(
        config_groups={"group_0": scheme}))
    with torch.no_grad():
        for m in root.modules():
            if hasattr(m, "weight_scale"):
                w = m.weight.reshape(m.weight.shape[0], -1, g)
                m.weight_scale.copy_(w.abs().amax(dim=2) / 7.5)
    comp = ModelCompressor.from_pretrained_model(root, quantization_format="pack-quantized")
    comp.compress_model(root)
    save_file({k: v.contiguous() for k, v in root.state_dict().items()},
              str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    comp.update_config(str(folder))
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
