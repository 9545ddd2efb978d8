"""Reliability of the public op: defined semantics for odd but valid input (k > E, duplicate ids,
NaN/inf, zero rows), a seeded random-shape fuzz against the reference, determinism across
thread counts and repeated calls, concurrent callers, and memory (scratch bound, reuse, no RSS
growth over 1000 calls); no raw-address doors in the shipped module and no write into read-only
memory through out; the hammer (ids rewritten by another thread during calls) and the soak
(CPUMOE_SOAK_CALLS random calls, default 20000, bounded memory). The bad-input matrix is in
test_errors.py.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time

import numpy as np
import pytest

import cpumoe
from cpumoe import _C
from conftest import MOE_ATOL_OF_SCALE, MOE_RTOL, activation_specs, assert_moe_close, make_problem

DTYPES = ("float32", "float16", "bfloat16")
ACTIVATIONS = activation_specs()
UNDER_QEMU = bool(os.environ.get("QEMU_CPU"))  # ci/test_all.sh's cross-python stage sets it


def _assert_same_nonfinite_and_close(backend, out, ref):
    """NaN exactly where the reference has NaN (and inf where it has inf); the rest within the
    usual tolerance of the finite part's scale."""
    o, r = backend.numpy(out).astype(np.float32), backend.numpy(ref).astype(np.float32)
    assert np.array_equal(np.isnan(o), np.isnan(r)), (
        f"NaN at {np.argwhere(np.isnan(o)).tolist()[:8]}..., reference "
        f"{np.argwhere(np.isnan(r)).tolist()[:8]}...")
    assert np.array_equal(np.isinf(o), np.isinf(r))
    assert np.array_equal(o[np.isinf(o)], r[np.isinf(r)])
    fin = np.isfinite(r)
    if fin.any():
        scale = float(np.abs(r[fin]).max())
        err = np.abs(o[fin].astype(np.float64) - r[fin])
        assert (err <= MOE_ATOL_OF_SCALE * scale + MOE_RTOL * np.abs(r[fin])).all(), err.max()


# ---------------------------------------------------------------------------- valid odd input
@pytest.mark.parametrize("k", [5, 8])
def test_k_greater_than_E_counts_every_slot(backend, k):
    """k > E: ids must repeat; each slot counts with its own weight (no dedup, no error)."""
    p = make_problem(backend, T=9, E=4, k=4, H=64, I=32, dtype="bfloat16", bias=True)
    rng = np.random.default_rng(k)
    ids = backend.asarray(rng.integers(0, 4, (9, k), dtype=np.int32))
    w = backend.asarray(rng.random((9, k), dtype=np.float32))
    assert_moe_close(backend, p.run(topk_ids=ids, topk_weights=w),
                     p.reference(topk_ids=ids, topk_weights=w))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_nan_and_inf_in_x_make_that_token_nan(backend, dtype, activation):
    """A token with a NaN or an inf anywhere in x gets an all-NaN row, like the reference;
    every other token is unaffected. Nothing crashes, nothing is silently finite."""
    p = make_problem(backend, T=8, E=4, k=2, H=32, I=16, dtype=dtype, activation=activation,
                     bias=True)
    x = backend.numpy(p.x).astype(np.float32)
    x[1, 5] = np.nan
    x[3, 0] = np.inf
    x[4, 31] = -np.inf
    x[6, :] = np.nan
    x[7, :] = 0.0  # an all-zero token quantizes to zeros: finite (the biases)
    xt = backend.asarray(x, dtype)
    out, ref = p.run(x=xt), p.reference(x=xt)
    _assert_same_nonfinite_and_close(backend, out, ref)
    bad = np.isnan(backend.numpy(out)).any(axis=1)
    assert bad.tolist() == [False, True, False, True, True, False, True, False]
    assert np.isnan(backend.numpy(out)[bad]).all()


def test_nan_weights_and_biases_propagate_like_the_reference(backend):
    p = make_problem(backend, T=6, E=4, k=2, H=32, I=16, dtype="float32", bias=True)
    w = backend.numpy(p.topk_weights).copy()
    w[1, 0] = np.nan
    w[2, 1] = np.inf
    wt = backend.asarray(w)
    _assert_same_nonfinite_and_close(backend, p.run(topk_weights=wt), p.reference(topk_weights=wt))
    b13 = backend.numpy(p.b13).copy()
    b13[0, 3] = np.nan  # expert 0's gate column 3: every token on expert 0 becomes NaN
    p.b13 = backend.asarray(b13)
    out, ref = p.run(), p.reference()
    _assert_same_nonfinite_and_close(backend, out, ref)
    on_expert0 = (backend.numpy(p.topk_ids) == 0).any(axis=1)
    assert np.isnan(backend.numpy(out)).any(axis=1).tolist() == on_expert0.tolist()


# ---------------------------------------------------------------------------- fuzz
ROUTINGS = ("uniform", "all_on_one", "skewed", "repeats")


def _fuzz_case(seed):
    rng = np.random.default_rng([6, seed])
    T = int(rng.choice([0, 1, 2, 5, 17, 40, 100]))
    E = int(rng.integers(1, 13))
    k = int(rng.integers(1, min(E, 6) + 1))
    H, I = (8 * int(v) for v in rng.integers(1, 9, 2))
    case = dict(T=T, E=E, k=k, H=H, I=I, dtype=str(rng.choice(DTYPES)),
                activation=str(rng.choice(ACTIVATIONS)), bias=bool(rng.integers(2)),
                skip_weighted=k == 1 and bool(rng.integers(2)), seed=seed)
    return case, str(ROUTINGS[seed % len(ROUTINGS)]), rng


@pytest.mark.parametrize("seed", range(24))
def test_fuzz_against_reference(backend, seed):
    """Random shapes, dtypes, activations, biases and routing skews (all tokens on one expert
    included) through the public API: close to the reference, same bits on every path."""
    case, routing, rng = _fuzz_case(seed)
    p = make_problem(backend, **case)
    T, E, k = case["T"], case["E"], case["k"]
    if routing == "all_on_one":
        ids = np.full((T, k), int(rng.integers(E)), np.int32)
    elif routing == "skewed":
        ids = np.minimum((E * rng.random((T, k)) ** 3).astype(np.int32), E - 1)
    elif routing == "repeats":
        ids = rng.integers(0, E, (T, k), dtype=np.int32)
    else:
        ids = None
    kw = {} if ids is None else dict(topk_ids=backend.asarray(ids))
    out = p.run(**kw)
    assert_moe_close(backend, out, p.reference(**kw))
    for path in cpumoe.available_paths()[1:]:
        assert np.array_equal(backend.bits(p.run(p.prepack(isa=path), **kw)), backend.bits(out))


# ---------------------------------------------------------------------------- determinism
@pytest.mark.parametrize("dtype", DTYPES)
def test_bitwise_identical_for_1_2_4_threads_and_repeated_calls(backend, dtype):
    p = make_problem(backend, T=45, E=8, k=4, H=128, I=64, dtype=dtype, activation="gelu",
                     bias=True)
    for path in cpumoe.available_paths():
        packed = p.prepack(isa=path)
        want = backend.bits(p.run(packed, num_threads=1))
        for rep in range(3):
            for threads in (1, 2, 4):
                got = backend.bits(p.run(packed, num_threads=threads))
                assert np.array_equal(got, want), f"{path}, {threads} threads, repetition {rep}"


def test_eight_python_threads_match_serial_calls(backend):
    """8 threads call the op at once (the GIL is released around the kernel) on one packed
    layer, each with its own inputs and shapes: every result equals the serial call's."""
    base = make_problem(backend, T=1, E=8, k=2, H=64, I=64, dtype="bfloat16", bias=True)
    packed = base.prepack()
    problems = [make_problem(backend, T=3 + 9 * i, E=8, k=2, H=64, I=64, dtype="bfloat16",
                             bias=True, seed=100 + i) for i in range(8)]
    want = [backend.bits(q.run(packed, num_threads=1)) for q in problems]
    reps = 3 if UNDER_QEMU else 20
    barrier = threading.Barrier(8)
    errors = []

    def worker(i):
        try:
            barrier.wait()
            for r in range(reps):
                got = backend.bits(problems[i].run(packed, num_threads=1 + (i + r) % 2))
                if not np.array_equal(got, want[i]):
                    errors.append(f"thread {i}, repetition {r}: differs from the serial call")
        except Exception as e:  # reported below: an exception in a thread must fail the test
            errors.append(f"thread {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_gil_released_during_the_call(backend):
    """A Python thread keeps running while another thread is inside a (long) call."""
    p = make_problem(backend, T=2048, E=4, k=2, H=256, I=256, dtype="float32")
    packed = p.prepack()
    ticks, done = [], threading.Event()

    def ticker():
        while not done.is_set():
            ticks.append(1)
            done.wait(0.001)

    t = threading.Thread(target=ticker)
    t.start()
    try:
        for _ in range(3):
            start = len(ticks)
            p.run(packed, num_threads=1)
            if len(ticks) > start + 1:
                break
    finally:
        done.set()
        t.join()
    assert len(ticks) > start + 1, "no Python code ran during the call: GIL held?"


# ---------------------------------------------------------------------------- memory
def test_scratch_bytes_bounds_what_a_thread_holds(backend):
    """scratch_bytes(T, k, packed) is an upper bound of the scratch a call leaves in its thread;
    it is reused (not grown) by later calls of the same or smaller size and stops growing
    beyond one chunk of 16384 slots. Runs in new threads, which start without scratch."""
    p = make_problem(backend, T=300, E=8, k=4, H=128, I=64, dtype="float16", bias=True)
    packed = p.prepack()
    small = make_problem(backend, T=7, E=8, k=4, H=128, I=64, dtype="float16", bias=True)
    seen = {}

    def work():
        seen["before"] = _C.thread_scratch_bytes()
        p.run(packed, num_threads=2)
        seen["after"] = _C.thread_scratch_bytes()
        for _ in range(5):
            small.run(packed, num_threads=2)
            p.run(packed, num_threads=2)
        seen["later"] = _C.thread_scratch_bytes()
        _C.release_thread_scratch()
        seen["released"] = _C.thread_scratch_bytes()

    t = threading.Thread(target=work)
    t.start()
    t.join()
    bound = cpumoe.scratch_bytes(300, 4, packed, num_threads=2)
    assert seen["before"] == 0
    assert 0 < seen["after"] <= bound
    assert seen["later"] == seen["after"]
    assert seen["released"] == 0
    assert cpumoe.scratch_bytes(0, 4, packed) == 0
    assert cpumoe.scratch_bytes(1, 1, packed) < cpumoe.scratch_bytes(7, 4, packed) < bound
    chunk = cpumoe.scratch_bytes(4096, 4, packed)
    assert cpumoe.scratch_bytes(10**9, 4, packed) == chunk  # one chunk, for any batch
    # Bound of a Qwen3-30B-A3B layer at 16384 slots: intermediate buffers beyond 2**31 bytes
    # would need int64 offsets; the planner's arithmetic is 64-bit (see test_reliability.cpp).
    with pytest.raises(ValueError, match="^T"):
        cpumoe.scratch_bytes(-1, 4, packed)
    with pytest.raises(ValueError, match="^k"):
        cpumoe.scratch_bytes(4, 0, packed)
    with pytest.raises(ValueError, match="^T"):  # beyond int64: named, not pybind's TypeError
        cpumoe.scratch_bytes(2**63, 4, packed)
    with pytest.raises(ValueError, match="^k"):
        cpumoe.scratch_bytes(4, 2**64, packed)
    with pytest.raises(TypeError, match="^packed"):
        cpumoe.scratch_bytes(4, 2, "packed")


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
@pytest.mark.skipif(UNDER_QEMU, reason="under qemu-user the RSS is the emulator's (and slow)")
@pytest.mark.skipif("libasan" in os.environ.get("LD_PRELOAD", ""),
                    reason="ASan's quarantine keeps freed memory resident by design")
def test_no_rss_growth_over_1000_calls(backend):
    p = make_problem(backend, T=64, E=8, k=2, H=128, I=128, dtype="bfloat16", bias=True)
    packed = p.prepack()
    out = backend.empty((64, 128), "bfloat16")
    per_call = cpumoe.scratch_bytes(64, 2, packed, num_threads=2)
    for _ in range(50):  # warm up: scratch, OpenMP pool, allocator caches
        p.run(packed, num_threads=2)
        p.run(packed, out=out, num_threads=2)
    held = _C.thread_scratch_bytes()
    before = _rss_bytes()
    for i in range(1000):
        if i % 2:
            p.run(packed, num_threads=2)  # a new output each call, freed by the caller
        else:
            p.run(packed, out=out, num_threads=2)
    growth = _rss_bytes() - before
    assert _C.thread_scratch_bytes() == held, "scratch was reallocated"
    # A leak of anything per call (the scratch alone is per_call bytes) would show as megabytes.
    assert growth < 2 * 2**20, f"RSS grew by {growth} bytes over 1000 calls (scratch {per_call})"


# ---------------------------------------------------------------------------- no raw doors
def test_shipped_module_has_no_test_only_raw_address_entry_points():
    """The shipped _C keeps only the checked entry points; the raw quantizer lives in the
    test-only module (built for the test stages, not installed by pip install .)."""
    assert not hasattr(_C, "quantize_rows")
    try:
        from cpumoe import _C_testing
    except ImportError:
        return  # an installed package: the test module is not there, as intended
    assert hasattr(_C_testing, "quantize_rows")


def _native_call_args(x, tw, ids, out):
    """The raw arguments of _C.fused_moe_int8/bf16 for numpy x, topk_weights, topk_ids, out."""
    from cpumoe._tensors import view
    xv, wv, iv, ov = view("x", x), view("topk_weights", tw), view("topk_ids", ids), view("out", out)
    T, k = iv.shape
    return (T, k, xv.address, xv.strides[0], xv.dtype, wv.address, wv.strides[0], iv.address,
            iv.dtype == "int64", iv.strides[0], "silu", False, ov.address, ov.strides[0], 1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mmap PROT_READ")
def test_out_over_read_only_memory_is_refused(backend):
    """A read-only numpy out is refused by the Python layer; a torch tensor has no read-only flag,
    so one made over read-only memory (torch.from_numpy of a read-only mapping) reaches the native
    op, which probes out's pages and raises instead of dying of SIGSEGV."""
    import mmap
    import warnings
    p = make_problem(backend, T=4, E=4, k=2, H=64, I=32)
    packed = p.prepack()
    x = np.ascontiguousarray(backend.numpy(p.x), np.float32)
    tw, ids = backend.numpy(p.topk_weights), backend.numpy(p.topk_ids)
    mm = mmap.mmap(-1, 8192, prot=mmap.PROT_READ)
    ro = np.frombuffer(mm, np.float32, count=4 * 64).reshape(4, 64)
    with pytest.raises(ValueError, match="^out: is read-only"):
        cpumoe.fused_moe_int8(x, packed, tw, ids, out=ro)
    with pytest.raises(ValueError, match="^out: its memory is not writable"):
        _C.fused_moe_int8(packed, *_native_call_args(x, tw, ids, ro))
    # One writable page then a read-only one: every page is probed, not just the first.
    mixed = mmap.mmap(-1, 8192)
    addr = np.frombuffer(mixed, np.uint8).__array_interface__["data"][0]
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mprotect(ctypes.c_void_p(addr + 4096), ctypes.c_size_t(4096), 1) == 0  # PROT_READ
    rows = np.frombuffer(mixed, np.float32).reshape(32, 64)[14:18]  # bytes 3584..4607
    with pytest.raises(ValueError, match="^out: its memory is not writable"):
        _C.fused_moe_int8(packed, *_native_call_args(x, tw, ids, rows))
    if backend.torch is not None:
        torch = backend.torch
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns that the array is not writable
            t = torch.from_numpy(ro)
        with pytest.raises(ValueError, match="^out: its memory is not writable"):
            cpumoe.fused_moe_int8(torch.from_numpy(x), packed, torch.from_numpy(tw),
                                  torch.from_numpy(ids), out=t)
    assert not np.frombuffer(mm, np.uint8).any()  # nothing was written
    # A writable out in the same kind of memory works.
    rw = np.frombuffer(mmap.mmap(-1, 8192), np.float32, count=4 * 64).reshape(4, 64)
    assert_moe_close(backend, backend.asarray(cpumoe.fused_moe_int8(x, packed, tw, ids, out=rw)),
                     backend.asarray(backend.numpy(p.reference(x=backend.asarray(x)))))


# ---------------------------------------------------------------------------- the hammer
def _bf16_weights(backend, p):
    """The int8 problem's layer as bf16 weights (w * scale)."""
    B = backend
    w13 = B.numpy(p.w13).astype(np.float32) * B.numpy(p.s13)[:, :, None]
    w2 = B.numpy(p.w2).astype(np.float32) * B.numpy(p.s2)[:, :, None]
    return B.asarray(w13, "bfloat16"), B.asarray(w2, "bfloat16")


# Per caller thread; fewer under qemu-user (30-60 times slower: 200 calls took 46 s there), where
# the cross-python stage runs this file on two CPU models.
HAMMER_CALLS = int(os.environ.get("CPUMOE_HAMMER_CALLS", "60" if UNDER_QEMU else "1000"))


def test_hammer_ids_rewritten_while_other_threads_call(backend):
    """One thread rewrites topk_ids (and the expert map) with random values in [-5, E + 10^6)
    and back, while two threads call fused_moe_int8 and fused_moe_bf16 HAMMER_CALLS times each,
    with and without an expert map: every call returns or raises ValueError (the ids are copied
    once and the copy checked). Before that copy, 3 of 5 such processes died of SIGSEGV."""
    E, G, T, k = 16, 24, 64, 4
    p = make_problem(backend, T=T, E=E, k=k, H=256, I=128, dtype="bfloat16", bias=True)
    packed = p.prepack(num_threads=1)
    w13, w2 = _bf16_weights(backend, p)
    packed16 = cpumoe.prepack_bf16(w13, w2, p.b13, p.b2, num_threads=1)
    ids = backend.asarray(backend.numpy(p.topk_ids).astype(np.int32))
    ids_np = ids.numpy() if backend.torch is not None else ids  # the same memory
    valid_ids = ids_np.copy()
    emap_np = np.array([-1 if g % 3 == 2 else g % E for g in range(G)], np.int32)
    emap = backend.asarray(emap_np, copy=False)
    emap_np = emap.numpy() if backend.torch is not None else emap
    valid_map = emap_np.copy()
    stop = threading.Event()

    def writer():
        rng = np.random.default_rng(17)
        while not stop.is_set():
            t, j, g = int(rng.integers(T)), int(rng.integers(k)), int(rng.integers(G))
            ids_np[t, j] = rng.integers(-5, E + 10**6)
            if rng.random() < 0.25:
                emap_np[g] = rng.integers(-5, E + 10**6)
            time.sleep(0)  # lets the callers take the GIL: the wrong value stays for a while
            ids_np[t, j] = valid_ids[t, j]
            emap_np[g] = valid_map[g]
            time.sleep(0)

    results = {"int8": [0, 0, []], "bf16": [0, 0, []]}

    def caller(name, op, pk):
        r = results[name]
        for i in range(HAMMER_CALLS):
            try:
                out = op(p.x, pk, p.topk_weights, ids, expert_map=emap if i % 2 else None,
                         num_threads=1)
                assert tuple(out.shape) == (T, 256)
                r[0] += 1
            except ValueError:
                r[1] += 1
            except BaseException as e:  # noqa: BLE001 - recorded, reported below
                r[2].append(repr(e))

    threads = [threading.Thread(target=writer),
               threading.Thread(target=caller, args=("int8", cpumoe.fused_moe_int8, packed)),
               threading.Thread(target=caller, args=("bf16", cpumoe.fused_moe_bf16, packed16))]
    for th in threads:
        th.start()
    for th in threads[1:]:
        th.join()
    stop.set()
    threads[0].join()
    for name, (ok, value_errors, other) in results.items():
        print(f"hammer {name}: {ok} returned, {value_errors} ValueError")
        assert not other, f"{name}: {other[:3]}"
        assert ok + value_errors == HAMMER_CALLS, name


# ---------------------------------------------------------------------------- the soak
SOAK_CALLS = int(os.environ.get("CPUMOE_SOAK_CALLS", "20000"))
_UNDER_ASAN = "libasan" in os.environ.get("LD_PRELOAD", "")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
@pytest.mark.skipif(UNDER_QEMU, reason="under qemu-user the RSS is the emulator's (and slow)")
def test_soak_random_shapes_and_paths_bounded_memory(backend):
    """SOAK_CALLS calls with random T, k, dtype, activation, op (int8 / bf16), expert map, out
    and thread count on four layers: resident memory after the first 1000 calls stays within 5%
    (scratch is bounded), and one call in 100 is checked against the reference. Under ASan (whose
    quarantine keeps freed memory resident) only the checks run, on fewer calls."""
    calls = min(SOAK_CALLS, 5000) if _UNDER_ASAN else SOAK_CALLS
    from cpumoe.reference import ref_fused_moe_bf16, ref_fused_moe_int8
    rng = np.random.default_rng(20000)
    layers = []
    for E, H, I in ((8, 64, 32), (16, 128, 64), (4, 256, 128), (32, 64, 64)):
        p = make_problem(backend, T=1, E=E, k=1, H=H, I=I, bias=E % 8 == 0)
        w13, w2 = _bf16_weights(backend, p)
        layers.append((p, p.prepack(), w13, w2, cpumoe.prepack_bf16(w13, w2, p.b13, p.b2)))
    dtypes = [d for d in DTYPES if backend.torch is not None or d != "bfloat16"
              or _has_ml_dtypes()]
    B = backend
    baseline = None
    checked = 0
    for i in range(calls):
        if i == 1000:
            gc.collect()
            baseline = _rss_bytes()
        # The first 8 calls take each layer's largest T and k on both ops, so the scratch reaches
        # its bound early; the rest are random.
        first = i < 2 * len(layers)
        p, packed, w13, w2, packed16 = layers[i % len(layers) if first else
                                              int(rng.integers(len(layers)))]
        E, H = p.E, p.H
        T = 130 if first else int(rng.choice([0, 1, 2, 7, 16, 33, 64, 130]))
        k = min(E, 8) if first else int(rng.integers(1, min(E, 8) + 1))
        dtype = dtypes[int(rng.integers(len(dtypes)))]
        act = ACTIVATIONS[int(rng.integers(len(ACTIVATIONS)))]
        x = B.asarray(rng.standard_normal((T, H), dtype=np.float32), dtype)
        ids_np = np.argsort(rng.random((T, E)), axis=1)[:, :k].astype(
            np.int32 if rng.random() < 0.5 else np.int64)
        tw_np = rng.random((T, k), dtype=np.float32)
        emap_np = None
        if rng.random() < 0.3:  # expert parallelism: global ids over 2E experts
            emap_np = np.full(2 * E, -1, np.int32)
            emap_np[rng.permutation(2 * E)[:E]] = np.arange(E, dtype=np.int32)
            inv = np.argsort(np.where(emap_np < 0, E + np.arange(2 * E), emap_np))[:E]
            ids_np = np.where(rng.random((T, k)) < 0.8, inv[ids_np],
                              rng.integers(0, 2 * E, (T, k))).astype(ids_np.dtype)
        bf16 = i >= len(layers) if first else rng.random() < 0.5
        out = B.empty((T, H), dtype) if rng.random() < 0.5 else None
        op, pk = (cpumoe.fused_moe_bf16, packed16) if bf16 else (cpumoe.fused_moe_int8, packed)
        got = op(x, pk, B.asarray(tw_np), B.asarray(ids_np), act, out=out,
                 expert_map=None if emap_np is None else B.asarray(emap_np),
                 num_threads=int(rng.integers(1, 3)))
        assert tuple(got.shape) == (T, H)
        if i % 100 == 0 and T > 0:
            # The reference has no expert map: slots of other ranks get weight 0 and id 0.
            local, w = ids_np, tw_np
            if emap_np is not None:
                local = emap_np[ids_np]
                w = np.where(local < 0, np.float32(0), tw_np)
                local = np.where(local < 0, 0, local)
            lt, wt = B.asarray(local.astype(np.int64)), B.asarray(w)
            if bf16:
                ref = ref_fused_moe_bf16(x, w13, w2, wt, lt, act, p.b13, p.b2)
            else:
                ref = ref_fused_moe_int8(x, p.w13, p.w2, p.s13, p.s2, wt, lt, act, p.b13, p.b2)
            assert_moe_close(B, got, ref)
            checked += 1
    assert checked >= calls // 200
    if baseline is not None and not _UNDER_ASAN:
        gc.collect()
        grown = _rss_bytes() - baseline
        print(f"soak: {calls} calls, {checked} checked; RSS after 1000 calls {baseline} bytes, "
              f"at the end {baseline + grown} ({100 * grown / baseline:+.2f}%)")
        assert grown <= 0.05 * baseline, (
            f"RSS {baseline} -> {baseline + grown} bytes after {calls} calls (> 5%)")


def _has_ml_dtypes():
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        return False
    return True
