"""vLLM's x86 CPU MoE kernels (cpumoe.cli.bench.vllm_cpu, the benchmark's contenders) compute
the same layer as cpumoe.reference, on a small problem; the semantic differences found are pinned
here. Then the plugin's takeover of vLLM's GPTQ / AWQ MoE methods (cpumoe.vllm_plugin): its
reading of their parameters against vLLM's own CPU processing, and GPTQ / AWQ checkpoints served
through vllm.LLM.
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


# ---------------------------------------------------------------------------- GPTQ / AWQ (plugin)
# vLLM 0.32 gives 4-bit GPTQ and AWQ MoE layers AutoGPTQMoEMethod / AutoAWQMoEMethod, whose only
# CPU experts (CPUExpertsInt4, fused_experts_cpu INT4_W4A8) it selects on x86 with AMX; elsewhere
# its engine fails ("No WNA16 MoE backend supports the deployment configuration"). cpumoe's plugin
# takes those layers (cpumoe.vllm_plugin: kinds._gptq_awq_kind, methods' CpumoeGptqMoEMethod /
# CpumoeAwqMoEMethod, experts.CpumoeGptqAwqExperts). Checked here: its reading of vLLM's loaded
# parameters (exact), its op against vLLM's own CPU processing of the same parameters, which
# layers it takes, and the checkpoints served end to end through vllm.LLM.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's: nibble i of a word holds column 8 c + order[i]


def _vllm():
    """Imports vLLM and the modules these tests use, their import-time warnings silenced (this
    file's config turns warnings into errors; vLLM's and torch's own imports warn)."""
    import importlib
    import warnings
    mods = ("vllm", "vllm.model_executor.layers.quantization",
            "vllm.model_executor.layers.quantization.auto_gptq",
            "vllm.model_executor.layers.quantization.auto_awq",
            "vllm.model_executor.layers.fused_moe.oracle.int_wna16",
            "vllm.model_executor.layers.fused_moe.experts.cpu_moe", "cpumoe.vllm_plugin.layer")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for m in mods:
                importlib.import_module(m)
            from cpumoe.vllm_plugin.methods import method_classes
            method_classes()  # imports vLLM's quantized MoE methods
    except Exception as e:  # noqa: BLE001
        _unavailable(f"vllm does not import ({type(e).__name__}: {e})")


def _pack_rows(v, bits=4):
    """GPTQ's qweight packing (test_checkpoint_gptq's independent packer)."""
    from test_checkpoint_gptq import pack_along_rows
    return pack_along_rows(v, bits)


def _pack_cols(v, order=tuple(range(8)), bits=4):
    """GPTQ's qzeros / AWQ's packing along N (test_checkpoint_gptq's independent packer)."""
    from test_checkpoint_gptq import pack_along_cols
    return pack_along_cols(v, order, bits)


def _gptq_awq_linear(method, fmt, q, z, s, bits=4):
    """One Linear's checkpoint tensors from codes q [N, K], zero points z [G, N] and scales
    s [G, N] (float16): GPTQ v1 stores z - 1, gptq_v2 and AWQ z; GPTQ 8-bit four to a word."""
    if method == "gptq":
        stored = z - 1 if fmt == "gptq" else z
        return {"qweight": _pack_rows(np.ascontiguousarray(q.T), bits),
                "qzeros": _pack_cols(stored.astype(np.uint8), bits=bits), "scales": s}
    return {"qweight": _pack_cols(np.ascontiguousarray(q.T), AWQ_ORDER),
            "qzeros": _pack_cols(z.astype(np.uint8), AWQ_ORDER), "scales": s}


def _random_linear(rng, method, fmt, n, k, g, sym, bits=4):
    """(tensors, float32 weight [n, k] = s * (q - z) exactly) of one random Linear."""
    ge = k if g == -1 else g
    G = k // ge
    top = 1 << bits
    q = rng.integers(0, top, (n, k), dtype=np.uint8)
    if sym:
        z = np.full((G, n), top // 2)
    elif method == "gptq" and fmt == "gptq":  # v1 stores z - 1 in a field: z in [1, 2^bits]
        z = rng.integers(1, top + 1, (G, n))
    else:
        z = rng.integers(0, top, (G, n))
    s = (rng.random((G, n)) * 0.02 + 0.004).astype(np.float16)
    gi = np.arange(k) // ge
    w = (s.astype(np.float64)[gi].T * (q.astype(np.float64) - z[gi].T)).astype(np.float32)
    return _gptq_awq_linear(method, fmt, q, z, s, bits), w


def _vllm_layer_params(method, fmt, E, H, I, g, sym, seed=0, bits=4):
    """A GPTQ / AWQ MoE layer's parameters as vLLM's AutoGPTQMoEMethod / AutoAWQMoEMethod load
    them (gate and up stacked along N, the projections' own packings kept; scales fp32 as
    cpumoe's methods create them) and its float weights w13 [E, 2I, H], w2 [E, H, I]."""
    rng = np.random.default_rng(seed)
    stack = {}
    w13 = np.empty((E, 2 * I, H), np.float32)
    w2 = np.empty((E, H, I), np.float32)
    for e in range(E):
        for j, (n, k) in enumerate(((I, H), (I, H), (H, I))):
            t, w = _random_linear(rng, method, fmt, n, k, g, sym, bits)
            if j < 2:
                w13[e, j * I:(j + 1) * I] = w
            else:
                w2[e] = w
            stem = "w2" if j == 2 else "w13"
            for name, a in t.items():
                stack.setdefault((stem, name), [[] for _ in range(E)])[e].append(a)
    params = {}
    for (stem, name), per_expert in stack.items():
        # w13: gate then up along N, the packed (N / 8) or plain N axis: the last one
        arr = np.stack([np.concatenate(p, axis=-1) for p in per_expert])
        params[f"{stem}_{name}"] = torch.from_numpy(arr.astype(np.float32) if name == "scales"
                                                    else arr)
    return params, w13, w2


GPTQ_AWQ_CASES = [("gptq", "gptq", True, 64, 4), ("gptq", "gptq", False, 32, 4),
                  ("gptq", "gptq_v2", False, 128, 4), ("gptq", "gptq", True, -1, 4),
                  ("gptq", "gptq", False, -1, 4), ("awq", "gemm", False, 64, 4),
                  ("awq", "gemm", True, 32, 4), ("gptq", "gptq", True, 64, 8),
                  ("gptq", "gptq_v2", False, 32, 8)]


@pytest.mark.parametrize("method,fmt,sym,g,bits", GPTQ_AWQ_CASES)
def test_gptq_awq_layer_reads_vllms_parameters_exactly(method, fmt, sym, g, bits):
    _vllm()
    from cpumoe.vllm_plugin.experts import gptq_awq_layer
    E, H, I = 3, 256, 128
    p, w13, w2 = _vllm_layer_params(method, fmt, E, H, I, g, sym, bits=bits)
    off = 1 if fmt == "gptq" else 0
    got_fmt, gg, c13, c2, s13, s2 = gptq_awq_layer(
        method, p["w13_qweight"], p["w2_qweight"], p["w13_scales"], p["w2_scales"],
        p["w13_qzeros"], p["w2_qzeros"], g, off, bits=bits)
    assert got_fmt == ("int8_affine" if bits == 8 else "int4" if sym else "int4_affine")
    assert gg == (g if g > 0 else 128)  # group -1 (one group per row): gcd(H, I)
    R = cpumoe.reference
    deq = R.dequantize_int4 if got_fmt == "int4" else R.dequantize_int4_affine
    assert np.array_equal(deq(c13, s13, gg), w13) and np.array_equal(deq(c2, s2, gg), w2)
    if method == "gptq" and not sym:  # v1 read as v2 (or the reverse) is off by one step
        _, _, _, _, t13, _ = gptq_awq_layer(
            method, p["w13_qweight"], p["w2_qweight"], p["w13_scales"], p["w2_scales"],
            p["w13_qzeros"], p["w2_qzeros"], g, 1 - off, bits=bits)
        assert not np.array_equal(R.dequantize_int4_affine(c13, t13, gg), w13)


def _gptq_awq_experts(E, k):
    """cpumoe's GPTQ / AWQ experts object as vLLM's kernel builder makes it (without a
    FusedMoEConfig: the attributes its process_weights_after_loading and apply read)."""
    import types
    from cpumoe.vllm_plugin.experts import CpumoeGptqAwqExperts
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    ex = object.__new__(CpumoeGptqAwqExperts)
    ex.packed, ex.layer_name, ex._act, ex._act_why, ex._stats = None, "?", "silu", "", {}
    ex._emap_src = ex._emap = None
    ex.moe_config = types.SimpleNamespace(experts_per_token=k, activation=MoEActivation.SILU)
    return ex


@pytest.mark.parametrize("method,sym", [("gptq", True), ("gptq", False), ("awq", True),
                                        ("awq", False)])
def test_gptq_awq_experts_agree_with_vllms_cpu_processing(method, sym, monkeypatch):
    """The same loaded parameters through vLLM's own CPU path (its _process_weights_cpu, as
    AutoGPTQMoEMethod / AutoAWQMoEMethod call it, then fused_experts_cpu INT4_W4A8 as
    CPUExpertsInt4.apply does; bf16 scales as vLLM's parameters hold them) and through cpumoe's
    experts: the same layer, within the measured rounding differences of the two int8 ops
    (a misread nibble order, AWQ order or zero offset would be off by O(1))."""
    _vllm()
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import _process_weights_cpu
    from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig
    from cpumoe.vllm_plugin.experts import gptq_awq_layer, stats
    E, H, I, g, T, k = 4, 256, 128, 64, 9, 2
    p, _, _ = _vllm_layer_params(method, "gptq" if method == "gptq" else "gemm", E, H, I, g, sym,
                                 seed=3)
    for name in ("w13_scales", "w2_scales"):  # vLLM's scales are bf16: make them exact there
        p[name] = p[name].to(torch.bfloat16).float()
    names = ("w13_qweight", "w2_qweight", "w13_scales", "w2_scales", "w13_qzeros", "w2_qzeros")
    if method == "gptq":
        qc = AutoGPTQConfig.from_config({"quant_method": "gptq", "bits": 4, "group_size": g,
                                         "desc_act": False, "sym": True})
        args = [p[n].transpose(1, 2).contiguous() for n in names]  # the method's N-first
    else:
        qc = AutoAWQConfig.from_config({"quant_method": "awq", "bits": 4, "group_size": g,
                                        "zero_point": True})
        args = [p[n] for n in names]
    args[2], args[3] = args[2].to(torch.bfloat16), args[3].to(torch.bfloat16)
    w13, w2, s13, s2, z13, z2, *_ = _process_weights_cpu(qc, *args)
    rng = np.random.default_rng(4)
    x = torch.from_numpy(rng.standard_normal((T, H), np.float32)).to(torch.bfloat16)
    ids = torch.from_numpy(random_topk_ids(rng, T, E, k)).to(torch.int32)
    wts = torch.from_numpy(random_topk_weights(rng, T, k))
    theirs = torch.zeros_like(x)
    torch.ops._C.fused_experts_cpu(theirs, x, w13, w2, wts, ids, 3, s13, s2, z13, z2, None,
                                   None, None, None, None, None, True)
    # cpumoe's experts on the same parameters (a layer as cpumoe's method leaves it).
    def experts_on_a_layer():
        layer = torch.nn.Module()
        layer.layer_name = f"model.layers.7.mlp.experts.{method}"
        for name in names:
            layer.register_parameter(name, torch.nn.Parameter(p[name].clone(),
                                                              requires_grad=False))
        layer.cpumoe_gptq_awq = {"method": method, "group_size": g,
                                 "zero_offset": 1 if method == "gptq" else 0,
                                 "checkpoint_format": "gptq" if method == "gptq" else "gemm"}
        ex = _gptq_awq_experts(E, k)
        ex.process_weights_after_loading(layer)
        return layer, ex
    layer, ex = experts_on_a_layer()
    assert ex.packed.weight_format == ("int4" if sym else "int4_affine")
    assert ex.packed.group_size == g and ex.kind == method
    assert ex._format_name() == (f"W4A8 {ex.packed.weight_format} g{g} "
                                 f"({'GPTQ v1' if method == 'gptq' else 'AWQ GEMM'} checkpoint, "
                                 f"int8 activations)")
    assert layer.w13_qweight.numel() == 0 and layer.w13_scales.numel() == 0  # freed once packed
    ours = torch.empty_like(x)
    ex.apply(ours, x, None, None, wts, ids, MoEActivation.SILU, E, None, None, None, None, None,
             None, False)
    assert stats()["layers"][layer.layer_name]["kind"] == method
    assert_moe_close(get_backend(), ours, theirs, atol_of_scale=4e-2, rtol=0)
    # ... and exactly the op on the layer gptq_awq_layer reads (cpumoe's reference of it).
    fmt, gg, c13, c2, q13, q2 = gptq_awq_layer(method, *[p[n] for n in names], g,
                                               1 if method == "gptq" else 0)
    R = cpumoe.reference
    ref = (R.ref_fused_moe_int4 if fmt == "int4" else R.ref_fused_moe_int4_affine)(
        x, c13, c2, q13, q2, wts, ids, group_size=gg)
    assert_moe_close(get_backend(), ours, ref)
    # CPUMOE_VLLM_W4_ACT=bf16: the symmetric layer W4A16 (the BF16 op on its dequantized
    # weights); with zero points it keeps int8 activations and says why.
    monkeypatch.setenv("CPUMOE_VLLM_W4_ACT", "bf16")
    layer, ex = experts_on_a_layer()
    if fmt == "int4":
        assert isinstance(ex.packed, cpumoe.PackedMoeFp8)
        assert ex._format_name().startswith(f"W4A16 int4 g{gg}, ")
        ours = torch.empty_like(x)
        ex.apply(ours, x, None, None, wts, ids, MoEActivation.SILU, E, None, None, None, None,
                 None, None, False)
        d13, d2 = (torch.as_tensor(np.asarray(cpumoe.quantize.dequantize_int4(c, q, gg)))
                   for c, q in ((c13, q13), (c2, q2)))
        assert_moe_close(get_backend(), ours, R.ref_fused_moe_bf16(x, d13, d2, wts, ids))
    else:
        assert ex.packed.weight_format == "int4_affine"
        assert ex._format_name().endswith("int8 activations: bf16 ones need symmetric 4-bit "
                                          "weights)")


def _moe_namespace(H=2048, I=768):
    import types
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    return types.SimpleNamespace(
        hidden_dim=H, intermediate_size_per_partition=I, is_act_and_mul=True,
        activation=MoEActivation.SILU, in_dtype=torch.bfloat16, is_lora_enabled=False,
        swiglu_limit=None, swiglu_alpha=None, swiglu_beta=None,
        moe_parallel_config=types.SimpleNamespace(tp_size=1))


_GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
_AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
        "version": "gemm"}
_EXPERTS = "model.layers.0.mlp.experts"


@pytest.mark.parametrize("cfg,want,reason", [
    (_GPTQ, "gptq", ""),
    (dict(_GPTQ, checkpoint_format="gptq_v2"), "gptq", ""),
    (dict(_GPTQ, group_size=-1), "gptq", ""),
    (dict(_GPTQ, group_size=32), "gptq", ""),
    (dict(_GPTQ, checkpoint_format="marlin"), None, "checkpoint_format 'marlin'"),
    (dict(_GPTQ, bits=8), "gptq", ""),  # int8_affine
    (dict(_GPTQ, group_size=48), None, "hidden dim 2048 is not a multiple of 32 and of "
                                       "group_size 48"),
    (dict(_GPTQ, group_size=512), None, "intermediate (per partition) dim 768"),
    # GPTQModel's per-module overrides: this layer's bits; a "-:" match leaves it unquantized
    # (vLLM's own unquantized method, then cpumoe's bf16 experts: not this kind).
    (dict(_GPTQ, dynamic={r"+:.*layers\.0\..*": {"bits": 8}}), "gptq", ""),
    (dict(_GPTQ, dynamic={r"+:.*layers\.1\..*": {"bits": 8}}), "gptq", ""),
    (dict(_GPTQ, dynamic={r"-:.*mlp\.experts": {}}), "unhandled", ""),
    (_AWQ, "awq", ""),
    (dict(_AWQ, group_size=64), "awq", ""),
    (dict(_AWQ, zero_point=False), None, "AWQ zero_point: false"),
    (dict(_AWQ, version="gemv"), None, "AWQ version 'gemv'"),
    (dict(_AWQ, modules_to_not_convert=["mlp.experts"]), "unhandled", ""),
    (dict(_AWQ, modules_to_not_convert=["self_attn"]), "awq", ""),
])
def test_gptq_awq_layers_the_plugin_takes(cfg, want, reason):
    """Which GPTQ / AWQ MoE layers run on cpumoe (4-bit, GPTQ also 8-bit, group sizes cpumoe can
    regroup to a multiple of 32 dividing H and I, GPTQ v1 / v2, AWQ GEMM with zero points), the
    reason for the others, and the layers vLLM leaves unquantized (not this kind:
    "unhandled")."""
    _vllm()
    from vllm.model_executor.layers.quantization import get_quantization_config
    from cpumoe.vllm_plugin import kinds
    from cpumoe.vllm_plugin.methods import method_classes
    qc = get_quantization_config(cfg["quant_method"]).from_config(cfg)
    kind, why, handled, layer_cfg = kinds._gptq_awq_kind(None, _EXPERTS, qc, _moe_namespace())
    if want == "unhandled":
        assert (kind, why, handled) == (None, "", False)
        return
    assert handled and kind == want and (reason in why if reason else why == ""), why
    if want is None:
        return
    # quantized_kind hands the layer's config to cpumoe's method of that kind: vLLM's GPTQ /
    # AWQ MoE method's parameters and loader.
    got, scheme, why = kinds.quantized_kind(None, _EXPERTS, qc, _moe_namespace())
    assert (got, why) == (want, "") and repr(scheme["weights"]) == repr(layer_cfg)
    from vllm.model_executor.layers.quantization.auto_awq import AutoAWQMoEMethod
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQMoEMethod
    cls = method_classes()[want]
    assert issubclass(cls, AutoGPTQMoEMethod if want == "gptq" else AutoAWQMoEMethod)


@pytest.mark.parametrize("cfg", [_GPTQ, dict(_GPTQ, checkpoint_format="gptq_v2"), _AWQ])
def test_gptq_awq_methods_create_vllms_parameters_with_fp32_scales(cfg):
    """cpumoe's methods create vLLM's GPTQ / AWQ parameters (names, shapes, loader attributes)
    with fp32 group scales (a checkpoint's fp16 scales load exactly; vLLM's are the model
    dtype) and tell their experts what the checkpoint is."""
    import types
    _vllm()
    from vllm.model_executor.layers.quantization import get_quantization_config
    from cpumoe.vllm_plugin.methods import method_classes
    qc = get_quantization_config(cfg["quant_method"]).from_config(cfg)
    method = cfg["quant_method"]
    m = method_classes()[method](qc, None, types.SimpleNamespace(w13_num_shards=2))
    layer = torch.nn.Module()
    E, H, I, g = 2, 256, 128, cfg["group_size"]
    m.create_weights(layer, E, H, I, torch.bfloat16, weight_loader=print)
    if method == "gptq":
        shapes = {"w13_qweight": (E, H // 8, 2 * I), "w2_qweight": (E, I // 8, H)}
    else:
        shapes = {"w13_qweight": (E, H, 2 * I // 8), "w2_qweight": (E, I, H // 8)}
    shapes.update(w13_scales=(E, H // g, 2 * I), w2_scales=(E, I // g, H),
                  w13_qzeros=(E, H // g, 2 * I // 8), w2_qzeros=(E, I // g, H // 8))
    for name, shape in shapes.items():
        t = getattr(layer, name)
        assert tuple(t.shape) == shape, name
        assert t.dtype == (torch.float32 if name.endswith("scales") else torch.int32), name
        assert t.weight_loader is print and t.is_transposed, name
    assert layer.w13_scales.quant_method == "group"
    assert layer.cpumoe_gptq_awq == {
        "method": method, "group_size": g,
        "zero_offset": {"gptq": 1, "gptq_v2": 0, "gemm": 0}[
            cfg.get("checkpoint_format", "gemm" if method == "awq" else "gptq")],
        "checkpoint_format": cfg.get("checkpoint_format", "gemm" if method == "awq" else "gptq"),
        "bits": cfg["bits"]}


def _save_gptq_awq(src, dst, method, g=64, bits=4):
    """The bf16 checkpoint ``src`` with its experts quantized to ``bits`` bits (4; GPTQ also 8;
    min-max per group of ``g``; GPTQ v1 symmetric: zero points 2^(bits-1), scales
    amax / (2^(bits-1) - 1); AWQ asymmetric: integer zero points) and written as AutoGPTQ / AutoAWQ do (the experts only: attention and router stay
    bf16, as GPTQModel's ``dynamic`` "-:" rules and AWQ's ``modules_to_not_convert`` say), and its
    bf16 reference (the experts dequantized, rounded to bf16). Returns (checkpoint, reference)."""
    import json
    from pathlib import Path
    from safetensors.torch import load_file, save_file
    src = Path(src)
    tensors = load_file(str(src / "model.safetensors"))
    out, ref = {}, {}
    for name, t in tensors.items():
        if ".experts." not in name or not name.endswith(".weight"):
            out[name] = ref[name] = t
            continue
        w = t.float().numpy()
        n, k = w.shape
        wg = w.reshape(n, k // g, g)
        half = 1 << (bits - 1)
        if method == "gptq":
            s = (np.abs(wg).max(-1) / (half - 1)).astype(np.float16)
            z = np.full(s.shape, half)
        else:
            lo, hi = np.minimum(wg.min(-1), 0), np.maximum(wg.max(-1), 0)
            s = ((hi - lo) / 15).astype(np.float16)
            z = np.clip(np.rint(-lo / s.astype(np.float32)), 0, 15).astype(np.int64)
        s32 = s.astype(np.float32)
        q = np.clip(np.rint(wg / s32[..., None]) + z[..., None], 0, 2 * half - 1).astype(np.uint8)
        ref[name] = torch.from_numpy(s32[..., None] * (q.astype(np.float32) - z[..., None])
                                     ).reshape(n, k).to(torch.bfloat16)
        m = name[:-len(".weight")]
        lin = _gptq_awq_linear(method, "gptq", q.reshape(n, k), z.T, s.T.copy(), bits)
        for suffix, a in lin.items():
            out[f"{m}.{suffix}"] = torch.from_numpy(np.ascontiguousarray(a))
        if method == "gptq":  # AutoGPTQ writes the (trivial) group index too
            out[f"{m}.g_idx"] = torch.from_numpy((np.arange(k) // g).astype(np.int32))
    config = json.loads((src / "config.json").read_text())
    if method == "gptq":
        qc = {"quant_method": "gptq", "bits": bits, "group_size": g, "desc_act": False,
              "sym": True, "checkpoint_format": "gptq",
              "dynamic": {r"-:.*self_attn.*": {}, r"-:.*mlp\.gate$": {}}}
    else:
        qc = {"quant_method": "awq", "bits": 4, "group_size": g, "zero_point": True,
              "version": "gemm", "modules_to_not_convert": ["self_attn", "mlp.gate"]}
    folders = []
    stem = method + ("" if bits == 4 else str(bits))
    for folder, t, q in ((Path(dst) / stem, out, qc), (Path(dst) / f"{stem}_ref", ref, None)):
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in t.items()}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps(
            dict(config, quantization_config=q) if q else config, indent=1))
        folders.append(folder)
    return tuple(folders)


def _compare(a, b, tol=0.8):
    """Problems between two greedy runs (cpumoe.vllm_plugin.serve results): a token's logprob
    off by more than tol, or a divergence that is not a near tie in both runs (as
    tests_vllm/test_engine.py's comparison)."""
    problems = []
    for i, (ta, tb) in enumerate(zip(a["tokens"], b["tokens"])):
        la, lb = a["logprobs"][i], b["logprobs"][i]
        for step, (x, y) in enumerate(zip(ta, tb)):
            if x == y:
                if abs(la[step][str(x)] - lb[step][str(y)]) > tol:
                    problems.append(f"prompt {i} step {step}: token {x} logprobs differ")
                continue
            if str(y) not in la[step] or str(x) not in lb[step] or max(
                    abs(la[step][str(x)] - la[step][str(y)]),
                    abs(lb[step][str(x)] - lb[step][str(y)])) > tol:
                problems.append(f"prompt {i} step {step}: {x} vs {y}, not a near tie")
            break
    return problems


def test_gptq_awq_checkpoints_served_through_vllm_on_cpumoe(tmp_path):
    """A tiny Qwen3-MoE with GPTQ (v1, symmetric: cpumoe's int4), AWQ and compressed-tensors
    W4A16_ASYM (asymmetric: int4_affine) experts served through vllm.LLM with CPUMOE_VLLM=1
    (vLLM's own config, its GPTQ / AWQ / WNA16 MoE parameters and weight loading; cpumoe's
    experts in every MoE layer),
    against vLLM's bf16 serving of the same weights dequantized. vLLM's own run of the quantized
    checkpoints (CPUMOE_VLLM=0) serves them only on x86 with AMX (then it is compared too);
    elsewhere its engine fails as documented in docs/integrations.md."""
    import json
    import platform
    import subprocess
    import sys
    _vllm()
    from cpumoe.testing import models
    src = models.save_tiny("qwen3_moe", tmp_path / "bf16")
    ck = {}
    for method in ("gptq", "awq"):
        ck[method], ck[method + "_ref"] = _save_gptq_awq(src, tmp_path, method)
    ck["gptq8"], ck["gptq8_ref"] = _save_gptq_awq(src, tmp_path, "gptq", bits=8)
    # compressed-tensors W4A16 with zero points (symmetric: false), written by compressed-tensors
    ck["ct_asym"] = models.save_w4a16_asym(src, tmp_path / "ct_asym", 64)
    ck["ct_asym_ref"] = models.save_w4_dequantized(ck["ct_asym"], tmp_path / "ct_asym_ref")
    procs = {}
    for backend, names in (("cpumoe", ["gptq", "awq", "ct_asym", "gptq8"]),
                           ("vllm", ["gptq_ref", "awq_ref", "ct_asym_ref", "gptq8_ref", "gptq",
                                     "awq"])):
        out = tmp_path / f"{backend}.json"
        cmd = [sys.executable, "-m", "cpumoe.vllm_plugin.serve", "--out", str(out)]
        cmd += [str(ck[n]) for n in names]
        if backend == "vllm":
            cmd += ["--may-fail", str(ck["gptq"]), "--may-fail", str(ck["awq"])]
        env = dict(os.environ, CPUMOE_VLLM="1" if backend == "cpumoe" else "0")
        log = open(tmp_path / f"{backend}.log", "w")
        procs[backend] = (subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                           cwd=tmp_path), out, log)
    runs = {}
    for backend, (p, out, log) in procs.items():
        try:
            rc = p.wait(timeout=900)
        finally:
            if p.poll() is None:
                p.kill()
            log.close()
        text = (tmp_path / f"{backend}.log").read_text()
        assert rc == 0, f"{backend} serving failed (exit {rc}):\n{text[-6000:]}"
        runs[backend] = {"log": text, "results": {
            r["model"]: r for r in json.loads(out.read_text())["results"]}}
    for method, kind, cls, fmt, label in (
            ("gptq", "gptq", "CpumoeGptqAwqExperts", "int4", "GPTQ v1 checkpoint"),
            ("awq", "awq", "CpumoeGptqAwqExperts", "int4_affine", "AWQ GEMM checkpoint"),
            ("ct_asym", "int4", "CpumoeInt4Experts", "int4_affine",
             "W4A16 asymmetric checkpoint"),
            ("gptq8", "gptq", "CpumoeGptqAwqExperts", "int8_affine",
             "GPTQ v1 8-bit checkpoint")):
        ours = runs["cpumoe"]["results"][str(ck[method])]
        (w,) = ours["worker"]
        assert w["experts"] and set(w["experts"].values()) == {cls}
        layers = w["cpumoe"]["layers"]
        assert set(layers) == set(w["experts"])
        for layer, st in layers.items():
            assert st["kind"] == kind and st["calls"] >= 16, (layer, st)
            op = "W8A8" if fmt == "int8_affine" else "W4A8"
            assert f"cpumoe: {layer} runs on cpumoe ({op} {fmt} g64 ({label}, " \
                   f"int8 activations)" in runs["cpumoe"]["log"]
        ref = runs["vllm"]["results"][str(ck[method + "_ref"])]
        assert not _compare(ours, ref), _compare(ours, ref)
        if method in ("ct_asym", "gptq8"):
            continue  # vLLM's own runs: the symmetric W4A16 one (tests_vllm), 4-bit GPTQ
        theirs = runs["vllm"]["results"][str(ck[method])]
        if "error" not in theirs:  # vLLM's CPUExpertsInt4 (x86 with AMX)
            assert not _compare(ours, theirs), _compare(ours, theirs)
        elif platform.machine() == "x86_64":
            assert "No WNA16 MoE backend supports the deployment configuration" in \
                runs["vllm"]["log"], theirs["error"]
