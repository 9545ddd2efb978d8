"""cpumoe.transformers: the "cpumoe" / "cpumoe_bf16" experts backends of Hugging Face transformers,
on tiny random models built from configs (no downloads) of four families: Qwen3-MoE, Mixtral,
gpt-oss (clamped swiglu, interleaved gate/up, biases, transposed weights) and DeepSeek-V3
(shared experts, grouped sigmoid routing, a dense first layer); and the gating of the experts
modules of every family with its own ``_apply_gate`` that builds tiny here (the clamped SwiGLU
of DeepSeek-V4, GLM5-Next, HY-V4 and Step3p7, MiniMax-M3's swigluoai on gate/up halves) and of
every ``hidden_act``, with gate/up values past their clamps: run as eager runs them or refused.

The models have one MoE layer, so the router sees the same input under every backend (with two,
a rounding difference in the first layer can flip a near-tie of the second one's top-k, which
says nothing about the backend). Needs the torch backend and transformers (skipped otherwise).
"""

from __future__ import annotations

import copy
import importlib
from typing import Optional

import pytest

from conftest import BACKEND_NAME

if BACKEND_NAME != "torch":
    pytest.skip("the transformers backends need the torch backend", allow_module_level=True)
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

import cpumoe.transformers as cmt  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # noqa: E402

# max|logits - eager logits| / max|eager logits|. W8A8: the int8 roundings of weights and
# activations (about 1% of a block's output scale, see conftest's MOE tolerance); bf16: x, the
# weights and the activation rounded to bf16 (a few 1e-3).
TOL = {"cpumoe": 3e-2, "cpumoe_bf16": 1e-2}
VOCAB = 96

# family -> (config class name, config kwargs, expected activation, gate/up interleaved)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True), "silu"),
    "mixtral": ("MixtralConfig", dict(
        hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2), "silu"),
    "gpt_oss": ("GptOssConfig", dict(
        hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["full_attention"]), "swigluoai"),
    "deepseek_v3": ("DeepseekV3Config", dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None,
        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        num_hidden_layers=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "silu"),
}


def _config(family: str, **over):
    cls_name, kw, _ = FAMILIES[family]
    args = dict(vocab_size=VOCAB, num_hidden_layers=1, max_position_embeddings=64,
                initializer_range=0.1)
    args.update(kw)
    args.update(over)
    return getattr(transformers, cls_name)(**args)


def _model(family: str, impl: str = "eager", **over):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(family, **over), experts_implementation=impl)
    if family == "gpt_oss":  # its biases start at zero: give them values so they are tested
        with torch.no_grad():
            for _, m in cmt.experts_modules(model):
                m.gate_up_proj_bias.normal_(0, 0.1)
                m.down_proj_bias.normal_(0, 0.1)
    return model.eval()


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).abs().max() / ref.abs().max())


@pytest.fixture(scope="module")
def models():
    """family -> (eager model, token ids [2, 10], eager logits); built once."""
    out = {}
    gen = torch.Generator().manual_seed(1)
    for fam in FAMILIES:
        m = _model(fam)
        ids = torch.randint(0, VOCAB, (2, 10), generator=gen)
        with torch.no_grad():
            out[fam] = (m, ids, m(ids).logits)
    return out


def test_backends_are_registered():
    for name in ("cpumoe", "cpumoe_bf16", "cpumoe_int4", "cpumoe_mxfp4"):
        assert name in ALL_EXPERTS_FUNCTIONS
        assert name in cmt.BACKENDS
    # from_pretrained/from_config accept the names (transformers checks them against its registry)
    model = _model("mixtral", impl="cpumoe")
    assert model.config._experts_implementation == "cpumoe"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("backend", ["cpumoe", "cpumoe_bf16"])
def test_logits_match_eager(models, family, backend):
    eager, ids, ref = models[family]
    model = copy.deepcopy(eager)
    model.set_experts_implementation(backend)
    with torch.no_grad():
        got = model(ids).logits
    err = _rel(got, ref)
    assert err <= TOL[backend], f"{family} {backend}: relative error {err:.3g}"
    names = [n for n, _ in cmt.experts_modules(model)]
    assert names, family
    for _, m in cmt.experts_modules(model):  # packed at the first call, floats released
        st = m._cpumoe_state[cmt.BACKENDS[backend]]
        assert st.activation == FAMILIES[family][2]
        assert m.gate_up_proj.numel() == 0 and m.down_proj.numel() == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_closer_than_int8_and_experts_matter(models, family):
    """The checks above mean something only if the experts move the logits by much more than
    the tolerance; and bf16 (no quantization) lands closer to eager than W8A8."""
    eager, ids, ref = models[family]
    errs = {}
    for backend in ("cpumoe", "cpumoe_bf16"):
        model = copy.deepcopy(eager)
        cmt.prepare(model, backend)
        with torch.no_grad():
            errs[backend] = _rel(model(ids).logits, ref)
    assert errs["cpumoe_bf16"] < errs["cpumoe"], errs
    no_experts = copy.deepcopy(eager)
    with torch.no_grad():
        for _, m in cmt.experts_modules(no_experts):
            m.down_proj.zero_()
            if getattr(m, "has_bias", False):
                m.down_proj_bias.zero_()
        effect = _rel(no_experts(ids).logits, ref)
    assert effect > 5 * TOL["cpumoe"], f"{family}: the experts change the logits by {effect:.3g}"


def test_wrong_layout_would_be_caught(models):
    """gpt-oss interleaves gate/up: packing its rows as halves (what a backend ignoring the
    layout would do) lands far outside the tolerance, so the test above checks the layout."""
    eager, ids, ref = models["gpt_oss"]
    model = copy.deepcopy(eager)
    m = cmt.experts_modules(model)[0][1]
    with torch.no_grad():
        gu = m.gate_up_proj.data  # [E, H, 2I], gate even / up odd columns
        m.gate_up_proj.data = torch.cat([gu[..., 0::2], gu[..., 1::2]], dim=-1).reshape(gu.shape)
        bias = m.gate_up_proj_bias.data
        m.gate_up_proj_bias.data = torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=-1)
        # the layout stays "interleaved", so cpumoe reads the halves as pairs: wrong numbers
        model.set_experts_implementation("cpumoe_bf16")
        err = _rel(model(ids).logits, ref)
    assert err > 5 * TOL["cpumoe"]


def _snap_to_w4(model, backend: str) -> None:
    """Moves every expert weight onto the grid of ``backend``'s quantizer (int4 g32: the first of
    cpumoe_int4's group sizes dividing these models' I = 32; MXFP4), in place: the 4-bit backend
    then packs exactly the model's weights and differs from eager only by its int8 activations."""
    from cpumoe import reference as R

    def snap(w):  # w [N, K], groups along K (the input of each GEMM)
        if backend == "cpumoe_mxfp4":
            return R.dequantize_mxfp4(*R.quantize_mxfp4(w.float())).to(w.dtype)
        return R.dequantize_int4(*R.quantize_int4(w.float(), 32), 32).to(w.dtype)

    with torch.no_grad():
        for _, m in cmt.experts_modules(model):
            for p in (m.gate_up_proj, m.down_proj):
                for e in range(p.shape[0]):
                    # transposed modules (gpt-oss) hold [K, N]
                    p[e] = snap(p[e].t()).t() if m.is_transposed else snap(p[e])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("backend", ["cpumoe_int4", "cpumoe_mxfp4"])
def test_w4_backends_match_eager_on_their_grid(models, family, backend):
    """W4A8 backends on a model whose experts lie on their 4-bit grid: within W8A8's tolerance of
    eager (only the activations are quantized), packed at 4 bits."""
    eager, ids, _ = models[family]
    model = copy.deepcopy(eager)
    _snap_to_w4(model, backend)
    with torch.no_grad():
        ref = model(ids).logits
        cmt.prepare(model, backend)
        got = model(ids).logits
    err = _rel(got, ref)
    assert err <= TOL["cpumoe"], f"{family} {backend}: relative error {err:.3g}"
    for _, m in cmt.experts_modules(model):
        st = m._cpumoe_state[cmt.BACKENDS[backend]]
        assert st.packed.weight_format == cmt.BACKENDS[backend]
        assert st.packed.group_size == 32 and st.activation == FAMILIES[family][2]


@pytest.mark.parametrize("backend", ["cpumoe_int4", "cpumoe_mxfp4"])
def test_w4_backends_round_to_nearest(models, backend):
    """On plain random weights the 4-bit backends add their rounding: further from eager than
    W8A8, still the same model (well inside what dropping the experts changes)."""
    eager, ids, ref = models["qwen3_moe"]
    errs = {}
    for b in ("cpumoe", backend):
        model = copy.deepcopy(eager)
        cmt.prepare(model, b)
        with torch.no_grad():
            errs[b] = _rel(model(ids).logits, ref)
    assert errs["cpumoe"] < errs[backend] < 0.25, errs


def test_mxfp4_checkpoint_through_transformers(tmp_path):
    """A gpt-oss MXFP4 checkpoint (the release layout) loaded by transformers, which dequantizes
    the experts on a CPU: "cpumoe_mxfp4" packs the checkpoint's values exactly (its logits are
    eager's up to the int8 activations) and greedy generation runs on it."""
    pytest.importorskip("accelerate", reason="transformers loads MXFP4 checkpoints with it")
    from cpumoe.testing import models as ckpts
    src = tmp_path / "bf16"
    _model("gpt_oss").save_pretrained(str(src))
    dst = ckpts.save_mxfp4(src, tmp_path / "mxfp4")
    model = AutoModelForCausalLM.from_pretrained(str(dst)).eval()
    from safetensors.torch import load_file
    from cpumoe import reference as R
    tensors = load_file(str(dst / "model.safetensors"))
    m = cmt.experts_modules(model)[0][1]
    blocks = tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"]
    scales = tensors["model.layers.0.mlp.experts.gate_up_proj_scales"]
    assert torch.equal(m.gate_up_proj.data.float(),
                       R.dequantize_mxfp4(blocks, scales).transpose(1, 2))
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(ids).logits
        cmt.prepare(model, "cpumoe_mxfp4")
        got = model(ids).logits
        seq = model.generate(ids[:1, :6], max_new_tokens=8, min_new_tokens=8, do_sample=False,
                             pad_token_id=0)
    assert _rel(got, ref) <= TOL["cpumoe"]
    assert seq.shape == (1, 14)


@pytest.mark.parametrize("backend", ["cpumoe", "cpumoe_bf16"])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_greedy_generate(models, family, backend):
    """16 greedy tokens (decode steps run the experts at T = 1 through the KV cache): each one is
    the argmax of the same backend's logits for the whole sequence (prefill), and with bf16 the
    sequence is eager's."""
    eager, ids, _ = models[family]
    prompt = ids[:1, :6]
    model = copy.deepcopy(eager)
    model.set_experts_implementation(backend)
    with torch.no_grad():
        seq = model.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                             pad_token_id=0)
        assert seq.shape == (1, 6 + 16)
        logits = model(seq).logits[0, 5:-1]
        assert torch.equal(logits.argmax(-1), seq[0, 6:])
        if backend == "cpumoe_bf16":
            want = eager.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                  pad_token_id=0)
            assert torch.equal(seq, want)


@pytest.mark.parametrize("backend", ["cpumoe", "cpumoe_bf16"])
def test_torch_compile_fullgraph(models, backend):
    eager, ids, _ = models["qwen3_moe"]
    model = copy.deepcopy(eager)
    cmt.prepare(model, backend)
    with torch.no_grad():
        want = model(ids).logits
        graphs = []

        def capture(gm, example_inputs):
            graphs.append(gm)
            from torch._dynamo.backends.common import aot_autograd
            return aot_autograd(fw_compiler=lambda g, _: g.forward)(gm, example_inputs)

        torch._dynamo.reset()
        got = torch.compile(model.forward, fullgraph=True, backend=capture)(ids).logits
    assert torch.equal(got, want)
    assert len(graphs) == 1
    ops = [n for n in graphs[0].graph.nodes
           if n.op == "call_function" and "cpumoe" in str(n.target)]
    assert len(ops) == len(cmt.experts_modules(model))
    torch._dynamo.reset()


def test_compile_before_packing_is_a_clear_error(models):
    eager, ids, _ = models["mixtral"]
    model = copy.deepcopy(eager)
    model.set_experts_implementation("cpumoe")
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(Exception, match="pack the experts before torch.compile"):
        torch.compile(model.forward, fullgraph=True, backend="eager")(ids)
    torch._dynamo.reset()


def test_unsupported_activation_names_layer_and_reason():
    model = _model("qwen3_moe", hidden_act="relu")
    with pytest.raises(cmt.UnsupportedExperts,
                       match=r"model\.layers\.0\.mlp\.experts.*ReLU.*matches none"):
        cmt.quantize(model)
    assert model.config._experts_implementation == "eager"  # nothing changed
    model.set_experts_implementation("cpumoe")  # the lazy path (first call) names it too
    ids = torch.zeros((1, 4), dtype=torch.long)
    with torch.no_grad(), pytest.raises(cmt.UnsupportedExperts,
                                        match=r"model\.layers\.0\.mlp\.experts.*matches none"):
        model(ids)


@pytest.mark.parametrize("over, what", [
    (dict(moe_intermediate_size=12), r"I = 12 must be multiples of 8"),
    (dict(hidden_size=36, head_dim=8), r"H = 36 .*multiples of 8"),
])
def test_unaligned_sizes_name_layer_and_reason(over, what):
    model = _model("qwen3_moe", **over)
    with pytest.raises(cmt.UnsupportedExperts, match=r"model\.layers\.0\.mlp\.experts.*" + what):
        cmt.prepare(model, "cpumoe_bf16")


def test_post_expert_norm_and_expert_parallel_are_refused():
    model = _model("mixtral")
    m = cmt.experts_modules(model)[0][1]
    m._is_expert_parallel = True
    with pytest.raises(cmt.UnsupportedExperts, match="expert parallelism"):
        cmt.quantize(model)
    m._is_expert_parallel = False
    m.has_post_expert_norm = True
    with pytest.raises(cmt.UnsupportedExperts, match="has_post_expert_norm"):
        cmt.quantize(model)


def test_released_floats_cannot_be_repacked(models):
    eager, ids, ref = models["mixtral"]
    model = copy.deepcopy(eager)
    assert cmt.quantize(model) == ["model.layers.0.mlp.experts"]
    assert model.config._experts_implementation == "cpumoe"
    with pytest.raises(cmt.UnsupportedExperts, match="released"):
        cmt.pack_bf16(model)
    kept = copy.deepcopy(eager)  # keep_float_weights: both backends, eager still works
    cmt.quantize(kept, keep_float_weights=True)
    cmt.pack_bf16(kept, keep_float_weights=True)
    with torch.no_grad():
        assert _rel(kept(ids).logits, ref) <= TOL["cpumoe_bf16"]
    kept.set_experts_implementation("eager")
    with torch.no_grad():
        assert torch.equal(kept(ids).logits, ref)


def test_backward_raises(models):
    eager, ids, _ = models["qwen3_moe"]
    model = copy.deepcopy(eager)
    cmt.pack_bf16(model)
    out = model(ids).logits  # grad enabled: the forward runs, its backward must not be silent
    with pytest.raises(RuntimeError, match="inference-only"):
        out.sum().backward()


def test_bf16_model_and_routing_dtypes(models):
    """A bf16 model: x and the router weights arrive in bf16 (converted for the op)."""
    eager, ids, ref = models["qwen3_moe"]
    model = copy.deepcopy(eager).to(torch.bfloat16)
    with torch.no_grad():
        want = model(ids).logits.float()
        model.set_experts_implementation("cpumoe")
        got = model(ids).logits.float()
    assert got.dtype == torch.float32 and _rel(got, want) <= TOL["cpumoe"]


# ---------------------------------------------------------------------------- gating and clamps
# Experts modules with their own _apply_gate, built bare from a tiny config (no model around
# them: fast): family -> (config class, experts class, config kwargs, the activation cpumoe must
# run, None where it must refuse).
GATED = {
    "deepseek_v4": ("DeepseekV4Config", "DeepseekV4Experts",
                    dict(moe_intermediate_size=32, n_routed_experts=8), "silu_clamp(limit=10)"),
    "glm5_next": ("Glm5NextTextConfig", "Glm5NextTextExperts",
                  dict(moe_intermediate_size=32, n_routed_experts=8), "silu_clamp(limit=10)"),
    "hy_v4": ("HYV4Config", "HYV4Experts", dict(moe_intermediate_size=32, n_routed_experts=8),
              "silu_clamp(limit=10)"),
    # without a per-layer limit its limit is inf: plain silu (a limit: test_step3p7_...)
    "step3p7": ("Step3p7TextConfig", "Step3p7Experts",
                dict(moe_intermediate_size=32, moe_num_experts=8), "silu"),
    # gpt-oss's clamped swiglu on gate/up halves
    "minimax_m3_vl": ("MiniMaxM3VLTextConfig", "MiniMaxM3VLExperts",
                      dict(intermediate_size=32, num_local_experts=8), "swigluoai"),
    "openai_privacy_filter": ("OpenAIPrivacyFilterConfig", "OpenAIPrivacyFilterExperts",
                              dict(intermediate_size=32, num_local_experts=8), "swigluoai"),
    "beam": ("BeamConfig", "BeamExperts", dict(moe_intermediate_size=32, num_experts=8), "silu"),
    # a softcapped swiglu: cpumoe has none
    "inkling2": ("Inkling2TextConfig", "Inkling2Experts",
                 dict(moe_intermediate_size=32, n_routed_experts=8), None),
}
# max|experts output - eager's| / max|eager's| at module level, gate/up values past every clamp:
# the error of bf16 (or int8) x and weights is no longer averaged away by the rest of a model.
OP_TOL = {"cpumoe": 8e-2, "cpumoe_bf16": 2e-2}
SCALE = 300  # gate_up_proj ~ N(0, 0.02) times this: gate/up values of about +-50, up to 200


def _init_experts(m: torch.nn.Module, dtype=torch.float32, scale: float = SCALE):
    """``m`` with its own parameters (expert weights and biases; not an act_fn's) drawn
    N(0, 0.02), those of GEMM1 times ``scale``, in ``dtype``, for eager dispatch."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in m._parameters.items():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02
                    * (scale if name.startswith("gate_up") else 1))
    if hasattr(m, "config"):  # a module of @use_experts_implementation: eager by default
        m.config._experts_implementation = "eager"
    return m.to(dtype).eval()


def _experts(family: str, dtype=torch.float32, limit=None, **over):
    """A bare experts module of a GATED family (limit: its swiglu_limit; Step3p7 takes it per
    layer, as an argument), or that of a FAMILIES' tiny model, via _init_experts. Skips a
    family this transformers cannot build."""
    if family in FAMILIES:
        return _init_experts(cmt.experts_modules(_model(family, **over))[0][1], dtype)
    cfg_name, cls_name, kw, _ = GATED[family]
    args = {} if limit is None or family != "step3p7" else {"swiglu_limit": limit}
    if limit is not None and family != "step3p7":
        over["swiglu_limit"] = limit
    try:
        modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        config = getattr(transformers, cfg_name)(hidden_size=64, **{**kw, **over})
        m = getattr(modeling, cls_name)(config, **args)
    except (ImportError, AttributeError, TypeError, ValueError) as e:
        pytest.skip(f"{family}: no tiny experts module with transformers "
                    f"{transformers.__version__} ({e})")
    return _init_experts(m, dtype)


def _run_experts(m: torch.nn.Module, backend: str, wrong: Optional[str] = None):
    """(activation cpumoe runs, max|backend - eager| / max|eager|) of experts module ``m`` on
    32 random tokens routed to two experts each (a copy of m packed; the op called as
    transformers calls it); with ``wrong``, the error of running that activation instead."""
    E = m.gate_up_proj.shape[0]
    H = m.down_proj.shape[2 if getattr(m, "is_transposed", False) else 1]
    gen = torch.Generator().manual_seed(1)
    dtype = m.gate_up_proj.dtype
    x = torch.randn(32, H, generator=gen).to(dtype)
    ids = torch.rand(32, E, generator=gen).topk(2, dim=1).indices
    tw = torch.softmax(torch.randn(32, 2, generator=gen), dim=1).to(dtype)
    packed = copy.deepcopy(m)
    forward = ALL_EXPERTS_FUNCTIONS[backend]
    with torch.no_grad():
        want = m(x, ids, tw).float()
        got = forward(packed, x, ids, tw).float()
        st = packed._cpumoe_state[cmt.BACKENDS[backend]]
        if wrong is None:
            return st.activation, _rel(got, want)
        st.activation = wrong
        return st.activation, _rel(forward(packed, x, ids, tw).float(), want)


# hidden_act -> what cpumoe runs it as; every other one of ACT2FN must be refused or match
ACCEPTED_ACTS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_python": "gelu",
                 "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu_accurate": "gelu_tanh",
                 "gelu_pytorch_tanh": "gelu_tanh", "gelu_python_tanh": "gelu_tanh"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_hidden_act_matches_eager_or_is_refused(dtype):
    """Qwen3-MoE's experts with every activation transformers has, gate values past any clip
    (gelu_10 clips gelu at 10): each runs as eager does or is refused, never silently as
    another activation; the probe tells gelu from gelu_tanh and quick_gelu in bf16 too."""
    from transformers.activations import ACT2FN
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    accepted, refused = {}, set()
    for act in ACT2FN:
        m = _init_experts(Qwen3MoeExperts(_config("qwen3_moe", hidden_act=act)), dtype)
        for backend, tol in OP_TOL.items():
            try:
                spec, err = _run_experts(m, backend)
            except cmt.UnsupportedExperts as e:
                assert "matches none of cpumoe's activations" in str(e)
                refused.add(act)
                continue
            assert err <= tol, f"{act} run as {spec} by {backend}: relative error {err:.3g}"
            accepted[act] = spec
    assert {a: accepted.get(a) for a in ACCEPTED_ACTS} == ACCEPTED_ACTS
    assert {"relu", "quick_gelu", "gelu_10"} <= refused
    assert not set(accepted) & refused


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", [*FAMILIES, *GATED])
def test_family_gating_matches_eager_past_its_clamps(family, dtype):
    """Each family's experts, gate/up values well past their clamps: cpumoe runs what the
    module computes (with its limit) or refuses it."""
    m = _experts(family, dtype)
    want = FAMILIES[family][2] if family in FAMILIES else GATED[family][3]
    for backend, tol in OP_TOL.items():
        if want is None:
            with pytest.raises(cmt.UnsupportedExperts, match="matches none.*closest"):
                _run_experts(m, backend)
            continue
        spec, err = _run_experts(m, backend)
        assert spec == want, family
        assert err <= tol, f"{family} {backend} {dtype}: relative error {err:.3g}"


@pytest.mark.parametrize("limit", [10.0, 50.0])
@pytest.mark.parametrize("family", ["deepseek_v4", "glm5_next", "hy_v4", "step3p7",
                                    "minimax_m3_vl"])
def test_clamped_swiglu_limits(family, limit):
    """The clamp at the module's own limit (at 50 only some gate/up values pass it; MiniMax's
    swigluoai with another alpha too), and the clamp matters: plain silu (what the old probe
    over [-9, 9) took these for) is far off."""
    over = dict(swiglu_alpha=1.5) if family == "minimax_m3_vl" else {}
    m = _experts(family, limit=limit, **over)
    lim = f"limit={limit:g}"
    want = {"minimax_m3_vl": {f"swigluoai({lim},alpha=1.5)"},
            # Step3p7 clamps silu(g): for L >= 17 silu(L) == L in fp32, and both forms agree
            "step3p7": {f"silu_clamp_post({lim})"} | ({f"silu_clamp({lim})"} if limit > 17
                                                       else set())}
    for backend, tol in OP_TOL.items():
        spec, err = _run_experts(m, backend)
        assert spec in want.get(family, {f"silu_clamp({lim})"})
        assert err <= tol, f"{family} {backend}: relative error {err:.3g}"
        _, err = _run_experts(m, backend, wrong="silu")
        assert err > 10 * tol, f"{family}: the clamp at {limit:g} changes little ({err:.3g})"


def test_step3p7_per_layer_limits():
    """Step3p7's limit per layer (0: none, inf in the module): the unclamped layer is plain
    silu, the others clamp silu(g) at their limit; each matches eager. (transformers does not
    dispatch Step3p7's experts through the ExpertsInterface: the backend is called directly.)"""
    try:
        from transformers.models.step3p7.modeling_step3p7 import Step3p7SparseMoeBlock
        config = transformers.Step3p7TextConfig(
            hidden_size=64, intermediate_size=64, moe_intermediate_size=32, moe_num_experts=8,
            share_expert_dim=64, num_hidden_layers=3, swiglu_limits=[0.0, 7.0, 3.0])
    except (ImportError, AttributeError, TypeError, ValueError) as e:
        pytest.skip(f"no tiny Step3p7 here ({e})")
    want = ["silu", "silu_clamp_post(limit=7)", "silu_clamp_post(limit=3)"]
    for layer, spec in enumerate(want):
        # gate/up values of about +-10: at SCALE's +-50 the bf16 rounding of x moves a gate by
        # ~0.2, much of a limit of 3 (the outputs' scale)
        m = _init_experts(Step3p7SparseMoeBlock(config, layer).experts, scale=SCALE / 5)
        for backend, tol in OP_TOL.items():
            got, err = _run_experts(m, backend)
            assert got == spec and err <= tol, (layer, backend, got, err)


def _tiny_clamped_model(family: str, seed: int):
    """A one-layer DeepSeek-V4 / GLM5-Next model whose gate/up values pass the clamp (its
    experts' GEMM1 weights x20), the expert weights on the bf16 grid (the bf16 backend then
    differs from eager only by rounding x and the activation)."""
    torch.manual_seed(seed)
    try:
        if family == "deepseek_v4":
            model = AutoModelForCausalLM.from_config(transformers.DeepseekV4Config(
                vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32,
                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=8, n_shared_experts=1,
                max_position_embeddings=64, hc_mult=2, o_groups=2, o_lora_rank=32,
                index_n_heads=2, index_head_dim=16, index_topk=8, sliding_window=16,
                initializer_range=0.1, layer_types=["sliding_attention"],
                mlp_layer_types=["moe"]))
        else:
            text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64,
                        moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                        kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16,
                        mlp_layer_types=["sparse"], layer_types=["indexed_attention"],
                        index_topk=16, index_head_dim=16, index_n_heads=2, linear_head_dim=16,
                        linear_num_heads=4, hc_mult=2, max_position_embeddings=64,
                        initializer_range=0.1, pad_token_id=0)
            vision = dict(depth=1, hidden_size=32, num_heads=2, out_hidden_size=64,
                          intermediate_size=32, projection_intermediate_size=32)
            model = transformers.Glm5NextForConditionalGeneration(
                transformers.Glm5NextConfig(text_config=text, vision_config=vision))
    except (ImportError, AttributeError, TypeError, ValueError) as e:
        pytest.skip(f"no tiny {family} model here ({e})")
    (_, m), = cmt.experts_modules(model)
    with torch.no_grad():
        m.gate_up_proj.mul_(20)
        for p in (m.gate_up_proj, m.down_proj):
            p.copy_(p.bfloat16().float())
    return model.eval()


# family -> the seed of its model and prompt: top-1 logits ahead of the second by > 4% of the
# largest logit at every generated position, 10x the bf16 backend's error
GREEDY_SEEDS = {"deepseek_v4": 0, "glm5_next": 1}


@pytest.mark.parametrize("family", GREEDY_SEEDS)
def test_clamped_models_greedy_tokens_are_eager_s(family):
    """DeepSeek-V4 / GLM5-Next generate eager's tokens with "cpumoe_bf16" while their clamps
    fire (gate/up values reach 5x the limit); with plain silu the logits are far off."""
    seed = GREEDY_SEEDS[family]
    eager = _tiny_clamped_model(family, seed)
    (_, m), = cmt.experts_modules(eager)
    limit = getattr(m, "limit", getattr(m, "swiglu_limit", None))
    seen = []
    apply_gate = m._apply_gate
    m._apply_gate = lambda h: (seen.append(float(h.abs().max())), apply_gate(h))[1]
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(seed))
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = eager.generate(prompt, **kw)
        ref = eager(want).logits
    del m._apply_gate
    assert max(seen) > 3 * limit
    model = copy.deepcopy(eager)
    cmt.pack_bf16(model)
    with torch.no_grad():
        assert torch.equal(model.generate(prompt, **kw), want)
        assert _rel(model(want).logits, ref) <= TOL["cpumoe_bf16"]
        st = cmt.experts_modules(model)[0][1]._cpumoe_state["bf16"]
        assert st.activation == f"silu_clamp(limit={limit:g})"
        st.activation = "silu"
        assert _rel(model(want).logits, ref) > 10 * TOL["cpumoe_bf16"]


# ---------------------------------------------------------------------------- W8A8 checkpoints
def _save_w8a8_checkpoint(model, folder, mixtral_names=False):
    """Saves ``model`` the way llm-compressor saves a W8A8 MoE model, with the compressed-tensors
    package doing the quantization bookkeeping, compression and config: one Linear per expert
    projection (``mlp.experts.{e}.{gate,up,down}_proj``), every Linear but lm_head W8A8 (int8
    per-channel weights with minmax scales, dynamic per-token activations). mixtral_names: the
    original Mixtral checkpoint names instead (``block_sparse_moe.experts.{e}.{w1,w3,w2}``, the
    router at ``block_sparse_moe.gate``)."""
    ct_quant = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.compressors import ModelCompressor
    from safetensors.torch import save_file

    def put(root, path, module):
        *parents, leaf = path.split(".")
        node = root
        for p in parents:
            if not hasattr(node, p):
                node.add_module(p, torch.nn.Module())
            node = getattr(node, p)
        node.add_module(leaf, module)

    def linear(w):
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        lin.weight.data = w.detach().clone().contiguous()
        return lin

    def ck_name(name):
        return name.replace(".mlp.", ".block_sparse_moe.") if mixtral_names else name

    projs = ("w1", "w3", "w2") if mixtral_names else ("gate_proj", "up_proj", "down_proj")
    root = torch.nn.Module()
    expert_names = dict(cmt.experts_modules(model))
    for name, m in model.named_modules():
        if name in expert_names:
            I = m.intermediate_dim
            for e in range(m.num_experts):
                put(root, f"{ck_name(name)}.{e}.{projs[0]}", linear(m.gate_up_proj[e, :I]))
                put(root, f"{ck_name(name)}.{e}.{projs[1]}", linear(m.gate_up_proj[e, I:]))
                put(root, f"{ck_name(name)}.{e}.{projs[2]}", linear(m.down_proj[e]))
        elif isinstance(m, torch.nn.Linear):
            put(root, ck_name(name), linear(m.weight))
    scheme = ct_quant.preset_name_to_scheme("W8A8", ["Linear"])
    qcfg = ct_quant.QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    ct_quant.apply_quantization_config(root, qcfg)
    with torch.no_grad():
        for m in root.modules():
            if hasattr(m, "weight_scale"):  # a minmax observer's scale (what calibration sets)
                m.weight_scale.copy_(m.weight.abs().amax(dim=1, keepdim=True) / 127)
    compressor = ModelCompressor.from_pretrained_model(root, quantization_format="int-quantized")
    compressor.compress_model(root)
    tensors = {k: v.contiguous() for k, v in root.state_dict().items()}
    linear_keys = set(tensors)
    for k, v in model.state_dict().items():  # embeddings, norms, router: float
        mod = k.rsplit(".", 1)[0]
        if (ck_name(k) not in linear_keys and mod not in expert_names
                and not mod.endswith("lm_head")):
            tensors[ck_name(k)] = v.detach().clone().contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    model.config.save_pretrained(str(folder))
    compressor.update_config(str(folder))
    return tensors


def test_load_w8a8_compressed_tensors_checkpoint(tmp_path):
    eager = _model("qwen3_moe", tie_word_embeddings=True)
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = eager(ids).logits
    tensors = _save_w8a8_checkpoint(eager, tmp_path)
    assert tensors["model.layers.0.mlp.experts.0.gate_proj.weight"].dtype == torch.int8
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.int8

    model = cmt.load_w8a8(tmp_path, dtype=torch.float32)
    assert model.config._experts_implementation == "cpumoe"
    (name, m), = cmt.experts_modules(model)
    assert m.gate_up_proj.numel() == 0 and set(m._cpumoe_state) == {"int8"}
    with torch.no_grad():
        got = model(ids).logits
        err = _rel(got, ref)
        assert err <= TOL["cpumoe"], err  # attention dequantized from int8 too
        # The experts hold the checkpoint's int8 weights: the same op output as quantizing the
        # float experts here (same minmax scales, round half to even).
        own = copy.deepcopy(eager)
        cmt.quantize(own)
        x = torch.randn(12, 64)
        tw = torch.rand(12, 2)
        top = torch.randint(0, 8, (12, 2))
        a = cmt.experts_modules(own)[0][1](x, top, tw)
        b = m(x, top, tw)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6 * float(a.abs().max()))


def test_load_w8a8_mixtral_checkpoint_names(tmp_path):
    # Mixtral's original names (block_sparse_moe.experts.{e}.w1/w3/w2, block_sparse_moe.gate):
    # the experts through cpumoe.checkpoint's mixtral naming, the router renamed as transformers
    # renames it.
    eager = _model("mixtral")
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = eager(ids).logits
    tensors = _save_w8a8_checkpoint(eager, tmp_path, mixtral_names=True)
    assert tensors["model.layers.0.block_sparse_moe.experts.0.w1.weight"].dtype == torch.int8
    assert "model.layers.0.block_sparse_moe.gate.weight" in tensors
    assert not any(".mlp." in k for k in tensors)
    model = cmt.load_w8a8(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        err = _rel(model(ids).logits, ref)
    assert err <= TOL["cpumoe"], err


def test_load_w8a8_refuses_a_float_checkpoint(tmp_path):
    from safetensors.torch import save_file
    model = _model("qwen3_moe")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(tmp_path / "model.safetensors"))
    model.config.save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="no compressed-tensors quantization_config"):
        cmt.load_w8a8(tmp_path)



@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_load_w4a8_compressed_tensors_int4_checkpoint(tmp_path, family):
    """An llm-compressor style W4A16 checkpoint (compressed-tensors pack-quantized, group 32;
    Mixtral's with its original block_sparse_moe names, DeepSeek-V3's with a dense first layer
    and shared experts): the experts packed at 4 bits straight from the int4 words, never in
    float; the model generates."""
    from cpumoe.testing import models as ckpts
    eager = _model(family)
    _snap_to_w4(eager, "cpumoe_int4")  # the checkpoint then holds the model's weights exactly
    eager.save_pretrained(str(tmp_path / "float"))
    dst = ckpts.save_w4a16(tmp_path / "float", tmp_path / "w4a16", group_size=32)
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(5))
    model = cmt.load_w4a8(dst, dtype=torch.float32)
    assert model.config._experts_implementation == "cpumoe_int4"
    (_, m), = cmt.experts_modules(model)
    st = m._cpumoe_state["int4"]
    assert m.gate_up_proj.numel() == 0 and set(m._cpumoe_state) == {"int4"}
    assert st.packed.weight_format == "int4" and st.packed.group_size == 32
    with torch.no_grad():
        err = _rel(model(ids).logits, eager(ids).logits)
        assert err <= TOL["cpumoe"], err  # only the int8 activations differ
        # The same layer as the 4-bit backend packs from the float model.
        own = copy.deepcopy(eager)
        cmt.prepare(own, "cpumoe_int4")
        x, tw = torch.randn(12, 64), torch.rand(12, 2)
        top = torch.randint(0, m.num_experts, (12, 2))
        a = cmt.experts_modules(own)[0][1](x, top, tw)
        b = m(x, top, tw)
        seq = model.generate(ids[:1, :6], max_new_tokens=6, min_new_tokens=6, do_sample=False,
                             pad_token_id=0)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6 * float(a.abs().max()))
    assert seq.shape == (1, 12)


def test_load_w4a8_gpt_oss_mxfp4_checkpoint(tmp_path):
    """gpt-oss's MXFP4 release layout: the experts packed from the codes and E8M0 scales (with
    their biases, swigluoai), the rest bf16; eager on the dequantized checkpoint differs only by
    the int8 activations."""
    from cpumoe.testing import models as ckpts
    _model("gpt_oss").save_pretrained(str(tmp_path / "float"))
    dst = ckpts.save_mxfp4(tmp_path / "float", tmp_path / "mxfp4")
    deq = ckpts.save_mxfp4_dequantized(dst, tmp_path / "dequantized")
    eager = AutoModelForCausalLM.from_pretrained(str(deq), dtype=torch.float32).eval()
    model = cmt.load_w4a8(dst, dtype=torch.float32)
    assert model.config._experts_implementation == "cpumoe_mxfp4"
    (_, m), = cmt.experts_modules(model)
    st = m._cpumoe_state["mxfp4"]
    assert st.packed.weight_format == "mxfp4" and st.activation == "swigluoai"
    assert m.gate_up_proj_bias.numel() == 0  # the biases are packed with the layer
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        err = _rel(model(ids).logits, eager(ids).logits)
    assert err <= TOL["cpumoe"], err


def test_load_w4a8_refuses_other_checkpoints(tmp_path):
    from cpumoe.checkpoint import UnsupportedCheckpoint
    eager = _model("qwen3_moe")
    eager.save_pretrained(str(tmp_path / "float"))
    with pytest.raises(UnsupportedCheckpoint, match="not compressed-tensors int4 or mxfp4"):
        cmt.load_w4a8(tmp_path / "float")
    _save_w8a8_checkpoint(eager, tmp_path)
    with pytest.raises(UnsupportedCheckpoint, match="format 'int-quantized'.*load_w8a8"):
        cmt.load_w4a8(tmp_path)
    from cpumoe.testing import models as ckpts  # W4A8 as compressed-tensors stores it
    dst = ckpts.save_w4a8(tmp_path / "float", tmp_path / "w4a8", group_size=32)
    with pytest.raises(UnsupportedCheckpoint, match="format 'int-quantized'.*vLLM plugin"):
        cmt.load_w4a8(dst)


# ---------------------------------------------------------------------------- GPTQ / AWQ
def _quantize_4bit(w: torch.Tensor, g: int, sym: bool, min_zero: int, bits: int = 4):
    """Min-max b-bit quantization (4 by default) of a float weight [n, k] per group of g inputs,
    as GPTQ / AWQ store it: codes q uint8 [n, k], zero points z [G, n] (2^(b-1) when ``sym``,
    else in [min_zero, 2^b - 1]), fp16 scales s [G, n]; and its float32 weight s * (q - z)
    (exact)."""
    import numpy as np
    w = w.detach().float().numpy()
    n, k = w.shape
    wg = w.reshape(n, k // g, g)
    top, half = (1 << bits) - 1, 1 << (bits - 1)
    if sym:
        s = np.maximum(np.abs(wg).max(-1) / (half - 1), 1e-6).astype(np.float16)
        z = np.full(s.shape, half, np.int64)
    else:
        lo, hi = np.minimum(wg.min(-1), 0), np.maximum(wg.max(-1), 0)
        s = np.maximum((hi - lo) / top, 1e-6).astype(np.float16)
        z = np.clip(np.round(-lo / s.astype(np.float32)), min_zero, top).astype(np.int64)
    s32 = s.astype(np.float32)[..., None]
    q = np.clip(np.round(wg / s32) + z[..., None], 0, top)
    deq = (s32 * (q - z[..., None]).astype(np.float32)).reshape(n, k).astype(np.float32)
    return q.reshape(n, k).astype(np.uint8), z.T.copy(), s.T.copy(), deq


def _save_gptq_awq(model, folder, kind: str, *, g: int = 32, sym: bool = False,
                   sym_layers=(), mixtral_names: bool = False, bits: int = 4):
    """Writes ``model`` as a ``bits``-bit (4; GPTQ also 8) ``kind`` checkpoint ("gptq": AutoGPTQ v1, zero points stored
    minus one; "awq": AutoAWQ GEMM) with its experts and attention projections quantized (min-max
    per group of g inputs, symmetric when ``sym`` or the layer is in ``sym_layers``), packed by
    test_checkpoint_gptq's independent packers (the documented layouts); the embeddings, norms,
    router and lm_head float. Sets the model's quantized weights to the checkpoint's dequantized
    values, in place: the model is then the checkpoint's reference."""
    import json
    import re
    import numpy as np
    from safetensors.numpy import save_file
    from test_checkpoint_gptq import ORDER, pack_along_cols, pack_along_rows

    def ck_name(name):
        return name.replace(".mlp.", ".block_sparse_moe.") if mixtral_names else name

    def layer_of(name):
        return int(re.search(r"layers\.(\d+)\.", name).group(1))

    tensors = {}

    def put(module_name, w, sym_here):  # w [n, k]; returns the dequantized weight
        q, z, sc, deq = _quantize_4bit(w, g, sym_here, 1 if kind == "gptq" else 0, bits)
        pre = ck_name(module_name) + "."
        if kind == "gptq":
            tensors[pre + "qweight"] = pack_along_rows(np.ascontiguousarray(q.T), bits)
            tensors[pre + "qzeros"] = pack_along_cols((z - 1).astype(np.uint8),
                                                      bits=bits)  # v1: z - 1
            tensors[pre + "g_idx"] = (np.arange(q.shape[1]) // g).astype(np.int32)
        else:
            tensors[pre + "qweight"] = pack_along_cols(np.ascontiguousarray(q.T), ORDER)
            tensors[pre + "qzeros"] = pack_along_cols(z.astype(np.uint8), ORDER)
        tensors[pre + "scales"] = sc
        return torch.from_numpy(deq)

    projs = ("w1", "w3", "w2") if mixtral_names else ("gate_proj", "up_proj", "down_proj")
    done = set()
    with torch.no_grad():
        for name, m in cmt.experts_modules(model):
            sym_here = sym or layer_of(name) in sym_layers
            I = m.intermediate_dim
            for e in range(m.num_experts):
                gu = m.gate_up_proj[e]
                m.gate_up_proj[e, :I] = put(f"{name}.{e}.{projs[0]}", gu[:I], sym_here)
                m.gate_up_proj[e, I:] = put(f"{name}.{e}.{projs[1]}", gu[I:], sym_here)
                m.down_proj[e] = put(f"{name}.{e}.{projs[2]}", m.down_proj[e], sym_here)
            done.update(f"{name}.{p}" for p in ("gate_up_proj", "down_proj"))
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Linear) and ".self_attn." in name:
                m.weight.copy_(put(name, m.weight, sym or layer_of(name) in sym_layers))
                done.add(f"{name}.weight")
    for k, v in model.state_dict().items():
        if k not in done:
            tensors[ck_name(k)] = v.detach().float().numpy().copy()
    save_file(tensors, str(folder / "model.safetensors"))
    model.config.save_pretrained(str(folder))
    if kind == "gptq":
        q = {"quant_method": "gptq", "bits": bits, "group_size": g, "desc_act": False,
             "sym": sym, "checkpoint_format": "gptq"}
    else:
        q = {"quant_method": "awq", "bits": 4, "group_size": g, "zero_point": True,
             "version": "gemm"}
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = q
    (folder / "config.json").write_text(json.dumps(cfg))
    return tensors


@pytest.mark.parametrize("kind, family", [("gptq", "qwen3_moe"), ("awq", "qwen3_moe"),
                                          ("gptq", "mixtral")])
def test_load_quantized_asymmetric_gptq_awq(tmp_path, kind, family):
    """An asymmetric GPTQ (v1) / AWQ checkpoint (experts and attention 4-bit, zero points;
    Mixtral's with its block_sparse_moe names): the experts packed as int4_affine from the codes,
    scales and zero points, the attention dequantized exactly; eager on the checkpoint's
    dequantized weights differs only by the int8 activations; the model generates."""
    eager = _model(family)
    tensors = _save_gptq_awq(eager, tmp_path, kind, mixtral_names=family == "mixtral")
    moe = "block_sparse_moe.experts.0.w1" if family == "mixtral" else "mlp.experts.0.gate_proj"
    assert f"model.layers.0.{moe}.qweight" in tensors
    assert "model.layers.0.self_attn.q_proj.qweight" in tensors
    model = cmt.load_quantized(tmp_path, dtype=torch.float32)
    assert model.config._experts_implementation == "cpumoe_int4_affine"
    (_, m), = cmt.experts_modules(model)
    st = m._cpumoe_state["int4_affine"]
    assert m.gate_up_proj.numel() == 0 and set(m._cpumoe_state) == {"int4_affine"}
    assert st.packed.weight_format == "int4_affine" and st.packed.group_size == 32
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):  # s * (q - z), exact in float32
        ours = getattr(model.model.layers[0].self_attn, name).weight
        assert torch.equal(ours, getattr(eager.model.layers[0].self_attn, name).weight), name
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        err = _rel(model(ids).logits, eager(ids).logits)
        seq = model.generate(ids[:1, :6], max_new_tokens=6, min_new_tokens=6, do_sample=False,
                             pad_token_id=0)
    assert err <= TOL["cpumoe"], err  # only the int8 activations differ
    assert seq.shape == (1, 12)


@pytest.mark.parametrize("kind", ["gptq", "awq"])
def test_load_quantized_symmetric_is_int4(tmp_path, kind):
    """A symmetric checkpoint (every zero point 8; AWQ stores them too, GPTQ says sym) gives
    packed int4 on "cpumoe_int4"; the default dtype is bf16 (the dequantized attention and the
    rest)."""
    eager = _model("qwen3_moe")
    _save_gptq_awq(eager, tmp_path, kind, sym=True)
    model = cmt.load_quantized(tmp_path, dtype=torch.float32)
    assert model.config._experts_implementation == "cpumoe_int4"
    (_, m), = cmt.experts_modules(model)
    assert set(m._cpumoe_state) == {"int4"}
    assert m._cpumoe_state["int4"].packed.weight_format == "int4"
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        err = _rel(model(ids).logits, eager(ids).logits)
    assert err <= TOL["cpumoe"], err
    bf16 = cmt.load_quantized(tmp_path)
    assert bf16.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.isfinite(bf16(ids).logits).all()


@pytest.mark.parametrize("sym", [True, False])
def test_load_quantized_8_bit_gptq_is_int8_affine(tmp_path, sym):
    """An 8-bit GPTQ checkpoint (Qwen's GPTQ-Int8 kind: 4 codes per word): the experts packed
    as int8_affine from the codes, scales and zero points; eager on the checkpoint's dequantized
    weights differs only by the int8 activations."""
    eager = _model("qwen3_moe")
    _save_gptq_awq(eager, tmp_path, "gptq", sym=sym, bits=8)
    model = cmt.load_quantized(tmp_path, dtype=torch.float32)
    assert model.config._experts_implementation == "cpumoe_int8_affine"
    (_, m), = cmt.experts_modules(model)
    assert m._cpumoe_state["int8_affine"].packed.weight_format == "int8_affine"
    for name in ("q_proj", "o_proj"):  # s * (q - z), exact in float32
        ours = getattr(model.model.layers[0].self_attn, name).weight
        assert torch.equal(ours, getattr(eager.model.layers[0].self_attn, name).weight), name
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        err = _rel(model(ids).logits, eager(ids).logits)
    assert err <= TOL["cpumoe"], err


def test_load_quantized_mixed_layers_run_as_int4_affine(tmp_path):
    """A symmetric layer beside an asymmetric one: one backend for the model, the symmetric layer
    stored as int4_affine (codes + 8, (s, -8 s)): the same op output as its int4 packing; each
    experts module matches eager's on the checkpoint's weights."""
    from cpumoe import loaders, ops
    eager = _model("qwen3_moe", num_hidden_layers=2)
    _save_gptq_awq(eager, tmp_path, "gptq", sym_layers=(0,))
    assert loaders.read_experts(tmp_path, 0).weight_format == "int4"
    assert loaders.read_experts(tmp_path, 1).weight_format == "int4_affine"
    model = cmt.load_quantized(tmp_path, dtype=torch.float32)
    assert model.config._experts_implementation == "cpumoe_int4_affine"
    mods = cmt.experts_modules(model)
    assert len(mods) == 2
    gen = torch.Generator().manual_seed(11)
    x, tw = torch.randn(12, 64, generator=gen), torch.rand(12, 2, generator=gen)
    top = torch.randint(0, 8, (12, 2), generator=gen)
    with torch.no_grad():
        for (name, m), (_, ref) in zip(mods, cmt.experts_modules(eager)):
            assert set(m._cpumoe_state) == {"int4_affine"}, name
            got, want = m(x, top, tw), ref(x, top, tw)
            assert _rel(got, want) <= TOL["cpumoe"], name
        as_int4 = loaders.load_experts(tmp_path, 0)
        assert as_int4.weight_format == "int4"
        a = ops.fused_moe(x, as_int4, tw, top, activation="silu")
        b = mods[0][1](x, top, tw)
    torch.testing.assert_close(b, a, rtol=0, atol=1e-5 * float(a.abs().max()))


def test_load_quantized_refuses_other_checkpoints(tmp_path):
    from cpumoe.checkpoint import UnsupportedCheckpoint
    from cpumoe.testing import models as ckpts
    eager = _model("qwen3_moe")
    eager.save_pretrained(str(tmp_path / "float"))
    with pytest.raises(UnsupportedCheckpoint, match="not a GPTQ or AWQ checkpoint: a float"):
        cmt.load_quantized(tmp_path / "float")
    dst = ckpts.save_w4a16(tmp_path / "float", tmp_path / "w4a16", group_size=32)
    with pytest.raises(UnsupportedCheckpoint,
                       match="not a GPTQ or AWQ checkpoint: a compressed-tensors.*load_w4a8"):
        cmt.load_quantized(dst)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(UnsupportedCheckpoint, match="a GGUF file.*load_gguf reads GGUF models"):
        cmt.load_quantized(gguf)


# ---------------------------------------------------------------------------- the bench hook
def test_bench_model_option_and_presets():
    """`cpumoe bench --model` parses, and each preset's transformers config has the layer shape
    (H, I, E, k) of cpumoe's preset of that name (the block it times is the layer `cpumoe bench`
    times). The timing itself is not run here (real shapes: minutes)."""
    from cpumoe.cli import bench, problem
    from cpumoe.cli.bench import hf_block
    args = bench.parser().parse_args(["--model", "all", "--no-whole-model"])
    assert args.model == list(hf_block.MODEL_CONFIGS) and args.no_whole_model
    with pytest.raises(SystemExit):
        bench.parser().parse_args(["--model", "llama"])
    for preset in hf_block.MODEL_CONFIGS:
        cfg = hf_block.model_config(preset, 2, 64, transformers)
        assert hf_block._shape(cfg) == problem.PRESETS[preset][:4]
    calls = []
    times = hf_block._alternate({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                                lambda name: calls.append("setup " + name), 0.0, 2)
    assert {n: len(t) for n, t in times.items()} == {"a": 2, "b": 2}  # one call per round
    assert calls[-4:] == ["setup b", "b", "setup a", "a"]  # the second round rotated


@pytest.mark.parametrize("backend, inter, what", [
    ("cpumoe_int4", 40, "int4 needs a group size that divides both H = 64 and I = 40"),
    ("cpumoe_mxfp4", 48, "mxfp4 needs a group size that divides both H = 64 and I = 48")])
def test_w4_backends_name_sizes_they_cannot_group(backend, inter, what):
    model = _model("qwen3_moe", moe_intermediate_size=inter)
    with pytest.raises(cmt.UnsupportedExperts, match=what):
        cmt.prepare(model, backend)


# ---------------------------------------------------------------------------- FP8 checkpoints
# Every module but the embeddings, the router and lm_head FP8 (attention too, as DeepSeek-V3's).
_FP8_NOT_CONVERTED = ["lm_head", "model.embed_tokens", "model.layers.*.mlp.gate"]


def test_load_w8a16_hf_fp8_checkpoint(tmp_path):
    """A HF "fp8" checkpoint (transformers' Fp8Quantize, 32 x 32 blocks: the tiny model's sides)
    with FP8 experts and attention: the experts packed in the fp8 format from the codes and
    block scales as stored, the attention dequantized; transformers' own load of it (which
    dequantizes everything on a CPU) run eager differs only by the bf16 activations."""
    from cpumoe.testing import models as ckpts
    _model("qwen3_moe").save_pretrained(str(tmp_path / "float"))
    dst = ckpts.save_fp8(tmp_path / "float", tmp_path / "fp8", block_size=(32, 32),
                         linears=True, modules_to_not_convert=_FP8_NOT_CONVERTED)
    eager = AutoModelForCausalLM.from_pretrained(str(dst), dtype=torch.float32,
                                                 experts_implementation="eager").eval()
    model = cmt.load_w8a16(dst, dtype=torch.float32)
    assert model.config._experts_implementation == "cpumoe_fp8"
    (_, m), = cmt.experts_modules(model)
    st = m._cpumoe_state["fp8"]
    assert m.gate_up_proj.numel() == 0 and set(m._cpumoe_state) == {"fp8"}
    assert st.packed.weight_format == "fp8"
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):  # dequantized exactly as transformers
        ours = getattr(model.model.layers[0].self_attn, name).weight
        theirs = getattr(eager.model.layers[0].self_attn, name).weight
        assert torch.equal(ours, theirs), name
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        err = _rel(model(ids).logits, eager(ids).logits)
    assert err <= TOL["cpumoe_bf16"], err  # the experts' activations in bf16


@pytest.mark.parametrize("strategy", ["channel", "block"])
def test_load_w8a16_compressed_tensors_fp8_checkpoint(tmp_path, strategy):
    """compressed-tensors FP8 (FP8_DYNAMIC per channel, FP8_BLOCK 32 x 32), the experts read as
    stored. transformers cannot load such an MoE checkpoint on a CPU: the reference is eager on
    the float model with the checkpoint's experts dequantized."""
    pytest.importorskip("compressed_tensors")
    from cpumoe.checkpoint_fp8 import load_fp8_moe_layer
    from cpumoe.testing import models as ckpts
    eager = _model("qwen3_moe")
    eager.save_pretrained(str(tmp_path / "float"))
    dst = ckpts.save_fp8_compressed(tmp_path / "float", tmp_path / "ct", strategy=strategy,
                                    block_size=(32, 32))
    w13, w2 = load_fp8_moe_layer(dst, 0).dequantized()
    (_, ex), = cmt.experts_modules(eager)
    with torch.no_grad():
        ex.gate_up_proj.copy_(torch.from_numpy(w13))
        ex.down_proj.copy_(torch.from_numpy(w2))
    model = cmt.load_w8a16(dst, dtype=torch.float32)
    (_, m), = cmt.experts_modules(model)
    assert m._cpumoe_state["fp8"].packed.weight_format == "fp8"
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        err = _rel(model(ids).logits, eager(ids).logits)
    assert err <= TOL["cpumoe_bf16"], err


def test_load_w8a16_refuses_other_checkpoints(tmp_path):
    from cpumoe.checkpoint import UnsupportedCheckpoint
    from cpumoe.testing import models as ckpts
    eager = _model("qwen3_moe")
    eager.save_pretrained(str(tmp_path / "float"))
    with pytest.raises(UnsupportedCheckpoint, match="not an FP8 checkpoint.*float checkpoint"):
        cmt.load_w8a16(tmp_path / "float")
    _save_w8a8_checkpoint(eager, tmp_path)
    with pytest.raises(UnsupportedCheckpoint, match="without FP8 weights.*int8 W8A8: load_w8a8"):
        cmt.load_w8a16(tmp_path)
    dst = ckpts.save_w4a16(tmp_path / "float", tmp_path / "w4a16", group_size=32)
    with pytest.raises(UnsupportedCheckpoint, match="int4: load_w4a8"):
        cmt.load_w8a16(dst)
