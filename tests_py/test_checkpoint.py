"""cpumoe.checkpoint: W8A8 MoE layers read from compressed-tensors safetensors checkpoints that
the tests write themselves (sharded with an index, or single files), checked tensor for tensor
against what was written and through the op against the reference.

Two writers: the ``safetensors`` package (skipped where it is not installed, e.g. the aarch64
CPython under qemu) and a minimal one here that follows the same format, so the reader is also
exercised where only numpy is available.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

import cpumoe
from cpumoe import checkpoint as ck
from conftest import assert_moe_close, make_problem, random_weights

try:
    import safetensors.numpy as st_numpy
except ImportError:
    st_numpy = None

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None

W8A8_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "quantization_config": {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                        "dynamic": False, "group_size": None, "observer": "minmax"},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                  "strategy": "token", "dynamic": True},
        }},
        "ignore": ["lm_head", "re:.*mlp.gate$"],
    },
}

_ST_NAMES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "int8": "I8",
             "int32": "I32", "int64": "I64"}


def _write_minimal(path: Path, tensors: dict) -> None:
    """The safetensors format: u64 LE header size, JSON header, raw LE data (8-byte aligned)."""
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        data = a.tobytes()
        header[name] = {"dtype": _ST_NAMES[a.dtype.name], "shape": list(a.shape),
                        "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def _write(writer: str, path: Path, tensors: dict) -> None:
    if writer == "safetensors":
        st_numpy.save_file(tensors, str(path), metadata={"format": "pt"})
    else:
        _write_minimal(path, tensors)


def _bf16(a: np.ndarray) -> np.ndarray:
    if ml_dtypes is None:
        pytest.skip("bfloat16 scales need ml_dtypes")
    return a.astype(ml_dtypes.bfloat16)


WRITERS = [pytest.param("safetensors", marks=pytest.mark.skipif(
    st_numpy is None, reason="the safetensors package is not installed")), "minimal"]


def make_checkpoint(root: Path, writer: str, *, layers=(0, 1), E=8, H=64, I=32, shards=3,
                    bias=False, scale_dtype="float32", layout="qwen3", config=W8A8_CONFIG,
                    zero_point=False, seed=0):
    """A small MoE checkpoint: per layer an attention-ish float tensor, the router gate, and E
    experts named as ``layout`` does, spread round-robin over ``shards`` files (an index when
    shards > 1). Returns {layer: (w13, w2, s13, s2, b13, b2)} of what was written, stacked in
    the op's layout (gate rows then up rows), with the scales as stored (rounded to
    scale_dtype, widened back to float32)."""
    root.mkdir(parents=True, exist_ok=True)
    template, (gate, up, down) = ck.LAYOUTS[layout]
    tensors = {"model.embed_tokens.weight": np.zeros((16, H), np.float32)}
    written = {}
    for L in layers:
        w13, w2, s13, s2, b13, b2 = random_weights(E, H, I, seed=seed + L)
        tensors[f"model.layers.{L}.self_attn.q_proj.weight"] = np.zeros((H, H), np.float32)
        tensors[f"model.layers.{L}.mlp.gate.weight"] = np.zeros((E, H), np.float32)

        def scale(v):
            v = v.reshape(-1, 1)
            return _bf16(v) if scale_dtype == "bfloat16" else v.astype(scale_dtype)

        for e in range(E):
            parts = {gate: (w13[e, :I], s13[e, :I], b13[e, :I]),
                     up: (w13[e, I:], s13[e, I:], b13[e, I:]),
                     down: (w2[e], s2[e], b2[e])}
            for proj, (w, s, b) in parts.items():
                name = template.format(layer=L, expert=e, proj=proj)
                tensors[name + ".weight"] = w
                tensors[name + ".weight_scale"] = scale(s)
                if zero_point:
                    tensors[name + ".weight_zero_point"] = np.zeros((w.shape[0], 1), np.int8)
                if bias:
                    tensors[name + ".bias"] = b.astype(np.float32)
        stored = lambda v: (np.asarray(scale(v), np.float32).reshape(E, -1))  # noqa: E731
        written[L] = (w13, w2, stored(s13), stored(s2), b13 if bias else None,
                      b2 if bias else None)
    names = list(tensors)
    if shards == 1:
        _write(writer, root / "model.safetensors", tensors)
    else:
        weight_map = {}
        for i in range(shards):
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[i::shards]}
            _write(writer, root / fname, part)
            weight_map.update({n: fname for n in part})
        (root / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    if config is not None:
        (root / "config.json").write_text(json.dumps(config))
    return written


# ---------------------------------------------------------------------------- reading
@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16"])
def test_sharded_layer_reads_back_and_runs(backend, tmp_path, writer, scale_dtype):
    written = make_checkpoint(tmp_path, writer, scale_dtype=scale_dtype, zero_point=True)
    c = ck.Checkpoint(tmp_path)
    assert c.moe_layers() == [0, 1]
    assert c.num_experts(1) == 8 and c.detect_layout(1) == "qwen3"
    lw = ck.load_moe_layer(tmp_path, 1)
    w13, w2, s13, s2, _, _ = written[1]
    assert lw.w13.dtype == np.int8 and lw.s13.dtype == np.float32
    assert np.array_equal(lw.w13, w13) and np.array_equal(lw.w2, w2)
    assert np.array_equal(lw.s13, s13) and np.array_equal(lw.s2, s2)
    assert lw.b13 is None and lw.b2 is None
    assert (lw.num_experts, lw.hidden, lw.intermediate) == (8, 64, 32)
    # Through the op, against the reference on the weights that were written.
    p = make_problem(backend, T=13, E=8, k=2, H=64, I=32, dtype="float32")
    packed = ck.load_packed_moe_layer(tmp_path, 1)
    out = cpumoe.fused_moe_int8(p.x, packed, p.topk_weights, p.topk_ids)
    B = backend
    ref = cpumoe.reference.ref_fused_moe_int8(p.x, B.asarray(w13), B.asarray(w2), B.asarray(s13),
                                              B.asarray(s2), p.topk_weights, p.topk_ids)
    assert_moe_close(backend, out, ref)


@pytest.mark.parametrize("writer", WRITERS)
def test_swigluoai_bias_interleaves_gate_and_up(backend, tmp_path, writer):
    """gpt-oss quantized per expert: gate/up/down with biases; swigluoai wants gate rows at
    even and up rows at odd positions of w13."""
    written = make_checkpoint(tmp_path, writer, layers=(3,), bias=True, shards=1, config=None)
    w13, w2, s13, s2, b13, b2 = written[3]
    lw = ck.load_moe_layer(tmp_path / "model.safetensors", 3, activation="swigluoai")
    I = 32
    assert np.array_equal(lw.w13[:, 0::2], w13[:, :I]) and np.array_equal(lw.w13[:, 1::2],
                                                                           w13[:, I:])
    assert np.array_equal(lw.s13[:, 0::2], s13[:, :I]) and np.array_equal(lw.b13[:, 1::2],
                                                                          b13[:, I:])
    assert np.array_equal(lw.b2, b2)
    p = make_problem(backend, T=6, E=8, k=4, H=64, I=32, dtype="float32", activation="swigluoai")
    B = backend
    out = cpumoe.fused_moe_int8(p.x, lw.prepack(), p.topk_weights, p.topk_ids, "swigluoai")
    ref = cpumoe.reference.ref_fused_moe_int8(
        p.x, B.asarray(lw.w13), B.asarray(w2), B.asarray(lw.s13), B.asarray(s2),
        p.topk_weights, p.topk_ids, "swigluoai", b13=B.asarray(lw.b13), b2=B.asarray(b2))
    assert_moe_close(backend, out, ref)


def test_expert_subset_and_map(backend, tmp_path):
    """Expert parallelism: load global experts {6, 1, 4} only; global ids through the map."""
    written = make_checkpoint(tmp_path, "minimal", layers=(0,), shards=2)
    w13, w2, s13, s2, _, _ = written[0]
    lw = ck.load_moe_layer(tmp_path, 0, experts=[6, 1, 4])
    assert lw.expert_ids == [6, 1, 4] and lw.num_global_experts == 8
    assert np.array_equal(lw.w13, w13[[6, 1, 4]])
    emap = lw.expert_map()
    assert emap.dtype == np.int32 and emap.tolist() == [-1, 1, -1, -1, 2, -1, 0, -1]
    p = make_problem(backend, T=10, E=8, k=3, H=64, I=32, dtype="float32")
    B = backend
    out = cpumoe.fused_moe_int8(p.x, lw.prepack(), p.topk_weights, p.topk_ids,
                                expert_map=B.asarray(emap))
    keep = emap[B.numpy(p.topk_ids)] >= 0
    ref = cpumoe.reference.ref_fused_moe_int8(
        p.x, B.asarray(w13), B.asarray(w2), B.asarray(s13), B.asarray(s2),
        B.asarray(np.where(keep, B.numpy(p.topk_weights), 0).astype(np.float32)), p.topk_ids)
    assert_moe_close(backend, out, ref)


def test_mixtral_layout(tmp_path):
    written = make_checkpoint(tmp_path, "minimal", layers=(2,), layout="mixtral", shards=2)
    c = ck.Checkpoint(tmp_path / "model.safetensors.index.json")
    assert c.detect_layout(2) == "mixtral" and c.moe_layers("mixtral") == [2]
    assert c.moe_layers("qwen3") == []
    lw = ck.load_moe_layer(c, 2)
    assert lw.layout == "mixtral" and np.array_equal(lw.w13, written[2][0])


def test_into_the_experts_class(backend, tmp_path):
    """Checkpoint -> Int8Experts.process_weights_after_loading -> apply."""
    from cpumoe.experts import Int8Experts

    written = make_checkpoint(tmp_path, "minimal", layers=(0,), bias=True, shards=2)
    lw = ck.load_moe_layer(tmp_path, 0)
    layer = lw.as_layer(backend.name)
    ex = Int8Experts(lw.hidden, lw.intermediate, lw.num_experts, 2)
    ex.process_weights_after_loading(layer)
    p = make_problem(backend, T=5, E=8, k=2, H=64, I=32, dtype="float16")
    w13, w2, s13, s2, b13, b2 = (backend.asarray(a) for a in written[0])
    ref = cpumoe.reference.ref_fused_moe_int8(p.x, w13, w2, s13, s2, p.topk_weights,
                                              p.topk_ids, b13=b13, b2=b2)
    assert_moe_close(backend, ex.apply(p.x, p.topk_weights, p.topk_ids), ref)


# ---------------------------------------------------------------------------- refusals
def _qcfg(**changes):
    cfg = json.loads(json.dumps(W8A8_CONFIG))
    q = cfg["quantization_config"]
    for path, value in changes.items():
        node = q
        keys = path.split(".")
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value
    return cfg


@pytest.mark.parametrize("config, match", [
    (_qcfg(**{"config_groups.group_0.weights.num_bits": 4}), "num_bits is 4"),
    (_qcfg(**{"config_groups.group_0.weights.strategy": "group"}), "strategy is 'group'"),
    (_qcfg(**{"config_groups.group_0.input_activations": None}), "weight-only"),
    (_qcfg(**{"config_groups.group_0.input_activations.dynamic": False}), "dynamic"),
    (_qcfg(**{"format": "pack-quantized"}), "format 'pack-quantized'"),
    (_qcfg(**{"quant_method": "awq"}), "quant_method 'awq'"),
    (_qcfg(**{"ignore": ["lm_head", "re:.*mlp.experts.*"]}), "ignore"),
    (_qcfg(**{"config_groups.group_0.targets": ["re:.*self_attn.*"]}), "no quantization_config"),
])
def test_scheme_refusals(tmp_path, config, match):
    make_checkpoint(tmp_path, "minimal", layers=(0,), shards=1, config=config)
    with pytest.raises(ck.UnsupportedCheckpoint, match=match):
        ck.load_moe_layer(tmp_path, 0)
    ck.load_moe_layer(tmp_path, 0, check_config=False)  # the tensors themselves are fine


def test_tensor_refusals(tmp_path):
    make_checkpoint(tmp_path, "minimal", layers=(0,), shards=1, E=2, config=None)
    c = ck.Checkpoint(tmp_path)
    tensors = {n: np.array(c.get(n)) for n in c.keys()}
    name = "model.layers.0.mlp.experts.1.up_proj"

    def broken(label, **repl):
        d = tmp_path / label
        d.mkdir()
        t = dict(tensors)
        for k, v in repl.items():
            if v is None:
                t.pop(name + k)
            else:
                t[name + k] = v
        _write_minimal(d / "model.safetensors", t)
        return d

    w = tensors[name + ".weight"]
    cases = [
        (broken("f32", **{".weight": w.astype(np.float32)}), "dtype F32, expected I8"),
        (broken("shape", **{".weight": w[:, :-8]}), "shape"),
        (broken("scale", **{".weight_scale": np.ones((5, 1), np.float32)}), "per output channel"),
        (broken("zp", **{".weight_zero_point": np.ones((w.shape[0], 1), np.int8)}), "asymmetric"),
        (broken("missing", **{".weight_scale": None}), "missing"),
    ]
    for path, match in cases:
        with pytest.raises(ck.UnsupportedCheckpoint, match=match):
            ck.load_moe_layer(path, 0)
    with pytest.raises(ck.UnsupportedCheckpoint, match="no routed experts"):
        ck.load_moe_layer(tmp_path, 5)
    with pytest.raises(ValueError, match="experts"):
        ck.load_moe_layer(tmp_path, 0, experts=[0, 2])
    with pytest.raises(ValueError, match="activation"):
        ck.load_moe_layer(tmp_path, 0, activation="relu")


def test_file_refusals(tmp_path):
    make_checkpoint(tmp_path / "a", "minimal", layers=(0,), shards=2, E=2)
    (tmp_path / "a" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        ck.Checkpoint(tmp_path / "a")
    (tmp_path / "b").mkdir()
    with pytest.raises(ck.UnsupportedCheckpoint, match="no \\*.safetensors"):
        ck.Checkpoint(tmp_path / "b")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", 10) + b"not json!!")
    with pytest.raises(ck.UnsupportedCheckpoint, match="header"):
        ck.Checkpoint(bad)
    # A key twice (json keeps the last; the safetensors package parses, and here refuses, the
    # first): ambiguous, refused (found by tests_py/fuzz_checkpoint.py).
    for h in (b'{"x":{"dtype":"I8","shape":[4],"data_offsets":[0]},'
              b'"x":{"dtype":"I8","shape":[4],"data_offsets":[0,4]}}',
              b'{"x":{"dtype":"I8","shape":[4],"data_offsets":[0],"data_offsets":[0,4]}}'):
        bad.write_bytes(struct.pack("<Q", len(h)) + h + bytes(4))
        with pytest.raises(ck.UnsupportedCheckpoint, match="duplicate key 'x'|duplicate key 'data"):
            ck.Checkpoint(bad)
    trunc = tmp_path / "trunc.safetensors"
    _write_minimal(trunc, {"x": np.zeros(64, np.int8)})
    trunc.write_bytes(trunc.read_bytes()[:-10])
    with pytest.raises(ck.UnsupportedCheckpoint, match="past the end"):
        ck.Checkpoint(trunc).get("x")
    with pytest.raises(FileNotFoundError):
        ck.Checkpoint(tmp_path / "nope")


@pytest.mark.skipif(st_numpy is None, reason="the safetensors package is not installed")
def test_reader_agrees_with_safetensors_package(tmp_path):
    """Every dtype the loader meets, read by both readers."""
    tensors = {"i8": np.arange(-6, 6, dtype=np.int8).reshape(3, 4),
               "f32": np.linspace(-1, 1, 10, dtype=np.float32).reshape(2, 5),
               "f16": np.linspace(-1, 1, 6).astype(np.float16),
               "i64": np.arange(3, dtype=np.int64)}
    if ml_dtypes is not None:
        tensors["bf16"] = np.linspace(-2, 2, 8, dtype=np.float32).astype(ml_dtypes.bfloat16)
    st_numpy.save_file(tensors, str(tmp_path / "t.safetensors"))
    c = ck.Checkpoint(tmp_path / "t.safetensors")
    theirs = st_numpy.load_file(str(tmp_path / "t.safetensors"))
    for name, a in theirs.items():
        if name == "bf16":
            assert np.array_equal(c.get_float32(name), a.astype(np.float32))
        else:
            assert np.array_equal(c.get(name), a) and c.get(name).dtype == a.dtype


def test_scheme_problem_is_what_is_supported_config_uses():
    from cpumoe.experts import Int8Experts

    group = W8A8_CONFIG["quantization_config"]["config_groups"]["group_0"]
    assert ck.scheme_problem(group) is None
    assert Int8Experts.is_supported_config(64, 64, 8, 2, "bfloat16", "silu", group) == (True,
                                                                                        None)


def test_readme_engine_integration_example(backend, tmp_path):
    """docs/integrations.md's engine example (the custom ops section), on a small checkpoint
    written here (aot_eager instead of inductor: same graph, no C++ compile)."""
    if backend.torch is None:
        pytest.skip("the example needs the torch backend")
    import re

    from conftest import REPO_ROOT

    readme = REPO_ROOT / "docs" / "integrations.md"
    if not readme.exists():
        pytest.skip("docs/integrations.md is not beside the tests")
    code = re.search(r"## torch custom ops and torch\.compile.*?```python\n(.*?)```",
                     readme.read_text(), re.S).group(1)
    assert 'fullgraph=True)' in code and '"/models/Qwen3-30B-A3B-w8a8"' in code
    make_checkpoint(tmp_path, "minimal", layers=(0,), E=16, shards=2)
    code = code.replace('"/models/Qwen3-30B-A3B-w8a8"', repr(str(tmp_path)))
    code = code.replace("fullgraph=True)", "fullgraph=True, backend=\"aot_eager\")")
    assert "torch.randn(4, 2048," in code
    code = code.replace("torch.randn(4, 2048,", "torch.randn(4, 64,")  # H of the checkpoint
    torch = backend.torch
    torch._dynamo.reset()
    ns: dict = {}
    exec(compile(code, str(readme), "exec"), ns)  # noqa: S102 - our own README
    y = ns["y"]
    assert y.shape == (4, 64) and y.dtype == torch.bfloat16
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(ns["block"](x), ns["block"]._orig_mod(x))
