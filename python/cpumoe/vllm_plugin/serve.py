"""Greedy generation through ``vllm.LLM`` for the plugin's tests, one process per backend.

``python -m cpumoe.vllm_plugin.serve --out result.json MODEL_DIR [MODEL_DIR ...]`` serves each
checkpoint in turn (bf16, eager, no tokenizer), generates ``--tokens`` tokens greedily for a few
fixed random prompts, and writes per model: the generated ids, the top logprobs of every step,
and what the worker process reports (its pid, the experts class of each MoE layer, cpumoe's
per-layer path and call counts). Whether cpumoe is used is the caller's ``CPUMOE_VLLM``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Dict, List

#: Defaults of the tests' engine (small KV cache and context: 2-core CI machine).
ENGINE_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
              "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def prompts(vocab: int, n: int = 4, seed: int = 0) -> List[List[int]]:
    """``n`` random prompts of 5..(5 + 7(n - 1)) token ids below ``vocab`` (fixed by seed)."""
    import random
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(5 + 7 * i)] for i in range(n)]


def worker_report(model: Any) -> Dict[str, Any]:
    """Runs in vLLM's worker (``LLM.apply_model``): pid, experts class per MoE layer, and
    cpumoe's per-layer stats when the plugin is on."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    experts = {}
    for _, m in model.named_modules():
        if isinstance(m, RoutedExperts):
            kernel = getattr(m.quant_method, "moe_kernel", None)
            fe = getattr(kernel, "fused_experts", None)
            experts[m.layer_name] = type(fe).__name__ if fe is not None else None
    report: Dict[str, Any] = {"pid": os.getpid(), "experts": experts, "cpumoe": None}
    if "cpumoe.vllm_plugin.layer" in sys.modules:
        report["cpumoe"] = sys.modules["cpumoe.vllm_plugin.layer"].stats()
    return report


def serve(model: str, n_tokens: int = 16, n_prompts: int = 4,
          logprobs: int = 5) -> Dict[str, Any]:
    """Greedy generation of one checkpoint; the result dict described in the module doc.
    ``model``: its folder, optionally followed by "::NAME=VALUE" environment settings for this
    model's engine only (e.g. "::CPUMOE_VLLM_W4_ACT=bf16"). (vLLM's CPU platform runs the worker
    in a process of its own, always; it inherits them.)"""
    model_dir, *settings = model.split("::")
    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    saved = {}
    for kv in settings:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            raise ValueError(f"{model}: expected FOLDER[::NAME=VALUE ...], got {kv!r}")
        saved[k] = os.environ.get(k)
        os.environ[k] = v
    try:
        result = _serve(model_dir, n_tokens, n_prompts, logprobs)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    result["model"] = model
    return result


def _serve(model_dir: str, n_tokens: int, n_prompts: int, logprobs: int) -> Dict[str, Any]:
    import vllm
    # By module, not __main__'s copy: the function is pickled by reference for the worker.
    from cpumoe.vllm_plugin.serve import worker_report as report_fn
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    t0 = time.perf_counter()
    llm = vllm.LLM(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16",
                   max_model_len=256, enforce_eager=True, seed=0)
    t_up = time.perf_counter() - t0
    params = vllm.SamplingParams(temperature=0.0, max_tokens=n_tokens, ignore_eos=True,
                                 logprobs=logprobs, detokenize=False)
    ps = prompts(vocab, n_prompts)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    t_gen = time.perf_counter() - t0
    result = {"model": model_dir, "prompts": ps, "engine_up_s": t_up, "generate_s": t_gen,
              "tokens": [], "logprobs": [], "worker": llm.apply_model(report_fn),
              "client_pid": os.getpid()}
    for out in outs:
        c = out.outputs[0]
        result["tokens"].append(list(c.token_ids))
        # Per step: {token id: logprob} of the top candidates (and the chosen token).
        result["logprobs"].append([{str(t): float(lp.logprob) for t, lp in step.items()}
                                   for step in (c.logprobs or [])])
    del llm
    return result


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cpumoe.vllm_plugin.serve", description=__doc__)
    ap.add_argument("models", nargs="+",
                    help="checkpoint folders, each optionally FOLDER::NAME=VALUE[::...]: "
                         "environment settings for that model's engine")
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--may-fail", action="append", default=[], metavar="MODEL",
                    help="a model whose engine may fail to start: its error is recorded")
    args = ap.parse_args(argv)
    results = []
    for m in args.models:
        try:
            results.append(serve(m, args.tokens, args.prompts))
        except Exception as e:  # noqa: BLE001 - recorded for the caller, who decides
            if m not in args.may_fail:
                raise
            results.append({"model": m, "error": f"{type(e).__name__}: {e}"})
    with open(args.out, "w") as f:
        json.dump({"cpumoe_vllm": os.environ.get("CPUMOE_VLLM", ""), "results": results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
