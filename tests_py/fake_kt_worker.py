"""A stand-in for cpumoe's kt_worker.py (tests_py/test_kt_cpu.py): the same protocol (JSON lines,
.npy files), computed with numpy from the bf16 weights of kt-int8 / kt-bf16, without kt-kernel.

Environment: FAKE_KT_MODE = ok (default), wrong (outputs doubled), crash_time (exits at the
second timed call), hang_time (never answers a timed call), crash_load (exits at the load);
FAKE_KT_SECONDS: the seconds each timed call reports (default 0.002); FAKE_KT_LOG: a file to
which each command is appended as a line "<pid> <cmd> [route]".
"""

import json
import os
import sys
import time

import numpy as np

MODE = os.environ.get("FAKE_KT_MODE", "ok")
SECONDS = float(os.environ.get("FAKE_KT_SECONDS", "0.002"))
LOG = os.environ.get("FAKE_KT_LOG")


def bf16(bits):
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def moe(x, w13, w2, ids, wts):
    I = w13.shape[1] // 2
    out = np.zeros((x.shape[0], w2.shape[1]), np.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e].astype(np.float64) @ x[t]
            g, u = h[:I], h[I:]
            out[t] += wts[t, j] * (w2[e].astype(np.float64) @ (g / (1 + np.exp(-g)) * u))
    return out.astype(np.float32) * (2 if MODE == "wrong" else 1)


def main():
    out = sys.stdout

    def reply(obj):
        out.write(json.dumps(obj) + "\n")
        out.flush()

    reply({"ok": True, "kt_kernel": "fake", "variant": "fake_isa", "int8_kernel": None,
           "torch": None, "numpy": np.__version__, "python": sys.version.split()[0]})
    layer, timed = None, 0
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["cmd"]
        if LOG:
            with open(LOG, "a") as f:
                f.write(f"{os.getpid()} {op} {cmd.get('route', '')}\n".rstrip() + "\n")
        if op == "quit":
            reply({"ok": True})
            return 0
        if op == "load":
            if MODE == "crash_load":
                os._exit(3)
            if cmd["fmt"] not in ("int8", "bf16"):
                reply({"ok": False, "error": f"the fake worker has no {cmd['fmt']}"})
                continue
            layer = {"w13": bf16(np.load(cmd["files"]["w13"])),
                     "w2": bf16(np.load(cmd["files"]["w2"]))}
            reply({"ok": True, "class": "Fake" + cmd["fmt"].upper(), "load_seconds": 0.0})
        elif layer is None:
            reply({"ok": False, "error": f"{op} before load"})
        elif op == "run":
            x = bf16(np.load(cmd["x"]))
            res = moe(x, layer["w13"], layer["w2"], np.load(cmd["ids"]), np.load(cmd["weights"]))
            np.save(cmd["out"], res)
            reply({"ok": True, "seconds": SECONDS})
        elif op == "inputs":
            layer["routes"] = len(cmd["routes"])
            reply({"ok": True})
        elif op == "time":
            timed += 1
            if MODE == "crash_time" and timed == 2:
                os._exit(3)
            if MODE == "hang_time":
                time.sleep(3600)
            reply({"ok": True, "seconds": [SECONDS] * int(cmd.get("count", 1))})
        else:
            reply({"ok": False, "error": f"unknown command {op!r}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
