"""The plugin in this process, without an engine: the switch, the support checks and their
reasons, and cpumoe's experts classes through vLLM's modular-kernel ``apply`` interface, with an
expert map (vLLM's expert parallelism) and with the router weight applied on the input."""

from __future__ import annotations

import types

import pytest
import torch

import cpumoe
from cpumoe import vllm_plugin
from cpumoe.quantize import quantize_fp8
from cpumoe.reference import (quantize_int4, quantize_mxfp4, quantize_per_channel,
                              ref_fused_moe_bf16, ref_fused_moe_fp8, ref_fused_moe_int4,
                              ref_fused_moe_int4_affine, ref_fused_moe_int8,
                              ref_fused_moe_mxfp4)
from cpumoe.vllm_plugin import experts, kinds
from cpumoe.vllm_plugin import layer as L
from vllm.model_executor.layers.fused_moe.activation import MoEActivation


@pytest.mark.parametrize("value,want", [("", False), ("0", False), ("off", False), ("1", True),
                                        ("true", True), ("ON", True)])
def test_switch(monkeypatch, value, want):
    monkeypatch.setenv("CPUMOE_VLLM", value)
    assert vllm_plugin.enabled() is want


def test_switch_rejects_other_values(monkeypatch):
    monkeypatch.setenv("CPUMOE_VLLM", "maybe")
    with pytest.raises(ValueError, match="CPUMOE_VLLM='maybe': expected 1 or 0"):
        vllm_plugin.enabled()


def test_register_off_registers_nothing(monkeypatch):
    from vllm.model_executor.custom_op import op_registry_oot
    monkeypatch.setenv("CPUMOE_VLLM", "0")
    before = dict(op_registry_oot)
    vllm_plugin.register()
    assert op_registry_oot == before


def test_install_replaces_routed_experts_and_model_subclasses():
    from vllm.model_executor.custom_op import op_registry_oot
    assert L.install() and L.install()  # idempotent: vLLM loads plugins in every process
    assert op_registry_oot["RoutedExperts"] is L.CpumoeRoutedExperts
    gpt = op_registry_oot["GptOssRoutedExperts"]
    from vllm.model_executor.models.gpt_oss import GptOssRoutedExperts
    assert issubclass(gpt, GptOssRoutedExperts) and issubclass(gpt, L._CpumoeLayer)


def test_layer_module_reexports_the_public_names():
    """cpumoe.vllm_plugin.layer still gives what lives in its sibling modules (README, serve.py)."""
    assert L.stats is experts.stats and L.reset_counts is experts.reset_counts
    assert L.layer_problem is kinds.layer_problem
    for name in ("CpumoeInt8Experts", "CpumoeInt4Experts", "CpumoeMxfp4Experts",
                 "CpumoeFp8Experts", "CpumoeBf16Experts"):
        assert getattr(L, name) is getattr(experts, name)


def _moe(**over):
    cfg = dict(is_act_and_mul=True, activation=MoEActivation.SILU, hidden_dim=256,
               intermediate_size_per_partition=128, in_dtype=torch.bfloat16,
               is_lora_enabled=False, swiglu_limit=None, swiglu_alpha=None, swiglu_beta=None)
    cfg.update(over)
    return types.SimpleNamespace(**cfg)


@pytest.mark.parametrize("over,reason", [
    ({}, None),
    ({"activation": MoEActivation.SWIGLUOAI, "swiglu_limit": 7.0, "swiglu_alpha": 1.702}, None),
    ({"is_act_and_mul": False, "activation": MoEActivation.RELU2_NO_MUL}, "non-gated"),
    ({"activation": MoEActivation.RELU2}, "activation 'relu2'"),
    # silu with a swiglu_limit: DeepSeek-V4's clamped SwiGLU, cpumoe's silu_clamp.
    ({"swiglu_limit": 10.0}, None),
    ({"activation": MoEActivation.SWIGLUOAI, "swiglu_limit": 10.0}, None),
    ({"swiglu_limit": 10.0, "swiglu_alpha": 1.5}, "cpumoe's silu_clamp has alpha 1"),
    ({"swiglu_limit": 0.0}, "limit must be > 0"),
    ({"activation": MoEActivation.GELU, "swiglu_limit": 10.0},
     "swiglu_limit=10.0 on a gelu layer"),
    ({"activation": MoEActivation.SWIGLUOAI, "swiglu_beta": 0.5}, "swiglu_beta=0.5"),
    ({"activation": MoEActivation.SWIGLUSTEP}, "activation 'swiglustep'"),
    ({"activation": MoEActivation.SWIGLUOAI_UNINTERLEAVE}, "swigluoai_uninterleave"),
    ({"hidden_dim": 260}, "hidden dim 260 is not a multiple of 8"),
    ({"intermediate_size_per_partition": 100}, "intermediate dim 100"),
    ({"is_lora_enabled": True}, "LoRA"),
])
def test_layer_problem_names_the_reason(over, reason):
    got = L.layer_problem(_moe(**over))
    if reason is None:
        assert got is None
    else:
        assert got is not None and reason in got, got


@pytest.mark.parametrize("over,spec", [
    ({}, "silu"),
    ({"swiglu_limit": 10.0}, "silu_clamp(limit=10)"),
    ({"swiglu_limit": 10.0, "swiglu_alpha": 1.0, "swiglu_beta": 0.0}, "silu_clamp(limit=10)"),
    ({"activation": MoEActivation.SWIGLUOAI}, "swigluoai"),
    ({"activation": MoEActivation.SWIGLUOAI, "swiglu_limit": 7.0, "swiglu_alpha": 1.702,
      "swiglu_beta": 1.0}, "swigluoai"),
    ({"activation": MoEActivation.SWIGLUOAI, "swiglu_limit": 10.0, "swiglu_alpha": 1.5},
     "swigluoai(limit=10,alpha=1.5)"),
])
def test_activation_spec_carries_vllms_parameters(over, spec):
    """What vLLM hands over becomes the spec cpumoe runs, parameters included; the quantization
    config's gemm1_* win over the layer's swiglu_* (as in vLLM's activation step)."""
    assert kinds.activation_of(_moe(**over)) == (spec, "")
    qc = types.SimpleNamespace(gemm1_clamp_limit=20.0, gemm1_alpha=None, gemm1_beta=None)
    got, _ = kinds.activation_of(_moe(**over), quant_config=qc)
    if spec.startswith("silu"):
        assert got == "silu_clamp(limit=20)"


def _experts(cls, E, H, I, k):
    """A cpumoe experts object as vLLM's kernel builder makes it (without a FusedMoEConfig)."""
    ex = object.__new__(cls)
    ex.packed, ex.layer_name, ex._act, ex._act_why, ex._stats = None, "?", "silu", "", {}
    ex._emap_src = ex._emap = None
    ex.moe_config = types.SimpleNamespace(experts_per_token=k)
    ex.quant_config = types.SimpleNamespace(gemm1_alpha=None, gemm1_beta=None,
                                            gemm1_clamp_limit=None)
    return ex


def _pack_int4_words(v: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' pack-quantized words: int32 [..., K / 8], value i of a word (+ 8) in
    bits 4i..4i+3."""
    u = (v.to(torch.int64) + 8).reshape(*v.shape[:-1], -1, 8)
    word = sum(u[..., i] << (4 * i) for i in range(8))
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def _layer(**params):
    layer = torch.nn.Module()
    layer.layer_name = "model.layers.3.mlp.experts"
    for name, t in params.items():
        layer.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    return layer


def _wna16_int4_layer(w13, w2):
    """w13 / w2 as int4 g32 the way vLLM's WNA16 method loads a pack-quantized checkpoint
    (int32 words, bf16 scales): (the layer, the values q13, q2 and the bf16 scales s13, s2)."""
    q13, s13 = quantize_int4(w13, 32)
    q2, s2 = quantize_int4(w2, 32)
    s13, s2 = s13.to(torch.bfloat16), s2.to(torch.bfloat16)
    layer = _layer(w13_weight_packed=_pack_int4_words(q13),
                   w2_weight_packed=_pack_int4_words(q2), w13_weight_scale=s13,
                   w2_weight_scale=s2)
    return layer, q13, q2, s13, s2


def _mxfp4_layer(w13, w2, **biases):
    """w13 / w2 as MXFP4 the way vLLM's gpt-oss MXFP4 method loads them (uint8 [E, N, K / 2]
    and [E, N, K / 32]), with the given biases: (the layer, bl13, sc13, bl2, sc2)."""
    E, N13, H = w13.shape
    I = w2.shape[2]
    bl13, sc13 = quantize_mxfp4(w13)
    bl2, sc2 = quantize_mxfp4(w2)
    layer = _layer(w13_weight=bl13.reshape(E, N13, H // 2), w13_weight_scale=sc13,
                   w2_weight=bl2.reshape(E, H, I // 2), w2_weight_scale=sc2, **biases)
    return layer, bl13, sc13, bl2, sc2


def _call(ex, x, tw, ids, emap=None, on_input=False):
    out = torch.empty_like(x)
    ex.apply(out, x, None, None, tw, ids, MoEActivation.SILU, 0, emap, None, None, None, None,
             None, on_input)
    return out


@pytest.mark.parametrize("kind", ["int8", "int4", "int4_a16", "int4_a16_asym", "mxfp4", "fp8",
                                  "fp8_channel", "bf16"])
def test_experts_with_expert_map_match_the_reference(kind):
    g = torch.Generator().manual_seed(0)
    E_global, E, H, I, k, T = 8, 4, 64, 32, 2, 12
    held = torch.tensor([1, 4, 6, 7])  # this rank's experts (global ids), local 0..3
    w13 = torch.randn(E, 2 * I, H, generator=g)
    w2 = torch.randn(E, H, I, generator=g) / 4
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, E_global, (T, k), generator=g, dtype=torch.int32)
    tw = torch.rand(T, k, generator=g)
    emap = torch.full((E_global,), -1, dtype=torch.int32)
    emap[held] = torch.arange(E, dtype=torch.int32)
    # Reference: slots of experts held elsewhere contribute nothing (weight 0).
    local = emap[ids.long()]
    tw_ref = torch.where(local >= 0, tw, torch.zeros_like(tw))
    ids_ref = local.clamp_min(0)
    if kind == "int8":
        q13, s13 = quantize_per_channel(w13)
        q2, s2 = quantize_per_channel(w2)
        layer = _layer(w13_weight=q13, w2_weight=q2, w13_weight_scale=s13.unsqueeze(-1),
                       w2_weight_scale=s2.unsqueeze(-1))
        ex = _experts(L.CpumoeInt8Experts, E, H, I, k)
        want = ref_fused_moe_int8(x, q13, q2, s13, s2, tw_ref, ids_ref)
    elif kind == "int4":
        # As vLLM's W4A8 int8 method loads them: int4 values as int8, fp32 group scales (g 32).
        q13, s13 = quantize_int4(w13, 32)
        q2, s2 = quantize_int4(w2, 32)
        layer = _layer(w13_weight=q13, w2_weight=q2, w13_weight_scale=s13, w2_weight_scale=s2)
        ex = _experts(L.CpumoeInt4Experts, E, H, I, k)
        want = ref_fused_moe_int4(x, q13, q2, s13, s2, tw_ref, ids_ref, group_size=32)
    elif kind == "int4_a16":
        # As vLLM's WNA16 method loads a pack-quantized checkpoint: int32 words, bf16 scales.
        layer, q13, q2, s13, s2 = _wna16_int4_layer(w13, w2)
        ex = _experts(L.CpumoeInt4Experts, E, H, I, k)
        want = ref_fused_moe_int4(x, q13, q2, s13.float(), s2.float(), tw_ref, ids_ref,
                                  group_size=32)
    elif kind == "int4_a16_asym":
        # symmetric: false pack-quantized, as vLLM's WNA16 method loads it: the words, bf16
        # scales and int32 zero points [E, N / 8, groups] packed along N (zp + 8 in bits 4i of
        # row 8 r + i); the weight is (q - zp) * s. One expert's zero points all 0, one layer
        # half asymmetric: still int4_affine for the whole layer.
        def affine(w):
            wg = w.reshape(w.shape[0], w.shape[1], -1, 32)
            lo, hi = wg.amin(-1), wg.amax(-1)
            s = ((hi - lo) / 15).to(torch.bfloat16).float()
            zp = (-8 - torch.round(lo / s)).clamp(-8, 7)
            zp[0] = 0
            q = (torch.round(wg / s.unsqueeze(-1)) + zp.unsqueeze(-1)).clamp(-8, 7)
            return q.reshape(w.shape).to(torch.int8), s, zp.to(torch.int64)

        def zp_words(zp):  # [E, N, G] -> int32 [E, N / 8, G]
            return _pack_int4_words(zp.transpose(1, 2)).transpose(1, 2).contiguous()

        (q13, s13, z13), (q2, s2, z2) = affine(w13), affine(w2)
        layer = _layer(w13_weight_packed=_pack_int4_words(q13),
                       w2_weight_packed=_pack_int4_words(q2),
                       w13_weight_scale=s13.to(torch.bfloat16),
                       w2_weight_scale=s2.to(torch.bfloat16),
                       w13_weight_zero_point=zp_words(z13), w2_weight_zero_point=zp_words(z2))
        ex = _experts(L.CpumoeInt4Experts, E, H, I, k)

        def pairs(s, z):
            return torch.stack([s, -s * (z + 8).float()], dim=-1)
        want = ref_fused_moe_int4_affine(x, (q13.to(torch.int16) + 8).to(torch.uint8).numpy(),
                                         (q2.to(torch.int16) + 8).to(torch.uint8).numpy(),
                                         pairs(s13, z13), pairs(s2, z2), tw_ref, ids_ref,
                                         group_size=32)
        # the weights as compressed-tensors dequantizes them: (q - zp) * s, exactly
        deq = cpumoe.quantize.dequantize_int4_affine(
            (q13.to(torch.int16) + 8).to(torch.uint8).numpy(), pairs(s13, z13).numpy(), 32)
        exact = (q13.float() - z13.repeat_interleave(32, -1).float()) * \
            s13.repeat_interleave(32, -1)
        assert (torch.from_numpy(deq) == exact).all()
    elif kind == "mxfp4":
        # As vLLM's gpt-oss MXFP4 method loads them: uint8 [E, N, K / 2] and [E, N, K / 32],
        # bf16 biases.
        b13 = torch.randn(E, 2 * I, generator=g).to(torch.bfloat16)
        b2 = torch.randn(E, H, generator=g).to(torch.bfloat16)
        layer, bl13, sc13, bl2, sc2 = _mxfp4_layer(w13, w2, w13_bias=b13, w2_bias=b2)
        ex = _experts(L.CpumoeMxfp4Experts, E, H, I, k)
        want = ref_fused_moe_mxfp4(x, bl13, sc13, bl2, sc2, tw_ref, ids_ref, b13=b13, b2=b2)
    elif kind in ("fp8", "fp8_channel"):
        # As vLLM's FP8 methods load them: float8_e4m3fn weights; HF fp8's block scales
        # weight_scale_inv (and the layer's weight_block_size), compressed-tensors' channel
        # scales weight_scale [E, N, 1].
        block = (32, 32) if kind == "fp8" else None
        (c13, s13), (c2, s2) = quantize_fp8(w13, block), quantize_fp8(w2, block)
        f13, f2 = c13.view(torch.float8_e4m3fn), c2.view(torch.float8_e4m3fn)
        names = (("w13_weight_scale_inv", "w2_weight_scale_inv") if block else
                 ("w13_weight_scale", "w2_weight_scale"))
        layer = _layer(w13_weight=f13, w2_weight=f2, **dict(zip(names, (s13, s2))))
        layer.weight_block_size = None if block is None else list(block)
        ex = _experts(L.CpumoeFp8Experts, E, H, I, k)
        want = ref_fused_moe_fp8(x, c13, c2, s13, s2, tw_ref, ids_ref, block_size=block)
    else:
        b13, b2 = w13.to(torch.bfloat16), w2.to(torch.bfloat16)
        layer = _layer(w13_weight=b13, w2_weight=b2)
        ex = _experts(L.CpumoeBf16Experts, E, H, I, k)
        want = ref_fused_moe_bf16(x, b13, b2, tw_ref, ids_ref)
    ex.process_weights_after_loading(layer)
    # vLLM's copies are replaced by empty placeholders of E and H; the packed layer holds them.
    assert tuple(layer.w13_weight.shape) == (E, 0, H) and layer.w13_weight.numel() == 0
    if kind.startswith("fp8"):
        assert ex.packed.weight_format == "fp8"
        assert ex._format_name() == ("W8A16 fp8, blocks 32x32" if kind == "fp8" else
                                     "W8A16 fp8, a scale per channel")
    else:
        assert ex.packed.path == (cpumoe.selected_path(op="bf16") if kind == "bf16"
                                  else cpumoe.selected_path())
    if kind == "int4":
        assert ex.packed.weight_format == "int4" and ex.packed.group_size == 32
        assert ex._format_name() == "W4A8 int4 g32"
    if kind == "int4_a16":
        assert ex.packed.weight_format == "int4" and ex.packed.group_size == 32
        assert ex._format_name() == "W4A8 int4 g32 (W4A16 checkpoint, int8 activations)"
        assert layer.w13_weight_packed.numel() == 0  # the words are freed once packed
    if kind == "int4_a16_asym":
        assert ex.packed.weight_format == "int4_affine" and ex.packed.group_size == 32
        assert ex._format_name() == ("W4A8 int4_affine g32 (W4A16 asymmetric checkpoint, int8 "
                                     "activations)")
        assert layer.w13_weight_zero_point.numel() == 0
    if kind == "mxfp4":
        assert ex.packed.weight_format == "mxfp4"
    assert ex.moe_problem_size(x, layer.w13_weight, layer.w2_weight, ids) == (E, T, 2 * I, H, k)
    got = _call(ex, x, tw, ids, emap)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2,
                               atol=2e-2 * float(want.float().abs().max()))
    assert L.stats()["layers"][layer.layer_name]["calls"] == 1
    assert L.stats()["layers"][layer.layer_name]["tokens"] == T


@pytest.mark.parametrize("mode", ["bf16", "group"])
@pytest.mark.parametrize("kind", ["int4_a16", "mxfp4"])
def test_w4_activation_modes(monkeypatch, kind, mode):
    """CPUMOE_VLLM_W4_ACT: "bf16" runs a 4-bit layer W4A16 (a PackedMoeFp8 of its codes: the
    BF16 op's result on the dequantized weights), "group" the W4A8 op with activations per
    group; an unknown value is a clear error."""
    monkeypatch.setenv(experts.W4_ACT_ENV, mode)
    g = torch.Generator().manual_seed(4)
    E, H, I, k, T = 4, 64, 32, 2, 10
    w13 = torch.randn(E, 2 * I, H, generator=g)
    w2 = torch.randn(E, H, I, generator=g) / 4
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, E, (T, k), generator=g, dtype=torch.int32)
    tw = torch.rand(T, k, generator=g)
    if kind == "int4_a16":
        layer, q13, q2, s13, s2 = _wna16_int4_layer(w13, w2)
        ex = _experts(L.CpumoeInt4Experts, E, H, I, k)
        d13, d2 = (cpumoe.quantize.dequantize_int4(q.numpy(), s.float().numpy(), 32)
                   for q, s in ((q13, s13), (q2, s2)))
        label = "int4 g32"
        int8_want = ref_fused_moe_int4(x, q13, q2, s13.float(), s2.float(), tw, ids,
                                       group_size=32, act_quant="group")
    else:
        layer, bl13, sc13, bl2, sc2 = _mxfp4_layer(w13, w2)
        ex = _experts(L.CpumoeMxfp4Experts, E, H, I, k)
        d13, d2 = (cpumoe.quantize.dequantize_mxfp4(b, c) for b, c in ((bl13, sc13), (bl2, sc2)))
        label = "mxfp4 g32"
        int8_want = ref_fused_moe_mxfp4(x, bl13, sc13, bl2, sc2, tw, ids, act_quant="group")
    ex.process_weights_after_loading(layer)
    if mode == "bf16":
        assert isinstance(ex.packed, cpumoe.PackedMoeFp8)
        assert ex._format_name().startswith(f"W4A16 {label}, {ex.packed.code_bits}-bit codes (")
        assert ex._format_name().endswith("W4A16 checkpoint, bf16 activations)")
        want = ref_fused_moe_bf16(x, torch.as_tensor(d13), torch.as_tensor(d2), tw, ids)
    else:
        assert ex.packed.act_quant == "group"
        assert ex._format_name().endswith("int8 activations per group)")
        want = int8_want
    got = _call(ex, x, tw, ids)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2,
                               atol=2e-2 * float(want.float().abs().max()))
    monkeypatch.setenv(experts.W4_ACT_ENV, "fp4")
    with pytest.raises(ValueError, match="CPUMOE_VLLM_W4_ACT='fp4': must be int8"):
        experts.w4_act_quant()


def test_router_weight_on_input_is_not_applied_twice():
    # vLLM's prepare step multiplies x by the (top-1) router weight before the experts run.
    g = torch.Generator().manual_seed(1)
    E, H, I, T = 4, 64, 32, 6
    w13 = torch.randn(E, 2 * I, H, generator=g).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) / 4).to(torch.bfloat16)
    ex = _experts(L.CpumoeBf16Experts, E, H, I, 1)
    ex.process_weights_after_loading(_layer(w13_weight=w13.clone(), w2_weight=w2.clone()))
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    tw = torch.rand(T, 1, generator=g) + 0.5
    ids = torch.randint(0, E, (T, 1), generator=g, dtype=torch.int32)
    xs = x * tw.to(x.dtype)
    got = _call(ex, xs, tw, ids, on_input=True)
    want = ref_fused_moe_bf16(xs, w13, w2, None, ids, skip_weighted=True)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2,
                               atol=2e-2 * float(want.float().abs().max()))


def _ct_scheme(weights: dict, acts, fmt: str) -> dict:
    """A scheme dict as vLLM's CompressedTensorsConfig.get_scheme_dict returns it."""
    from compressed_tensors.quantization import QuantizationArgs
    return {"weights": QuantizationArgs(**weights),
            "input_activations": None if acts is None else QuantizationArgs(**acts),
            "format": fmt}


_TOKEN8 = dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)


@pytest.mark.parametrize("weights,acts,want,reason", [
    (dict(num_bits=8, type="int", symmetric=True, strategy="channel"), _TOKEN8, "int8", ""),
    (dict(num_bits=8, type="int", symmetric=True, strategy="tensor"), _TOKEN8, None,
     "W8A8 with tensor weights"),
    (dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128), _TOKEN8,
     "int4", ""),
    (dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32), _TOKEN8,
     "int4", ""),
    (dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=512), _TOKEN8,
     None, "intermediate (per partition) dim 768 is not a multiple of group_size 512"),
    (dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=48), _TOKEN8,
     None, "group_size 48, cpumoe needs a positive multiple of 32"),
    (dict(num_bits=4, type="int", symmetric=True, strategy="channel"), _TOKEN8, None,
     "strategy is 'channel'"),
    (dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128),
     dict(_TOKEN8, symmetric=False), None, "input_activations: symmetric is False"),
    # W4A16 pack-quantized: run with int8 activations.
    (dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128), None,
     "int4_a16", ""),
    (dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=128), None,
     "int4_a16", ""),  # zero points: int4_affine
    (dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=128), _TOKEN8,
     None, ""),  # not vLLM's W4A8 int8 scheme (its own method decides)
    (dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128,
          actorder="group"), None, None, "actorder 'group'"),
    # FP8 W8A8 (dynamic activations) runs on the fp8 op with bf16 activations.
    (dict(num_bits=8, type="float", symmetric=True, strategy="channel"),
     dict(_TOKEN8, type="float"), "fp8_ct", ""),
    (dict(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[128, 128]),
     dict(_TOKEN8, type="float", strategy="group", group_size=128), "fp8_ct", ""),
    (dict(num_bits=8, type="float", symmetric=True, strategy="tensor"),
     dict(_TOKEN8, type="float", strategy="tensor", dynamic=False), None,
     "static activation scales"),
    (dict(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[512, 128]),
     dict(_TOKEN8, type="float", strategy="group", group_size=128), None,
     "intermediate dim 768 (per partition) is not a multiple"),
    (dict(num_bits=8, type="int", symmetric=True, strategy="channel"), None, None, ""),  # W8A16
])
def test_compressed_tensors_schemes_cpumoe_takes(weights, acts, want, reason):
    """Which compressed-tensors MoE schemes run on cpumoe (W8A8 channel / W4A8 group int4 with
    dynamic symmetric per-token int8 activations, W4A16 group int4, symmetric or not, with int8
    activations), and the reason for the near misses."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig)
    fmt = "pack-quantized" if acts is None else "int-quantized"
    moe = types.SimpleNamespace(hidden_dim=2048, intermediate_size_per_partition=768,
                                moe_parallel_config=types.SimpleNamespace(tp_size=1))
    kind, why = kinds._ct_kind(CompressedTensorsConfig, _ct_scheme(weights, acts, fmt), moe)
    assert kind == want
    assert (reason in why) if reason else why == "", why


def test_w4a16_needs_pack_quantized():
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig)
    w = dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128)
    moe = types.SimpleNamespace(hidden_dim=2048, intermediate_size_per_partition=768,
                                moe_parallel_config=types.SimpleNamespace(tp_size=1))
    kind, why = kinds._ct_kind(CompressedTensorsConfig, _ct_scheme(w, None, "int-quantized"), moe)
    assert kind is None and "format 'int-quantized'" in why


def test_experts_run_the_layers_clamped_silu_and_refuse_another_activation():
    """A SILU layer with swiglu_limit runs cpumoe's silu_clamp with that limit (values past the
    clamp: plain silu would differ); an activation other than the layer's is refused."""
    g = torch.Generator().manual_seed(3)
    E, H, I, k, T = 4, 64, 32, 2, 9
    q13, s13 = quantize_per_channel(torch.randn(E, 2 * I, H, generator=g) * 4)
    q2, s2 = quantize_per_channel(torch.randn(E, H, I, generator=g))
    x = (torch.randn(T, H, generator=g) * 4).to(torch.bfloat16)
    ids = torch.randint(0, E, (T, k), generator=g, dtype=torch.int32)
    tw = torch.rand(T, k, generator=g)
    ex = _experts(L.CpumoeInt8Experts, E, H, I, k)
    ex.moe_config.activation = MoEActivation.SILU
    ex._act, ex._act_why = kinds.activation_of(
        types.SimpleNamespace(activation=MoEActivation.SILU, swiglu_limit=2.0, swiglu_alpha=None,
                              swiglu_beta=None))
    assert ex._act == "silu_clamp(limit=2)"
    ex.process_weights_after_loading(_layer(w13_weight=q13, w2_weight=q2,
                                            w13_weight_scale=s13.unsqueeze(-1),
                                            w2_weight_scale=s2.unsqueeze(-1)))
    got = _call(ex, x, tw, ids)
    want = ref_fused_moe_int8(x, q13, q2, s13, s2, tw, ids, "silu_clamp(limit=2)")
    plain = ref_fused_moe_int8(x, q13, q2, s13, s2, tw, ids, "silu")
    scale = float(want.float().abs().max())
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * scale)
    assert float((plain.float() - want.float()).abs().max()) > 0.2 * scale  # the clamp fired
    out = torch.empty_like(x)
    with pytest.raises(ValueError, match="activation 'gelu'"):
        ex.apply(out, x, None, None, tw, ids, MoEActivation.GELU, 0, None, None, None, None,
                 None, None, False)
