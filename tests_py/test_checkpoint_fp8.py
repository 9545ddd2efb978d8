"""Loading FP8 MoE layers (cpumoe.checkpoint_fp8) from checkpoints written by the real libraries:

- HF "fp8" (DeepSeek-V3 / Qwen3-FP8 layout, transformers' FineGrainedFP8Config): a tiny random
  Qwen3-MoE / Mixtral quantized by transformers' own FP8 quantize op (its quantizer refuses to
  run through from_pretrained without a GPU), then loaded by transformers itself on this CPU
  (it dequantizes): its expert weights equal ours bit for bit, and its experts' forward is the
  float reference of the op.
- compressed-tensors FP8 (channel, block, group, tensor scales; dynamic, no or static
  activations): quantized and compressed by compressed-tensors; its own dequantize equals ours.

Each loaded layer runs through the op on every fp8 path against ref_fused_moe_fp8 on the raw
codes and scales, and against the float reference within bf16 tolerance. Malformed checkpoints
(written here with a minimal safetensors writer, numpy only) raise clear errors.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

import cpumoe
from cpumoe import quantize as Q
from cpumoe import reference as R
from cpumoe.checkpoint import UnsupportedCheckpoint
from cpumoe.checkpoint_fp8 import Fp8LayerWeights, load_fp8_moe_layer
from conftest import (BACKEND_NAME, close_report, random_topk_ids, random_topk_weights)

# The writers and transformers' loader are torch code: the numpy backend's run must not import
# torch (test_features checks), so those tests need the torch backend.
needs_torch = pytest.mark.skipif(BACKEND_NAME != "torch", reason="needs the torch backend")

FP8_PATHS = cpumoe.available_paths("fp8")
# The op against its reference: as test_fp8 (a bf16 rounding of the activation may flip).
ATOL, RTOL = 1e-2, 1e-2
# The op (bf16 activations) against the float32 layer: two bf16 roundings of the activations
# (2^-9 relative each) through two GEMMs; a wrong scale, block or row is off by O(1).
FLOAT_ATOL, FLOAT_RTOL = 2e-2, 2e-2


def _assert_close(out, ref, atol, rtol):
    ok, msg = close_report(np.asarray(out), np.asarray(ref), atol_of_scale=atol, rtol=rtol)
    assert ok, msg


def _routing(T, E, k, H, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((T, H)).astype(np.float32), random_topk_weights(rng, T, k),
            random_topk_ids(rng, T, E, k))


def _silu_moe(x, w13, w2, tw, ids, interleaved=False):
    """The float MoE layer (silu gate * up; swigluoai-free), in float64."""
    x, w13, w2 = (np.asarray(a, np.float64) for a in (x, w13, w2))
    I = w2.shape[2]
    out = np.zeros((x.shape[0], w2.shape[1]))
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            h = w13[ids[t, j]] @ x[t]
            g, u = (h[0::2], h[1::2]) if interleaved else (h[:I], h[I:])
            out[t] += tw[t, j] * (w2[ids[t, j]] @ (g / (1 + np.exp(-g)) * u))
    return out.astype(np.float32)


def _check_op(lw: Fp8LayerWeights, x, tw, ids, float_ref=None):
    """The op on every fp8 path against the layer's reference (and the float one)."""
    ref = lw.reference(x, tw, ids)
    for path in FP8_PATHS:
        packed = lw.prepack(isa=path)
        assert packed.weight_format == "fp8"
        out = cpumoe.fused_moe(x, packed, tw, ids, activation=lw.activation)
        _assert_close(out, ref, ATOL, RTOL)
        if float_ref is not None:
            _assert_close(out, float_ref, FLOAT_ATOL, FLOAT_RTOL)
    return ref


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> a tiny random bf16 checkpoint (transformers' save_pretrained), made once."""
    pytest.importorskip("transformers")
    from cpumoe.testing.models import save_tiny
    made = {}

    def get(family, **over):
        key = (family, tuple(sorted(over.items())))
        if key not in made:
            made[key] = save_tiny(family, tmp_path_factory.mktemp(family), **over)
        return made[key]

    return get


def _st(folder):
    from safetensors.torch import load_file
    return load_file(str(Path(folder) / "model.safetensors"))


def _u8(t):
    import torch
    return t.view(torch.uint8).numpy()


# ---------------------------------------------------------------------------- HF fp8
@needs_torch
@pytest.mark.parametrize("family,kw,block", [
    ("qwen3_moe", {}, (128, 128)),
    ("qwen3_moe", {"block_size": (64, 128)}, (64, 128)),
    ("qwen3_moe", {"scale_fmt": "ue8m0"}, (128, 128)),
    ("qwen3_moe", {"block_size": None}, (128, 256)),     # one scale per matrix
    ("mixtral", {}, (128, 128)),
])
def test_hf_fp8_checkpoint(tmp_path, tiny, family, kw, block):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM
    from cpumoe.testing.models import save_fp8

    folder = save_fp8(tiny(family), tmp_path / "fp8", **kw)
    cfg = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "fp8" and cfg["activation_scheme"] == "dynamic"
    L = 1
    lw = load_fp8_moe_layer(folder, L)
    E, I, H = 16, 128, 256
    assert lw.layout == ("mixtral" if family == "mixtral" else "qwen3")
    assert lw.block_size == block and lw.num_experts == E and lw.expert_ids == list(range(E))
    assert lw.w13.shape == (E, 2 * I, H) and lw.w2.shape == (E, H, I)
    # The codes are the file's, gate rows then up rows.
    st = _st(folder)
    base = f"model.layers.{L}.{'block_sparse_moe' if family == 'mixtral' else 'mlp'}.experts."
    gate, up, down = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj",
                                                                      "down_proj")
    assert np.array_equal(lw.w13[3, :I], _u8(st[f"{base}3.{gate}.weight"]))
    assert np.array_equal(lw.w13[3, I:], _u8(st[f"{base}3.{up}.weight"]))
    assert np.array_equal(lw.w2[3], _u8(st[f"{base}3.{down}.weight"]))
    x, tw, ids = _routing(11, E, 4, H)
    if kw.get("scale_fmt") is None and kw.get("block_size", (128, 128)) is not None:
        # ref_fused_moe_fp8 on the raw codes and weight_scale_inv, stacked here.
        def stack(projs, suffix):
            get = (lambda t: _u8(t)) if suffix == "weight" else (lambda t: t.float().numpy())
            return np.stack([np.concatenate([get(st[f"{base}{e}.{p}.{suffix}"]) for p in projs])
                             for e in range(E)])
        raw = R.ref_fused_moe_fp8(x, stack((gate, up), "weight"), stack((down,), "weight"),
                                  stack((gate, up), "weight_scale_inv"),
                                  stack((down,), "weight_scale_inv"), tw, ids,
                                  block_size=kw.get("block_size", (128, 128)))
        assert np.array_equal(lw.reference(x, tw, ids), raw)
    # transformers loads the checkpoint on this CPU (dequantizing it): its expert weights are
    # ours dequantized, bit for bit, and its experts' forward is the float reference.
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    experts = model.model.layers[L].mlp.experts
    w13, w2 = lw.dequantized()
    assert np.array_equal(w13, experts.gate_up_proj.detach().numpy())
    assert np.array_equal(w2, experts.down_proj.detach().numpy())
    with torch.no_grad():
        theirs = experts(torch.from_numpy(x), torch.from_numpy(ids.astype(np.int64)),
                         torch.from_numpy(tw)).numpy()
    _assert_close(_silu_moe(x, w13, w2, tw, ids), theirs, 1e-5, 1e-4)
    _check_op(lw, x, tw, ids, float_ref=theirs)


# ---------------------------------------------------------------------------- compressed-tensors
def _ct_dequantized(folder, lw, template, projs):
    """(w13, w2) float32 of every expert, dequantized by compressed-tensors from the file."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    cfg = json.loads((Path(folder) / "config.json").read_text())["quantization_config"]
    args = QuantizationArgs(**cfg["config_groups"]["group_0"]["weights"])
    st = _st(folder)

    def deq(e, p):
        m = template.format(expert=e, proj=p)
        return dequantize(st[m + ".weight"], st[m + ".weight_scale"], args=args).float().numpy()

    g, u, d = projs
    E = lw.num_global_experts
    return (np.stack([np.concatenate([deq(e, g), deq(e, u)]) for e in range(E)]),
            np.stack([deq(e, d) for e in range(E)]))


@needs_torch
@pytest.mark.parametrize("family,over,kw,block,s13_shape", [
    ("qwen3_moe", {}, {"strategy": "channel"}, None, (16, 256, 1)),
    ("qwen3_moe", {}, {"strategy": "block"}, (128, 128), (16, 2, 2)),
    ("qwen3_moe", {}, {"strategy": "group", "group_size": 64}, (1, 64), (16, 256, 4)),
    ("qwen3_moe", {}, {"strategy": "tensor"}, (128, 256), (16, 2, 1)),
    ("qwen3_moe", {}, {"strategy": "channel", "activations": None}, None, (16, 256, 1)),
    # I = 96: a 128-row block of gate (or up) scales ends inside the stacked w13, so the blocks
    # are split to gcd(96, 128) = 32 rows, each keeping its scale.
    ("qwen3_moe", {"moe_intermediate_size": 96}, {"strategy": "block"}, (32, 128), (16, 6, 2)),
    ("mixtral", {}, {"strategy": "block", "block_size": (64, 128)}, (64, 128), (16, 4, 2)),
])
def test_compressed_tensors_fp8_checkpoint(tmp_path, tiny, family, over, kw, block, s13_shape):
    pytest.importorskip("compressed_tensors")
    from cpumoe.checkpoint import LAYOUTS
    from cpumoe.testing.models import save_fp8_compressed

    folder = save_fp8_compressed(tiny(family, **over), tmp_path / "ct", **kw)
    q = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert q["quant_method"] == "compressed-tensors"
    assert q["format"] == ("naive-quantized" if "activations" in kw else "float-quantized")
    L = 0
    lw = load_fp8_moe_layer(folder, L)
    E, H = 16, 256
    I = over.get("moe_intermediate_size", 128)
    assert lw.block_size == block and lw.s13.shape == s13_shape
    assert lw.w13.shape == (E, 2 * I, H) and lw.scheme.startswith("compressed-tensors")
    template, projs = LAYOUTS[lw.layout]
    theirs13, theirs2 = _ct_dequantized(folder, lw, template.replace("{layer}", str(L)), projs)
    w13, w2 = lw.dequantized()
    assert np.array_equal(w13, theirs13) and np.array_equal(w2, theirs2)
    x, tw, ids = _routing(13, E, 4, H, seed=1)
    if kw["strategy"] == "channel" or block == (128, 128):
        # ref_fused_moe_fp8 on the raw codes and weight_scale, stacked here.
        st = _st(folder)
        mod = template.replace("{layer}", str(L))

        def stack(ps, suffix):
            get = (lambda t: _u8(t)) if suffix == "weight" else (lambda t: t.float().numpy())
            return np.stack([np.concatenate([get(st[mod.format(expert=e, proj=p) + "." + suffix])
                                             for p in ps]) for e in range(E)])
        raw = R.ref_fused_moe_fp8(x, stack(projs[:2], "weight"), stack(projs[2:], "weight"),
                                  stack(projs[:2], "weight_scale"),
                                  stack(projs[2:], "weight_scale"), tw, ids, block_size=block)
        assert np.array_equal(lw.reference(x, tw, ids), raw)
    _check_op(lw, x, tw, ids, float_ref=_silu_moe(x, theirs13, theirs2, tw, ids))


@needs_torch
def test_compressed_tensors_static_activations_refused(tmp_path, tiny):
    pytest.importorskip("compressed_tensors")
    from cpumoe.testing.models import save_fp8_compressed
    folder = save_fp8_compressed(tiny("qwen3_moe"), tmp_path / "ct", strategy="tensor",
                                 activations="static")
    with pytest.raises(UnsupportedCheckpoint, match="input_activations are static"):
        load_fp8_moe_layer(folder, 0)


@needs_torch
def test_swigluoai_interleaves_and_expert_subset(tmp_path, tiny):
    pytest.importorskip("compressed_tensors")
    from cpumoe.testing.models import save_fp8_compressed
    folder = save_fp8_compressed(tiny("qwen3_moe"), tmp_path / "ct", strategy="block")
    full = load_fp8_moe_layer(folder, 1)
    part = load_fp8_moe_layer(folder, 1, experts=[5, 2], activation="swigluoai")
    assert part.expert_ids == [5, 2] and list(part.expert_map()[[2, 5]]) == [1, 0]
    # Gate and up rows alternate, so a block row of scales becomes one row (block (1, 128)).
    assert part.block_size == (1, 128) and part.s13.shape == (2, 256, 2)
    I = 128
    f13, f2 = full.dequantized([5, 2])
    p13, p2 = part.dequantized()
    assert np.array_equal(p13[:, 0::2], f13[:, :I]) and np.array_equal(p13[:, 1::2], f13[:, I:])
    assert np.array_equal(p2, f2)
    x, tw, ids = _routing(9, 2, 2, 256, seed=3)
    _check_op(part, x, tw, ids)


# ---------------------------------------------------------------------------- bad checkpoints
# A minimal safetensors writer (numpy only): FP8 codes are uint8 arrays declared F8_E4M3.
_ST = {"float32": "F32", "float16": "F16", "int8": "I8", "uint8": "U8", "int32": "I32"}


def _write(path: Path, tensors: dict) -> None:
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for name, a in tensors.items():
        dtype = None
        if isinstance(a, tuple):
            a, dtype = a
        a = np.ascontiguousarray(a)
        data = a.tobytes()
        header[name] = {"dtype": dtype or _ST[a.dtype.name], "shape": list(a.shape),
                        "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


HF_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
          "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head", "mlp.gate"]}


def _hf_checkpoint(folder: Path, E=2, H=128, I=64, block=(128, 128), qcfg=HF_FP8, edit=None,
                   seed=0):
    """A DeepSeek-style FP8 layer 0 (codes from cpumoe's quantize_fp8); ``edit(tensors)`` may
    change the tensors before writing. Returns the float weights."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    t, floats = {}, {}
    for e in range(E):
        for proj, (n, k) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
            c, s = Q.quantize_fp8(w, block)
            m = f"model.layers.0.mlp.experts.{e}.{proj}"
            t[m + ".weight"] = (c, "F8_E4M3")
            t[m + ".weight_scale_inv"] = s
            floats[m] = w
    if edit is not None:
        edit(t)
    _write(folder / "model.safetensors", t)
    cfg = {"model_type": "deepseek_v3"}
    if qcfg is not None:
        cfg["quantization_config"] = qcfg
    (folder / "config.json").write_text(json.dumps(cfg))
    return floats


def test_hf_layout_without_torch(tmp_path):
    """The numpy-only path: a DeepSeek-style layer written by the minimal writer loads, runs
    and dequantizes to what was quantized."""
    floats = _hf_checkpoint(tmp_path)
    lw = load_fp8_moe_layer(tmp_path, 0)
    # I = 64: gate's 128-row blocks end at row 64 of w13, where up's begin: blocks of 64 rows.
    assert lw.block_size == (64, 128) and lw.scheme == "fp8 block [128, 128]"
    assert lw.group_size == 0 and 1 < lw.bytes_per_weight() < 1.01
    assert lw.s13.shape == (2, 2, 1) and lw.s2.shape == (2, 2, 1)
    w13, w2 = lw.dequantized()
    g = floats["model.layers.0.mlp.experts.1.gate_proj"]
    assert np.abs(w13[1, :64] - g).max() <= np.abs(g).max() / 16  # within E4M3's step
    x, tw, ids = _routing(5, 2, 1, 128, seed=4)
    _check_op(lw, x, tw, ids, float_ref=_silu_moe(x, w13, w2, tw, ids))
    packed = cpumoe.checkpoint_fp8.load_packed_fp8_moe_layer(tmp_path, 0, experts=[1])
    assert packed.weight_format == "fp8"


def _replace(name, value):
    def edit(t):
        if value is None:
            del t[name]
        else:
            t[name] = value
    return edit


G0 = "model.layers.0.mlp.experts.0.gate_proj"
D1 = "model.layers.0.mlp.experts.1.down_proj"


@pytest.mark.parametrize("edit,qcfg,match", [
    (_replace(G0 + ".weight_scale_inv", None), HF_FP8, f"missing {G0}.weight_scale_inv"),
    (_replace(D1 + ".weight_scale_inv", np.ones((2, 2), np.float32)), HF_FP8,
     rf"{D1}.weight_scale_inv: shape \[2, 2\], expected \[1, 1\]"),
    (None, dict(HF_FP8, activation_scheme="static"), "activation_scheme 'static'"),
    (None, dict(HF_FP8, quant_method="awq"), "quant_method 'awq'"),
    (None, dict(HF_FP8, modules_to_not_convert=["model.layers.0.mlp.experts"]),
     "modules_to_not_convert lists it.*not fp8"),
    (None, dict(HF_FP8, modules_to_not_convert=["model.layers.*.mlp"]),
     "modules_to_not_convert lists it"),
    (None, dict(HF_FP8, fmt="e5m2"), "fmt 'e5m2'"),
    (None, dict(HF_FP8, expert_dtype="fp4"), "expert_dtype 'fp4'"),
    (None, dict(HF_FP8, weight_block_size=[128, 48]), "blocks of 48 inputs.*multiple of 32"),
    (None, dict(HF_FP8, weight_block_size=[128]), "weight_block_size"),
    (_replace(G0 + ".weight", np.zeros((64, 128), np.float16)), HF_FP8,
     "dtype F16, expected F8_E4M3.*stored unquantized"),
    (_replace(D1 + ".weight", (np.full((128, 64), 0xFF, np.uint8), "F8_E4M3")), HF_FP8,
     f"{D1}.weight: 8192 E4M3 NaN code"),
    (_replace(D1 + ".weight_scale_inv", np.full((1, 1), np.inf, np.float32)), HF_FP8,
     f"{D1}.weight_scale_inv: 1 scale.*not finite"),
    (_replace(D1 + ".weight_scale_inv", np.full((1, 1), -1, np.float32)), HF_FP8,
     "not finite and >= 0"),
])
def test_bad_hf_checkpoints(tmp_path, edit, qcfg, match):
    _hf_checkpoint(tmp_path, qcfg=qcfg, edit=edit)
    with pytest.raises(UnsupportedCheckpoint, match=match):
        load_fp8_moe_layer(tmp_path, 0)


def test_nan_codes_are_the_prepack_error(tmp_path):
    _hf_checkpoint(tmp_path)
    lw = load_fp8_moe_layer(tmp_path, 0)
    lw.w13[1, 3, 5] = 0x7F
    with pytest.raises(ValueError, match="w13: E4M3 code 127 is NaN"):
        lw.prepack()


def test_block_size_without_config(tmp_path):
    _hf_checkpoint(tmp_path, block=(32, 64), qcfg=None)
    with pytest.raises(ValueError, match="block_size: .* pass block_size"):
        load_fp8_moe_layer(tmp_path, 0)
    lw = load_fp8_moe_layer(tmp_path, 0, block_size=(32, 64))
    assert lw.block_size == (32, 64) and lw.s13.shape == (2, 4, 2)
    # With a config, block_size must agree with it.
    _hf_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"block_size: \(32, 64\) given"):
        load_fp8_moe_layer(tmp_path, 0, block_size=(32, 64))
    # Per-channel scales ([N, 1]) say their granularity themselves.
    _hf_checkpoint(tmp_path, block=None, qcfg=None)
    assert load_fp8_moe_layer(tmp_path, 0).block_size is None
    with pytest.raises(UnsupportedCheckpoint, match="no routed experts"):
        load_fp8_moe_layer(tmp_path, 3)


CT_FP8 = {"quant_method": "compressed-tensors", "format": "float-quantized",
          "config_groups": {"group_0": {
              "targets": ["Linear"],
              "weights": {"num_bits": 8, "type": "float", "symmetric": True,
                          "strategy": "channel", "dynamic": False},
              "input_activations": {"num_bits": 8, "type": "float", "symmetric": True,
                                    "strategy": "token", "dynamic": True}}},
          "ignore": ["lm_head"]}


def _ct(**weights):
    q = json.loads(json.dumps(CT_FP8))
    q["config_groups"]["group_0"]["weights"].update(weights)
    return q


def _ct_checkpoint(folder: Path, qcfg, zero_point=False):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    t = {}
    for e in range(2):
        for proj, (n, k) in (("gate_proj", (64, 128)), ("up_proj", (64, 128)),
                             ("down_proj", (128, 64))):
            c, s = Q.quantize_fp8(rng.standard_normal((n, k)).astype(np.float32), None)
            m = f"model.layers.0.mlp.experts.{e}.{proj}"
            t[m + ".weight"] = (c, "F8_E4M3")
            t[m + ".weight_scale"] = s
            if zero_point:
                t[m + ".weight_zero_point"] = np.ones((n, 1), np.int8)
    _write(folder / "model.safetensors", t)
    (folder / "config.json").write_text(json.dumps({"quantization_config": qcfg}))


@pytest.mark.parametrize("qcfg,zp,match", [
    (CT_FP8, True, "nonzero zero points"),
    (_ct(type="int"), False, "weights type is 'int'"),
    (_ct(num_bits=4), False, "weights num_bits is 4"),
    (_ct(strategy="token"), False, "weights strategy 'token'"),
    (_ct(symmetric=False), False, "symmetric"),
    (dict(CT_FP8, format="pack-quantized"), False, "format 'pack-quantized'"),
    (dict(CT_FP8, ignore=["re:.*experts.*"]), False, "listed in quantization_config.ignore"),
    (dict(CT_FP8, config_groups={}), False, "no quantization_config.config_groups"),
])
def test_bad_compressed_tensors_checkpoints(tmp_path, qcfg, zp, match):
    _ct_checkpoint(tmp_path, qcfg, zero_point=zp)
    with pytest.raises(UnsupportedCheckpoint, match=match):
        load_fp8_moe_layer(tmp_path, 0)


def test_compressed_tensors_channel_without_torch(tmp_path):
    _ct_checkpoint(tmp_path, CT_FP8)
    lw = load_fp8_moe_layer(tmp_path, 0)
    assert lw.block_size is None and lw.s13.shape == (2, 128, 1) and lw.group_size == 0
    x, tw, ids = _routing(4, 2, 2, 128, seed=6)
    _check_op(lw, x, tw, ids)
