"""torch.compile(fullgraph=True) of code calling the public cpumoe.fused_moe_int8 / fused_moe_bf16
on torch tensors: the call becomes one cpumoe::fused_moe_packed node (the packed layer passed by
key), the graph is guarded on the packed object's identity, results equal eager.

Needs the torch backend (skipped with CPUMOE_TEST_BACKEND=numpy).
"""

from __future__ import annotations

import gc

import pytest

from conftest import BACKEND_NAME, make_problem

if BACKEND_NAME != "torch":
    pytest.skip("torch.compile needs the torch backend", allow_module_level=True)

import torch  # noqa: E402

import cpumoe  # noqa: E402


def _layers(backend, bf16, n: int = 2):
    """n different packed layers of one shape and a routed batch for them (bf16: "int4" makes
    W4A8 layers from the int8 values' top four bits)."""
    packed = []
    for i in range(n):
        p = make_problem(backend, T=7, E=8, k=2, H=64, I=32, dtype="bfloat16",
                         activation="silu", bias=True, weight_seed=i)
        if bf16 == "int4":
            v13, v2 = (p.w13 >> 4).contiguous(), (p.w2 >> 4).contiguous()  # in [-8, 7]
            packed.append(cpumoe.prepack_int4(v13, v2, p.s13[..., None].repeat(1, 1, 2) * 16,
                                              p.s2[..., None] * 16, p.b13, p.b2))
        elif bf16:  # the dequantized int8 weights, in bf16
            packed.append(cpumoe.prepack_bf16((p.w13.float() * p.s13[..., None]).bfloat16(),
                                              (p.w2.float() * p.s2[..., None]).bfloat16(),
                                              p.b13, p.b2))
        else:
            packed.append(cpumoe.prepack(p.w13, p.w2, p.s13, p.s2, p.b13, p.b2))
    return packed, p


def _graph_targets(fn, *args):
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, fullgraph=True, backend=capture)(*args)
    return out, graphs


@pytest.mark.parametrize("bf16", [False, True, "int4"], ids=["int8", "bf16", "int4"])
def test_public_op_compiles_fullgraph(backend, bf16):
    (pa, pb), p = _layers(backend, bf16)
    op = cpumoe.fused_moe_bf16 if bf16 is True else cpumoe.fused_moe_int8

    def f(x, packed, tw, ids):
        return op(torch.nn.functional.layer_norm(x, x.shape[-1:]), packed, tw, ids) * 2

    eager = f(p.x, pa, p.topk_weights, p.topk_ids)
    out, graphs = _graph_targets(f, p.x, pa, p.topk_weights, p.topk_ids)
    assert torch.equal(out, eager)
    assert len(graphs) == 1
    targets = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert "cpumoe.fused_moe_packed.default" in targets
    torch._dynamo.reset()


def test_graph_is_guarded_on_the_packed_object(backend):
    (pa, pb), p = _layers(backend, bf16=False)

    def f(x, packed, tw, ids):
        return cpumoe.fused_moe_int8(x, packed, tw, ids)

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    got_a = cf(p.x, pa, p.topk_weights, p.topk_ids)
    got_b = cf(p.x, pb, p.topk_weights, p.topk_ids)  # another layer: not the first one's key
    assert torch.equal(got_a, f(p.x, pa, p.topk_weights, p.topk_ids))
    assert torch.equal(got_b, f(p.x, pb, p.topk_weights, p.topk_ids))
    assert not torch.equal(got_a, got_b)
    torch._dynamo.reset()


def test_out_argument_and_dynamic_T(backend):
    (pa,), p = _layers(backend, bf16=True, n=1)

    def f(x, packed, tw, ids):
        out = torch.empty_like(x)
        cpumoe.fused_moe_bf16(x, packed, tw, ids, out=out)
        return out + 1

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=True)
    for T in (9, 4, 1):
        q = make_problem(backend, T=T, E=8, k=2, H=64, I=32, dtype="bfloat16",
                         activation="silu", bias=True)
        assert torch.equal(cf(q.x, pa, q.topk_weights, q.topk_ids),
                           f(q.x, pa, q.topk_weights, q.topk_ids))
    torch._dynamo.reset()


def test_shape_error_at_trace_time(backend):
    (pa,), p = _layers(backend, bf16=False, n=1)
    x = torch.zeros((3, 32))  # H = 32, the layer has 64
    ids = torch.zeros((3, 2), dtype=torch.int32)
    tw = torch.ones((3, 2))
    with pytest.raises(Exception, match=r"x: shape must be \[\?, 64\]"):
        cpumoe.fused_moe_int8(x, pa, tw, ids)  # eager: the direct path's message
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"x: shape must be \[\?, 64\]"):
        torch.compile(lambda a: cpumoe.fused_moe_int8(a, pa, tw, ids), fullgraph=True,
                      backend="aot_eager")(x)
    torch._dynamo.reset()


def test_registry_does_not_keep_layers_alive(backend):
    from cpumoe import torch_ops
    (pa,), p = _layers(backend, bf16=False, n=1)
    key = torch_ops._packed_key(pa)
    assert torch_ops._packed_by_key(key) is pa
    del pa
    gc.collect()
    with pytest.raises(ValueError, match="no live"):
        torch_ops._packed_by_key(key)
