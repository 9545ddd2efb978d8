"""End-to-end benchmark: vLLM offline with its own CPU MoE backend against cpumoe's plugin.

``python -m cpumoe.cli.bench.vllm_engine`` writes a random model of Qwen3-30B-A3B's width (H 2048,
128 experts of I 768, top-8, 32 heads, vocabulary cut to 2048) with ``--layers`` layers, in bf16,
W8A8 (compressed-tensors int8 experts) and, with ``--checkpoints w4a8,...``, W4A8 (int4 experts,
g 128), then for each checkpoint serves it through
``vllm.LLM`` (bf16 activations, eager) once per backend and round, the backends alternating
(``--rounds``), each engine in a fresh process, and measures:

* prefill: one prompt of ``--prefill`` tokens, generating 1 token (tokens/s);
* decode at batch 1 and 8: ``--decode`` tokens after a 16-token prompt, the time of the run
  minus that of the same prompts generating 1 token (tokens/s over the batch);
* where the time goes: the seconds spent in the MoE layers' experts (``forward_modular`` of
  vLLM's RoutedExperts, timed in the worker: prepare, experts kernel, finalize; not the router)
  against the whole, per phase.

Medians over the rounds are reported as a markdown table (and ``--json``). A backend that cannot
serve a checkpoint on this CPU (vLLM has no Int8 MoE kernel on x86 without AMX) is reported as
such. Memory: the experts are 8 x 128 x 3 x 2048 x 768 bytes = 4.8 GB at int8, 9.7 GB at bf16
(W4A8's checkpoint stores its int4 values in int8 bytes too; packed, they take half).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

from cpumoe.vllm_plugin.serve import ENGINE_ENV

_MOE_T: Dict[str, float] = {}


# ---------------------------------------------------------------------------- in the worker
def install_timers(model: Any) -> int:
    """(worker, through ``LLM.apply_model``) Times every MoE layer's ``forward_modular``."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    n = 0
    for _, m in model.named_modules():
        if isinstance(m, RoutedExperts) and "forward_modular" not in m.__dict__:
            inner = m.forward_modular

            def timed(*a, _inner=inner, **kw):
                t0 = time.perf_counter()
                try:
                    return _inner(*a, **kw)
                finally:
                    _MOE_T["s"] = _MOE_T.get("s", 0.0) + time.perf_counter() - t0
            m.forward_modular = timed
            n += 1
    return n


def moe_seconds(model: Any, reset: bool = True) -> float:
    """(worker) Seconds in the MoE layers since the last reset."""
    s = _MOE_T.get("s", 0.0)
    if reset:
        _MOE_T["s"] = 0.0
    return s


def experts_classes(model: Any) -> List[str]:
    from cpumoe.vllm_plugin.serve import worker_report
    return sorted(set(str(c) for c in worker_report(model)["experts"].values()))


# ---------------------------------------------------------------------------- one engine
def measure(model_dir: str, prefill: int, decode: int, batches: List[int],
            repeats: int) -> Dict[str, Any]:
    """Starts one engine on ``model_dir`` and measures (in this process)."""
    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    import vllm
    from cpumoe.cli.bench import vllm_engine as me  # by module: pickled by reference for the worker
    t0 = time.perf_counter()
    llm = vllm.LLM(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16",
                   max_model_len=max(1024, prefill + 64), enforce_eager=True, seed=0,
                   max_num_seqs=max(batches + [1]), max_num_batched_tokens=max(prefill, 2048))
    up = time.perf_counter() - t0
    (classes,) = llm.apply_model(me.experts_classes)
    llm.apply_model(me.install_timers)
    vocab = 2048

    def run(prompts: List[List[int]], n: int) -> tuple:
        params = vllm.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                                     detokenize=False)
        llm.apply_model(me.moe_seconds)  # reset
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - t
        (moe,) = llm.apply_model(me.moe_seconds)
        return wall, moe

    def ids(n: int, seed: int) -> List[int]:
        return [(seed * 7919 + 31 * i) % vocab for i in range(n)]

    run([ids(32, 99)], 4)  # warm-up
    out: Dict[str, Any] = {"engine_up_s": up, "experts": classes}
    pf = [run([ids(prefill, r)], 1) for r in range(repeats)]
    w, m = min(pf)
    out["prefill"] = {"tok_s": prefill / w, "s": w, "moe_s": m}
    for b in batches:
        samples = []
        for r in range(repeats):
            prompts = [ids(16, 100 + 10 * r + i) for i in range(b)]
            w1, m1 = run(prompts, 1)
            wn, mn = run(prompts, decode + 1)
            step = (wn - w1) / decode
            samples.append((step, (mn - m1) / decode))
        step, moe = min(samples)
        out[f"decode_b{b}"] = {"tok_s": b / step, "step_ms": 1e3 * step, "moe_ms": 1e3 * moe}
    del llm
    return out


# ---------------------------------------------------------------------------- the driver
def vllm_int8_kernel() -> str:
    """The name of a CPU Int8 MoE experts class of vLLM's that runs on this CPU, or "" (then
    vLLM cannot serve a W8A8 MoE checkpoint here: its engine fails at start-up with "No Int8 MoE
    backend supports the deployment configuration"). Imports vLLM."""
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe as c
    for k in (c.ZenCPUExpertsInt8, c.PowerCPUExpertsInt8, c.ArmCPUExpertsInt8, c.CPUExpertsInt8):
        if k._supports_current_device():
            return k.__name__
    return ""


def _has_vllm_int8() -> bool:
    """vllm_int8_kernel() in a child process (the driver does not import vLLM itself)."""
    code = "from cpumoe.cli.bench.vllm_engine import vllm_int8_kernel as k; print(k() or '-')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    lines = out.stdout.split()
    return bool(lines) and lines[-1] != "-"


def _run_child(backend: str, model_dir: Path, args, log: Path) -> Dict[str, Any]:
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    env = dict(os.environ, CPUMOE_VLLM="1" if backend == "cpumoe" else "0")
    cmd = [sys.executable, "-m", "cpumoe.cli.bench.vllm_engine", "--child", str(model_dir),
           "--out", str(out), "--prefill", str(args.prefill), "--decode", str(args.decode),
           "--batches", args.batches, "--repeats", str(args.repeats)]
    with open(log, "a") as f:
        f.write(f"\n##### {backend} {model_dir}\n")
        f.flush()
        rc = subprocess.call(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
        text = log.read_text()
        reason = "engine failed"
        if "No Int8 MoE backend supports" in text.rsplit("#####", 1)[-1]:
            reason = "no Int8 MoE kernel of vLLM's for this CPU"
        return {"error": reason}
    res = json.loads(out.read_text())
    out.unlink()
    return res


def _med(xs: List[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def table(results: Dict[str, Dict[str, List[Dict[str, Any]]]], batches: List[int],
          prefill: int) -> str:
    cols = [f"prefill {prefill} tok/s"] + [f"decode b{b} tok/s" for b in batches] + \
           [f"b1 step ms (MoE ms)"] + [f"prefill MoE share"]
    lines = ["| checkpoint | backend (experts) | " + " | ".join(cols) + " |",
             "|---" * (len(cols) + 2) + "|"]
    for ck, by_backend in results.items():
        for backend, runs in by_backend.items():
            ok = [r for r in runs if "error" not in r]
            if not ok:
                lines.append(f"| {ck} | {backend} | " + " | ".join(
                    [runs[0]["error"]] + [""] * (len(cols) - 1)) + " |")
                continue
            cells = [f"{_med([r['prefill']['tok_s'] for r in ok]):.0f}"]
            cells += [f"{_med([r[f'decode_b{b}']['tok_s'] for r in ok]):.1f}" for b in batches]
            b1 = f"decode_b{batches[0]}"
            cells.append(f"{_med([r[b1]['step_ms'] for r in ok]):.1f} "
                         f"({_med([r[b1]['moe_ms'] for r in ok]):.1f})")
            cells.append(f"{_med([r['prefill']['moe_s'] / r['prefill']['s'] for r in ok]):.0%}")
            lines.append(f"| {ck} | {backend} ({', '.join(ok[0]['experts'])}) | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cpumoe.cli.bench.vllm_engine",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dir", default=None, help="checkpoint folder (kept; default: a temp dir)")
    ap.add_argument("--checkpoints", default="w8a8,bf16", help="of bf16, w8a8, w4a8")
    ap.add_argument("--backends", default="vllm,cpumoe")
    ap.add_argument("--rounds", type=int, default=2, help="engine starts per backend")
    ap.add_argument("--repeats", type=int, default=3, help="measurements per engine (best)")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--threads", default="",
                    help="VLLM_CPU_OMP_THREADS_BIND for the engines (default: all cores, no "
                         "reserved core)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        res = measure(args.child, args.prefill, args.decode, batches, args.repeats)
        Path(args.out).write_text(json.dumps(res))
        return 0

    from cpumoe.testing import models
    if not args.threads:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    else:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.threads
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="cpumoe-vllm-bench-"))
    log = root / "bench.log"
    cks = args.checkpoints.split(",")
    results: Dict[str, Dict[str, List[Dict[str, Any]]]] = {}
    for ck in cks:
        folder = root / f"qwen3-{args.layers}l-{ck}"
        if not (folder / "config.json").exists():
            t0 = time.perf_counter()
            models.save_qwen3_bench(folder, None if ck == "bf16" else ck,
                                    num_layers=args.layers)
            print(f"[bench] wrote {folder} ({models.checkpoint_bytes(folder) / 1e9:.1f} GB) in "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
        results[ck] = {b: [] for b in args.backends.split(",")}
        if ck == "w8a8" and "vllm" in results[ck] and not _has_vllm_int8():
            results[ck]["vllm"].append({"error": "no Int8 MoE kernel of vLLM's for this CPU"})
        if ck == "w4a8" and "vllm" in results[ck] and platform.machine() not in ("aarch64",
                                                                                  "arm64"):
            results[ck]["vllm"].append({"error": "no W4A8 MoE kernel of vLLM's off Arm"})
        for r in range(args.rounds):
            for backend in results[ck]:
                if any("error" in x for x in results[ck][backend]):
                    continue  # it cannot serve this checkpoint here: once is enough
                t0 = time.perf_counter()
                res = _run_child(backend, folder, args, log)
                results[ck][backend].append(res)
                print(f"[bench] {ck} {backend} round {r}: "
                      f"{json.dumps(res)} ({time.perf_counter() - t0:.0f} s)", flush=True)
    text = table(results, batches, args.prefill)
    print(f"\nQwen3-30B-A3B width, {args.layers} layers, vocab 2048, bf16 activations, "
          f"enforce_eager, {os.cpu_count()} cores; medians of {args.rounds} engine(s) per backend, "
          f"best of {args.repeats} per engine\n")
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
