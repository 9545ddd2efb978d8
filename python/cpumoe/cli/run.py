"""``cpumoe`` without a subcommand: check every path on one layer, then a short timing table."""

from __future__ import annotations

import argparse
import sys
import time

from . import problem
from .bench import contenders, timing


def parser() -> argparse.ArgumentParser:
    """The original command line (no subcommand): check + short bench of one layer."""
    p = argparse.ArgumentParser(
        prog="cpumoe",
        description="Check the fused W8A8 int8 MoE op against the reference on every path this "
                    "CPU runs, then time it. Default problem: the Qwen3-30B-A3B MoE layer with "
                    "random int8 experts.",
        epilog="Subcommands: cpumoe check | bench | info (see cpumoe SUBCOMMAND --help).")
    problem.problem_args(p, [1, 16, 128])
    problem.timing_args(p, "timed calls per T (default: about 2 s worth, 5 to 50)")
    p.add_argument("--no-check", action="store_true", help="skip the check against the reference")
    return p


def run(args: argparse.Namespace) -> int:
    """The original command: check every path at --tokens, then time the selected path."""
    import cpumoe

    layer = problem.Layer(args)
    if not problem.topk_fits(layer, "cpumoe"):
        return 2
    out = sys.stdout
    chosen = problem.print_header(layer, out)
    if chosen is None:
        return 2
    t_gen = layer.make()
    t0 = time.perf_counter()
    try:
        packed = layer.packed(None)
    except (ValueError, TypeError) as e:
        print(f"cpumoe: {e}", file=sys.stderr)
        return 2
    t_pack = time.perf_counter() - t0
    print(f"weights  {layer.E * layer.expert_bytes / 1e6:.1f} MB int8 (made in {t_gen:.1f} s); "
          f"packed {packed.packed_bytes / 1e6:.1f} MB in {t_pack:.2f} s for {packed.path} "
          f"({packed.kernel})", file=out)
    problems = problem.problems(layer, args.tokens)
    lib = layer.lib
    w13, w2, s13, s2, b13, b2 = layer.tensors

    failed = False
    if not args.no_check:
        paths = problem.paths_under(layer.isa)
        tol = problem.TOLERANCE
        print(f"check    against cpumoe.reference on {', '.join(paths)} (pass: |err| <= "
              f"{tol:g} * scale + {tol:g} * |ref|, scale = max|ref|)", file=out)
        for T, (x, routings) in problems.items():
            ids, wts = routings[0]
            ids_t, wts_t = lib.tensor(ids), lib.tensor(wts)
            t0 = time.perf_counter()
            ref = cpumoe.reference.ref_fused_moe_int8(x, w13, w2, s13, s2, wts_t, ids_t,
                                                      layer.activation, b13=b13, b2=b2)
            t_ref = time.perf_counter() - t0
            for path in paths:
                got = cpumoe.fused_moe_int8(x, layer.packed(path), wts_t, ids_t,
                                            layer.activation, num_threads=layer.threads)
                ok, rel = problem.check_one(lib, got, ref)
                failed |= not ok
                print(f"  T={T:<5d} {path:<12} max|err|/scale = {rel:.2e}  "
                      f"{'PASS' if ok else 'FAIL'}  (reference {t_ref:.2f} s)", file=out)

    print(f"timing   median and min of the timed calls after {args.warmup} warm-up; each call "
          f"routes anew (16 routings per T), so the experts read change from call to call",
          file=out)
    print(timing.TABLE_HEAD, file=out)
    contender = contenders.cpumoe_int8(layer, packed)
    for T, (x, routings) in problems.items():
        rows, _ = timing.time_point(layer, [contender], "cold", T, x, routings, None, args.warmup,
                                    args.iters, 2.0, 1, min_calls=5, max_calls=50)
        print(timing.fmt_row(rows[0]), file=out)

    if failed:
        print("FAIL: the op is outside the tolerance of the reference", file=out)
        return 1
    return 0
