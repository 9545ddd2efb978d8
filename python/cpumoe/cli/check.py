"""``cpumoe check``: every path against cpumoe.reference on small cases and the preset layer."""

from __future__ import annotations

import argparse
import sys
from typing import List

import numpy as np

from . import problem


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cpumoe check",
        description="Correctness of every path this CPU runs against cpumoe.reference: small "
                    "cases (dtypes x activations x bias, expert_map, skip_weighted, int64 ids, "
                    "strided rows, T=0), the W4A8 formats on their paths, and the preset layer. "
                    "Exit code 1 on a failure.")
    problem.problem_args(p, [1, 16])
    p.add_argument("--no-layer", action="store_true",
                   help="only the small cases, not the preset layer")
    return p


def small_cases() -> List[dict]:
    """Small problems covering the op's options; each runs on every path."""
    shapes = [(1, 8, 1, 64, 64), (7, 16, 2, 128, 64), (33, 8, 4, 64, 128)]
    cases = []
    i = 0
    for dtype in ("float32", "float16", "bfloat16"):
        for act in problem.ACTIVATIONS:
            for bias in (False, True):
                T, E, k, H, I = shapes[i % len(shapes)]
                cases.append(dict(name=f"{dtype} {act}{' +bias' if bias else ''}", T=T, E=E, k=k,
                                  H=H, I=I, dtype=dtype, activation=act, bias=bias))
                i += 1
    base = dict(T=19, E=16, k=4, H=64, I=64, dtype="float32", activation="silu", bias=True)
    cases += [
        dict(base, name="expert_map (half the experts here)", expert_map=True),
        dict(base, name="skip_weighted (k=1)", k=1, skip_weighted=True),
        dict(base, name="int64 topk_ids", int64_ids=True),
        dict(base, name="strided x rows", strided=True),
        dict(base, name="repeated expert ids", repeated=True),
        dict(base, name="T=0", T=0),
        dict(base, name="T=300 (several chunks)", T=300, dtype="bfloat16"),
    ]
    return cases


def _run_small_case(lib: problem.Lib, case: dict, paths: List[str], threads: int):
    """Returns {path: (ok, rel_err)} and whether all paths agreed bit for bit."""
    import cpumoe
    from ..reference import ref_fused_moe_int8

    T, E, k, H, I = (case[n] for n in ("T", "E", "k", "H", "I"))
    rng = np.random.default_rng([7, T, E, k, H, I])
    w13, w2, s13, s2, b13, b2 = problem.make_weights(E, H, I, True, 11, 1)
    if not case["bias"]:
        b13 = b2 = None
    x = rng.standard_normal((T, 2 * H if case.get("strided") else H), dtype=np.float32)
    ids, wts = problem.make_routing(rng, T, E, k)
    if case.get("repeated") and T:
        ids[:, 1] = ids[:, 0]
    if case.get("skip_weighted"):
        wts = np.ones_like(wts)
    xt = lib.tensor(x, case["dtype"])
    if case.get("strided"):
        xt = xt[:, :H]
    t = lambda a: None if a is None else lib.tensor(a)  # noqa: E731
    ref_ids = ids
    emap = None
    w13l, w2l, s13l, s2l, b13l, b2l = w13, w2, s13, s2, b13, b2
    if case.get("expert_map"):
        local = np.arange(0, E, 2)  # even experts live here, odd ones elsewhere
        emap = np.full(E, -1, np.int32)
        emap[local] = np.arange(local.size, dtype=np.int32)
        w13l, w2l, s13l, s2l = w13[local], w2[local], s13[local], s2[local]
        b13l = None if b13 is None else b13[local]
        b2l = None if b2 is None else b2[local]
        keep = emap[ids] >= 0  # the reference: drop the slots of remote experts
        wts_ref = np.where(keep, wts, 0).astype(np.float32)
    ids_t = lib.tensor(ids.astype(np.int64) if case.get("int64_ids") else ids)
    ref = ref_fused_moe_int8(xt, t(w13), t(w2), t(s13), t(s2),
                             t(wts_ref if emap is not None else wts), t(ref_ids),
                             case["activation"], b13=t(b13), b2=t(b2),
                             skip_weighted=bool(case.get("skip_weighted")))
    results, bits = {}, []
    for path in paths:
        packed = cpumoe.prepack(t(w13l), t(w2l), t(s13l), t(s2l), t(b13l), t(b2l), isa=path)
        got = cpumoe.fused_moe_int8(xt, packed, t(wts), ids_t, case["activation"],
                                    bool(case.get("skip_weighted")),
                                    expert_map=t(emap) if emap is not None else None,
                                    num_threads=threads)
        results[path] = problem.check_one(lib, got, ref)
        bits.append(lib.numpy32(got).tobytes())
    return results, all(b == bits[0] for b in bits)


W4_CASES = (("int4", 32, "silu"), ("int4", 128, "gelu"), ("mxfp4", 32, "swigluoai"))


def _run_w4_case(lib: problem.Lib, fmt: str, g: int, act: str, paths: List[str], threads: int):
    """A W4A8 layer (4-bit weights made from random floats) on every W4A8 path against its
    reference; returns {path: (ok, rel_err)} and whether the paths agreed bit for bit."""
    import cpumoe
    from .. import quantize as Q
    from .. import reference as R
    T, E, k, H, I = 13, 8, 2, 256, 128
    rng = np.random.default_rng([9, g, len(act)])
    w13 = (rng.standard_normal((E, 2 * I, H)) / np.sqrt(H)).astype(np.float32)
    w2 = (rng.standard_normal((E, H, I)) / np.sqrt(I)).astype(np.float32)
    b13 = (rng.standard_normal((E, 2 * I)) * 0.1).astype(np.float32)
    b2 = (rng.standard_normal((E, H)) * 0.1).astype(np.float32)
    x = lib.tensor(rng.standard_normal((T, H), dtype=np.float32), "float32")
    ids, wts = problem.make_routing(rng, T, E, k)
    ids_t, wts_t = lib.tensor(ids), lib.tensor(wts)
    if fmt == "mxfp4":
        (q13, e13), (q2, e2) = Q.quantize_mxfp4(w13), Q.quantize_mxfp4(w2)
        ref = R.ref_fused_moe_mxfp4(x, q13, e13, q2, e2, wts_t, ids_t, act, b13=b13, b2=b2)
        pack = lambda p: cpumoe.prepack_mxfp4(q13, e13, q2, e2, b13, b2, isa=p)  # noqa: E731
    else:
        (v13, t13), (v2, t2) = Q.quantize_int4(w13, g), Q.quantize_int4(w2, g)
        ref = R.ref_fused_moe_int4(x, v13, v2, t13, t2, wts_t, ids_t, act, b13=b13, b2=b2,
                                   group_size=g)
        pack = lambda p: cpumoe.prepack_int4(v13, v2, t13, t2, b13, b2, group_size=g,  # noqa: E731
                                             isa=p)
    results, bits = {}, []
    for path in paths:
        got = cpumoe.fused_moe_int8(x, pack(path), wts_t, ids_t, act, num_threads=threads)
        results[path] = problem.check_one(lib, got, ref)
        bits.append(lib.numpy32(got).tobytes())
    return results, all(b == bits[0] for b in bits)


def run(args: argparse.Namespace) -> int:
    import cpumoe

    layer = problem.Layer(args)
    if not problem.topk_fits(layer, "cpumoe check"):
        return 2
    out = sys.stdout
    if problem.print_header(layer, out) is None:
        return 2
    paths = problem.paths_under(layer.isa)
    lib = layer.lib
    if lib.torch is None and lib.name == "numpy":
        try:
            import ml_dtypes  # noqa: F401
            have_bf16 = True
        except ImportError:
            have_bf16 = False
    else:
        have_bf16 = True
    tol = problem.TOLERANCE
    print(f"check    every path against cpumoe.reference (pass: |err| <= {tol:g} * scale + "
          f"{tol:g} * |ref|); columns: max|err|/scale per path", file=out)
    width = max(len(c["name"]) for c in small_cases()) + 2
    print(f"  {'case':<{width}}" + "".join(f"{p:>14}" for p in paths) + "  same bits", file=out)
    n_pass = n_fail = n_skip = 0
    for case in small_cases():
        if case["dtype"] == "bfloat16" and not have_bf16:
            print(f"  {case['name']:<{width}}  skipped (bfloat16 needs torch or ml_dtypes)",
                  file=out)
            n_skip += 1
            continue
        results, same = _run_small_case(lib, case, paths, layer.threads)
        cells = []
        for p in paths:
            ok, rel = results[p]
            n_pass += ok
            n_fail += not ok
            cells.append(f"{rel:.1e} {'ok' if ok else 'FAIL'}")
        if not same:
            n_fail += 1
        print(f"  {case['name']:<{width}}" + "".join(f"{c:>14}" for c in cells)
              + f"  {'yes' if same else 'NO'}", file=out)

    # W4A8: its own kernel family and paths (cpumoe.available_paths("int4")).
    w4_paths = [p for p in cpumoe.available_paths("int4") if p in paths or p == "portable"]
    print(f"  W4A8 (int4 / mxfp4 weights) on {', '.join(w4_paths)}", file=out)
    for fmt, g, act in W4_CASES:
        results, same = _run_w4_case(lib, fmt, g, act, w4_paths, layer.threads)
        cells = []
        for p in w4_paths:
            ok, rel = results[p]
            n_pass += ok
            n_fail += not ok
            cells.append(f"{p} {rel:.1e} {'ok' if ok else 'FAIL'}")
        n_fail += not same
        print(f"  {f'{fmt} g{g} {act}':<{width}}" + "".join(f"{c:>24}" for c in cells)
              + f"  {'yes' if same else 'NO'}", file=out)

    if not args.no_layer:
        t_gen = layer.make()
        print(f"layer    {layer.name} at T = {', '.join(map(str, args.tokens))} (weights made in "
              f"{t_gen:.1f} s)", file=out)
        w13, w2, s13, s2, b13, b2 = layer.tensors
        for T, (x, routings) in problem.problems(layer, args.tokens).items():
            ids, wts = routings[0]
            ids_t, wts_t = lib.tensor(ids), lib.tensor(wts)
            ref = cpumoe.reference.ref_fused_moe_int8(x, w13, w2, s13, s2, wts_t, ids_t,
                                                      layer.activation, b13=b13, b2=b2)
            cells, bits = [], []
            for p in paths:
                got = cpumoe.fused_moe_int8(x, layer.packed(p), wts_t, ids_t, layer.activation,
                                            num_threads=layer.threads)
                ok, rel = problem.check_one(lib, got, ref)
                n_pass += ok
                n_fail += not ok
                cells.append(f"{rel:.1e} {'ok' if ok else 'FAIL'}")
                bits.append(lib.numpy32(got).tobytes())
            same = all(b == bits[0] for b in bits)
            n_fail += not same
            print(f"  {'T=' + str(T):<{width}}" + "".join(f"{c:>14}" for c in cells)
                  + f"  {'yes' if same else 'NO'}", file=out)
    verdict = "PASS" if n_fail == 0 else "FAIL"
    print(f"{verdict}: {n_pass} passed, {n_fail} failed"
          f"{f', {n_skip} skipped' if n_skip else ''} on {', '.join(paths)}", file=out)
    return 0 if n_fail == 0 else 1
