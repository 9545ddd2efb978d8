"""vLLM's x86 CPU MoE kernels (cpumoe.cli.bench.vllm_cpu, the benchmark's contenders) compute
the same layer as cpumoe.reference, on a small problem; the semantic differences found are pinned
here.
Runs where vllm-cpu is installed beside torch: the vLLM venv (ci/setup_vllm_venv.sh; the vllm
stage of ci/test_all.sh runs this file there with CPUMOE_REQUIRE_VLLM_CPU=1, which turns the skip
below into a failure). Skipped elsewhere, e.g. in the main Python, which has no vllm-cpu."""

from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import (BACKEND_NAME, assert_moe_close, get_backend, random_topk_ids,
                      random_topk_weights)


def _unavailable(why: str) -> None:
    if os.environ.get("CPUMOE_REQUIRE_VLLM_CPU") == "1":
        pytest.fail(f"CPUMOE_REQUIRE_VLLM_CPU=1, but vLLM's kernels do not run: {why}",
                    pytrace=False)
    pytest.skip(f"vLLM's kernels: {why}", allow_module_level=True)


if BACKEND_NAME != "torch":  # the numpy backend never imports torch
    _unavailable("they need torch (the test backend is numpy)")

import torch  # noqa: E402

import cpumoe  # noqa: E402
from cpumoe.cli.bench import vllm_cpu  # noqa: E402

if vllm_cpu.load() is not None:
    _unavailable(vllm_cpu.load())

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


# ---------------------------------------------------------------------------- 4-bit weights
def _w4_problem(seed, fmt, g=32, bias=False):
    """_problem's layer quantized to int4 (group g) or mxfp4, in cpumoe's prepack input form."""
    p = _problem(seed, bias)
    q = {}
    for name, w in (("13", p["w13b"]), ("2", p["w2b"])):
        wf = w.float().numpy()
        q[name] = (cpumoe.reference.quantize_mxfp4(wf) if fmt == "mxfp4" else
                   cpumoe.reference.quantize_int4(wf, g))
    p["q"] = (*q["13"], *q["2"])  # w13, s13, w2, s2 (blocks and scales for mxfp4)
    return p


def test_gptq_words_hold_the_values_nibble_by_nibble():
    rng = np.random.default_rng(3)
    v = rng.integers(-8, 8, size=(2, 5, 24)).astype(np.int8)
    words = vllm_cpu._gptq_words(v).numpy().view(np.uint32)  # [E, K / 8, N]
    assert words.shape == (2, 3, 5)
    for j in range(8):
        got = ((words >> (4 * j)) & 15).astype(np.int16) - 8  # k = 8 i + j
        assert np.array_equal(got.transpose(0, 2, 1), v[:, :, j::8])


@pytest.mark.parametrize("g", [32, 128])
def test_int4_matches_its_reference(g):
    p = _w4_problem(2, "int4", g)
    w13, s13, w2, s2 = p["q"]
    k = vllm_cpu.Int4(w13, s13, w2, s2)
    assert k.group_size == g and k.kernel.endswith(f"g{g}")
    got = _run(k, p)
    assert_moe_close(get_backend(), got, vllm_cpu.ref_int4(p["x"], w13, s13, w2, s2, p["wts"],
                                                           p["ids"]))
    # The measured differences from cpumoe's W4A8 op move its output by about 1% of the scale;
    # a wrong nibble or scale order would be off by O(1).
    ours = cpumoe.reference.ref_fused_moe_int4(p["x"], w13, w2, s13, s2, p["wts"], p["ids"],
                                               group_size=g)
    assert_moe_close(get_backend(), got, ours, atol_of_scale=4e-2, rtol=0)


def test_int4_refuses_what_it_does_not_compute():
    p = _w4_problem(2, "int4", 32, bias=True)
    w13, s13, w2, s2 = p["q"]
    with pytest.raises(vllm_cpu.Unsupported, match="silu only"):
        vllm_cpu.Int4(w13, s13, w2, s2, activation="swigluoai")
    with pytest.raises(vllm_cpu.Unsupported, match="biases"):
        vllm_cpu.Int4(w13, s13, w2, s2, p["b13"], p["b2"])
    with pytest.raises(vllm_cpu.Unsupported, match="bf16 or fp16"):
        vllm_cpu.Int4(w13, s13, w2, s2, x_dtype=torch.float32)
    with pytest.raises(ValueError, match="one group size"):  # w2's scales of groups of 64
        vllm_cpu.Int4(w13, s13, w2, s2[:, :, ::2])
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        vllm_cpu.Int4(w13 * 2, s13, w2, s2)
    # Why: the op takes biases, alpha and limit, and its int4 path ignores all of them.
    k = vllm_cpu.Int4(w13, s13, w2, s2)
    with_bias = torch.zeros_like(p["x"])
    torch.ops._C.fused_experts_cpu(with_bias, p["x"], k.w13, k.w2, p["wts"], p["ids"], 3, k.s13,
                                   k.s2, k.z13, k.z2, None, None, p["b13"], p["b2"], 1.702, 7.0,
                                   True)
    assert torch.equal(with_bias, _run(k, p))


@pytest.mark.parametrize("activation,bias", [("silu", False), ("silu", True),
                                             ("swigluoai", True)])
def test_mxfp4_computes_the_bf16_layer_of_its_weights(activation, bias):
    p = _w4_problem(4, "mxfp4", bias=bias)
    b13, s13, b2, s2 = p["q"]
    k = vllm_cpu.Mxfp4(b13, s13, b2, s2, p["b13"], p["b2"], activation=activation)
    R = cpumoe.reference
    ref = R.ref_fused_moe_bf16(p["x"], R.dequantize_mxfp4(b13, s13), R.dequantize_mxfp4(b2, s2),
                               p["wts"], p["ids"], activation, b13=p["b13"], b2=p["b2"])
    assert_moe_close(get_backend(), _run(k, p), ref)
    with pytest.raises(vllm_cpu.Unsupported, match="silu or swigluoai"):
        vllm_cpu.Mxfp4(b13, s13, b2, s2, activation="gelu")
    with pytest.raises(ValueError, match="gpt-oss"):  # w2's blocks and scales swapped
        vllm_cpu.Mxfp4(b13, s13, s2, b2)
    # fp16 activations abort the process inside the op: refused before.
    with pytest.raises(vllm_cpu.Unsupported, match="must be bf16"):
        vllm_cpu.Mxfp4(b13, s13, b2, s2, x_dtype=torch.float16)


def _fp8_problem(seed, bias=False):
    """_problem's layer as FP8 codes and 128 x 128 block scales (cpumoe.quantize)."""
    p = _problem(seed, bias)
    w13, w2 = p["w13b"].float().numpy(), p["w2b"].float().numpy()
    p["fp8"] = cpumoe.quantize.quantize_experts("fp8", lambda e: w13[e], lambda e: w2[e],
                                                group_size=128, num_experts=E)
    return p


def test_fp8_matches_cpumoes_fp8_reference():
    p = _fp8_problem(6)
    q = p["fp8"]
    k = vllm_cpu.Fp8(q.w13, q.s13, q.w2, q.s2)
    got = _run(k, p)
    ref, name = vllm_cpu.Fp8.reference(p["x"], q, p["wts"], p["ids"], "silu")
    assert name == "fp8 g128"
    # vLLM rounds each dequantized weight (code x block scale) to bf16 before its bf16 GEMM:
    # about 0.5% of the output scale from cpumoe's exact per-block sums (a code or scale in the
    # wrong place would be off by O(1)).
    assert_moe_close(get_backend(), got, ref, atol_of_scale=1.5e-2, rtol=0)
    # The codes as torch float8_e4m3fn give the same packed weights.
    k2 = vllm_cpu.Fp8(torch.from_numpy(q.w13).view(torch.float8_e4m3fn), q.s13,
                      torch.from_numpy(q.w2).view(torch.float8_e4m3fn), q.s2)
    assert torch.equal(k2.w13, k.w13) and torch.equal(k2.w2, k.w2)


def test_fp8_refuses_what_it_does_not_compute():
    p = _fp8_problem(7, bias=True)
    q = p["fp8"]
    with pytest.raises(vllm_cpu.Unsupported, match="silu only"):
        vllm_cpu.Fp8(q.w13, q.s13, q.w2, q.s2, activation="swigluoai")
    with pytest.raises(vllm_cpu.Unsupported, match="biases"):
        vllm_cpu.Fp8(q.w13, q.s13, q.w2, q.s2, p["b13"], p["b2"])
    with pytest.raises(vllm_cpu.Unsupported, match="must be bf16"):
        vllm_cpu.Fp8(q.w13, q.s13, q.w2, q.s2, x_dtype=torch.float16)
    with pytest.raises(ValueError, match="128 x 128 blocks"):  # w2's scales in w13's place
        vllm_cpu.Fp8(q.w13, q.s2, q.w2, q.s13)


def test_int4_takes_fp16_activations():
    p = _w4_problem(5, "int4", 32)
    p["x"] = p["x"].to(torch.float16)
    w13, s13, w2, s2 = p["q"]
    got = _run(vllm_cpu.Int4(w13, s13, w2, s2, x_dtype=torch.float16), p)
    assert got.dtype == torch.float16
    assert_moe_close(get_backend(), got, vllm_cpu.ref_int4(p["x"], w13, s13, w2, s2, p["wts"],
                                                           p["ids"]))
