"""``cpumoe bench``'s kt-kernel contenders (python/cpumoe/cli/bench/kt_cpu.py): the skip without
kt-kernel's venv, and the parent side (worker protocol, check, alternation, timing, a worker
that fails) against a stand-in worker (fake_kt_worker.py, numpy only). One test runs the real
kt-kernel when its venv is on this machine (``cpumoe bench --kt-venv create`` makes it)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from cpumoe import cli
from cpumoe.cli.bench import kt_cpu, timing

FAKE = str(Path(__file__).with_name("fake_kt_worker.py"))
TINY = ["--experts", "8", "--topk", "2", "--hidden", "64", "--inter", "32", "--threads", "1",
        "--probe-mib", "8", "--no-progress", "--weights", "cold", "--dtype", "bf16"]


def _bench(backend, capsys, tmp_path, contenders, *extra):
    js = tmp_path / "b.json"
    argv = ["bench", *TINY, "--backend", backend.name, "--contenders", contenders,
            "--json", str(js), *extra]
    code = cli.main(argv)
    return code, capsys.readouterr().out, json.loads(js.read_text())


@pytest.fixture
def fake_venv(tmp_path, monkeypatch):
    """A 'venv' whose python is this one, marked ready, with the stand-in worker. x86-64 only:
    elsewhere the bench skips kt before it starts a worker (test_skip_without_venv), and under
    qemu-user (the cross-python stage) this python could not be started as a child anyway."""
    if kt_cpu.off_x86() is not None:
        pytest.skip(kt_cpu.off_x86())
    d = tmp_path / "kt-venv"
    (d / "bin").mkdir(parents=True)
    os.symlink(sys.executable, d / "bin" / "python")
    (d / kt_cpu.READY).write_text(json.dumps({
        "kt_kernel": kt_cpu.KT_VERSION, "torch": kt_cpu.TORCH_VERSION, "variant": "fake_isa",
        "int8_kernel": None}))
    monkeypatch.setenv("CPUMOE_KT_VENV", str(d))
    monkeypatch.setattr(kt_cpu, "WORKER", FAKE)
    monkeypatch.setattr(kt_cpu, "SPIN_PAUSE_S", 0.001)
    log = tmp_path / "commands.log"
    monkeypatch.setenv("FAKE_KT_LOG", str(log))
    monkeypatch.setenv("FAKE_KT_SECONDS", "0.00125")
    return log


def test_skip_without_venv(backend, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("CPUMOE_KT_VENV", str(tmp_path / "absent"))
    code, out, doc = _bench(backend, capsys, tmp_path, "cpumoe-int8,kt-int8,kt-bf16",
                            "--tokens", "1", "--iters", "1", "--warmup", "0")
    assert code == 0
    for name in ("kt-int8", "kt-bf16"):
        lines = [ln for ln in out.splitlines() if ln.strip().startswith(f"skip   {name}:")]
        assert len(lines) == 1
        if kt_cpu.off_x86() is not None:  # e.g. the aarch64 stage: said before any venv
            assert "kt-kernel ships x86-64 builds only" in lines[0]
            continue
        assert "kt-kernel's venv is not at" in lines[0] and "--kt-venv create" in lines[0]
    assert {r["contender"] for r in doc["results"]} == {"cpumoe-int8"}
    assert doc["kt"]["error"] and not (tmp_path / "absent").exists()  # nothing was made


def test_off_x86_skipped_before_any_venv(backend, capsys, tmp_path, monkeypatch):
    import platform
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    monkeypatch.setenv("CPUMOE_KT_VENV", str(tmp_path / "absent"))
    code, out, doc = _bench(backend, capsys, tmp_path, "cpumoe-int8,kt-bf16", "--tokens", "1",
                            "--iters", "1", "--warmup", "0", "--kt-venv", "create")
    assert code == 0
    lines = [ln for ln in out.splitlines() if ln.strip().startswith("skip   kt-bf16:")]
    assert len(lines) == 1 and "x86-64 builds only (this machine is aarch64)" in lines[0]
    assert not (tmp_path / "absent").exists()  # --kt-venv create made nothing


def test_venv_info_and_create_refuses_other_folders(tmp_path, monkeypatch):
    d = tmp_path / "v"
    (d / "bin").mkdir(parents=True)
    os.symlink(sys.executable, d / "bin" / "python")
    assert kt_cpu.venv_info(str(d)) is None  # no READY file: not finished
    (d / kt_cpu.READY).write_text(json.dumps({"kt_kernel": "0.0.1", "torch": "2.13.0"}))
    assert kt_cpu.venv_info(str(d)) is None  # another kt-kernel
    (d / kt_cpu.READY).write_text(json.dumps({"kt_kernel": kt_cpu.KT_VERSION,
                                              "torch": kt_cpu.TORCH_VERSION + "+cpu"}))
    assert kt_cpu.venv_info(str(d))["kt_kernel"] == kt_cpu.KT_VERSION
    assert kt_cpu.create_venv(str(d)) is not None  # there already: nothing to do
    other = tmp_path / "other"
    other.mkdir()
    (other / "precious.txt").write_text("x")
    with pytest.raises(kt_cpu.KtError, match="not a virtual environment"):
        kt_cpu.create_venv(str(other))
    assert (other / "precious.txt").exists()


def test_fake_worker_checked_alternated_and_timed(backend, capsys, tmp_path, fake_venv):
    code, out, doc = _bench(backend, capsys, tmp_path,
                            "cpumoe-int8,cpumoe-bf16,kt-int8,kt-bf16",
                            "--tokens", "1,3", "--iters", "4", "--rounds", "4", "--warmup", "1")
    assert code == 0, out
    assert "kt       kt-kernel 0.7.2 (fake_isa extension" in out
    for name, ref in (("kt-int8", "int8"), ("kt-bf16", "bf16")):
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(f"check  {name} "))
        assert line.endswith(f"ok (vs {ref} reference, T=3)") and "kt Fake" in line
    rows = {(r["T"], r["contender"]): r for r in doc["results"]}
    for T in (1, 3):
        for name in ("kt-int8", "kt-bf16"):
            r = rows[(T, name)]
            # the worker's own seconds, not this process's clock around the protocol
            assert r["ms_median"] == pytest.approx(1.25) and r["ms_min"] == pytest.approx(1.25)
            assert r["calls"] == 4 and r["kernel"].startswith("kt Fake")
    pairs = {(r["a"], r["b"]) for r in doc["ratios"]}
    assert {("cpumoe-int8", "kt-int8"), ("cpumoe-bf16", "kt-bf16")} <= pairs
    assert "cpumoe-int8/kt-int8" in out
    # Two workers; per point each gets 'inputs', a warm-up call, then one call per round, the
    # rounds alternating the four contenders in rotated order (round r starts with the r-th:
    # round 3 with kt-bf16, the others with cpumoe's ops or kt-int8).
    lines = [ln.split() for ln in fake_venv.read_text().splitlines()]
    pids = list(dict.fromkeys(p for p, *_ in lines))
    assert len(pids) == 2
    for cmd in ("load", "run", "quit"):
        assert sorted(p for p, c, *_ in lines if c == cmd) == sorted(pids)
    timed = [(p, c) for p, c, *_ in lines if c in ("inputs", "time")]
    for point in range(2):
        seq = timed[point * 12:(point + 1) * 12]
        assert [c for _, c in seq].count("inputs") == 2 and len(seq) == 12
        rounds = [p for p, c in seq[4:]]  # after both warm-ups: 4 rounds of 2 calls
        assert all(sorted(rounds[i:i + 2]) == sorted(pids) for i in (0, 2, 4, 6))
        assert rounds[0] == rounds[2] == rounds[4] != rounds[6]


def test_fake_worker_wrong_output_is_left_out(backend, capsys, tmp_path, fake_venv, monkeypatch):
    monkeypatch.setenv("FAKE_KT_MODE", "wrong")
    code, out, doc = _bench(backend, capsys, tmp_path, "cpumoe-bf16,kt-bf16",
                            "--tokens", "1", "--iters", "1", "--warmup", "0")
    assert code == 0  # kt's mismatch is reported, it does not fail cpumoe's bench
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("skip   kt-bf16:"))
    assert "kt FakeBF16 (fake_isa) fails the check against the bf16 reference" in line
    assert "not timed" in line
    assert {r["contender"] for r in doc["results"]} == {"cpumoe-bf16"}
    assert "quit" in fake_venv.read_text()  # its worker was ended


@pytest.mark.parametrize("mode", ["crash_time", "crash_load"])
def test_fake_worker_that_dies(backend, capsys, tmp_path, fake_venv, monkeypatch, mode):
    monkeypatch.setenv("FAKE_KT_MODE", mode)
    code, out, doc = _bench(backend, capsys, tmp_path, "cpumoe-int8,kt-int8",
                            "--tokens", "1,2", "--iters", "2", "--warmup", "0")
    assert code == 0, out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("skip   kt-int8:"))
    assert "the worker exited (3)" in line
    got = {(r["T"], r["contender"]) for r in doc["results"]}
    assert {(1, "cpumoe-int8"), (2, "cpumoe-int8")} <= got
    assert not any(c == "kt-int8" for _, c in got)  # its point was timed again without it
    if mode == "crash_time":
        assert line.strip().startswith("skip   kt-int8: kt FakeINT8, time:")
        assert "(at T=1, cold)" in line


def test_worker_protocol_errors_and_timeout(tmp_path, fake_venv, monkeypatch):
    w = kt_cpu.Worker([sys.executable, FAKE], str(tmp_path / "w.log"), "kt-x")
    assert w.hello["variant"] == "fake_isa"
    with pytest.raises(kt_cpu.KtError, match="before load") as e:
        w.request({"cmd": "time", "route": 0})
    assert e.value.contender == "kt-x"
    with pytest.raises(kt_cpu.KtError, match="has no fp8"):
        w.request({"cmd": "load", "fmt": "fp8", "files": {}})
    w.close()
    assert w.proc.returncode == 0
    monkeypatch.setenv("FAKE_KT_MODE", "hang_time")
    w = kt_cpu.Worker([sys.executable, FAKE], str(tmp_path / "w2.log"), "kt-y")
    files = {"w13": str(tmp_path / "a.npy"), "w2": str(tmp_path / "b.npy")}
    import numpy as np
    for f in files.values():
        np.save(f, np.zeros((1, 2, 2), np.uint16))
    w.request({"cmd": "load", "fmt": "bf16", "files": files})
    w.request({"cmd": "inputs", "x": "", "routes": []})
    with pytest.raises(kt_cpu.KtError, match="no answer in 1 s"):
        w.request({"cmd": "time", "route": 0}, timeout=1)
    assert w.proc.returncode is not None  # killed


def test_measure_pauses_after_a_contenders_turn(monkeypatch):
    events = []
    monkeypatch.setattr(timing.time, "sleep", lambda s: events.append(("sleep", s)))

    def call(k):
        def f(n):
            events.append(("call", k))
            return 0.001
        return f
    times, _ = timing.measure({"a": call("a"), "b": call("b")}, None, 0, 2, 1.0, 2, False,
                              pauses={"a": 0.25})
    assert times == {"a": [0.001] * 2, "b": [0.001] * 2}
    # round 1: a (pause) b; round 2: b a (pause); nothing sleeps after b
    assert events == [("call", "a"), ("sleep", 0.25), ("call", "b"),
                      ("call", "b"), ("call", "a"), ("sleep", 0.25)]


def test_real_kt_kernel(backend, capsys, tmp_path, monkeypatch):
    if kt_cpu.off_x86() is not None:
        pytest.skip(kt_cpu.off_x86())
    if kt_cpu.venv_info() is None:
        pytest.skip(f"kt-kernel's venv is not at {kt_cpu.venv_dir()} (cpumoe bench --kt-venv "
                    f"create makes it; it takes minutes and downloads torch)")
    names = ["kt-int8", "kt-bf16", "kt-fp8", "kt-mxfp4", "kt-int4-g32"]
    js = tmp_path / "k.json"
    argv = ["bench", "--experts", "8", "--topk", "2", "--hidden", "256", "--inter", "128",
            "--threads", "1", "--backend", backend.name, "--dtype", "bf16", "--tokens", "1,3",
            "--iters", "2", "--warmup", "0", "--probe-mib", "8", "--weights", "cold",
            "--no-progress", "--contenders", ",".join(["cpumoe-int8", *names]),
            "--json", str(js)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    doc = json.loads(js.read_text())
    ran = {r["contender"] for r in doc["contenders"] if r.get("check_ok")}
    skipped = {r["contender"]: r["skipped"] for r in doc["contenders"] if "skipped" in r}
    # Every kt class this build has for the format passes the check against cpumoe's reference
    # of the same weights; a format this build lacks is skipped with the reason.
    assert set(names) <= ran | set(skipped), out
    assert not [n for n, why in skipped.items() if "fails the check" in why], out
    assert {"kt-int8", "kt-bf16"} <= ran, out
    rows = {(r["T"], r["contender"]) for r in doc["results"]}
    assert all((T, n) in rows for T in (1, 3) for n in ran)
