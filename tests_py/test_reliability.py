"""Reliability of the public op: defined semantics for odd but valid input (k > E, duplicate ids,
NaN/inf, zero rows), a seeded random-shape fuzz against the reference, determinism across
thread counts and repeated calls, concurrent callers, and memory (scratch bound, reuse, no RSS
growth over 1000 calls). The bad-input matrix is in test_errors.py.
"""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest

import cpumoe
from cpumoe import _C
from conftest import MOE_ATOL_OF_SCALE, MOE_RTOL, assert_moe_close, make_problem

DTYPES = ("float32", "float16", "bfloat16")
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swigluoai")
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
