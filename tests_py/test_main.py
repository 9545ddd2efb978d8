"""The ``cpumoe`` command (python -m cpumoe) on a small problem: check, table, exit codes."""

from __future__ import annotations

import pytest

import cpumoe
from cpumoe import cli

SMALL = ["--tokens", "1,5", "--experts", "8", "--topk", "2", "--hidden", "64", "--inter", "32",
         "--iters", "2", "--warmup", "1", "--threads", "1"]


def _argv(backend, *extra):
    return SMALL + ["--backend", backend.name, *extra]


def test_main_passes_and_prints_table(backend, capsys):
    assert cli.main(_argv(backend, "--activation", "swigluoai", "--bias")) == 0
    out = capsys.readouterr().out
    # Every path this CPU runs is checked at each T.
    assert out.count("PASS") == 2 * len(cpumoe.available_paths()) and "FAIL" not in out
    assert "ms/call" in out and "tokens/s" in out
    assert "threads  1" in out
    rows = [ln.split() for ln in out.splitlines() if ln.split()[:1] in (["1"], ["5"])]
    assert len(rows) == 2 and all(r[1] in cpumoe.available_paths() for r in rows)


def test_main_no_check_and_isa(backend, capsys):
    assert cli.main(_argv(backend, "--no-check", "--isa", "portable", "--dtype", "fp16")) == 0
    out = capsys.readouterr().out
    assert "check    " not in out and "PASS" not in out
    # --isa reaches the op: the layer is packed for portable and the timed rows run it (the
    # paths line names portable whatever the cap, so it proves nothing).
    assert "(selected: portable, capped by --isa portable)" in out
    assert "s for portable (" in next(ln for ln in out.splitlines() if ln.startswith("weights"))
    rows = [ln.split() for ln in out.splitlines() if ln.split()[:1] in (["1"], ["5"])]
    assert len(rows) == 2 and all(r[1] == "portable" for r in rows)
    assert out.splitlines()[0].endswith(", float16 (" + backend.name + ")")  # --dtype fp16


def test_main_checks_only_paths_under_the_cap(backend, capsys):
    assert cli.main(_argv(backend, "--isa", "portable")) == 0
    checks = [ln for ln in capsys.readouterr().out.splitlines() if "PASS" in ln]
    assert len(checks) == 2 and all(" portable " in ln for ln in checks)


def test_main_fails_on_wrong_result(backend, capsys, monkeypatch):
    import cpumoe.reference as ref
    real = ref.ref_fused_moe_int8

    def broken(*a, **kw):
        return real(*a, **kw) * 2  # torch tensor or numpy array alike

    monkeypatch.setattr(ref, "ref_fused_moe_int8", broken)
    assert cli.main(_argv(backend, "--dtype", "fp32")) == 1
    assert "FAIL" in capsys.readouterr().out


def test_main_rejects_bad_arguments(backend, capsys):
    with pytest.raises(SystemExit):
        cli.main(["--tokens", "a,b"])
    assert cli.main(_argv(backend, "--isa", "bogus")) == 2
    assert "isa" in capsys.readouterr().err
    assert cli.main(_argv(backend, "--topk", "9")) == 2
