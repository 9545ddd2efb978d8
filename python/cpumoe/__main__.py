"""``python -m cpumoe`` / ``cpumoe``: check, time and describe the fused W8A8 MoE op on this CPU.

Subcommands:

- ``cpumoe check``: correctness of every path this CPU runs against cpumoe.reference: a matrix
  of small cases (dtypes x activations x bias, expert_map, skip_weighted, int64 ids, strided
  rows, T = 0), then the preset layer; exit code 1 on a failure.
- ``cpumoe bench`` (cpumoe/bench.py): times preset layers for each path and T, and side by side
  cpumoe's bf16 op and vLLM's CPU kernels (``--contenders``), cold and warm weights, against a
  read-bandwidth probe (tqdm progress bar, tables and ratios on stdout, ``--json out.json``,
  ``--plot out.png`` with matplotlib, ``--targets`` for issue 4's matrix and verdicts).
- ``cpumoe info``: CPU features, paths, kernels, build (``--json`` for a machine-readable form).

With no subcommand (the original command line, all its flags kept) it runs the Qwen3-30B-A3B MoE
layer (H=2048, I=768, E=128, top-8, silu) with random int8 experts at T = 1, 16, 128: each result
on every path against the reference, then a short timing table of the selected path.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.metadata
import json
import os
import platform
import sys
import time
from typing import Any, Dict, List, Optional

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
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swigluoai")
DEFAULT_PRESET = "qwen3-30b-a3b"
SUBCOMMANDS = ("check", "bench", "info")
BENCH_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128]


def _positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _positive_float(s: str) -> float:
    v = float(s)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {s}")
    return v


def _token_list(s: str) -> List[int]:
    try:
        out = [int(t) for t in s.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of ints, got {s!r}")
    if not out or any(t < 0 for t in out):
        raise argparse.ArgumentTypeError(f"expected token counts >= 0, got {s!r}")
    return out


def _name_list(choices, all_value, what: str):
    """An argparse type: comma-separated names from ``choices``, ``all`` standing for
    ``all_value``; duplicates dropped, order kept."""
    def parse(s: str) -> List[str]:
        names: List[str] = []
        for n in (n.strip() for n in s.split(",")):
            names += list(all_value) if n == "all" else [n] if n else []
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(bad) or '(empty)'}; choose from "
                f"{', '.join(choices)} or all")
        return list(dict.fromkeys(names))
    return parse


def _problem_args(p: argparse.ArgumentParser, tokens_default: List[int],
                  multi_preset: bool = False) -> None:
    """The options that define the layer and how it runs (shared by run, check, bench; bench
    takes several presets)."""
    if multi_preset:
        p.add_argument("--preset", type=_name_list(list(PRESETS), list(PRESETS), "preset"),
                       default=None,
                       help=f"comma-separated layer shapes to start from, or all (default: "
                            f"{DEFAULT_PRESET})")
    else:
        p.add_argument("--preset", choices=sorted(PRESETS), default=DEFAULT_PRESET,
                       help="layer shape to start from (default: %(default)s)")
    p.add_argument("--tokens", type=_token_list, default=tokens_default,
                   help=f"comma-separated token counts T (default: "
                        f"{','.join(map(str, tokens_default))})")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="threads for the op (default: torch's count with torch, else OpenMP's)")
    p.add_argument("--isa", default=None,
                   help="cap the kernel path, e.g. portable (default: best this CPU runs, "
                        "capped by CPUMOE_ISA)")
    p.add_argument("--hidden", type=_positive_int, help="H, hidden size")
    p.add_argument("--inter", type=_positive_int, help="I, intermediate size per expert")
    p.add_argument("--experts", type=_positive_int, help="E, number of experts")
    p.add_argument("--topk", type=_positive_int, help="k, experts per token")
    p.add_argument("--activation", choices=ACTIVATIONS)
    p.add_argument("--bias", action=argparse.BooleanOptionalAction, default=None,
                   help="random biases b13/b2 (default: per preset)")
    p.add_argument("--dtype", choices=sorted(DTYPE_ALIASES), default=None,
                   help="activation dtype (default: bfloat16 with torch, float32 without)")
    p.add_argument("--backend", choices=("auto", "torch", "numpy"), default="auto",
                   help="tensor library (default: torch if it imports)")
    p.add_argument("--seed", type=int, default=0)


def _timing_args(p: argparse.ArgumentParser, iters_help: str) -> None:
    p.add_argument("--iters", type=_positive_int, default=None, help=iters_help)
    p.add_argument("--warmup", type=int, default=2, help="untimed calls first (default: 2)")


def _parser() -> argparse.ArgumentParser:
    """The original command line (no subcommand): check + short bench of one layer."""
    p = argparse.ArgumentParser(
        prog="cpumoe",
        description="Check the fused W8A8 int8 MoE op against the reference on every path this "
                    "CPU runs, then time it. Default problem: the Qwen3-30B-A3B MoE layer with "
                    "random int8 experts.",
        epilog="Subcommands: cpumoe check | bench | info (see cpumoe SUBCOMMAND --help).")
    _problem_args(p, [1, 16, 128])
    _timing_args(p, "timed calls per T (default: about 2 s worth, 5 to 50)")
    p.add_argument("--no-check", action="store_true", help="skip the check against the reference")
    return p


def _check_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cpumoe check",
        description="Correctness of every path this CPU runs against cpumoe.reference: small "
                    "cases (dtypes x activations x bias, expert_map, skip_weighted, int64 ids, "
                    "strided rows, T=0) and the preset layer. Exit code 1 on a failure.")
    _problem_args(p, [1, 16])
    p.add_argument("--no-layer", action="store_true",
                   help="only the small cases, not the preset layer")
    return p


def _info_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cpumoe info",
                                description="CPU features, paths, kernels and build of cpumoe.")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
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


def _default_threads(lib: Optional[_Lib]) -> int:
    if lib is not None and lib.torch is not None:
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


class _Layer:
    """The problem of run/check/bench: shape from the preset and flags, backend, threads,
    random weights (numpy and backend tensors), packed once per path on demand."""

    def __init__(self, args: argparse.Namespace):
        H, I, E, k, activation, bias = PRESETS[args.preset]
        self.H = args.hidden or H
        self.I = args.inter or I
        self.E = args.experts or E
        self.k = args.topk or k
        self.activation = args.activation or activation
        self.bias = bias if args.bias is None else args.bias
        self.custom = any(v is not None for v in (args.hidden, args.inter, args.experts,
                                                  args.topk))
        self.name = f"{args.preset} (modified)" if self.custom else args.preset
        self.lib = _pick_lib(args.backend)
        self.dtype = DTYPE_ALIASES[args.dtype] if args.dtype else (
            "bfloat16" if self.lib.torch is not None else "float32")
        self.threads = args.threads or _default_threads(self.lib)
        self.seed = args.seed
        self.isa = args.isa
        self.tensors = None
        self._packed: Dict[str, Any] = {}

    def describe(self) -> str:
        import cpumoe
        return (f"cpumoe {cpumoe.__version__}: W8A8 fused MoE, {self.name} layer: H={self.H} "
                f"I={self.I} E={self.E} top-{self.k} {self.activation}"
                f"{' +bias' if self.bias else ''}, {self.dtype} ({self.lib.name})")

    def make(self) -> float:
        """Makes the random weights; returns the seconds it took."""
        t0 = time.perf_counter()
        arrays = make_weights(self.E, self.H, self.I, self.bias, self.seed, self.threads)
        lib = self.lib
        self.tensors = tuple(None if a is None else lib.tensor(a) for a in arrays)
        return time.perf_counter() - t0

    def packed(self, path: Optional[str]):
        """The layer packed for ``path`` (None: the default choice under --isa)."""
        import cpumoe
        key = path or f"default:{self.isa}"
        if key not in self._packed:
            w13, w2, s13, s2, b13, b2 = self.tensors
            self._packed[key] = cpumoe.prepack(w13, w2, s13, s2, b13, b2,
                                               isa=path or self.isa, num_threads=self.threads)
        return self._packed[key]

    @property
    def expert_bytes(self) -> int:
        return 3 * self.H * self.I  # int8 w13 + w2 of one expert


def _paths_under(isa: Optional[str]) -> List[str]:
    """Available paths, best first, capped by ``isa`` (ValueError for an unknown name)."""
    import cpumoe
    paths = cpumoe.available_paths()
    if isa is None:
        return paths
    ladder = cpumoe._C.isa_ladder()
    if isa not in ladder:
        cpumoe.selected_path(isa)  # raises the op's own error for a bad name
        raise ValueError(f"isa: unknown path {isa!r}")
    allowed = set(ladder[ladder.index(isa):])
    return [p for p in paths if p in allowed]


def _print_header(layer: _Layer, out) -> Optional[str]:
    """Prints the header lines; returns the selected path (None after a bad --isa, reported)."""
    import cpumoe
    print(layer.describe(), file=out)
    print(f"cpu      {_fmt_features(cpumoe.cpu_features())}", file=out)
    try:
        paths = cpumoe.available_paths()
        chosen = cpumoe.selected_path(layer.isa)
    except ValueError as e:
        print(f"cpumoe: {e}", file=sys.stderr)
        return None
    print(f"paths    {', '.join(paths)} (selected: {chosen}"
          f"{', capped by --isa ' + layer.isa if layer.isa else ''}"
          f"{', CPUMOE_ISA=' + os.environ['CPUMOE_ISA'] if os.environ.get('CPUMOE_ISA') else ''})",
          file=out)
    print(f"threads  {layer.threads}", file=out)
    return chosen


def _problems(layer: _Layer, tokens: List[int]):
    lib = layer.lib
    rng = np.random.default_rng([layer.seed, 12345])
    problems = {}
    for T in tokens:
        x = lib.tensor(rng.standard_normal((T, layer.H), dtype=np.float32), layer.dtype)
        problems[T] = (x, [make_routing(rng, T, layer.E, layer.k) for _ in range(16)])
    return problems


# ---------------------------------------------------------------------------- run (default)
def _cmd_run(args: argparse.Namespace) -> int:
    """The original command: check every path at --tokens, then time the selected path."""
    import cpumoe

    layer = _Layer(args)
    if layer.k > layer.E:
        print(f"cpumoe: --topk {layer.k} exceeds --experts {layer.E}", file=sys.stderr)
        return 2
    out = sys.stdout
    chosen = _print_header(layer, out)
    if chosen is None:
        return 2
    t_gen = layer.make()
    t0 = time.perf_counter()
    try:
        packed = layer.packed(None)
    except (ValueError, TypeError) as e:
        print(f"cpumoe: {e}", file=sys.stderr)
        return 2
    t_pack = time.perf_counter() - t0
    print(f"weights  {layer.E * layer.expert_bytes / 1e6:.1f} MB int8 (made in {t_gen:.1f} s); "
          f"packed {packed.packed_bytes / 1e6:.1f} MB in {t_pack:.2f} s for {packed.path} "
          f"({packed.kernel})", file=out)
    problems = _problems(layer, args.tokens)
    lib = layer.lib
    w13, w2, s13, s2, b13, b2 = layer.tensors

    failed = False
    if not args.no_check:
        paths = _paths_under(layer.isa)
        print(f"check    against cpumoe.reference on {', '.join(paths)} (pass: |err| <= "
              f"{TOLERANCE:g} * scale + {TOLERANCE:g} * |ref|, scale = max|ref|)", file=out)
        for T, (x, routings) in problems.items():
            ids, wts = routings[0]
            ids_t, wts_t = lib.tensor(ids), lib.tensor(wts)
            t0 = time.perf_counter()
            ref = cpumoe.reference.ref_fused_moe_int8(x, w13, w2, s13, s2, wts_t, ids_t,
                                                      layer.activation, b13=b13, b2=b2)
            t_ref = time.perf_counter() - t0
            for path in paths:
                got = cpumoe.fused_moe_int8(x, layer.packed(path), wts_t, ids_t,
                                            layer.activation, num_threads=layer.threads)
                ok, rel = check_one(lib, got, ref)
                failed |= not ok
                print(f"  T={T:<5d} {path:<12} max|err|/scale = {rel:.2e}  "
                      f"{'PASS' if ok else 'FAIL'}  (reference {t_ref:.2f} s)", file=out)

    print(f"timing   median and min of the timed calls after {args.warmup} warm-up; each call "
          f"routes anew (16 routings per T), so the experts read change from call to call",
          file=out)
    from . import bench  # the timing machinery of cpumoe bench
    print(bench.TABLE_HEAD, file=out)
    contender = bench.cpumoe_int8(layer, packed)
    for T, (x, routings) in problems.items():
        rows, _ = bench.time_point(layer, [contender], "cold", T, x, routings, None, args.warmup,
                                   args.iters, 2.0, 1, min_calls=5, max_calls=50)
        print(bench.fmt_row(rows[0]), file=out)

    if failed:
        print("FAIL: the op is outside the tolerance of the reference", file=out)
        return 1
    return 0


# ---------------------------------------------------------------------------- check
def _small_cases() -> List[dict]:
    """Small problems covering the op's options; each runs on every path."""
    shapes = [(1, 8, 1, 64, 64), (7, 16, 2, 128, 64), (33, 8, 4, 64, 128)]
    cases = []
    i = 0
    for dtype in ("float32", "float16", "bfloat16"):
        for act in ACTIVATIONS:
            for bias in (False, True):
                T, E, k, H, I = shapes[i % len(shapes)]
                cases.append(dict(name=f"{dtype} {act}{' +bias' if bias else ''}", T=T, E=E, k=k,
                                  H=H, I=I, dtype=dtype, activation=act, bias=bias))
                i += 1
    base = dict(T=19, E=16, k=4, H=64, I=64, dtype="float32", activation="silu", bias=True)
    cases += [
        dict(base, name="expert_map (half the experts here)", expert_map=True),
        dict(base, name="skip_weighted (k=1)", k=1, skip_weighted=True),
        dict(base, name="int64 topk_ids", int64_ids=True),
        dict(base, name="strided x rows", strided=True),
        dict(base, name="repeated expert ids", repeated=True),
        dict(base, name="T=0", T=0),
        dict(base, name="T=300 (several chunks)", T=300, dtype="bfloat16"),
    ]
    return cases


def _run_small_case(lib: _Lib, case: dict, paths: List[str], threads: int):
    """Returns {path: (ok, rel_err)} and whether all paths agreed bit for bit."""
    import cpumoe
    from .reference import ref_fused_moe_int8

    T, E, k, H, I = (case[n] for n in ("T", "E", "k", "H", "I"))
    rng = np.random.default_rng([7, T, E, k, H, I])
    w13, w2, s13, s2, b13, b2 = make_weights(E, H, I, True, 11, 1)
    if not case["bias"]:
        b13 = b2 = None
    x = rng.standard_normal((T, 2 * H if case.get("strided") else H), dtype=np.float32)
    ids, wts = make_routing(rng, T, E, k)
    if case.get("repeated") and T:
        ids[:, 1] = ids[:, 0]
    if case.get("skip_weighted"):
        wts = np.ones_like(wts)
    xt = lib.tensor(x, case["dtype"])
    if case.get("strided"):
        xt = xt[:, :H]
    t = lambda a: None if a is None else lib.tensor(a)  # noqa: E731
    ref_ids = ids
    emap = None
    w13l, w2l, s13l, s2l, b13l, b2l = w13, w2, s13, s2, b13, b2
    if case.get("expert_map"):
        local = np.arange(0, E, 2)  # even experts live here, odd ones elsewhere
        emap = np.full(E, -1, np.int32)
        emap[local] = np.arange(local.size, dtype=np.int32)
        w13l, w2l, s13l, s2l = w13[local], w2[local], s13[local], s2[local]
        b13l = None if b13 is None else b13[local]
        b2l = None if b2 is None else b2[local]
        keep = emap[ids] >= 0  # the reference: drop the slots of remote experts
        wts_ref = np.where(keep, wts, 0).astype(np.float32)
    ids_t = lib.tensor(ids.astype(np.int64) if case.get("int64_ids") else ids)
    ref = ref_fused_moe_int8(xt, t(w13), t(w2), t(s13), t(s2),
                             t(wts_ref if emap is not None else wts), t(ref_ids),
                             case["activation"], b13=t(b13), b2=t(b2),
                             skip_weighted=bool(case.get("skip_weighted")))
    results, bits = {}, []
    for path in paths:
        packed = cpumoe.prepack(t(w13l), t(w2l), t(s13l), t(s2l), t(b13l), t(b2l), isa=path)
        got = cpumoe.fused_moe_int8(xt, packed, t(wts), ids_t, case["activation"],
                                    bool(case.get("skip_weighted")),
                                    expert_map=t(emap) if emap is not None else None,
                                    num_threads=threads)
        results[path] = check_one(lib, got, ref)
        bits.append(lib.numpy32(got).tobytes())
    return results, all(b == bits[0] for b in bits)


def _cmd_check(args: argparse.Namespace) -> int:
    import cpumoe

    layer = _Layer(args)
    if layer.k > layer.E:
        print(f"cpumoe check: --topk {layer.k} exceeds --experts {layer.E}", file=sys.stderr)
        return 2
    out = sys.stdout
    if _print_header(layer, out) is None:
        return 2
    paths = _paths_under(layer.isa)
    lib = layer.lib
    if lib.torch is None and lib.name == "numpy":
        try:
            import ml_dtypes  # noqa: F401
            have_bf16 = True
        except ImportError:
            have_bf16 = False
    else:
        have_bf16 = True
    print(f"check    every path against cpumoe.reference (pass: |err| <= {TOLERANCE:g} * scale + "
          f"{TOLERANCE:g} * |ref|); columns: max|err|/scale per path", file=out)
    width = max(len(c["name"]) for c in _small_cases()) + 2
    print(f"  {'case':<{width}}" + "".join(f"{p:>14}" for p in paths) + "  same bits", file=out)
    n_pass = n_fail = n_skip = 0
    for case in _small_cases():
        if case["dtype"] == "bfloat16" and not have_bf16:
            print(f"  {case['name']:<{width}}  skipped (bfloat16 needs torch or ml_dtypes)",
                  file=out)
            n_skip += 1
            continue
        results, same = _run_small_case(lib, case, paths, layer.threads)
        cells = []
        for p in paths:
            ok, rel = results[p]
            n_pass += ok
            n_fail += not ok
            cells.append(f"{rel:.1e} {'ok' if ok else 'FAIL'}")
        if not same:
            n_fail += 1
        print(f"  {case['name']:<{width}}" + "".join(f"{c:>14}" for c in cells)
              + f"  {'yes' if same else 'NO'}", file=out)

    if not args.no_layer:
        t_gen = layer.make()
        print(f"layer    {layer.name} at T = {', '.join(map(str, args.tokens))} (weights made in "
              f"{t_gen:.1f} s)", file=out)
        w13, w2, s13, s2, b13, b2 = layer.tensors
        for T, (x, routings) in _problems(layer, args.tokens).items():
            ids, wts = routings[0]
            ids_t, wts_t = lib.tensor(ids), lib.tensor(wts)
            ref = cpumoe.reference.ref_fused_moe_int8(x, w13, w2, s13, s2, wts_t, ids_t,
                                                      layer.activation, b13=b13, b2=b2)
            cells, bits = [], []
            for p in paths:
                got = cpumoe.fused_moe_int8(x, layer.packed(p), wts_t, ids_t, layer.activation,
                                            num_threads=layer.threads)
                ok, rel = check_one(lib, got, ref)
                n_pass += ok
                n_fail += not ok
                cells.append(f"{rel:.1e} {'ok' if ok else 'FAIL'}")
                bits.append(lib.numpy32(got).tobytes())
            same = all(b == bits[0] for b in bits)
            n_fail += not same
            print(f"  {'T=' + str(T):<{width}}" + "".join(f"{c:>14}" for c in cells)
                  + f"  {'yes' if same else 'NO'}", file=out)
    verdict = "PASS" if n_fail == 0 else "FAIL"
    print(f"{verdict}: {n_pass} passed, {n_fail} failed"
          f"{f', {n_skip} skipped' if n_skip else ''} on {', '.join(paths)}", file=out)
    return 0 if n_fail == 0 else 1


# ---------------------------------------------------------------------------- info
def info_dict() -> Dict[str, Any]:
    """What ``cpumoe info`` prints, as a dict."""
    import cpumoe
    from . import _C

    cap = _C.env_isa_cap()
    try:
        selected = cpumoe.selected_path()
        selected_kernel = _C.select_kernel(None)
    except ValueError as e:  # a bad CPUMOE_ISA
        selected, selected_kernel = f"error: {e}", None
    kernels = cpumoe.kernels()
    for k in kernels:
        k["selected"] = k["name"] == selected_kernel
    build: Dict[str, Any] = {
        "target_arch": _C.target_arch(),
        "isa_ladder": _C.isa_ladder(),
        "paths_compiled": list(dict.fromkeys(k["isa"] for k in kernels)),
        "extension": getattr(_C, "__file__", None),
    }
    if hasattr(_C, "build_info"):  # newer extensions report their compile-time settings
        build.update(dict(_C.build_info()))
    versions = {"python": platform.python_version(), "numpy": np.__version__}
    for dist in ("torch", "ml_dtypes", "safetensors", "tqdm", "matplotlib"):
        try:  # the installed version, without importing the package
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return {
        "cpumoe": cpumoe.__version__,
        "cpu": {"machine": platform.machine(), "features": cpumoe.cpu_features()},
        "paths": {"available": cpumoe.available_paths(), "selected": selected,
                  "CPUMOE_ISA": cap},
        "kernels": kernels,
        "build": build,
        "threads_default": _default_threads(None),
        "versions": versions,
    }


def _cmd_info(args: argparse.Namespace) -> int:
    d = info_dict()
    if args.json:
        print(json.dumps(d, indent=1))
        return 0
    out = sys.stdout
    f = d["cpu"]["features"]
    print(f"cpumoe {d['cpumoe']}", file=out)
    print(f"cpu        {d['cpu']['machine']}; features used by cpumoe: "
          f"{' '.join(k for k, v in f.items() if v is True) or '(none)'}", file=out)
    off = [k for k, v in f.items() if v is False]
    print(f"           absent: {' '.join(off) or '(none)'}", file=out)
    p = d["paths"]
    print(f"paths      available: {', '.join(p['available'])}; selected: {p['selected']}"
          f"{'; capped by CPUMOE_ISA=' + p['CPUMOE_ISA'] if p['CPUMOE_ISA'] else ''}", file=out)
    print(f"           ladder (best first): {' > '.join(d['build']['isa_ladder'])}", file=out)
    print("kernels    (compiled in, best first)", file=out)
    print(f"  {'name':<44} {'path':<12} {'mr':>3} {'nr':>3} {'kr':>3}  runs here  selected",
          file=out)
    for k in d["kernels"]:
        print(f"  {k['name']:<44} {k['isa']:<12} {k['mr']:>3} {k['nr']:>3} {k['kr']:>3}  "
              f"{'yes' if k['supported'] else 'no':<9}  {'*' if k['selected'] else ''}", file=out)
    b = d["build"]
    print(f"build      target {b['target_arch']}; paths compiled: "
          f"{', '.join(b['paths_compiled'])}", file=out)
    for key, value in b.items():
        if key not in ("target_arch", "isa_ladder", "paths_compiled", "extension"):
            print(f"           {key}: {value}", file=out)
    print(f"           extension {b['extension']}", file=out)
    v = d["versions"]
    print("versions   " + ", ".join(f"{k} {val or '(not installed)'}" for k, val in v.items()),
          file=out)
    print(f"threads    {d['threads_default']} by default (OMP_NUM_THREADS or the CPUs this "
          f"process may use)", file=out)
    return 0


# ---------------------------------------------------------------------------- main
def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv.pop(0) if argv and argv[0] in SUBCOMMANDS else None
    if cmd == "info":
        return _cmd_info(_info_parser().parse_args(argv))
    if cmd == "check":
        args = _check_parser().parse_args(argv)
        handler = _cmd_check
    elif cmd == "bench":
        from . import bench  # the bench module (imports this one)
        args = bench.parser().parse_args(argv)
        handler = bench.run
    else:
        args = _parser().parse_args(argv)
        handler = _cmd_run
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
