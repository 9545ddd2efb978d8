"""``python -m cpumoe`` / ``cpumoe``: check and time the fused W8A8 MoE op on this CPU.

With no arguments it runs the Qwen3-30B-A3B MoE layer (H=2048, I=768, E=128, top-8, silu) with
random int8 experts at T = 1, 16, 128 tokens: first each result against cpumoe.reference (exit
code 1 if one is outside the tolerance), then the timing table. See ``--help`` for the knobs.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time
from typing import List, Optional

import numpy as np

# Same tolerance as the tests (tests_py/conftest.py): |err| <= TOL * max|ref| + TOL * |ref|.
# The int8 requantization between the GEMMs makes last-bit differences jump by up to ~1% of
# the output scale; real bugs are off by O(1).
TOLERANCE = 2e-2

PRESETS = {
    # name: (H, I, E, k, activation, bias)
    "qwen3-30b-a3b": (2048, 768, 128, 8, "silu", False),
    "gpt-oss-20b": (2880, 2880, 32, 4, "swigluoai", True),
    "mixtral": (4096, 14336, 8, 2, "silu", False),
}
DTYPE_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16",
                 "float16": "float16", "half": "float16", "fp32": "float32",
                 "float32": "float32", "float": "float32"}


def _positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _token_list(s: str) -> List[int]:
    try:
        out = [int(t) for t in s.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of ints, got {s!r}")
    if not out or any(t < 0 for t in out):
        raise argparse.ArgumentTypeError(f"expected token counts >= 0, got {s!r}")
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cpumoe",
        description="Check the fused W8A8 int8 MoE op against the reference, then time it. "
                    "Default problem: the Qwen3-30B-A3B MoE layer with random int8 experts.")
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-30b-a3b",
                   help="layer shape to start from (default: %(default)s)")
    p.add_argument("--tokens", type=_token_list, default=[1, 16, 128],
                   help="comma-separated token counts T (default: 1,16,128)")
    p.add_argument("--iters", type=_positive_int, default=None,
                   help="timed calls per T (default: about 2 s worth, 5 to 50)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls first (default: 2)")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="threads for the op (default: torch's count with torch, else OpenMP's)")
    p.add_argument("--isa", default=None,
                   help="cap the kernel path, e.g. portable (default: best this CPU runs, "
                        "capped by CPUMOE_ISA)")
    p.add_argument("--hidden", type=_positive_int, help="H, hidden size")
    p.add_argument("--inter", type=_positive_int, help="I, intermediate size per expert")
    p.add_argument("--experts", type=_positive_int, help="E, number of experts")
    p.add_argument("--topk", type=_positive_int, help="k, experts per token")
    p.add_argument("--activation", choices=("silu", "gelu", "gelu_tanh", "swigluoai"))
    p.add_argument("--bias", action=argparse.BooleanOptionalAction, default=None,
                   help="random biases b13/b2 (default: per preset)")
    p.add_argument("--dtype", choices=sorted(DTYPE_ALIASES), default=None,
                   help="activation dtype (default: bfloat16 with torch, float32 without)")
    p.add_argument("--backend", choices=("auto", "torch", "numpy"), default="auto",
                   help="tensor library (default: torch if it imports)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-check", action="store_true", help="skip the check against the reference")
    return p


# ---------------------------------------------------------------------------- tensors
class _Lib:
    """The few tensor operations needed, on torch or numpy."""

    def __init__(self, name: str):
        self.name = name
        self.torch = None
        if name == "torch":
            import torch
            self.torch = torch

    def dtype(self, name: str):
        if self.torch is not None:
            return getattr(self.torch, name)
        if name == "bfloat16":
            try:
                import ml_dtypes
            except ImportError:
                raise SystemExit("cpumoe: bfloat16 without torch needs ml_dtypes "
                                 "(pip install ml_dtypes), or use --dtype float32")
            return np.dtype(ml_dtypes.bfloat16)
        return np.dtype(name)

    def tensor(self, a: np.ndarray, dtype: Optional[str] = None):
        """numpy (writable, contiguous) -> this library, optionally cast."""
        if self.torch is not None:
            t = self.torch.from_numpy(np.ascontiguousarray(a))
            return t if dtype is None else t.to(self.dtype(dtype))
        return a if dtype is None else a.astype(self.dtype(dtype))

    def numpy32(self, t) -> np.ndarray:
        if self.torch is not None:
            return t.to(self.torch.float32).numpy()
        return np.asarray(t, dtype=np.float32)


def _pick_lib(choice: str) -> _Lib:
    if choice == "numpy":
        return _Lib("numpy")
    try:
        import torch  # noqa: F401
    except ImportError:
        if choice == "torch":
            raise SystemExit("cpumoe: --backend torch, but torch does not import")
        return _Lib("numpy")
    return _Lib("torch")


def _default_threads(lib: _Lib) -> int:
    if lib.torch is not None:
        return int(lib.torch.get_num_threads())
    env = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# ---------------------------------------------------------------------------- the problem
def make_weights(E: int, H: int, I: int, bias: bool, seed: int, threads: int):
    """Random int8 experts as checkpoints make them: N(0, 1/sqrt(fan_in)) float weights,
    quantized per output channel (cpumoe.quantize_per_channel), one expert at a time (so the
    float temporaries stay small) on ``threads`` threads; expert e's values depend only on
    (seed, e). Biases N(0, 0.1) fp32 when ``bias``. numpy arrays."""
    from .reference import quantize_per_channel

    w13 = np.empty((E, 2 * I, H), np.int8)
    w2 = np.empty((E, H, I), np.int8)
    s13 = np.empty((E, 2 * I), np.float32)
    s2 = np.empty((E, H), np.float32)

    def one(e: int) -> None:
        rng = np.random.default_rng([seed, e])
        w13[e], s13[e] = quantize_per_channel(
            rng.standard_normal((2 * I, H), dtype=np.float32) * np.float32(H ** -0.5))
        w2[e], s2[e] = quantize_per_channel(
            rng.standard_normal((H, I), dtype=np.float32) * np.float32(I ** -0.5))

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        list(pool.map(one, range(E)))  # numpy releases the GIL in its loops
    b13 = b2 = None
    if bias:
        rng = np.random.default_rng([seed, E, 1])
        b13 = (rng.standard_normal((E, 2 * I)) * 0.1).astype(np.float32)
        b2 = (rng.standard_normal((E, H)) * 0.1).astype(np.float32)
    return w13, w2, s13, s2, b13, b2


def make_routing(rng: np.random.Generator, T: int, E: int, k: int):
    """k distinct experts per token (a random permutation's first k) and softmax weights."""
    ids = np.argsort(rng.random((T, E)), axis=1)[:, :k].astype(np.int32)
    logits = rng.standard_normal((T, k))
    w = np.exp(logits - logits.max(axis=1, keepdims=True)) if T else logits
    w = (w / w.sum(axis=1, keepdims=True)) if T else w
    return ids, w.astype(np.float32)


def check_one(lib: _Lib, out, ref):
    """(ok, max|err| / scale) with the tests' tolerance."""
    o, r = lib.numpy32(out).astype(np.float64), lib.numpy32(ref).astype(np.float64)
    if o.size == 0:
        return True, 0.0
    if not np.isfinite(o).all():
        return False, float("inf")
    scale = float(np.abs(r).max())
    err = np.abs(o - r)
    ok = bool((err <= TOLERANCE * scale + TOLERANCE * np.abs(r)).all())
    return ok, float(err.max() / scale) if scale > 0 else float(err.max())


def _fmt_features(f: dict) -> str:
    on = [k for k, v in f.items() if k != "arch" and v is True]
    return f"{f.get('arch', '?')}: {' '.join(on) if on else '(no SIMD features used by cpumoe)'}"


# ---------------------------------------------------------------------------- main
def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    import cpumoe

    H, I, E, k, activation, bias = PRESETS[args.preset]
    H = args.hidden or H
    I = args.inter or I
    E = args.experts or E
    k = args.topk or k
    activation = args.activation or activation
    bias = bias if args.bias is None else args.bias
    if k > E:
        print(f"cpumoe: --topk {k} exceeds --experts {E}", file=sys.stderr)
        return 2
    lib = _pick_lib(args.backend)
    dtype = DTYPE_ALIASES[args.dtype] if args.dtype else (
        "bfloat16" if lib.torch is not None else "float32")
    threads = args.threads or _default_threads(lib)
    out = sys.stdout

    custom = any(v is not None for v in (args.hidden, args.inter, args.experts, args.topk))
    name = f"{args.preset} (modified)" if custom else args.preset
    print(f"cpumoe {cpumoe.__version__}: W8A8 fused MoE, {name} layer: H={H} I={I} E={E} "
          f"top-{k} {activation}{' +bias' if bias else ''}, {dtype} ({lib.name})", file=out)
    print(f"cpu      {_fmt_features(cpumoe.cpu_features())}", file=out)
    try:
        paths = cpumoe.available_paths()
        chosen = cpumoe.selected_path(args.isa)
    except ValueError as e:
        print(f"cpumoe: {e}", file=sys.stderr)
        return 2
    print(f"paths    {', '.join(paths)} (selected: {chosen}"
          f"{', capped by --isa ' + args.isa if args.isa else ''}"
          f"{', CPUMOE_ISA=' + os.environ['CPUMOE_ISA'] if os.environ.get('CPUMOE_ISA') else ''})",
          file=out)
    print(f"threads  {threads}", file=out)

    t0 = time.perf_counter()
    w13n, w2n, s13n, s2n, b13n, b2n = make_weights(E, H, I, bias, args.seed, threads)
    t_gen = time.perf_counter() - t0
    w13, w2, s13, s2 = (lib.tensor(a) for a in (w13n, w2n, s13n, s2n))
    b13 = lib.tensor(b13n) if b13n is not None else None
    b2 = lib.tensor(b2n) if b2n is not None else None
    t0 = time.perf_counter()
    try:
        packed = cpumoe.prepack(w13, w2, s13, s2, b13, b2, isa=args.isa, num_threads=threads)
    except (ValueError, TypeError) as e:
        print(f"cpumoe: {e}", file=sys.stderr)
        return 2
    t_pack = time.perf_counter() - t0
    expert_bytes = 3 * H * I  # int8 w13 + w2 of one expert
    print(f"weights  {E * expert_bytes / 1e6:.1f} MB int8 (made in {t_gen:.1f} s); packed "
          f"{packed.packed_bytes / 1e6:.1f} MB in {t_pack:.2f} s for {packed.path} "
          f"({packed.kernel})", file=out)

    rng = np.random.default_rng([args.seed, 12345])
    problems = {}
    for T in args.tokens:
        x = lib.tensor(rng.standard_normal((T, H), dtype=np.float32), dtype)
        problems[T] = (x, [make_routing(rng, T, E, k) for _ in range(16)])

    failed = False
    if not args.no_check:
        print(f"check    against cpumoe.reference (pass: |err| <= {TOLERANCE:g} * scale + "
              f"{TOLERANCE:g} * |ref|, scale = max|ref|)", file=out)
        for T, (x, routings) in problems.items():
            ids, wts = routings[0]
            ids_t, wts_t = lib.tensor(ids), lib.tensor(wts)
            got = cpumoe.fused_moe_int8(x, packed, wts_t, ids_t, activation,
                                        num_threads=threads)
            t0 = time.perf_counter()
            ref = cpumoe.reference.ref_fused_moe_int8(x, w13, w2, s13, s2, wts_t, ids_t,
                                                      activation, b13=b13, b2=b2)
            t_ref = time.perf_counter() - t0
            ok, rel = check_one(lib, got, ref)
            failed |= not ok
            print(f"  T={T:<5d} max|err|/scale = {rel:.2e}  {'PASS' if ok else 'FAIL'}"
                  f"  (reference {t_ref:.2f} s)", file=out)

    print(f"timing   median and min of the timed calls after {args.warmup} warm-up; each call "
          f"routes anew (16 routings per T), so the experts read change from call to call",
          file=out)
    head = (f"{'T':>6}  {'path':<12} {'kernel':<34} {'ms/call med':>11} {'ms/call min':>11} "
            f"{'tokens/s':>10} {'weights GB/s':>12} {'calls':>5}")
    print(head, file=out)
    for T, (x, routings) in problems.items():
        calls = [(lib.tensor(i), lib.tensor(w)) for i, w in routings]
        touched = np.mean([len(np.unique(i)) for i, _ in routings]) * expert_bytes
        result = lib.tensor(np.zeros((T, H), np.float32), dtype)

        def call(n: int) -> float:
            ids_t, wts_t = calls[n % len(calls)]
            t = time.perf_counter()
            cpumoe.fused_moe_int8(x, packed, wts_t, ids_t, activation, out=result,
                                  num_threads=threads)
            return time.perf_counter() - t

        n = 0
        first = None
        for _ in range(max(0, args.warmup)):
            first = call(n)
            n += 1
        if args.iters is not None:
            iters = args.iters
        else:
            if first is None:
                first = call(n)
                n += 1
            iters = int(min(50, max(5, round(2.0 / max(first, 1e-6)))))
        times = [call(n + i) for i in range(iters)]
        med, best = float(np.median(times)), float(np.min(times))
        tps = T / med if med > 0 else float("inf")
        gbs = touched / med / 1e9 if med > 0 and T else 0.0
        print(f"{T:>6}  {packed.path:<12} {packed.kernel:<34} {med * 1e3:>11.3f} "
              f"{best * 1e3:>11.3f} {tps:>10.0f} {gbs:>12.2f} {iters:>5}", file=out)

    if failed:
        print("FAIL: the op is outside the tolerance of the reference", file=out)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
