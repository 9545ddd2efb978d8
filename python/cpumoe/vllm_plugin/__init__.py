"""cpumoe as a vLLM plugin: vLLM's CPU MoE layers run on cpumoe's fused kernels.

Install cpumoe beside vLLM (``pip install cpumoe[vllm]``); the package registers the entry point
``cpumoe = cpumoe.vllm_plugin:register`` in the group ``vllm.general_plugins``, which vLLM calls in
every process it starts (front end, engine core, workers). The switch is the environment
variable ``CPUMOE_VLLM=1`` (vLLM 0.32's ``moe_backend`` is a closed list of names, so it cannot
name an out-of-tree backend). Unset or ``0``, :func:`register` does nothing and vLLM runs
unchanged.

Switched on, :func:`register` puts :class:`cpumoe.vllm_plugin.layer.CpumoeRoutedExperts` in place
of vLLM's ``RoutedExperts`` through vLLM's out-of-tree layer registry
(``PluggableLayer.register_oot``, the registry ``CustomOp.register_oot`` fills too). Each MoE
layer is still built by vLLM (its quantization method, weight loading, router, prepare/finalize,
expert-parallel map); where vLLM chose its CPU experts kernel, the layer's experts become
cpumoe's, as a ``FusedMoEExpertsModular`` of vLLM's modular kernel:

* compressed-tensors W8A8 int8 (channel weights, dynamic per-token activations): the int8 op;
* compressed-tensors W4A8 int4 (group weights, dynamic per-token int8 activations), W4A16 int4
  (pack-quantized; with zero points: int4_affine) and gpt-oss MXFP4: the int8 op on 4-bit
  weights (W4A8; the W4A16 and MXFP4 checkpoints' activations become int8 per token);
* 4-bit GPTQ (v1 / gptq_v2) and AWQ (GEMM) checkpoints (vLLM's AutoGPTQ / AutoAWQ MoE methods):
  the int8 op on int4 (symmetric) or int4_affine weights, int8 activations;
* HF ``quant_method: fp8`` (E4M3 weights, ``weight_block_size`` blocks or a scale per tensor)
  and compressed-tensors FP8 (channel, tensor or block scales), dynamic activations: the fp8
  op (W8A16: bf16 activations);
* unquantized bf16: the BF16 op;
* with expert parallelism, vLLM's ``expert_map`` goes to the op (global top-k ids).

One INFO line per layer says which layers cpumoe took and on which path (``packed.path``); a
layer it cannot take (another quantization, dtype, activation or shape) stays on vLLM's kernel
with one INFO line saying why.
"""

from __future__ import annotations

import os

__all__ = ["ENV", "enabled", "register"]

#: The switch: "1" (or true/yes/on) runs vLLM's CPU MoE layers on cpumoe.
ENV = "CPUMOE_VLLM"


def enabled() -> bool:
    """True if ``CPUMOE_VLLM`` asks for cpumoe (1, true, yes, on)."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{ENV}={os.environ[ENV]!r}: expected 1 or 0")


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point (called once per process; idempotent)."""
    if not enabled():
        return
    from . import layer
    layer.install()
