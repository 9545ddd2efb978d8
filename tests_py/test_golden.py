"""cpumoe and cpumoe.reference against the 72 golden cases computed by vLLM's Arm kernel.

The vectors are not part of the repository: they are read from CPUMOE_GOLDEN_DIR, else from
shared/golden/ beside the clone when it exists; without them this module skips. Format: a
manifest (JSON, one entry per case: case, T, H, I, E, k, dtype, activation, bias, skip_weighted)
and an npz holding each case's arrays as ``<case>_<array>`` (x, w13, w2, s13, s2, topk_weights,
topk_ids, b13, b2, out).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import cpumoe
from cpumoe.reference import ref_fused_moe_int8
from conftest import REPO_ROOT, close_report

# The README's bound: an implementation of the op's semantics matches within atol = rtol = 2e-2
# of the output scale (an independent fp64 reference lands within 1.1e-2; bf16 rounding of the
# intermediate activation can flip between implementations).
GOLDEN_ATOL_OF_SCALE = 2e-2
GOLDEN_RTOL = 2e-2

NPZ = "seed_int8_moe_vectors.npz"
MANIFEST = "seed_int8_moe_vectors.json"


def _golden_dir():
    env = os.environ.get("CPUMOE_GOLDEN_DIR")
    if env:
        return Path(env)
    # tests_py/ -> repo root -> its parent -> shared/golden
    return REPO_ROOT.parent / "shared" / "golden"


GOLDEN_DIR = _golden_dir()
if not ((GOLDEN_DIR / NPZ).is_file() and (GOLDEN_DIR / MANIFEST).is_file()):
    pytest.skip(f"golden vectors not found in {GOLDEN_DIR} (set CPUMOE_GOLDEN_DIR)",
                allow_module_level=True)

CASES = json.loads((GOLDEN_DIR / MANIFEST).read_text())


@pytest.fixture(scope="module")
def golden():
    with np.load(GOLDEN_DIR / NPZ) as z:
        yield {name: z[name] for name in z.files}


def _inputs(backend, golden, case):
    c = case["case"]
    dt = case["dtype"]
    g = {name[len(c) + 1:]: golden[name] for name in golden if name.startswith(c + "_")}
    B = backend
    x_np = g["x"]
    x = B.asarray(x_np, dt)
    # The README promises x is exactly representable in the case's dtype.
    assert np.array_equal(B.numpy(x), x_np), "x is not exact in the case's dtype"
    args = dict(x=x, w13=B.asarray(g["w13"]), w2=B.asarray(g["w2"]), s13=B.asarray(g["s13"]),
                s2=B.asarray(g["s2"]), topk_weights=B.asarray(g["topk_weights"]),
                topk_ids=B.asarray(g["topk_ids"]),
                b13=B.asarray(g["b13"], dt) if case["bias"] else None,
                b2=B.asarray(g["b2"], dt) if case["bias"] else None)
    assert ("b13" in g) == case["bias"]
    assert tuple(x_np.shape) == (case["T"], case["H"])
    assert tuple(g["w13"].shape) == (case["E"], 2 * case["I"], case["H"])
    assert tuple(g["topk_ids"].shape) == (case["T"], case["k"])
    return args, g["out"]


def _check(backend, out, gold, case):
    assert backend.dtype_name(out) == case["dtype"]
    ok, msg = close_report(backend.numpy(out), gold, GOLDEN_ATOL_OF_SCALE, GOLDEN_RTOL)
    assert ok, f"{case}: {msg}"


@pytest.mark.parametrize("case", CASES, ids=[c["case"] for c in CASES])
def test_kernel_matches_golden(backend, golden, case):
    a, gold = _inputs(backend, golden, case)
    packed = cpumoe.prepack(a["w13"], a["w2"], a["s13"], a["s2"], a["b13"], a["b2"])
    out = cpumoe.fused_moe_int8(a["x"], packed, a["topk_weights"], a["topk_ids"],
                                activation=case["activation"],
                                skip_weighted=case["skip_weighted"])
    _check(backend, out, gold, case)


@pytest.mark.parametrize("case", CASES, ids=[c["case"] for c in CASES])
def test_reference_matches_golden(backend, golden, case):
    a, gold = _inputs(backend, golden, case)
    ref = ref_fused_moe_int8(a["x"], a["w13"], a["w2"], a["s13"], a["s2"], a["topk_weights"],
                             a["topk_ids"], activation=case["activation"], b13=a["b13"],
                             b2=a["b2"], skip_weighted=case["skip_weighted"])
    _check(backend, ref, gold, case)


def test_manifest_complete(golden):
    assert len(CASES) == 72
    assert len({c["case"] for c in CASES}) == 72
    for c in CASES:
        assert f"{c['case']}_out" in golden
