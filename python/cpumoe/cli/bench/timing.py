"""The timing of ``cpumoe bench``: alternating calls, the bandwidth and GEMM probes, table rows."""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from .contenders import Contender  # noqa: F401 (annotations)


MIN_CALLS, MAX_CALLS = 3, 200


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
               reps: int = 5, budget_s: float = 0.05) -> Optional[float]:
    """GOP/s of one big GEMM in torch (oneDNN), best of ``reps``: int8 ``torch._int_mm`` or bf16
    ``mm``; what this CPU reaches on compute-bound work (the best call: the least disturbed on a
    shared machine), the yardstick for prefill. None if unsupported.

    The row count starts at 16 and doubles up to ``M`` while one call takes under ``budget_s``:
    a CPU without native bf16 runs torch's bf16 ``mm`` in a slow fallback (16 s for 512x2048x2048
    on an AVX2 EPYC), and the probe must not cost more than the benchmark it frames."""
    try:
        if dtype == "int8":
            b = torch.randint(-127, 128, (K, N), dtype=torch.int8)
            make = lambda m: torch.randint(-127, 128, (m, K), dtype=torch.int8)  # noqa: E731
            mm = torch._int_mm
        else:
            b = torch.randn(K, N, dtype=torch.bfloat16)
            make = lambda m: torch.randn(m, K, dtype=torch.bfloat16)  # noqa: E731
            mm = torch.mm
        m = min(16, M)
        while True:
            a = make(m)
            mm(a, b)  # a shape's first call (oneDNN's code generation) is not the one timed
            t = time.perf_counter()
            mm(a, b)
            if m >= M or time.perf_counter() - t >= budget_s:
                break
            m = min(2 * m, M)
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            mm(a, b)
            ts.append(time.perf_counter() - t)
    except (RuntimeError, AttributeError):
        return None
    return 2 * m * K * N / min(ts) / 1e9


def amx_peak(threads: int) -> Optional[Dict[str, float]]:
    """The AMX tile units' peak on ``threads`` threads (cpumoe's tile-only loop, best of two
    short runs), {'int8_ops', 'bf16_flops'} per second; None without AMX."""
    import cpumoe
    runs = [cpumoe._C.amx_peak(max(1, threads), 0.1) for _ in range(2)]
    runs = [r for r in runs if r]
    if not runs:
        return None
    return {k: max(r[k] for r in runs) for k in ("int8_ops", "bf16_flops")}


def fmt_peak(peak: Optional[Dict[str, float]], threads: int) -> str:
    if not peak:
        return "amx peak - (this CPU or build has no AMX)"
    return (f"amx peak int8 {peak['int8_ops'] / 1e12:.2f} TOP/s, bf16 "
            f"{peak['bf16_flops'] / 1e12:.2f} TFLOP/s (tile-only loop, {threads} threads)")


def pct_of_peak(r: Dict[str, Any], peak: Optional[Dict[str, float]]) -> Optional[float]:
    """A row's GOP/s as a share of the AMX peak of its arithmetic (bf16 contenders: bf16)."""
    if not peak or not r["T"]:
        return None
    key = "bf16_flops" if "bf16" in r["contender"] else "int8_ops"
    return 100 * r["gops"] * 1e9 / peak[key]


def l3_bytes() -> Optional[int]:
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            s = f.read().strip()
    except OSError:
        return None
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(s[-1:], 1)
    return int(s.rstrip("KMG")) * mult if s.rstrip("KMG").isdigit() else None


def caller(c: Contender, x, routes, out_t) -> Callable[[int], float]:
    """Call n of contender ``c`` (routing n mod their count), answering its seconds: timed here,
    or where the contender runs (``c.timed``: another process, which times the call itself)."""
    if c.timed is not None:
        return c.timed

    def call(n: int) -> float:
        ids, wts = routes[n % len(routes)]
        t = time.perf_counter()
        c.fn(x, wts, ids, out_t)
        return time.perf_counter() - t
    return call


def measure(calls: Dict[str, Callable[[int], float]], probe: Optional[ReadProbe], warmup: int,
            iters: Optional[int], seconds: float, rounds: int, warm: bool,
            min_calls: int = MIN_CALLS, max_calls: int = MAX_CALLS,
            pauses: Optional[Dict[str, float]] = None
            ) -> Tuple[Dict[str, List[float]], List[float]]:
    """Times the contenders alternating: ``rounds`` rounds, each running every contender's share
    of its calls (rotated order; in warm mode after one untimed call that brings its experts
    back into the caches) and one probe read. ``calls[k](n)`` makes call n, returns seconds.
    ``pauses[k]``: seconds to idle after contender k's turn (its threads spin a while after a
    call and would take a core from the next one)."""
    count = dict.fromkeys(calls, 0)
    pauses = pauses or {}

    def pause(k: str) -> None:
        if pauses.get(k, 0) > 0:
            time.sleep(pauses[k])

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
        if count[k]:
            pause(k)
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
            if n:
                pause(k)
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
        "experts_read": experts, "weight_bytes": c.weight_bytes, "calls": len(times),
        "pct_peak": None,
        "check_rel": None if c.check is None else c.check[1],
        "check_ok": None if c.check is None else c.check[0],
    }


TABLE_HEAD = (f"{'T':>6}  {'contender':<13} {'kernel':<40} {'ms/call med':>11} "
              f"{'ms/call min':>11} {'tokens/s':>10} {'weights GB/s':>12} {'%probe':>6} "
              f"{'GOP/s':>7} {'%peak':>6} {'calls':>5}")


def fmt_row(r: Dict[str, Any]) -> str:
    pct = f"{r['pct_probe']:>6.0f}" if r["pct_probe"] is not None else f"{'-':>6}"
    peak = f"{r['pct_peak']:>6.1f}" if r.get("pct_peak") is not None else f"{'-':>6}"
    return (f"{r['T']:>6}  {r['label']:<13} {r['kernel']:<40} {r['ms_median']:>11.3f} "
            f"{r['ms_min']:>11.3f} {r['tokens_per_s']:>10.0f} {r['weights_gbs']:>12.2f} {pct} "
            f"{r['gops']:>7.1f} {peak} {r['calls']:>5}")


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
    for c in conts:
        if c.prepare is not None:
            c.prepare(x, used)
    calls = {c.label: caller(c, x, routes, lib.tensor(np.zeros((T, layer.H), np.float32),
                                                      layer.dtype)) for c in conts}
    times, ptimes = measure(calls, probe, warmup, iters, seconds, rounds, mode == "warm",
                            min_calls, max_calls, {c.label: c.pause for c in conts if c.pause})
    pgbs = probe.gbs(ptimes) if probe is not None and ptimes else None
    return [row(layer, mode, T, c, times[c.label], experts, pgbs) for c in conts], ptimes
