"""CPU feature detection, the path ladder, and the CPUMOE_ISA cap (in subprocesses, since the
cap is read once per process)."""

from __future__ import annotations

import json
import os
import sys

import pytest

import cpumoe
from conftest import BACKEND_NAME, run_python


def test_cpu_features():
    f = cpumoe.cpu_features()
    assert isinstance(f, dict)
    assert f["arch"] in ("aarch64", "x86_64", "other")
    flags = {k: v for k, v in f.items() if k != "arch"}
    assert flags and all(isinstance(v, bool) for v in flags.values())
    if f["arch"] == "aarch64":
        assert f["neon"]  # every AArch64 CPU has Advanced SIMD
        if f["i8mm"] and not os.environ.get("CPUMOE_ISA"):
            assert "neon_i8mm" in cpumoe.available_paths()


def test_available_paths():
    paths = cpumoe.available_paths()
    assert isinstance(paths, list) and paths
    assert paths[-1] == "portable"
    assert len(set(paths)) == len(paths)
    assert cpumoe.selected_path() in paths
    assert cpumoe.selected_path() == paths[0]
    assert cpumoe.selected_path("portable") == "portable"


def test_kernels_listed():
    ks = cpumoe.kernels()
    assert ks and all({"name", "isa", "mr", "nr", "kr", "supported"} <= set(k) for k in ks)
    supported_paths = {k["isa"] for k in ks if k["supported"]}
    assert set(cpumoe.available_paths()) <= supported_paths
    assert any(k["isa"] == "portable" and k["supported"] for k in ks)


_PROBE = """
import json, sys
out = {}
try:
    import cpumoe
    out["paths"] = cpumoe.available_paths()
    out["selected"] = cpumoe.selected_path()
    import numpy as np
    w13 = np.ones((2, 16, 8), np.int8); w2 = np.ones((2, 8, 8), np.int8)
    p = cpumoe.prepack(w13, w2, np.ones((2, 16), np.float32), np.ones((2, 8), np.float32))
    out["packed_path"] = p.path
except Exception as e:
    out["error"] = [type(e).__name__, isinstance(e, ValueError), str(e)]
out["torch_imported"] = "torch" in sys.modules
print("PROBE " + json.dumps(out))
"""


def _probe(env):
    r = run_python(_PROBE, env)
    assert r.returncode == 0, f"subprocess died (rc {r.returncode}):\n{r.stdout}\n{r.stderr}"
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("PROBE ")]
    assert line, r.stdout + r.stderr
    return json.loads(line[-1][len("PROBE "):])


def test_cpumoe_isa_portable_caps_selection():
    out = _probe({"CPUMOE_ISA": "portable"})
    assert "error" not in out, out
    assert out["paths"] == ["portable"]
    assert out["selected"] == "portable"
    assert out["packed_path"] == "portable"


def test_cpumoe_isa_unset_is_the_default():
    out = _probe({"CPUMOE_ISA": None})
    assert "error" not in out, out
    assert out["paths"][-1] == "portable"
    assert out["selected"] == out["packed_path"] == out["paths"][0]


def test_cpumoe_isa_empty_means_unset():
    out = _probe({"CPUMOE_ISA": ""})
    assert "error" not in out, out
    assert out["paths"][-1] == "portable"


@pytest.mark.parametrize("value", ["bogus", "PORTABLE ", "neon_i8mm_sve"])
def test_cpumoe_isa_invalid_is_a_clear_error(value):
    out = _probe({"CPUMOE_ISA": value})
    assert "error" in out, f"CPUMOE_ISA={value!r} was accepted: {out}"
    name, is_value_error, msg = out["error"]
    assert is_value_error, out["error"]
    assert "CPUMOE_ISA" in msg, msg


def test_import_does_not_need_torch():
    """``import cpumoe`` and a numpy call never import torch (it is optional)."""
    out = _probe({"CPUMOE_ISA": None})
    assert out["torch_imported"] is False


def test_backend_is_numpy_only_when_asked():
    if BACKEND_NAME == "numpy":
        assert "torch" not in sys.modules, "the numpy test backend must not import torch"
    else:
        assert "torch" in sys.modules
