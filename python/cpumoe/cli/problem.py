"""The problem every subcommand runs: the layer (preset and flags), its options, backend and
threads, random int8 weights and routings, and the check against the reference."""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time
from typing import Any, Dict, List, Optional

import numpy as np

from .. import ops as _ops


# Same tolerance as the tests (tests_py/conftest.py): |err| <= TOL * max|ref| + TOL * |ref|.
# The int8 requantization between the GEMMs makes last-bit differences jump by up to ~1% of
# the output scale; real bugs are off by O(1).
TOLERANCE = 2e-2

PRESETS = {
    # name: (H, I, E, k, activation, bias)
    "qwen3-30b-a3b": (2048, 768, 128, 8, "silu", False),
    "gpt-oss-20b": (2880, 2880, 32, 4, "swigluoai", True),
    "mixtral": (4096, 14336, 8, 2, "silu", False),
    # DeepSeek-V3/R1's expert shape, 32 of its 256 routed experts (the FP8 issue's second layer;
    # the shared expert is not part of the op).
    "deepseek-v3-experts": (7168, 2048, 32, 8, "silu", False),
}
DTYPE_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16",
                 "float16": "float16", "half": "float16", "fp32": "float32",
                 "float32": "float32", "float": "float32"}
#: One runnable spec per activation of the op's table: the name, or with a limit of 1 where the
#: activation needs one (inside the random problems' GEMM1 values, so the clamp fires).
ACTIVATIONS = tuple(a["name"] if all(v is not None for v in a["params"].values())
                    else f"{a['name']}(limit=1)" for a in _ops.activations())
#: The 4-bit weight formats (W4A8: the bench's issue-14 targets).
FOUR_BIT = tuple(r["name"] for r in _ops.formats() if r["bits"] == 4)
DEFAULT_PRESET = "qwen3-30b-a3b"
BENCH_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128]


def activation_arg(s: str) -> str:
    """An activation spec (cpumoe.ops.parse_activation), canonical; argparse's error otherwise."""
    try:
        return _ops.parse_activation(s)[1]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def positive_float(s: str) -> float:
    v = float(s)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {s}")
    return v


def token_list(s: str) -> List[int]:
    try:
        out = [int(t) for t in s.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of ints, got {s!r}")
    if not out or any(t < 0 for t in out):
        raise argparse.ArgumentTypeError(f"expected token counts >= 0, got {s!r}")
    return out


def name_list(choices, all_value, what: str):
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


def problem_args(p: argparse.ArgumentParser, tokens_default: List[int],
                  multi_preset: bool = False) -> None:
    """The options that define the layer and how it runs (shared by run, check, bench; bench
    takes several presets)."""
    if multi_preset:
        p.add_argument("--preset", type=name_list(list(PRESETS), list(PRESETS), "preset"),
                       default=None,
                       help=f"comma-separated layer shapes to start from, or all (default: "
                            f"{DEFAULT_PRESET})")
    else:
        p.add_argument("--preset", choices=sorted(PRESETS), default=DEFAULT_PRESET,
                       help="layer shape to start from (default: %(default)s)")
    p.add_argument("--tokens", type=token_list, default=tokens_default,
                   help=f"comma-separated token counts T (default: "
                        f"{','.join(map(str, tokens_default))})")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="threads for the op (default: torch's count with torch, else OpenMP's)")
    p.add_argument("--isa", default=None,
                   help="cap the kernel path, e.g. portable (default: best this CPU runs, "
                        "capped by CPUMOE_ISA)")
    p.add_argument("--hidden", type=positive_int, help="H, hidden size")
    p.add_argument("--inter", type=positive_int, help="I, intermediate size per expert")
    p.add_argument("--experts", type=positive_int, help="E, number of experts")
    p.add_argument("--topk", type=positive_int, help="k, experts per token")
    p.add_argument("--activation", type=activation_arg,
                   help=f"the op's activation spec, one of {', '.join(ACTIVATIONS)} "
                        f"(other limits as e.g. silu_clamp(limit=10); default: per preset)")
    p.add_argument("--bias", action=argparse.BooleanOptionalAction, default=None,
                   help="random biases b13/b2 (default: per preset)")
    p.add_argument("--dtype", choices=sorted(DTYPE_ALIASES), default=None,
                   help="activation dtype (default: bfloat16 with torch, float32 without)")
    p.add_argument("--backend", choices=("auto", "torch", "numpy"), default="auto",
                   help="tensor library (default: torch if it imports)")
    p.add_argument("--seed", type=int, default=0)


def timing_args(p: argparse.ArgumentParser, iters_help: str) -> None:
    p.add_argument("--iters", type=positive_int, default=None, help=iters_help)
    p.add_argument("--warmup", type=int, default=2, help="untimed calls first (default: 2)")


# ---------------------------------------------------------------------------- tensors
class Lib:
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


def pick_lib(choice: str) -> Lib:
    if choice == "numpy":
        return Lib("numpy")
    try:
        import torch  # noqa: F401
    except ImportError:
        if choice == "torch":
            raise SystemExit("cpumoe: --backend torch, but torch does not import")
        return Lib("numpy")
    return Lib("torch")


def default_threads(lib: Optional[Lib]) -> int:
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
    from ..quantize import quantize_per_channel

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


def check_one(lib: Lib, out, ref):
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


def fmt_features(f: dict) -> str:
    on = [k for k, v in f.items() if k != "arch" and v is True]
    return f"{f.get('arch', '?')}: {' '.join(on) if on else '(no SIMD features used by cpumoe)'}"


class Layer:
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
        self.lib = pick_lib(args.backend)
        self.dtype = DTYPE_ALIASES[args.dtype] if args.dtype else (
            "bfloat16" if self.lib.torch is not None else "float32")
        self.threads = args.threads or default_threads(self.lib)
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


def paths_under(isa: Optional[str], fmt: str = "int8") -> List[str]:
    """Available paths of weight format ``fmt``'s kernels, best first, capped by ``isa``
    (ValueError for an unknown name)."""
    import cpumoe
    paths = cpumoe.available_paths(fmt)
    if isa is None:
        return paths
    ladder = cpumoe._C.isa_ladder()
    if isa not in ladder:
        cpumoe.selected_path(isa)  # raises the op's own error for a bad name
        raise ValueError(f"isa: unknown path {isa!r}")
    allowed = set(ladder[ladder.index(isa):])
    return [p for p in paths if p in allowed]


def topk_fits(layer: Layer, prog: str) -> bool:
    """False (reported on stderr as `prog: ...`) when --topk exceeds --experts."""
    if layer.k > layer.E:
        print(f"{prog}: --topk {layer.k} exceeds --experts {layer.E}", file=sys.stderr)
        return False
    return True


def print_header(layer: Layer, out) -> Optional[str]:
    """Prints the header lines; returns the selected path (None after a bad --isa, reported)."""
    import cpumoe
    print(layer.describe(), file=out)
    print(f"cpu      {fmt_features(cpumoe.cpu_features())}", file=out)
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


def problems(layer: Layer, tokens: List[int]):
    lib = layer.lib
    rng = np.random.default_rng([layer.seed, 12345])
    problems = {}
    for T in tokens:
        x = lib.tensor(rng.standard_normal((T, layer.H), dtype=np.float32), layer.dtype)
        problems[T] = (x, [make_routing(rng, T, layer.E, layer.k) for _ in range(16)])
    return problems
