"""cpumoe.experts.Int8Experts: the engine-facing experts class (vLLM FusedMoEExperts style).

Runs on both backends: numpy layers (a SimpleNamespace of arrays) and torch layers (an
nn.Module with Parameters); the torch.compile case needs the torch backend.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

import cpumoe
from cpumoe.experts import Int8Experts, topk_softmax
from conftest import BACKEND_NAME, assert_moe_close, make_problem, run_python

CT_W8A8 = {  # a compressed-tensors config group, as llm-compressor writes it for W8A8 int8
    "targets": ["Linear"],
    "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                "dynamic": False, "group_size": None},
    "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                          "dynamic": True},
}


def _layer(backend, p, module=False, trailing_one=True):
    """A layer with vLLM's attribute names holding copies of the problem's weights."""
    copy = (lambda a: None if a is None else backend.asarray(backend.numpy(a) if a.dtype.kind
                                                             == "f" else np.asarray(a)))
    if backend.torch is not None:
        copy = (lambda a: None if a is None else a.clone())
    s13, s2 = copy(p.s13), copy(p.s2)
    if trailing_one:
        s13, s2 = s13.reshape(p.E, -1, 1), s2.reshape(p.E, -1, 1)
    attrs = dict(w13_weight=copy(p.w13), w2_weight=copy(p.w2), w13_weight_scale=s13,
                 w2_weight_scale=s2, w13_bias=copy(p.b13), w2_bias=copy(p.b2))
    if module:
        torch = backend.torch
        m = torch.nn.Module()
        for k, v in attrs.items():
            if v is not None:
                m.register_parameter(k, torch.nn.Parameter(v, requires_grad=False))
        return m
    return types.SimpleNamespace(**attrs)


# ---------------------------------------------------------------------------- capability
def test_supports_current_device():
    assert Int8Experts.supports_current_device()
    assert Int8Experts.has_fast_path() == (cpumoe.selected_path() != "portable")
    assert Int8Experts.supports_expert_map()


@pytest.mark.parametrize("args, why", [
    ((2048, 768, 128, 8, "bfloat16", "silu", "w8a8_int8"), None),
    ((2880, 2880, 32, 4, "float16", "swigluoai", "int8_w8a8"), None),
    ((64, 64, 8, 2, "float32", "gelu_tanh", CT_W8A8), None),
    ((2044, 768, 128, 8, "bfloat16", "silu", "w8a8"), "hidden dim must be a multiple of 8"),
    ((2048, 770, 128, 8, "bfloat16", "silu", "w8a8"), "intermediate dim"),
    ((2048, 768, 4, 8, "bfloat16", "silu", "w8a8"), "topk 8 exceeds num_experts 4"),
    ((2048, 768, 128, 0, "bfloat16", "silu", "w8a8"), "topk must be a positive int"),
    ((2048, 768, 128, 8, "int8", "silu", "w8a8"), "activation dtype"),
    ((2048, 768, 128, 8, "bfloat16", "relu2", "w8a8"), "activation 'relu2'"),
    ((2048, 768, 128, 8, "bfloat16", "swigluoai_uninterleave", "w8a8"), "unknown activation"),
    ((2048, 768, 128, 8, "bfloat16", "silu", "w4a16"), "quant_scheme 'w4a16'"),
    ((2048, 768, 128, 8, "bfloat16", "silu",
      dict(CT_W8A8, weights=dict(CT_W8A8["weights"], strategy="tensor"))), "strategy"),
    ((2048, 768, 128, 8, "bfloat16", "silu", dict(CT_W8A8, input_activations=None)),
     "weight-only"),
])
def test_is_supported_config(args, why):
    ok, reason = Int8Experts.is_supported_config(*args)
    if why is None:
        assert ok and reason is None
    else:
        assert not ok and why in reason


def test_is_supported_config_takes_enums_and_framework_dtypes(backend):
    import enum

    class MoEActivation(enum.Enum):  # as vLLM's enum: values are the op's names
        SILU = "silu"

    dtype = backend.dtype("float16")
    assert Int8Experts.is_supported_config(64, 64, 8, 2, dtype, MoEActivation.SILU,
                                           "w8a8_int8") == (True, None)


def test_constructor_rejects_bad_config():
    with pytest.raises(ValueError, match="multiple of 8"):
        Int8Experts(60, 64, 8, 2)


def test_from_config_duck_typed():
    cfg = types.SimpleNamespace(hidden_dim=64, intermediate_size_per_partition=32,
                                num_local_experts=8, experts_per_token=2, activation="gelu")
    ex = Int8Experts.from_config(cfg, isa="portable")
    assert (ex.hidden, ex.intermediate, ex.num_experts, ex.topk, ex.activation, ex.isa) == (
        64, 32, 8, 2, "gelu", "portable")


# ---------------------------------------------------------------------------- weights + apply
@pytest.mark.parametrize("module", [False, True], ids=["namespace", "nn.Module"])
def test_process_weights_then_apply(backend, module):
    if module and backend.torch is None:
        pytest.skip("nn.Module needs the torch backend")
    p = make_problem(backend, T=11, E=8, k=2, H=64, I=32, dtype="bfloat16",
                     activation="gelu", bias=True)
    layer = _layer(backend, p, module=module)
    ex = Int8Experts(64, 32, 8, 2, "gelu")
    ex.process_weights_after_loading(layer)
    assert ex.packed is not None and ex.packed.path == cpumoe.selected_path()
    # The unpacked copies are gone: empty tensors of the old dtypes (Parameters in a Module).
    for name in ("w2_weight", "w13_weight_scale", "w2_weight_scale", "w13_bias", "w2_bias"):
        t = getattr(layer, name)
        assert tuple(t.shape) == (0,), name
    if backend.torch is not None:
        from cpumoe import torch_ops
        assert torch_ops.is_handle(layer.w13_weight)
        if module:
            assert isinstance(layer.w13_weight, backend.torch.nn.Parameter)
            assert {n for n, _ in layer.named_parameters()} >= {"w13_weight", "w2_weight"}
    else:
        assert layer.w13_weight.size == 0
    ref = p.reference()
    out = ex.apply(p.x, p.topk_weights, p.topk_ids, w1=layer.w13_weight, w2=layer.w2_weight)
    assert backend.dtype_name(out) == "bfloat16"
    assert_moe_close(backend, out, ref)
    # output= is written in place; the default activation is the layer's.
    buf = backend.full((p.T, p.H), 5.0, "bfloat16")
    got = ex(p.x, p.topk_weights, p.topk_ids, output=buf)
    assert got is buf
    assert np.array_equal(backend.bits(buf), backend.bits(out))
    ex.release()
    with pytest.raises(RuntimeError, match="process_weights_after_loading"):
        ex.apply(p.x, p.topk_weights, p.topk_ids)


def test_wrong_layer_shape_is_rejected(backend):
    p = make_problem(backend, T=3, E=8, k=2, H=64, I=32)
    with pytest.raises(ValueError, match="w13_weight: shape"):
        Int8Experts(64, 64, 8, 2).process_weights_after_loading(_layer(backend, p))


def test_expert_map(backend):
    """Expert parallelism: this rank holds experts {0, 3, 5, 6} of 8; topk ids are global."""
    p = make_problem(backend, T=16, E=8, k=4, H=64, I=32, dtype="float32", bias=True)
    local = np.array([0, 3, 5, 6])
    emap = np.full(8, -1, np.int64)  # int64 on purpose: converted to int32 once
    emap[local] = np.arange(4)
    w = [backend.numpy(a) for a in (p.w13, p.w2, p.s13, p.s2, p.b13, p.b2)]
    layer = types.SimpleNamespace(**{
        n: backend.asarray(a[local]) for n, a in zip(
            ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale", "w13_bias",
             "w2_bias"), w)})
    # k = 4 with 4 local experts here; k may exceed the local count (checked against E_global).
    Int8Experts(64, 32, 2, 4, expert_map=np.array([0, 1, -1, -1, -1, -1, -1, -1]))
    with pytest.raises(ValueError, match="exceeds"):
        Int8Experts(64, 32, 2, 4)
    ex = Int8Experts(64, 32, 4, 4, expert_map=backend.asarray(emap))
    ex.process_weights_after_loading(layer)
    out = ex.apply(p.x, p.topk_weights, p.topk_ids)
    keep = emap[backend.numpy(p.topk_ids)] >= 0
    ref = p.reference(topk_weights=backend.asarray(
        np.where(keep, backend.numpy(p.topk_weights), 0).astype(np.float32)))
    assert_moe_close(backend, out, ref)
    # A per-call map overrides: here only expert 3 is local (as local id 1). A numpy map works
    # with torch tensors too.
    only3 = np.full(8, -1, np.int32)
    only3[3] = 1
    got = ex.apply(p.x, p.topk_weights, p.topk_ids, expert_map=only3)
    ref3 = p.reference(topk_weights=backend.asarray(
        np.where(backend.numpy(p.topk_ids) == 3, backend.numpy(p.topk_weights), 0)
        .astype(np.float32)))
    assert_moe_close(backend, got, ref3)
    with pytest.raises(ValueError, match="expert_map"):
        ex.set_expert_map(np.array([0, 7, -1], np.int32))  # 7 is not a local id


def test_apply_router_weight_on_input(backend):
    p = make_problem(backend, T=9, E=8, k=1, H=64, I=32, dtype="float32")
    ex = Int8Experts(64, 32, 8, 1)
    ex.process_weights_after_loading(_layer(backend, p, trailing_one=False))
    out = ex.apply(p.x, p.topk_weights, p.topk_ids, apply_router_weight_on_input=True)
    xw = backend.asarray(backend.numpy(p.x) * backend.numpy(p.topk_weights))
    ref = p.reference(x=xw, skip_weighted=True)
    assert_moe_close(backend, out, ref)
    q = make_problem(backend, T=4, E=8, k=2, H=64, I=32)
    with pytest.raises(ValueError, match="topk == 1"):
        ex.apply(q.x, q.topk_weights, q.topk_ids, apply_router_weight_on_input=True)


def test_topk_softmax(backend):
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((5, 8)).astype(np.float32)
    w, ids = topk_softmax(backend.asarray(logits), 3)
    assert backend.dtype_name(w) == "float32" and backend.dtype_name(ids) == "int32"
    w, ids = backend.numpy(w), backend.numpy(ids)
    want = np.argsort(-logits, axis=1)[:, :3]
    assert np.array_equal(np.sort(ids, axis=1), np.sort(want, axis=1))
    np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=1e-6)
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    w2, ids2 = topk_softmax(backend.asarray(logits), 3, renormalize=False)
    np.testing.assert_allclose(backend.numpy(w2),
                               np.take_along_axis(p, backend.numpy(ids2).astype(np.int64), 1),
                               rtol=1e-5)


@pytest.mark.skipif(BACKEND_NAME != "torch", reason="torch.compile needs the torch backend")
def test_compile_a_model_using_the_experts(backend):
    torch = backend.torch
    p = make_problem(backend, T=6, E=8, k=2, H=64, I=32, dtype="bfloat16", bias=True)

    class MoEBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(64, 8, bias=False, dtype=torch.bfloat16)
            self.experts = Int8Experts(64, 32, 8, 2)

        def forward(self, x):
            tw, ids = topk_softmax(self.gate(x), 2)
            return self.experts.apply(x, tw, ids)

    block = MoEBlock()
    block.experts.process_weights_after_loading(_layer(backend, p))
    with torch.no_grad():
        eager = block(p.x)
        torch._dynamo.reset()
        compiled = torch.compile(block, fullgraph=True, backend="aot_eager")(p.x)
    assert torch.equal(compiled, eager)


def test_expert_map_with_no_local_slot_gives_zeros():
    """No slot of the batch is local: zeros. In a subprocess, because the extension of commit
    5986c5a died here with SIGILL (reached ud2) instead of returning zeros."""
    code = (
        "import numpy as np, cpumoe\n"
        "E, H, I = 4, 64, 32\n"
        "w13 = np.ones((E, 2 * I, H), np.int8); w2 = np.ones((E, H, I), np.int8)\n"
        "packed = cpumoe.prepack(w13, w2, np.ones((E, 2 * I), np.float32),\n"
        "                        np.ones((E, H), np.float32))\n"
        "x = np.ones((5, H), np.float32)\n"
        "ids = np.zeros((5, 2), np.int32); ids[:, 1] = 1\n"
        "out = cpumoe.fused_moe_int8(x, packed, np.ones((5, 2), np.float32), ids,\n"
        "                            expert_map=np.full(8, -1, np.int32))\n"
        "assert not out.any(), out\n"
        "print('zeros')\n")
    r = run_python(code)
    assert r.returncode == 0 and "zeros" in r.stdout, (r.returncode, r.stderr[-2000:])
