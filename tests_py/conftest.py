"""Shared test machinery: the backend (torch or numpy), random MoE problems, the tolerance check.

Backend: torch when it imports, else numpy (+ ml_dtypes for bfloat16). The environment variable
CPUMOE_TEST_BACKEND=numpy|torch forces one; the aarch64 run under qemu uses numpy. With the numpy
backend torch is never imported, so the package's torch-free path is what gets tested.

Random data is always drawn with numpy from a fixed seed and then converted, so both backends
see the same numbers.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest

# Tolerance of the op against the reference, relative to the output scale s = max|ref|:
#   |out - ref| <= MOE_ATOL_OF_SCALE * s + MOE_RTOL * |ref|.
# Why 2e-2: the activation is rounded to the input dtype and requantized to int8 between the two
# GEMMs. Those roundings are discontinuous, so a last-bit difference in GEMM1's fp32 epilogue or in
# the activation's exp/erf/tanh (the kernels use polynomials) can move a bf16 value by one ulp
# (2^-8 relative) or an int8 code by one step (1/127 of the row's range); through GEMM2 such a flip
# moves outputs by up to about 1% of the output scale. An independent fp64 reference lands within
# 1.1e-2 of vLLM's Arm kernel (the golden cases of test_golden.py); a real bug (wrong expert, scale, layout,
# activation, missing bias) is off by O(1) of the scale.
MOE_ATOL_OF_SCALE = 2e-2
MOE_RTOL = 2e-2

REPO_ROOT = Path(__file__).resolve().parent.parent

# Idle OpenMP threads sleep instead of spinning (read once, when cpumoe._C loads libgomp, which
# happens after this file): the tests run 2-8 threads on small problems, often on a shared 2-core
# host, where spinning threads take the cores the working ones need (measured: 2-10 ms per small
# 2-thread call instead of 0.3 ms). Results do not depend on it; tests_cpp sets the same.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# ---------------------------------------------------------------------------- backend choice
def _choose_backend() -> str:
    forced = os.environ.get("CPUMOE_TEST_BACKEND", "").strip().lower()
    if forced not in ("", "torch", "numpy"):
        raise pytest.UsageError(f"CPUMOE_TEST_BACKEND must be 'torch' or 'numpy', got {forced!r}")
    if forced:
        return forced
    try:
        import torch  # noqa: F401
    except ImportError:
        return "numpy"
    return "torch"


BACKEND_NAME = _choose_backend()

try:
    import ml_dtypes
except ImportError:  # bfloat16 cases are skipped on the numpy backend then
    ml_dtypes = None


class Backend:
    """Tensor creation and conversion for one framework, in the few forms the tests need."""

    def __init__(self, name: str):
        self.name = name
        if name == "torch":
            import torch
            self.torch = torch
        else:
            self.torch = None

    def __repr__(self):
        return f"Backend({self.name})"

    # dtypes ---------------------------------------------------------------
    def dtype(self, name: str):
        """Framework dtype object of a numpy-style name (float32, bfloat16, int8, int64, ...)."""
        if self.torch is not None:
            return getattr(self.torch, name)
        if name == "bfloat16":
            if ml_dtypes is None:
                pytest.skip("bfloat16 on the numpy backend needs ml_dtypes")
            return np.dtype(ml_dtypes.bfloat16)
        return np.dtype(name)

    def dtype_name(self, t) -> str:
        if self.torch is not None:
            return str(t.dtype).replace("torch.", "")
        return t.dtype.name

    # conversions ----------------------------------------------------------
    def asarray(self, a: np.ndarray, dtype: Optional[str] = None, copy: bool = True):
        """numpy array -> backend tensor (a copy), optionally cast to ``dtype``. ``copy=False``
        lets the numpy backend hand out ``a`` itself (torch always copies)."""
        a = np.ascontiguousarray(a)
        if self.torch is None and not copy and dtype is None:
            return a
        if self.torch is not None:
            if a.dtype.name == "bfloat16":
                a = a.astype(np.float32)
            t = self.torch.from_numpy(a.copy())
            return t if dtype is None else t.to(self.dtype(dtype))
        return a.copy() if dtype is None else a.astype(self.dtype(dtype))

    def cast(self, t, dtype: str):
        if self.torch is not None:
            return t.to(self.dtype(dtype))
        return t.astype(self.dtype(dtype))

    def numpy(self, t) -> np.ndarray:
        """Backend tensor -> numpy, floats widened to float32 (exact for fp16/bf16)."""
        if self.torch is not None:
            t = t.detach().cpu()
            if t.is_floating_point():
                t = t.to(self.torch.float32)
            return t.numpy()
        t = np.asarray(t)
        if t.dtype.kind not in "iub":
            t = t.astype(np.float32)
        return t

    def empty(self, shape, dtype: str):
        if self.torch is not None:
            return self.torch.empty(shape, dtype=self.dtype(dtype))
        return np.empty(shape, dtype=self.dtype(dtype))

    def full(self, shape, value, dtype: str):
        if self.torch is not None:
            return self.torch.full(shape, value, dtype=self.dtype(dtype))
        return np.full(shape, value, dtype=self.dtype(dtype))

    def is_tensor(self, t) -> bool:
        if self.torch is not None:
            return isinstance(t, self.torch.Tensor)
        return isinstance(t, np.ndarray)

    def bits(self, t) -> np.ndarray:
        """The raw bits of a float tensor as an unsigned numpy array (for bitwise equality)."""
        if self.torch is not None:
            t = t.detach().cpu().contiguous()
            if t.dtype in (self.torch.float16, self.torch.bfloat16):
                return t.view(self.torch.int16).numpy().view(np.uint16)
            return t.view(self.torch.int32).numpy().view(np.uint32)
        t = np.ascontiguousarray(t)
        return t.view(np.uint16 if t.dtype.itemsize == 2 else np.uint32)


@functools.lru_cache(maxsize=None)
def get_backend() -> Backend:
    return Backend(BACKEND_NAME)


@pytest.fixture(scope="session")
def backend() -> Backend:
    return get_backend()


def pytest_report_header(config):
    return (f"cpumoe test backend: {BACKEND_NAME} (CPUMOE_TEST_BACKEND to force torch or numpy); "
            f"tier: {TIER} (CPUMOE_TEST_TIER: all, or binding)")


# Tests in tiers: the kernels are proved bit for bit against the oracle by the C++ grids on every
# path (native, Haswell, three qemu CPU models), and these Python grids prove the same through the
# binding once, in the torch-backend run. The other runs (the numpy backend, the aarch64 CPython
# under qemu) set CPUMOE_TEST_TIER=binding: they check the binding, the dtypes, the front ends and
# the integrations, and skip the grids below.
TIER = os.environ.get("CPUMOE_TEST_TIER", "all")
if TIER not in ("all", "binding"):
    raise RuntimeError(f"CPUMOE_TEST_TIER: all or binding, got {TIER!r}")
KERNEL_GRIDS = (
    "test_moe.py::test_matches_reference[",
    "test_moe.py::test_same_bits_on_every_path_and_thread_count[",
    "test_bf16.py::test_matches_reference_on_every_path[",
    "test_fp8.py::test_matches_reference_on_every_path[",
    "test_cli.py::test_accuracy_measures_every_format",  # numerics of whole layers
    "test_w4a8.py::test_matches_reference_on_every_path[",
    "test_reliability.py::test_bitwise_identical_for_1_2_4_threads_and_repeated_calls[",
)


def pytest_collection_modifyitems(config, items):
    if TIER == "all":
        return
    skip = pytest.mark.skip(reason="kernel grid: proved by the C++ grids and the torch-backend "
                                   "run (CPUMOE_TEST_TIER=binding)")
    for item in items:
        if any(g in item.nodeid for g in KERNEL_GRIDS):
            item.add_marker(skip)


# ---------------------------------------------------------------------------- problems
def random_topk_ids(rng: np.random.Generator, T: int, E: int, k: int) -> np.ndarray:
    """[T, k] int32: k distinct experts per token (the first k of a random permutation)."""
    if k > E:
        raise ValueError("k > E")
    return np.argsort(rng.random((T, E)), axis=1)[:, :k].astype(np.int32)


def random_topk_weights(rng: np.random.Generator, T: int, k: int) -> np.ndarray:
    """[T, k] float32, positive, each row summing to 1 (softmax of normal logits)."""
    logits = rng.standard_normal((T, k))
    w = np.exp(logits - logits.max(axis=1, keepdims=True))
    return (w / w.sum(axis=1, keepdims=True)).astype(np.float32)


def activation_specs(limit: float = 1.0):
    """One runnable spec per row of the op's activation table (cpumoe.activations()): the name,
    or with ``limit`` where the activation requires one (1: inside the tests' GEMM1 values,
    about N(0, 1), so the clamps fire), so a new activation is swept by every test using this."""
    import cpumoe

    return tuple(a["name"] if all(v is not None for v in a["params"].values())
                 else f"{a['name']}(limit={limit:g})" for a in cpumoe.activations())


def op_cases(shapes, **cycled):
    """pytest params of the ops' grids: every dtype x activation (activation_specs()) x bias,
    with the shapes (T, E, k, H, I) taken in turn, and each keyword's values in turn too (e.g.
    block_size=(...)); ids name them all."""
    import itertools

    import pytest
    out = []
    for i, (dt, act, bias) in enumerate(itertools.product(("float32", "float16", "bfloat16"),
                                                          activation_specs(), (False, True))):
        T, E, k, H, I = shapes[i % len(shapes)]
        extra = {name: vals[i % len(vals)] for name, vals in cycled.items()}
        out.append(pytest.param(dict(T=T, E=E, k=k, H=H, I=I, dtype=dt, activation=act,
                                     bias=bias, **extra),
                                id="-".join([dt, act, "bias" if bias else "nobias", f"T{T}",
                                             *(str(v) for v in extra.values())])))
    return out


def random_weights(E: int, H: int, I: int, seed: int = 0):
    """Int8 experts as checkpoints make them: float weights N(0, 1/sqrt(fan_in)) quantized per
    output channel; biases N(0, 0.1) in fp32. numpy arrays, cached (read-only) across tests."""
    return _random_weights(int(E), int(H), int(I), int(seed))


@functools.lru_cache(maxsize=8)
def _random_weights(E: int, H: int, I: int, seed: int):
    from cpumoe.reference import quantize_per_channel

    rng = np.random.default_rng([seed, E, H, I])
    w13 = np.empty((E, 2 * I, H), np.int8)
    w2 = np.empty((E, H, I), np.int8)
    s13 = np.empty((E, 2 * I), np.float32)
    s2 = np.empty((E, H), np.float32)
    for e in range(E):  # one expert at a time keeps the float temporaries small
        w13[e], s13[e] = quantize_per_channel(
            rng.standard_normal((2 * I, H), dtype=np.float32) * np.float32(1 / np.sqrt(H)))
        w2[e], s2[e] = quantize_per_channel(
            rng.standard_normal((H, I), dtype=np.float32) * np.float32(1 / np.sqrt(I)))
    b13 = (rng.standard_normal((E, 2 * I)) * 0.1).astype(np.float32)
    b2 = (rng.standard_normal((E, H)) * 0.1).astype(np.float32)
    out = (w13, w2, s13, s2, b13, b2)
    for a in out:
        a.setflags(write=False)
    return out


@dataclasses.dataclass
class Problem:
    """One random MoE call, as backend tensors, with helpers to run the op and the reference."""

    backend: Backend
    T: int
    E: int
    k: int
    H: int
    I: int
    dtype: str
    activation: str
    x: Any
    w13: Any
    w2: Any
    s13: Any
    s2: Any
    b13: Any
    b2: Any
    topk_weights: Any
    topk_ids: Any
    skip_weighted: bool = False

    def prepack(self, **kw):
        import cpumoe
        return cpumoe.prepack(self.w13, self.w2, self.s13, self.s2, self.b13, self.b2, **kw)

    def run(self, packed=None, **kw):
        import cpumoe
        if packed is None:
            packed = self.prepack()
        args = dict(x=self.x, topk_weights=self.topk_weights, topk_ids=self.topk_ids,
                    activation=self.activation, skip_weighted=self.skip_weighted)
        args.update(kw)
        return cpumoe.fused_moe_int8(args.pop("x"), packed, args.pop("topk_weights"),
                                     args.pop("topk_ids"), **args)

    def reference(self, **kw):
        from cpumoe.reference import ref_fused_moe_int8
        args = dict(x=self.x, topk_weights=self.topk_weights, topk_ids=self.topk_ids,
                    activation=self.activation, skip_weighted=self.skip_weighted)
        args.update(kw)
        return ref_fused_moe_int8(args.pop("x"), self.w13, self.w2, self.s13, self.s2,
                                  args.pop("topk_weights"), args.pop("topk_ids"),
                                  b13=self.b13, b2=self.b2, **args)


class FloatWeightsProblem:
    """An int8 test problem (make_problem's keywords) with its weights dequantized to float32
    (``w13f``, ``w2f``: w * scale), for the ops that take other weight formats: a subclass gives
    ``prepack(**kw)`` and ``reference()``; ``run`` calls cpumoe.fused_moe."""

    def __init__(self, backend: Backend, **kw):
        self.p = p = make_problem(backend, **kw)
        self.B = backend
        self.w13f = backend.numpy(p.w13).astype(np.float32) * backend.numpy(p.s13)[:, :, None]
        self.w2f = backend.numpy(p.w2).astype(np.float32) * backend.numpy(p.s2)[:, :, None]

    def run(self, packed=None, **kw):
        import cpumoe
        p = self.p
        if packed is None:
            packed = self.prepack()
        args = dict(activation=p.activation, skip_weighted=p.skip_weighted)
        args.update(kw)
        return cpumoe.fused_moe(args.pop("x", p.x), packed, p.topk_weights, p.topk_ids, **args)


def make_problem(backend: Backend, T: int, E: int, k: int, H: int, I: int, *,
                 dtype: str = "float32", activation: str = "silu", bias: bool = False,
                 skip_weighted: bool = False, seed: int = 0, weight_seed: int = 0) -> Problem:
    """x ~ N(0, 1) in ``dtype``; cached random int8 experts; distinct random experts per token;
    softmax router weights (all ones with skip_weighted)."""
    rng = np.random.default_rng([seed, T, E, k, H, I])
    w13, w2, s13, s2, b13, b2 = random_weights(E, H, I, weight_seed)
    x = rng.standard_normal((T, H), dtype=np.float32)
    ids = random_topk_ids(rng, T, E, k)
    tw = np.ones((T, k), np.float32) if skip_weighted else random_topk_weights(rng, T, k)
    B = backend
    return Problem(B, T, E, k, H, I, dtype, activation,
                   x=B.asarray(x, dtype), w13=B.asarray(w13, copy=False),
                   w2=B.asarray(w2, copy=False), s13=B.asarray(s13, copy=False),
                   s2=B.asarray(s2, copy=False),
                   b13=B.asarray(b13, copy=False) if bias else None,
                   b2=B.asarray(b2, copy=False) if bias else None,
                   topk_weights=B.asarray(tw), topk_ids=B.asarray(ids),
                   skip_weighted=skip_weighted)


# ---------------------------------------------------------------------------- comparisons
def close_report(out: np.ndarray, ref: np.ndarray, atol_of_scale=MOE_ATOL_OF_SCALE,
                 rtol=MOE_RTOL):
    """(ok, message) of |out - ref| <= atol_of_scale * max|ref| + rtol * |ref| (fp32 numpy)."""
    out = np.asarray(out, np.float32)
    ref = np.asarray(ref, np.float32)
    if out.shape != ref.shape:
        return False, f"shape {out.shape} != reference shape {ref.shape}"
    if out.size == 0:
        return True, "empty"
    if not np.isfinite(out).all():
        return False, f"{int((~np.isfinite(out)).sum())} non-finite outputs"
    scale = float(np.abs(ref).max())
    err = np.abs(out.astype(np.float64) - ref)
    bound = atol_of_scale * scale + rtol * np.abs(ref.astype(np.float64))
    bad = err > bound
    msg = (f"max|err| = {err.max():.3e} = {err.max() / max(scale, 1e-30):.2e} of the output scale "
           f"{scale:.3e}; {int(bad.sum())} of {out.size} outside the tolerance")
    if bad.any():
        i = np.unravel_index(np.argmax(err - bound), err.shape)
        msg += f"; worst at {tuple(int(v) for v in i)}: out {out[i]!r} ref {ref[i]!r}"
    return not bad.any(), msg


def assert_moe_close(backend: Backend, out, ref, **kw):
    ok, msg = close_report(backend.numpy(out), backend.numpy(ref), **kw)
    assert ok, msg


# ---------------------------------------------------------------------------- subprocesses
def python_command() -> list:
    """The command that starts this Python in a subprocess.

    CPUMOE_TEST_PYTHON (a shell-quoted command) overrides it. Under qemu-user without binfmt the
    guest's sys.executable cannot be exec'd by the host kernel; then, if qemu-aarch64 is found, the
    child is started as ``qemu-aarch64 -cpu max -L SYSROOT sys.executable`` with SYSROOT taken from
    the executable's path (SYSROOT/usr/bin/python3.x).
    """
    env_cmd = os.environ.get("CPUMOE_TEST_PYTHON")
    if env_cmd:
        return shlex.split(env_cmd)
    return list(_default_python_command())


@functools.lru_cache(maxsize=None)
def _default_python_command() -> tuple:
    exe = sys.executable
    try:
        subprocess.run([exe, "-c", "pass"], check=True, capture_output=True, timeout=120)
        return (exe,)
    except OSError:
        pass
    import platform
    import shutil
    qemu = shutil.which(f"qemu-{platform.machine()}")
    exe_path = Path(exe)
    if qemu and exe_path.parent.name == "bin" and exe_path.parent.parent.name == "usr":
        sysroot = exe_path.parent.parent.parent
        cpu = os.environ.get("QEMU_CPU", "max")
        return (qemu, "-cpu", cpu, "-L", str(sysroot), exe)
    return (exe,)


def run_python(code: str, env_update: Optional[dict] = None, timeout: float = 300):
    """Runs ``python -c code`` in a subprocess that imports the same cpumoe as this process."""
    import cpumoe

    env = dict(os.environ)
    pkg_parent = str(Path(cpumoe.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_parent, env.get("PYTHONPATH")) if p)
    for key, value in (env_update or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return subprocess.run(python_command() + ["-c", code], env=env, capture_output=True,
                          text=True, timeout=timeout)
