"""cpumoe as an experts backend of Hugging Face ``transformers`` (version 5 and later).

``import cpumoe.transformers`` registers one backend per weight format of
:data:`cpumoe.FORMATS` (:data:`BACKENDS`) with transformers' own registry
(``transformers.integrations.moe.ExpertsInterface``)::

    import cpumoe.transformers
    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="cpumoe")
    out = model.generate(**inputs)

``"cpumoe"``
    W8A8: the fused ``gate_up_proj`` / ``down_proj`` weights of each experts module are quantized
    per output channel (symmetric int8, fp32 scales), packed with :func:`cpumoe.prepack` the
    first time the module runs (or at :func:`quantize`), and the float copies released; each
    call runs :func:`cpumoe.fused_moe` (per-token int8 activations).
``"cpumoe_bf16"``
    :func:`cpumoe.fused_moe_bf16` on the model's weights (rounded to bf16 if the model is fp32),
    packed once (:func:`pack_bf16`); the float copies are released the same way.
``"cpumoe_<format>"``, every other format
    the experts quantized round-to-nearest by :func:`cpumoe.quantize.quantize_experts` (a scale
    per group of 128, else 64 or 32 inputs where the format lets one choose: the first dividing
    H and I), packed, run by :func:`cpumoe.fused_moe`. A model that transformers dequantized
    from a checkpoint in the same format gets the checkpoint's values back exactly (see
    docs/integrations.md).

Any model whose experts class uses transformers' ``@use_experts_implementation`` works if its
experts are gated (a fused ``gate_up_proj``) and their gating is one of cpumoe's activations:
the candidates come from what the module declares (``act_fn``, a ``limit`` / ``swiglu_limit``,
an ``alpha`` / ``swiglu_alpha``), and the module's own ``_apply_gate`` is probed over values of
both signs from 1e-3 to 1e4 and around each declared limit, in its dtype and in float32, so a
clamp cannot go unnoticed; the probe also tells whether gate and up are concatenated halves or
interleaved. Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek-V2/V3 (``act_fn`` silu, or a gelu form by
``hidden_act``), gpt-oss and MiniMax-M3 (clamped swiglu with alpha 1.702 and limit 7.0:
cpumoe's ``swigluoai``), DeepSeek-V4, GLM5-Next and HY-V4 (``silu(min(g, L)) * clamp(u, -L,
L)``: ``silu_clamp(limit=L)``) are taken as they are, biases included; the backends then run
the activation with the module's own parameters (:func:`cpumoe.activation_spec`). Step3p7's
experts (``min(silu(g), L) * clamp(u, -L, L)``: ``silu_clamp_post``, plain silu where a layer
has no limit) are recognised too, though transformers does not dispatch them through the
ExpertsInterface.
The router stays the model's (cpumoe gets its ``top_k_index`` / ``top_k_weights``), and so do
shared experts (DeepSeek's ``shared_experts`` are a separate MLP of the MoE block).

Experts cpumoe cannot take raise :class:`UnsupportedExperts` (a ValueError) naming the module
and the reason (an activation it lacks, such as relu, quick_gelu or gelu_10's clipped gelu: the
message says where the closest candidate differs; H or I not a multiple of 8, no gate, expert
parallelism, a post-expert norm, non-float or non-CPU weights); there is no fallback.

:func:`load_w8a8` builds the model of a compressed-tensors W8A8 checkpoint with its experts read
from the int8 tensors straight into packed layers; :func:`load_w4a8` that of a 4-bit checkpoint
(:mod:`cpumoe.checkpoint_w4` reads them), the experts packed at 4 bits from the checkpoint's
codes and scales (no float copy of them: what lets a 4-bit model load in the memory
its 4-bit weights take); :func:`load_w8a16` that of an FP8 checkpoint (HF ``fp8`` with
``weight_block_size``, or compressed-tensors FP8), its experts packed in the fp8 format from
the stored E4M3 codes and block scales (:mod:`cpumoe.checkpoint_fp8` reads them; backend
``"cpumoe_fp8"``, bf16 activations), its other FP8 Linears dequantized.
:func:`load_quantized` builds that of a 4-bit GPTQ (v1 / v2) or AWQ (GEMM) checkpoint, its
experts packed from the stored codes, scales and zero points (:mod:`cpumoe.checkpoint_gptq`
reads them, through :func:`cpumoe.loaders.read_experts`): backend ``"cpumoe_int4"`` when every
zero point is 8 (symmetric), else ``"cpumoe_int4_affine"`` (a (scale, min) pair per group, W4A8
too); its other GPTQ / AWQ Linears (attention) dequantized into the model's dtype
(:func:`cpumoe.checkpoint_gptq.dequantize_linear`). :func:`load_gguf` builds that of a GGUF
file, its experts packed from the stored blocks (Q4_0 -> int4, Q4_1 / Q4_K -> int4_affine,
MXFP4, BF16: :func:`cpumoe.load_experts`' rules), the other tensors dequantized by ``gguf`` and
named by transformers' GGUF tables (transformers' own ``from_pretrained(..., gguf_file=...)``
dequantizes the experts too, and a backend would then re-quantize them).

Inference only: the backward of a cpumoe call raises. ``torch.compile`` of the model works
once its experts are packed (call :func:`quantize` / :func:`pack_bf16`, or run it once, before
compiling): the op is one node of the graph.

The package's files: ``layout`` (which experts modules cpumoe takes and how their weights map to
the op's), ``packing`` (a module's packed layers, per weight format), ``backends`` (the
registered forwards and :func:`prepare`), ``checkpoints`` (:func:`load_w8a8`, :func:`load_w4a8`,
:func:`load_w8a16`, :func:`load_quantized`, their shared builder), ``gguf_model``
(:func:`load_gguf`).
"""

from __future__ import annotations

from .backends import experts_modules, pack_bf16, prepare, quantize  # registers the backends
from .checkpoints import load_quantized, load_w4a8, load_w8a8, load_w8a16
from .gguf_model import load_gguf
from .layout import UnsupportedExperts
from .packing import BACKENDS, INT4_GROUPS

__all__ = [
    "BACKENDS",
    "INT4_GROUPS",
    "UnsupportedExperts",
    "experts_modules",
    "load_gguf",
    "load_quantized",
    "load_w4a8",
    "load_w8a16",
    "load_w8a8",
    "pack_bf16",
    "prepare",
    "quantize",
]
