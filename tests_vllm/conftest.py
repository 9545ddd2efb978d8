"""Fixtures of the vLLM plugin tests (run in the vLLM venv: `bash ci/test_all.sh vllm`).

The session makes the tiny random checkpoints once (transformers + compressed-tensors, no
downloads) and serves them through ``vllm.LLM`` in two subprocesses that run side by side, one
per backend: ``CPUMOE_VLLM=0`` (vLLM's own CPU MoE kernels) and ``CPUMOE_VLLM=1`` (cpumoe's).
Each writes JSON (tokens, logprobs, the worker's report) and a log; the tests read both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM plugin tests need vLLM (ci/setup_vllm_venv.sh)")

from cpumoe.testing import models  # noqa: E402

#: name -> (source, kind). kind None: a random bf16 model of the family ``source``
#: (models.save_tiny); otherwise the checkpoint made from the model ``source`` by
#: models.save_<kind>:
#: "w8a8" / "w4a8" / "w4a16" quantized with compressed-tensors, "mxfp4" in gpt-oss's release
#: layout, "fp8" (HF quant_method fp8, 128x128 blocks, the experts only: vLLM 0.32's CPU
#: backend has no FP8 linear layers), "fp8_compressed" (compressed-tensors FP8_DYNAMIC: channel
#: weights, the experts only), and three bf16 references: "int4_grid" (the experts on an
#: int4 grid: the int4 checkpoints made from it hold it exactly), "mxfp4_dequantized" (an MXFP4
#: checkpoint's experts, exactly) and "fp8_dequantized" (an FP8 checkpoint's experts, e4m3 *
#: scale rounded to bf16). A quantized run is compared with vLLM's bf16 run of
#: REFERENCE[name]; where that holds the same weights, they differ only by cpumoe's int8
#: activations (4-bit) or the bf16 rounding of the dequantized weights (FP8).
MODELS = {"qwen3_moe": ("qwen3_moe", None), "qwen3_moe_w8a8": ("qwen3_moe", "w8a8"),
          "qwen3_moe_int4_grid": ("qwen3_moe", "int4_grid"),
          "qwen3_moe_w4a8": ("qwen3_moe_int4_grid", "w4a8"),
          "qwen3_moe_w4a16": ("qwen3_moe_int4_grid", "w4a16"),
          "mixtral": ("mixtral", None), "mixtral_w8a8": ("mixtral", "w8a8"),
          "gpt_oss": ("gpt_oss", None), "gpt_oss_mxfp4": ("gpt_oss", "mxfp4"),
          "gpt_oss_mxfp4_bf16": ("gpt_oss_mxfp4", "mxfp4_dequantized"),
          "qwen3_moe_fp8": ("qwen3_moe", "fp8"),
          "qwen3_moe_fp8_compressed": ("qwen3_moe", "fp8_compressed"),
          "qwen3_moe_fp8_bf16": ("qwen3_moe_fp8", "fp8_dequantized"),
          "qwen3_moe_fp8_compressed_bf16": ("qwen3_moe_fp8_compressed", "fp8_dequantized")}
#: Served a second time by the cpumoe run with these environment settings (the checkpoint of
#: the named model, the same kind): the 4-bit layers with bf16 activations (W4A16, as their
#: checkpoints were calibrated). The vLLM run does not serve them again.
ALIASES = {"qwen3_moe_w4a16_act_bf16": "qwen3_moe_w4a16", "gpt_oss_mxfp4_act_bf16": "gpt_oss_mxfp4"}
MODEL_ENV = {name: {"CPUMOE_VLLM_W4_ACT": "bf16"} for name in ALIASES}
MODELS.update({name: MODELS[src] for name, src in ALIASES.items()})
#: The bf16 checkpoints' kinds (the rest are quantized).
BF16_KINDS = (None, "int4_grid", "mxfp4_dequantized", "fp8_dequantized")
#: The bf16 model each quantized checkpoint is compared with.
REFERENCE = {"qwen3_moe_w8a8": "qwen3_moe", "mixtral_w8a8": "mixtral",
             "qwen3_moe_w4a8": "qwen3_moe_int4_grid", "qwen3_moe_w4a16": "qwen3_moe_int4_grid",
             "gpt_oss_mxfp4": "gpt_oss_mxfp4_bf16", "qwen3_moe_fp8": "qwen3_moe_fp8_bf16",
             "qwen3_moe_fp8_compressed": "qwen3_moe_fp8_compressed_bf16"}
REFERENCE.update({name: REFERENCE[src] for name, src in ALIASES.items()})
#: Served by each backend in this order, one engine at a time, in one process per backend (the
#: two processes run side by side). mixtral_w8a8 and qwen3_moe_fp8_compressed are left out of
#: the CI run: they take the same kernel paths as qwen3_moe_w8a8 and qwen3_moe_fp8 (the
#: compressed-tensors FP8 method's parameters are covered by test_plugin.py) and an engine
#: start costs the whole suite's time budget (CPUMOE_VLLM_ALL_MODELS=1 serves them too).
ORDER = ["qwen3_moe", "mixtral", "gpt_oss", "qwen3_moe_w8a8", "qwen3_moe_int4_grid",
         "qwen3_moe_w4a8", "qwen3_moe_w4a16", "qwen3_moe_w4a16_act_bf16", "gpt_oss_mxfp4_bf16",
         "gpt_oss_mxfp4", "gpt_oss_mxfp4_act_bf16", "qwen3_moe_fp8_bf16", "qwen3_moe_fp8"] + (
    ["mixtral_w8a8", "qwen3_moe_fp8_compressed_bf16", "qwen3_moe_fp8_compressed"]
    if os.environ.get("CPUMOE_VLLM_ALL_MODELS") == "1" else [])
N_TOKENS = 16
#: Seconds for one backend's whole run at most (a hung engine fails the session, not all CI).
TIMEOUT_S = 1500


def cpumoe_serves(name: str) -> bool:
    """Whether the cpumoe-backend run serves this model: all but the bf16 references of the 4-bit
    and FP8 checkpoints (their bf16 path is the one qwen3_moe and gpt_oss cover)."""
    return MODELS[name][1] not in ("int4_grid", "mxfp4_dequantized", "fp8_dequantized")


def vllm_serves(name: str) -> bool:
    """Whether the vLLM-backend run serves this model: every bf16 one; a W8A8 one only where
    vLLM has a CPU Int8 MoE kernel (x86 with AMX, Arm, ...); W4A8 only on Arm (KleidiAI), W4A16
    MXFP4 and block FP8 (its W8A16 CPUExpertsFp8, 128x128 blocks) only on x86 with AMX, FP8
    with channel scales nowhere. Elsewhere its engine cannot start ("No Int8 MoE backend
    supports the deployment configuration", "No W4A8 Int8 MoE backend ...", "No MXFP4 MoE
    backend ...", "No FP8 MoE backend ..."), and an engine start costs more than the rest of a
    test."""
    import platform
    from cpumoe.cli.bench.vllm_engine import vllm_int8_kernel
    kind = MODELS[name][1]
    if name in ALIASES:
        return False
    if kind in BF16_KINDS:
        return True
    if kind == "w8a8":
        return bool(vllm_int8_kernel())
    if kind == "w4a8":
        return platform.machine() in ("aarch64", "arm64")
    if kind == "fp8_compressed":  # channel scales: none of vLLM's CPU FP8 experts (blocks only)
        return False
    return platform.machine() == "x86_64" and torch_has_amx()


def torch_has_amx() -> bool:
    import torch
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def save_fp8(src: Path, dst: Path) -> Path:
    """models.save_fp8 (the experts only, 128x128 blocks) with modules_to_not_convert spelled
    out module by module: vLLM matches the names exactly (no globs), and every Linear it does
    not skip gets its FP8 linear method, which vLLM 0.32's CPU backend cannot run ("Failed to
    find a kernel that can implement the ScaledMM linear layer")."""
    n = json.loads((Path(src) / "config.json").read_text())["num_hidden_layers"]
    names = ["lm_head", "model.embed_tokens"] + [
        f"model.layers.{i}.{m}" for i in range(n)
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                  "self_attn.o_proj", "mlp.gate")]
    return models.save_fp8(src, dst, linears=False, modules_to_not_convert=names)


def save_fp8_dequantized(src: Path, dst: Path) -> Path:
    """Writes ``dst``: the FP8 checkpoint ``src`` (HF fp8: ``weight_scale_inv`` blocks of
    ``weight_block_size``; compressed-tensors: ``weight_scale`` per channel, per tensor or in
    blocks of ``block_structure``) with its FP8 weights dequantized to bf16 (e4m3 * scale,
    rounded to bf16) and no quantization_config: vLLM's bf16 reference."""
    import torch
    from safetensors.torch import load_file, save_file
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    qc = config.pop("quantization_config")
    block = qc.get("weight_block_size") or next(
        (g["weights"].get("block_structure") for g in qc.get("config_groups", {}).values()),
        None)
    tensors = load_file(str(src / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.endswith((".weight_scale_inv", ".weight_scale")):
            continue
        scale = tensors.get(name + "_scale_inv", tensors.get(name + "_scale"))
        if scale is not None and t.dtype == torch.float8_e4m3fn:
            n, k = t.shape
            s = scale.float().reshape(-1, 1)  # a scale per tensor or per channel
            if block is not None and scale.numel() > 1:  # blocks
                bn, bk = block
                s = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
            t = (t.float() * s).to(torch.bfloat16)
        out[name] = t.contiguous()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


#: Checkpoint writers of this file (the rest are models.save_<kind>).
SAVERS = {"fp8": save_fp8, "fp8_dequantized": save_fp8_dequantized}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    todo = {k: v for k, v in MODELS.items() if k not in ALIASES}
    while todo:  # each after its source
        for name, (source, kind) in list(todo.items()):
            if kind is None:
                out[name] = models.save_tiny(source, root / name)
            elif source in out:
                save = SAVERS.get(kind) or getattr(models, f"save_{kind}")
                out[name] = save(out[source], root / name)
            else:
                continue
            del todo[name]
    out.update({name: out[src] for name, src in ALIASES.items()})
    return out


@pytest.fixture(scope="session")
def runs(checkpoints, tmp_path_factory):
    """{backend: {"results": {model name: result}, "log": text}} for "vllm" and "cpumoe"."""
    folder = tmp_path_factory.mktemp("runs")
    # A model's argument: its folder, and "::NAME=VALUE" per setting of MODEL_ENV (serve.py).
    arg = {k: str(v) + "".join(f"::{e}={x}" for e, x in MODEL_ENV.get(k, {}).items())
           for k, v in checkpoints.items()}
    by_dir = {a: k for k, a in arg.items()}
    t0 = time.perf_counter()
    procs = {}
    for backend in ("vllm", "cpumoe"):
        env = dict(os.environ, CPUMOE_VLLM="1" if backend == "cpumoe" else "0")
        out = folder / f"{backend}.json"
        cmd = [sys.executable, "-m", "cpumoe.vllm_plugin.serve", "--out", str(out),
               "--tokens", str(N_TOKENS)]
        serves = cpumoe_serves if backend == "cpumoe" else vllm_serves
        names = [n for n in ORDER if serves(n)]
        cmd += [arg[n] for n in names]
        logf = open(folder / f"{backend}.log", "w")
        procs[backend] = (subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT,
                                           cwd=folder), out, logf)
    results = {}
    for backend, (p, out, logf) in procs.items():
        try:
            rc = p.wait(timeout=TIMEOUT_S)
        finally:
            if p.poll() is None:
                p.kill()
            logf.close()
        log = Path(logf.name).read_text()
        if rc != 0:
            pytest.fail(f"{backend} serving failed (exit {rc}):\n{log[-6000:]}")
        results[backend] = {"log": log, "results": {
            by_dir[r["model"]]: r for r in json.loads(out.read_text())["results"]}}
    print(f"\n[tests_vllm] the two backends served {len(ORDER)} models in "
          f"{time.perf_counter() - t0:.0f} s")
    return results
