"""The kt-kernel side of ``cpumoe bench``'s ``kt-*`` contenders: a worker that runs inside
kt-kernel's own virtual environment (see kt_cpu.py) and drives its MoE classes for the parent.

It imports only numpy, torch, kt_kernel and the standard library (not cpumoe), so it runs by file
path: ``<venv>/bin/python -I kt_worker.py``. Protocol: one JSON object per line on stdin, one JSON
reply per line on the original stdout ({"ok": true, ...} or {"ok": false, "error": ...}); arrays
travel as .npy files whose paths the commands name (bf16 as their uint16 bits). kt-kernel's C++
code prints to stdout, so the worker moves fd 1 to stderr and answers on a copy of it.

Commands:

- ``load``: one layer (E, k, H, I, threads, max_tokens, fmt) from the parent's weights in
  cpumoe's formats (``w13`` [E, 2I, H] with gate rows first, ``w2`` [E, H, I], ``s13`` /
  ``s2``); the worker turns them into kt-kernel's inputs (its own conversions where it has them)
  and loads the class kt-kernel's inference wrapper would pick for the format;
- ``run``: one call on x / ids / weights files, the output written to a file (the check);
- ``inputs``: the x and the routings of one timing point;
- ``time``: ``count`` calls on routings ``route``, ``route + 1``, ...; answers each call's seconds,
  timed around the layer's ``forward`` only (not this protocol);
- ``quit``.

kt-kernel's Python wrapper (``KTMoEWrapper``) pins its buffers (``pin_memory=True``), which needs
an accelerator: on a CPU-only torch it fails. So the worker does what the wrapper does inside:
an ``MOEConfig``, the MoE class, its ``load_weights_task``; each call is the class's ``forward``
on the worker's main thread (the wrapper queues ``forward_task`` on CPUInfer's queue thread and
spins in ``sync()``: one more spinning thread than this).
"""

import json
import os
import sys
import time

# The script's own folder (cpumoe's bench modules) must not shadow anything in the venv.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]


def _bits_to_bf16(torch, a):
    """uint16 numpy bits -> torch bfloat16 (same memory)."""
    return torch.from_numpy(a.view("int16")).view(torch.bfloat16)


class Layer:
    """One kt-kernel MoE layer and the buffers of its calls."""

    def __init__(self, kt, torch, np, cmd):
        self.kt, self.torch, self.np = kt, torch, np
        ext = kt.kt_kernel_ext
        self.E, self.k, self.H, self.I = (int(cmd[n]) for n in ("E", "k", "H", "I"))
        self.max_tokens = int(cmd["max_tokens"])
        cfg = ext.WorkerPoolConfig()
        cfg.subpool_count = 1
        cfg.subpool_numa_map = [0]
        cfg.subpool_thread_count = [int(cmd["threads"])]
        self.cpu = ext.CPUInfer(cfg)
        self.mask = torch.zeros(self.E, dtype=torch.bool)  # no expert on a GPU
        self.p2l = torch.arange(self.E, dtype=torch.int64)  # physical = logical experts
        self.fmt = cmd["fmt"]
        files = cmd["files"]
        t0 = time.perf_counter()
        self.moe, self.cls = self._load(self.fmt, {k: np.load(v) for k, v in files.items()})
        self.load_seconds = time.perf_counter() - t0
        self.x = self.out = None
        self.routes = []

    def _config(self):
        c = self.kt.kt_kernel_ext.moe.MOEConfig(self.E, self.k, self.H, self.I,
                                                self.mask.data_ptr())
        c.layer_idx = 0
        c.pool = self.cpu.backend_
        c.max_len = -(-self.max_tokens // 64) * 64  # kt's int8 buffers: a multiple of 32 rows
        return c

    def _per_expert(self, c, w13, w2, s13, s2):
        """kt's per-expert pointer lists ([numa][expert]) of gate (w13's first I rows), up (the
        other I) and down; scales split the same way (None: none, as for bf16)."""
        E, I = self.E, self.I
        c.gate_projs = [[w13[e, :I].data_ptr() for e in range(E)]]
        c.up_projs = [[w13[e, I:].data_ptr() for e in range(E)]]
        c.down_projs = [[w2[e].data_ptr() for e in range(E)]]
        if s13 is None:
            c.gate_scales = c.up_scales = c.down_scales = [[0] * E]
        else:
            n = s13.shape[1] // 2
            c.gate_scales = [[s13[e, :n].data_ptr() for e in range(E)]]
            c.up_scales = [[s13[e, n:].data_ptr() for e in range(E)]]
            c.down_scales = [[s2[e].data_ptr() for e in range(E)]]

    def _load(self, fmt, a):
        torch, np = self.torch, self.np
        from kt_kernel.utils import amx as A
        c = self._config()
        I = self.I
        keep = []  # the inputs stay alive until the load is done (kt copies them)
        if fmt == "int8":
            # kt quantizes bf16 weights itself (AMXMoEWrapper.load_weights_from_tensors's online
            # path, without writing the result to disk): whole-layer gate / up / down arrays.
            w13 = _bits_to_bf16(torch, a["w13"])
            keep += [w13[:, :I].contiguous(), w13[:, I:].contiguous(),
                     _bits_to_bf16(torch, a["w2"]).contiguous()]
            c.gate_proj, c.up_proj, c.down_proj = (t.data_ptr() for t in keep)
            cls = A.AMXInt8_MOE
        elif fmt == "bf16":
            keep += [_bits_to_bf16(torch, a["w13"]), _bits_to_bf16(torch, a["w2"])]
            self._per_expert(c, keep[0], keep[1], None, None)
            cls = A.AMXBF16_MOE if A._HAS_BF16_SUPPORT else A.AVX2BF16_MOE
        elif fmt == "fp8":
            # E4M3 codes with fp32 scales per 128 x 128 block: kt's FP8 (block) layout as is.
            keep += [torch.from_numpy(a[n]) for n in ("w13", "w2", "s13", "s2")]
            self._per_expert(c, *keep)
            c.quant_config.bits, c.quant_config.group_size = 8, 128
            c.quant_config.zero_point = False
            cls = A.AMXFP8_MOE if A._HAS_FP8_SUPPORT else A.AVX2FP8_MOE
        elif fmt == "mxfp4":
            # E2M1 nibbles (low nibble first) [N, K / 2] and E8M0 bytes, which kt's own loader
            # turns into the bf16 scales its kernels take.
            from kt_kernel.utils.loader import MXFP4SafeTensorLoader as L
            w13 = torch.from_numpy(np.ascontiguousarray(a["w13"]).reshape(self.E, 2 * I, -1))
            w2 = torch.from_numpy(np.ascontiguousarray(a["w2"]).reshape(self.E, self.H, -1))
            keep += [w13, w2, L._ue8m0_to_bf16(torch.from_numpy(a["s13"])),
                     L._ue8m0_to_bf16(torch.from_numpy(a["s2"]))]
            self._per_expert(c, *keep)
            c.quant_config.bits, c.quant_config.group_size = 4, 32
            c.quant_config.zero_point = False
            cls = A._select_mxfp4_backend()
        elif fmt == "int4":
            # Symmetric int4 values [-8, 7] with fp32 group scales -> kt's RAWINT4 input: the
            # compressed-tensors pack-quantized layout (v + 8, eight per int32, lowest k in the
            # lowest nibble) through kt's own normalization to bytes, and bf16 scales.
            from kt_kernel.utils.loader import CompressedSafeTensorLoader as L

            def pack(v, s):
                words = np.zeros((*v.shape[:-1], v.shape[-1] // 8), np.uint32)
                for e in range(v.shape[0]):  # one expert at a time: small temporaries
                    n = (v[e].astype(np.int32) + 8).reshape(*v.shape[1:-1], -1, 8)
                    for j in range(8):
                        words[e] |= n[..., j].astype(np.uint32) << np.uint32(4 * j)
                rows = torch.from_numpy(words.view(np.int32)).reshape(-1, words.shape[-1])
                sc = torch.from_numpy(s).to(torch.bfloat16)
                packed = L._normalize_rawint4_weight(rows, sc.reshape(-1, sc.shape[-1]))
                return packed.reshape(*v.shape[:-1], -1), sc

            w13, s13 = pack(a["w13"], a["s13"])
            w2, s2 = pack(a["w2"], a["s2"])
            keep += [w13, w2, s13, s2]
            self._per_expert(c, *keep)
            group = self.H // s13.shape[-1]
            c.quant_config.bits, c.quant_config.group_size = 4, group
            c.quant_config.zero_point = False
            cls = A._select_rawint4_backend(group)
        else:
            raise ValueError(f"unknown format {fmt!r}")
        if cls is None:
            raise RuntimeError(f"this kt-kernel build ({self.kt.__cpu_variant__}) has no "
                               f"{fmt} MoE class")
        moe = cls(c)
        self.cpu.submit(moe.load_weights_task(self.p2l.data_ptr()))
        self.cpu.sync()
        del keep
        return moe, cls.__name__

    # ------------------------------------------------------------------------------ calls
    def _x(self, x_file):
        x = _bits_to_bf16(self.torch, self.np.load(x_file)).contiguous()
        T = x.shape[0]
        if T > self.max_tokens:
            raise ValueError(f"T = {T} exceeds max_tokens = {self.max_tokens}")
        return x, T

    def _route(self, ids_file, w_file):
        torch, np = self.torch, self.np
        ids = torch.from_numpy(np.load(ids_file).astype(np.int64)).contiguous()
        w = torch.from_numpy(np.load(w_file).astype(np.float32)).contiguous()
        return ids, w

    def _call(self, x, T, ids, w, out):
        """One call, timed: the layer's ``forward`` on this thread, which becomes thread 0 of
        kt's pool (kt's ``submit`` + ``sync`` would run it on its queue's thread while this one
        spins in ``sync``: one busy thread more than ``threads``)."""
        bsz = self.torch.tensor([T], dtype=self.torch.int32)
        args = (bsz.data_ptr(), self.k, ids.data_ptr(), w.data_ptr(), x.data_ptr(),
                out.data_ptr(), False)
        t = time.perf_counter()
        self.moe.forward(*args)
        return time.perf_counter() - t

    def run(self, cmd):
        x, T = self._x(cmd["x"])
        ids, w = self._route(cmd["ids"], cmd["weights"])
        out = self.torch.zeros((T, self.H), dtype=self.torch.bfloat16)
        secs = self._call(x, T, ids, w, out)
        self.np.save(cmd["out"], out.to(self.torch.float32).numpy())
        return {"seconds": secs}

    def inputs(self, cmd):
        self.x, self.T = self._x(cmd["x"])
        self.routes = [self._route(i, w) for i, w in cmd["routes"]]
        self.out = self.torch.zeros((self.T, self.H), dtype=self.torch.bfloat16)
        return {}

    def time(self, cmd):
        if not self.routes:
            raise RuntimeError("time before inputs")
        n, count = int(cmd["route"]), int(cmd.get("count", 1))
        secs = []
        for j in range(count):
            ids, w = self.routes[(n + j) % len(self.routes)]
            secs.append(self._call(self.x, self.T, ids, w, self.out))
        return {"seconds": secs}


def main() -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # kt-kernel's printf (and any print) goes to stderr
    sys.stdout = sys.stderr

    def reply(obj):
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    try:
        import numpy as np
        import torch
        torch.set_num_threads(1)  # torch only holds buffers here; kt has its own threads
        import kt_kernel
    except Exception as e:  # noqa: BLE001 (reported to the parent)
        reply({"ok": False, "error": f"import: {type(e).__name__}: {e}"})
        return 1
    reply({"ok": True, "kt_kernel": getattr(kt_kernel, "__version__", None),
           "variant": kt_kernel.__cpu_variant__,
           "int8_kernel": getattr(kt_kernel, "__int8_kernel__", None),
           "torch": torch.__version__, "numpy": np.__version__,
           "python": sys.version.split()[0]})
    layer = None
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            cmd = json.loads(line)
            op = cmd.get("cmd")
            if op == "quit":
                reply({"ok": True})
                break
            if op == "load":
                layer = Layer(kt_kernel, torch, np, cmd)
                res = {"class": layer.cls, "load_seconds": layer.load_seconds}
            elif layer is None:
                raise RuntimeError(f"{op} before load")
            elif op in ("run", "inputs", "time"):
                res = getattr(layer, op)(cmd)
            else:
                raise ValueError(f"unknown command {op!r}")
            reply({"ok": True, **res})
        except Exception as e:  # noqa: BLE001 (reported to the parent)
            reply({"ok": False, "error": f"{type(e).__name__}: {e}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
