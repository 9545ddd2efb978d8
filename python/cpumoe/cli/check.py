"""``cpumoe check``: every path against cpumoe.reference on small cases and the preset layer."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

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


# Beside the int8 layers above: each other format of the extension's table, at its group sizes
# (32 and 128 where it may choose), the activations of the op's table in turn.
_CASE_ACTIVATIONS = problem.ACTIVATIONS


def format_cases() -> List[tuple]:
    """(format, group, activation) of the checks of the formats besides int8 (whose matrix is
    the small cases), from cpumoe.formats()."""
    import cpumoe
    from .. import quantize as Q
    cases = []
    for row in cpumoe.formats():
        if row["family"] == "qgemm" or row["name"] not in Q.quantized_formats():
            continue
        for g in Q.group_sizes(row["name"], 256, 128, preferred=(32, 128)):
            cases.append((row["name"], g, _CASE_ACTIVATIONS[len(cases) % len(_CASE_ACTIVATIONS)]))
    return cases


def _run_format_case(lib: problem.Lib, fmt: str, g: int, act: str, paths: List[str],
                     threads: int):
    """A layer in weight format ``fmt`` (made from random floats) on every path of its kernel
    family against its reference; returns {path: (ok, rel_err)} and whether the paths agreed
    bit for bit."""
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
    q = Q.quantize_experts(fmt, w13, w2, group_size=g, b13=b13, b2=b2)
    ref = R.ref_fused_moe_experts(x, q, wts_t, ids_t, act)
    results, bits = {}, []
    for path in paths:
        got = cpumoe.fused_moe(x, q.prepack(isa=path), wts_t, ids_t, activation=act,
                               num_threads=threads)
        results[path] = problem.check_one(lib, got, ref)
        bits.append(lib.numpy32(got).tobytes())
    # Only the int8-activation ops promise the same bits on every path (the bf16 ones sum in
    # fp32 in each kernel's own order).
    int8_op = cpumoe.formats()[cpumoe.FORMATS.index(fmt)]["activations"] == "int8"
    return results, (all(b == bits[0] for b in bits) if int8_op else None)


def _print_row(out, label: str, width: int, paths: List[str], results, same: Optional[bool],
               name_paths: bool = False):
    """One line of the check's table: max|err|/scale and the verdict per path (named in each
    cell with ``name_paths``), and whether the paths agreed bit for bit (None: not promised, "-").
    Returns (passed, failed); a disagreement of the paths is one failure more."""
    cells = []
    for p in paths:
        ok, rel = results[p]
        cells.append(f"{p + ' ' if name_paths else ''}{rel:.1e} {'ok' if ok else 'FAIL'}")
    cw = 24 if name_paths else 14
    print(f"  {label:<{width}}" + "".join(f"{c:>{cw}}" for c in cells)
          + f"  {'-' if same is None else 'yes' if same else 'NO'}", file=out)
    passed = sum(bool(results[p][0]) for p in paths)
    return passed, len(paths) - passed + (same is False)


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
        ok, bad = _print_row(out, case["name"], width, paths,
                             *_run_small_case(lib, case, paths, layer.threads))
        n_pass, n_fail = n_pass + ok, n_fail + bad

    # The other formats, each on its kernel family's paths (cpumoe.available_paths(format)).
    for fmt, g, act in format_cases():
        fpaths = problem.paths_under(layer.isa, fmt)
        ok, bad = _print_row(out, f"{fmt}{f' g{g}' if g else ''} {act}", width, fpaths,
                             *_run_format_case(lib, fmt, g, act, fpaths, layer.threads),
                             name_paths=True)
        n_pass, n_fail = n_pass + ok, n_fail + bad

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
            results, bits = {}, []
            for p in paths:
                got = cpumoe.fused_moe_int8(x, layer.packed(p), wts_t, ids_t, layer.activation,
                                            num_threads=layer.threads)
                results[p] = problem.check_one(lib, got, ref)
                bits.append(lib.numpy32(got).tobytes())
            ok, bad = _print_row(out, f"T={T}", width, paths, results,
                                 all(b == bits[0] for b in bits))
            n_pass, n_fail = n_pass + ok, n_fail + bad
    verdict = "PASS" if n_fail == 0 else "FAIL"
    print(f"{verdict}: {n_pass} passed, {n_fail} failed"
          f"{f', {n_skip} skipped' if n_skip else ''} on {', '.join(paths)}", file=out)
    return 0 if n_fail == 0 else 1
