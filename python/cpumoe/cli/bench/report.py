"""The summaries of ``cpumoe bench``: speed-up ratios, the targets of issues 4, 14 (W4A8) and 15
(AMX), progress bar, plot."""

from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional, Tuple

from .. import problem
from . import kt_cpu
from .contenders import QUANT_CONTENDERS


# The quantized contenders of cpumoe at their default group (cpumoe-<format>) and at g32; the
# 4-bit ones (the W4A8 targets).
_CPUMOE_Q = [n for n in QUANT_CONTENDERS if n.startswith("cpumoe-") and not n.endswith("-g32")]
_CPUMOE_G32 = [n for n in QUANT_CONTENDERS if n.startswith("cpumoe-") and n.endswith("-g32")]

#: Speed-ups printed (a over b: median time of b / median time of a) when both ran: each
#: quantized format against W8A8, and against vLLM's and kt-kernel's kernels of the same format
#: and group (cpumoe-<x> / kt-<x> = kt's time / cpumoe's).
RATIOS = (("cpumoe-int8", "vllm-int8"), ("cpumoe-int8", "cpumoe-bf16"),
          ("cpumoe-bf16", "vllm-bf16"), ("cpumoe-int8", "vllm-bf16"),
          ("cpumoe-bf16", "vllm-bf16-sgl"), *((n, "cpumoe-int8") for n in _CPUMOE_Q),
          *((n, "cpumoe-bf16") for n in _CPUMOE_Q
            if QUANT_CONTENDERS[n][0] not in problem.FOUR_BIT),
          *((n, "vllm-" + n[len("cpumoe-"):]) for n in QUANT_CONTENDERS
            if n.startswith("cpumoe-") and "vllm-" + n[len("cpumoe-"):] in QUANT_CONTENDERS),
          *(("cpumoe-" + n[len("kt-"):], n) for n in kt_cpu.CONTENDERS),
          *((n, n[:-len("-a16")]) for n in QUANT_CONTENDERS if n.endswith("-a16")))

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


def fmt_ratios(rats, preset: str, mode: str) -> List[str]:
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


def amx_targets(rows, rats, peak: Optional[Dict[str, float]]) -> List[Dict[str, Any]]:
    """The issue-15 (AMX) targets on the Qwen3 layer, cold weights, each {target, detail, ok}
    (ok None: not measured here)."""
    qwen = "qwen3-30b-a3b"

    def pick(a: str, b: str, tokens=None):
        return [r for r in rats if r["preset"] == qwen and r["weights"] == "cold"
                and (r["a"], r["b"]) == (a, b) and r["T"] and (tokens is None or tokens(r["T"]))]

    def target(text: str, sel, need: float):
        return {"target": text,
                "detail": ", ".join(f"T={r['T']} {r['speedup']:.2f}x" for r in sel) or
                "not measured",
                "ok": all(r["speedup"] >= need for r in sel) if sel else None}

    res = [target("cpumoe int8 >= 1.25x vLLM int8 at T = 512, 2048, 4096",
                  pick("cpumoe-int8", "vllm-int8", lambda T: T in (512, 2048, 4096)), 1.25),
           target("cpumoe int8 never slower than vLLM int8", pick("cpumoe-int8", "vllm-int8"),
                  1.0),
           target("cpumoe bf16 >= vLLM bf16 at every T", pick("cpumoe-bf16", "vllm-bf16"), 1.0),
           target("cpumoe int8 >= 1.9x vLLM bf16 at T >= 128",
                  pick("cpumoe-int8", "vllm-bf16", lambda T: T >= 128), 1.9)]
    med = _medians(rows)
    big = [r for r in rows if r["preset"] == qwen and r["weights"] == "cold" and r["T"] == 4096
           and r["contender"] == "cpumoe-int8" and r.get("pct_peak") is not None
           and med[(qwen, "cold", 4096)].get("cpumoe-int8") == r["ms_median"]]
    res.append({"target": "cpumoe int8 at T=4096 >= 30% of the measured AMX int8 peak",
                "detail": (", ".join(f"{r['gops']:.0f} GOP/s = {r['pct_peak']:.1f}% of "
                                     f"{peak['int8_ops'] / 1e9:.0f} GOP/s" for r in big)
                           if big and peak else "not measured" if peak else "no AMX here"),
                "ok": all(r["pct_peak"] >= 30 for r in big) if big else None})
    return res



def w4_targets(rows) -> List[Dict[str, Any]]:
    """The issue-14 (W4A8) targets on the Qwen3 layer, cold weights, each {target, detail, ok}
    (ok None: not measured here; ``info``: reported without a target): each 4-bit op's median
    time over the int8 op's at the same point, and its weight reads against the probe."""
    qwen = "qwen3-30b-a3b"
    pts = {T: m for (p, w, T), m in _medians(rows).items() if p == qwen and w == "cold" and T}

    def time_ratio(text: str, names, tokens, need: Optional[float]) -> Dict[str, Any]:
        """need None: reported without a verdict."""
        sel = [(n, T, pts[T][n] / pts[T]["cpumoe-int8"]) for n in names for T in sorted(pts)
               if T in tokens and n in pts[T] and pts[T].get("cpumoe-int8")]
        return {"target": text,
                "detail": ", ".join(f"{n[len('cpumoe-'):]} T={T} {r:.2f}x" for n, T, r in sel)
                or "not measured",
                "ok": all(r <= need for *_, r in sel) if sel and need is not None else None,
                "info": need is None}

    w4 = [n for n in _CPUMOE_Q if QUANT_CONTENDERS[n][0] in problem.FOUR_BIT]
    what = "W4A8 (" + ", ".join(f"{QUANT_CONTENDERS[n][0]} g{QUANT_CONTENDERS[n][1]}"
                                for n in w4) + ")"
    res = [time_ratio(f"{what} time <= 0.55x W8A8's at T = 1 and 16", w4, (1, 16), 0.55),
           time_ratio(f"{what} time <= 0.65x W8A8's at T = 128", w4, (128,), 0.65)]
    res.append(time_ratio("g32 time against W8A8's (reported beside them)",
                          [n for n in _CPUMOE_G32 if QUANT_CONTENDERS[n][0] in problem.FOUR_BIT],
                          (1, 16, 128), None))
    reads = [r for r in rows if r["preset"] == qwen and r["weights"] == "cold"
             and r["contender"] in w4 and 0 < r["T"] <= 16 and r["pct_probe"] is not None]
    res.append({"target": "W4A8 weight reads (4-bit bytes and the scales) >= 90% of the probe "
                          "at T <= 16",
                "detail": ", ".join(f"{r['contender'][len('cpumoe-'):]} T={r['T']} "
                                    f"{r['weights_gbs']:.1f} GB/s = {r['pct_probe']:.0f}%"
                                    for r in reads) or "not measured",
                "ok": all(r["pct_probe"] >= 90 for r in reads) if reads else None})
    return res

# ---------------------------------------------------------------------------- output helpers
def progress(total: int, enabled: bool):
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
