"""KTransformers' CPU MoE kernels (PyPI ``kt-kernel``) as ``cpumoe bench`` contenders
(``kt-int8``, ``kt-int4``, ``kt-int4-g32``, ``kt-bf16``, ``kt-mxfp4``, ``kt-fp8``).

kt-kernel 0.7.2 declares ``torch==2.9.1``: installed beside cpumoe it would replace the torch
cpumoe (and vLLM) are built for. So it never is: it lives in a virtual environment of its own
(``venv_dir()``: ``$CPUMOE_KT_VENV``, default ``~/.cache/cpumoe/venv-kt-kernel-0.7.2``), made once
on request (``cpumoe bench --kt-venv create``) with torch 2.13.0, ``kt-kernel==0.7.2`` without
its declared dependencies, and only the ones its import needs (numpy, safetensors, gguf, pyyaml:
not triton, typer, rich, httpx). Its extensions do not link libtorch (only libnuma, libgomp,
libhwloc, libstdc++), and its Python imports and runs beside torch 2.13.

Each kt contender runs in a worker process of that venv (kt_worker.py, run by file path), which
gets the layer's weights as cpumoe made them (.npy files): bf16 copies for kt-int8 (kt quantizes
them itself, its ``AMXInt8_MOE`` online path) and kt-bf16, cpumoe's FP8 / MXFP4 / int4 weights
for the others (converted to kt's layouts with kt's own helpers where it has them). The worker
times each call around the layer's ``forward`` (the protocol's time is not counted): kt's pool
(``--kt-threads``, default ``--threads``) computes while the calling thread spins until it is
done, as it does in kt's own ``CPUInfer.sync``. The parent alternates the contenders as for every
other one, and idles ``SPIN_PAUSE_S`` after a kt contender's turn: kt's worker threads spin for
50 ms after a call and would take a core from the next contender.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

import numpy as np

KT_VERSION = "0.7.2"
TORCH_VERSION = "2.13.0"
#: What ``import kt_kernel`` needs besides torch (found by importing it: its utils/loader.py
#: imports safetensors and gguf, gguf imports yaml); pip adds gguf's own (requests, tqdm).
IMPORT_DEPS = ("numpy", "safetensors", "gguf", "pyyaml")
READY = "cpumoe-kt-ready.json"  # written last when the venv is made: its versions and ISA
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kt_worker.py")
#: kt's worker threads spin 50 ms after a call (then sleep in 1 ms steps): the parent idles this
#: long after a kt contender's calls so that the next contender gets the cores.
SPIN_PAUSE_S = 0.1
#: Seconds a worker may take: to start (torch + kt import), to load a layer, for one command.
START_TIMEOUT, LOAD_TIMEOUT, CALL_TIMEOUT = 180.0, 1800.0, 600.0

#: contender -> (kt-kernel format, cpumoe's (format, group) of the weights it takes; None: the
#: bf16 copies of the int8 weights). The reference of each is its cpumoe namesake's.
CONTENDERS = {
    "kt-int8": ("int8", None),
    "kt-int4": ("int4", ("int4", 128)),
    "kt-int4-g32": ("int4", ("int4", 32)),
    "kt-bf16": ("bf16", None),
    "kt-mxfp4": ("mxfp4", ("mxfp4", 32)),
    "kt-fp8": ("fp8", ("fp8", 128)),
}
#: The kt contenders on cpumoe's quantized weights: name -> (format, group).
QUANT = {n: q for n, (_, q) in CONTENDERS.items() if q is not None}


class Unsupported(ValueError):
    """kt-kernel does not compute this problem (the message says why)."""


class KtError(RuntimeError):
    """A kt worker failed (did not start, died, answered an error, or timed out)."""

    def __init__(self, message: str, contender: Optional[str] = None):
        super().__init__(message)
        self.contender = contender


# ---------------------------------------------------------------------------- the venv
def off_x86() -> Optional[str]:
    """Why kt-kernel cannot run on this machine (its wheels are x86-64 only), or None."""
    import platform
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        return None
    return f"kt-kernel ships x86-64 builds only (this machine is {machine or 'unknown'})"


def venv_dir() -> str:
    if os.environ.get("CPUMOE_KT_VENV"):
        return os.path.abspath(os.path.expanduser(os.environ["CPUMOE_KT_VENV"]))
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "cpumoe", f"venv-kt-kernel-{KT_VERSION}")


def venv_python(d: str) -> str:
    return os.path.join(d, "bin", "python")


def venv_info(d: Optional[str] = None) -> Optional[Dict[str, Any]]:
    """What the venv's READY file says (versions, kt's extension), or None when the venv is not
    there, not finished, or of other versions."""
    d = d or venv_dir()
    try:
        with open(os.path.join(d, READY)) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    if (info.get("kt_kernel") != KT_VERSION or not os.access(venv_python(d), os.X_OK)
            or not str(info.get("torch", "")).startswith(TORCH_VERSION)):
        return None
    return info


def create_venv(d: Optional[str] = None, say=None) -> Optional[Dict[str, Any]]:
    """Makes the venv at ``d`` (default venv_dir()) unless it is there; returns its info.
    Raises KtError (with the log's path) when a step fails."""
    d = d or venv_dir()
    info = venv_info(d)
    if info is not None:
        return info
    say = say or (lambda s: None)
    if os.path.exists(d) and os.listdir(d) and not os.path.exists(os.path.join(d, "pyvenv.cfg")):
        raise KtError(f"{d} exists and is not a virtual environment; not touching it")
    shutil.rmtree(d, ignore_errors=True)  # an unfinished or outdated one
    os.makedirs(os.path.dirname(d), exist_ok=True)
    log = d + ".log"
    py = venv_python(d)
    steps = [
        ("venv", [sys.executable, "-m", "venv", d]),
        ("torch and kt-kernel's import dependencies",
         [py, "-m", "pip", "install", "--disable-pip-version-check", f"torch=={TORCH_VERSION}",
          *IMPORT_DEPS]),
        # --no-deps: its declared torch==2.9.1 (and triton, typer, rich, httpx) stay out.
        (f"kt-kernel {KT_VERSION}",
         [py, "-m", "pip", "install", "--disable-pip-version-check", "--no-deps",
          f"kt-kernel=={KT_VERSION}"]),
        ("the check that kt_kernel imports",
         [py, "-I", "-c", "import json, sys, torch, kt_kernel; print(json.dumps({"
          "'kt_kernel': kt_kernel.__version__, 'torch': torch.__version__, "
          "'variant': kt_kernel.__cpu_variant__, "
          "'int8_kernel': getattr(kt_kernel, '__int8_kernel__', None), "
          "'python': sys.version.split()[0]}))"]),
    ]
    t0 = time.perf_counter()
    with open(log, "w") as f:
        for what, cmd in steps:
            say(f"{what} ...")
            f.write(f"$ {' '.join(cmd)}\n")
            f.flush()
            r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, text=True)
            f.write(r.stdout)
            if r.returncode != 0:
                raise KtError(f"making kt-kernel's venv {d} failed at: {what} (exit "
                              f"{r.returncode}; log {log})")
    info = json.loads(r.stdout.strip().splitlines()[-1])
    info["seconds"] = round(time.perf_counter() - t0, 1)
    with open(os.path.join(d, READY), "w") as f:
        json.dump(info, f)
    return venv_info(d)


# ---------------------------------------------------------------------------- a worker
class Worker:
    """One worker process: JSON lines in and out (see kt_worker.py), its stderr in ``log``."""

    def __init__(self, argv: List[str], log: str, name: str):
        self.name, self.log = name, log
        self.what = "kt worker"  # "kt <class>" once a layer is loaded
        self._buf = b""
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err)
        self.hello = self._answer(START_TIMEOUT, "start")

    def _fail(self, what: str, why: str) -> KtError:
        tail = ""
        try:
            with open(self.log, errors="replace") as f:
                lines = [ln.strip() for ln in f if ln.strip()]
            tail = f"; last line of its log: {lines[-1][:200]}" if lines else ""
        except OSError:
            pass
        self.kill()
        return KtError(f"{self.what}, {what}: {why}{tail}", self.name)

    def _answer(self, timeout: float, what: str) -> Dict[str, Any]:
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise self._fail(what, f"no answer in {timeout:.0f} s")
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    code = self.proc.wait()
                    raise self._fail(what, f"the worker exited ({code}"
                                     f"{': killed by a signal' if code < 0 else ''})")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            res = json.loads(line)
        except ValueError:
            raise self._fail(what, f"answered {line[:200]!r}") from None
        if not res.get("ok"):
            raise KtError(f"{self.what}, {what}: {res.get('error')}", self.name)
        return res

    def request(self, cmd: Dict[str, Any], timeout: float = CALL_TIMEOUT) -> Dict[str, Any]:
        if self.proc.poll() is not None:
            raise KtError(f"{self.what}: the worker is gone (exit {self.proc.returncode})",
                          self.name)
        try:
            self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
            self.proc.stdin.flush()
        except OSError as e:
            raise self._fail(cmd.get("cmd", "?"), f"stdin: {e}") from None
        return self._answer(timeout, cmd.get("cmd", "?"))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.request({"cmd": "quit"}, timeout=10)
                self.proc.wait(timeout=10)
            except (KtError, subprocess.TimeoutExpired):
                pass
        self.kill()


# ---------------------------------------------------------------------------- a bench run
def _bits(a) -> np.ndarray:
    """numpy of a numpy array or torch tensor; bfloat16 as its uint16 bits (numpy has no
    bfloat16 of its own)."""
    if not isinstance(a, np.ndarray):  # a torch tensor
        import torch
        if a.dtype == torch.bfloat16:
            return a.contiguous().view(torch.int16).numpy().view(np.uint16)
        return a.contiguous().numpy()
    a = np.ascontiguousarray(a)
    return a.view(np.uint16) if a.dtype.name == "bfloat16" else a


class Session:
    """The kt contenders of one ``cpumoe bench`` run: the venv (made first when ``mode`` is
    ``create``), a temporary folder for the arrays, and the workers."""

    def __init__(self, mode: str, max_tokens: int, say=None, threads: Optional[int] = None):
        self.max_tokens = max_tokens
        self.threads = threads  # kt's pool size (None: the layer's threads)
        self.venv = venv_dir()
        self.error: Optional[str] = off_x86()
        self.info: Optional[Dict[str, Any]] = None if self.error else venv_info(self.venv)
        if self.error is None and self.info is None and mode == "create":
            try:
                self.info = create_venv(self.venv, say)
            except (KtError, OSError) as e:
                self.error = str(e)
        elif self.error is None and self.info is None:
            self.error = (f"kt-kernel's venv is not at {self.venv} (make it once with "
                          f"--kt-venv create; $CPUMOE_KT_VENV moves it)")
        self.argv = [venv_python(self.venv), "-I", WORKER]
        self.tmp: Optional[str] = None
        self.workers: List[Worker] = []
        self._n = 0

    def describe(self) -> str:
        if self.error:
            return self.error
        i = self.info
        threads = f"{self.threads} pool threads" if self.threads else "pool of --threads"
        return (f"kt-kernel {i.get('kt_kernel')} ({i.get('variant')} extension, int8 kernel "
                f"{i.get('int8_kernel')}), torch {i.get('torch')}, in {self.venv}; a worker "
                f"process per contender ({threads}, its caller spinning), each call timed "
                f"there around forward")

    def to_json(self) -> Dict[str, Any]:
        return {"venv": self.venv, "info": self.info, "error": self.error}

    def _dir(self, what: str) -> str:
        if self.tmp is None:
            self.tmp = tempfile.mkdtemp(prefix="cpumoe-kt-")
        self._n += 1
        d = os.path.join(self.tmp, f"{self._n}-{what}")
        os.makedirs(d)
        return d

    def write(self, what: str, arrays: Dict[str, np.ndarray]) -> Dict[str, str]:
        """Saves ``arrays`` as .npy files in a new folder; returns their paths."""
        d = self._dir(what)
        out = {}
        for k, a in arrays.items():
            out[k] = os.path.join(d, f"{k}.npy")
            np.save(out[k], a)
        return out

    def start(self, name: str) -> Worker:
        if self.error:
            raise KtError(self.error, name)
        w = Worker(self.argv, os.path.join(self._dir(name), "worker.log"), name)
        self.workers.append(w)
        return w

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.workers = []
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None


def check_problem(name: str, layer) -> None:
    """Raises Unsupported when kt-kernel does not compute the layer's problem."""
    if layer.activation != "silu":
        raise Unsupported(f"kt-kernel's MoE computes silu(gate) * up, not {layer.activation}")
    if layer.bias:
        raise Unsupported("kt-kernel's MoE has no expert biases")
    if layer.dtype != "bfloat16":
        raise Unsupported(f"kt-kernel takes bf16 activations, not {layer.dtype}")
    if CONTENDERS[name][0] == "fp8" and (layer.H % 128 or layer.I % 128):
        raise Unsupported(f"kt-kernel's FP8 blocks are 128 x 128: H = {layer.H} and I = "
                          f"{layer.I} must be multiples of 128")


def weight_bytes(name: str) -> float:
    """Bytes per weight in kt's layout: int8 / fp8 values (fp8: an fp32 scale per 128 x 128),
    bf16, 4-bit values with a bf16 scale per group."""
    fmt, q = CONTENDERS[name]
    if fmt == "bf16":
        return 2.0
    if fmt == "int8":
        return 1.0
    if fmt == "fp8":
        return 1.0 + 4 / (128 * 128)
    return 0.5 + 2 / q[1]


def contender(session: Session, name: str, layer, arrays: Dict[str, Any], ref: str):
    """The kt contender ``name`` on ``layer``: a worker started and loaded with ``arrays``
    (w13, w2 and, quantized, s13, s2: lib tensors or numpy) whose call is ``fn`` for the check
    and whose timing is ``timed`` (see contenders.Contender). Raises Unsupported or KtError."""
    from .contenders import Contender
    check_problem(name, layer)
    lib = layer.lib
    files = session.write(name + "-weights", {k: _bits(a) for k, a in arrays.items()})
    w = session.start(name)
    try:
        res = w.request({"cmd": "load", "fmt": CONTENDERS[name][0], "E": layer.E, "k": layer.k,
                         "H": layer.H, "I": layer.I, "threads": session.threads or layer.threads,
                         "max_tokens": session.max_tokens, "files": files}, LOAD_TIMEOUT)
    except KtError:
        w.close()
        raise
    finally:
        shutil.rmtree(os.path.dirname(next(iter(files.values()))), ignore_errors=True)
    w.what = f"kt {res['class']}"
    io = session._dir(name + "-io")

    def arr(key: str, a) -> str:
        path = os.path.join(io, f"{key}.npy")
        np.save(path, a)
        return path

    def guarded(f):  # the bench catches KtError: a worker's trouble must not end it
        def g(*a):
            try:
                return f(*a)
            except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
                raise KtError(f"kt contender {name}: {type(e).__name__}: {e}", name) from e
        return g

    @guarded
    def fn(x, wts, ids, out):
        o = os.path.join(io, "out.npy")
        w.request({"cmd": "run", "x": arr("x", _bits(x)), "ids": arr("ids", _bits(ids)),
                   "weights": arr("w", _bits(wts)), "out": o})
        got = np.load(o)
        if lib.torch is not None:
            out.copy_(lib.torch.from_numpy(got).to(out.dtype))
        else:
            out[...] = got.astype(out.dtype)

    @guarded
    def prepare(x, routes):
        w.request({"cmd": "inputs", "x": arr("px", _bits(x)),
                   "routes": [[arr(f"ids{j}", np.asarray(i)), arr(f"w{j}", np.asarray(r))]
                              for j, (i, r) in enumerate(routes)]})

    @guarded
    def timed(n: int) -> float:
        return float(w.request({"cmd": "time", "route": n, "count": 1})["seconds"][0])

    variant = w.hello.get("variant")
    kernel = f"kt {res['class']} ({variant})"
    if session.threads and session.threads != layer.threads:
        kernel += f" x{session.threads}"
    c = Contender(name, name, None, kernel, weight_bytes(name), fn, ref)
    c.prepare, c.timed, c.pause, c.close = prepare, timed, SPIN_PAUSE_S, w.close
    return c
