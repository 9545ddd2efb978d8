"""Benchmark of expert parallelism on one machine: R ranks (gloo on loopback) share a layer's
experts; per-rank compute and communication time for the all-reduce and all-to-all modes.

    python -m cpumoe.cli.bench.distributed [--ranks 1,2,4] [--tokens 1,16,128] [--iters 10]

Default problem: the Qwen3-30B-A3B MoE layer (H=2048, I=768, E=128, top-8, bf16), random int8
weights made on each rank for its own experts only. Each rank gets torch threads =
max(1, cores // R), so the ranks do not oversubscribe the machine.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world, port, args, queue):
    import torch
    import torch.distributed as dist

    from cpumoe.distributed import ExpertParallelMoE, contiguous_placement

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    E, H, I, k = args.experts, args.hidden, args.inter, args.topk
    n_local = contiguous_placement(E, world).count(rank)
    g = torch.Generator().manual_seed(100 + rank)
    w13 = torch.randint(-127, 128, (n_local, 2 * I, H), dtype=torch.int8, generator=g)
    w2 = torch.randint(-127, 128, (n_local, H, I), dtype=torch.int8, generator=g)
    s13 = torch.full((n_local, 2 * I), 1e-3)
    s2 = torch.full((n_local, H), 1e-3)
    layer = ExpertParallelMoE.from_local_shard(E, w13, w2, s13, s2)
    del w13, w2
    rows = []
    for T in args.tokens:
        gen = torch.Generator().manual_seed(T)  # the same routing on every rank
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
        routings = [torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
                    .to(torch.int32) for _ in range(4)]
        tw = torch.full((T, k), 1.0 / k)
        for mode in ("allreduce", "alltoall"):
            lo, hi = rank * T // world, (rank + 1) * T // world
            samples = []
            for it in range(args.iters + 1):
                ids = routings[it % len(routings)]
                dist.barrier()
                t0 = time.perf_counter()
                if mode == "allreduce":
                    layer(x, tw, ids, mode=mode)
                else:
                    layer(x[lo:hi], tw[lo:hi], ids[lo:hi], mode=mode)
                total = time.perf_counter() - t0
                if it:  # the first call warms up
                    samples.append((total, layer.last_timing["compute"], layer.last_timing["comm"]))
            rows.append((T, mode, [statistics.median(c) for c in zip(*samples)]))
    queue.put((rank, rows, layer.packed_bytes))
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cpumoe.cli.bench.distributed",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--tokens", default="1,16,128")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    args = p.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",")]
    import torch.multiprocessing as mp

    print(f"expert parallelism, gloo on loopback: H={args.hidden} I={args.inter} "
          f"E={args.experts} top-{args.topk} bf16, {os.cpu_count()} cores")
    print(f"{'R':>2} {'T':>5} {'mode':>9} {'ms/call':>9} {'compute':>9} {'comm':>9} "
          f"{'packed MB/rank':>15}")
    for world in (int(r) for r in args.ranks.split(",")):
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_rank_main, args=(r, world, port, args, queue))
                 for r in range(world)]
        for pr in procs:
            pr.start()
        got = {}
        for _ in range(world):
            rank, rows, nbytes = queue.get(timeout=1800)
            got[rank] = (rows, nbytes)
        for pr in procs:
            pr.join()
        # Per (T, mode): the slowest rank's total (the layer is done when all are), its split.
        for i, (T, mode, _) in enumerate(got[0][0]):
            worst = max(range(world), key=lambda r: got[r][0][i][2][0])
            total, comp, comm = got[worst][0][i][2]
            mb = max(got[r][1] for r in range(world)) / 2 ** 20
            print(f"{world:>2} {T:>5} {mode:>9} {total * 1e3:>9.2f} {comp * 1e3:>9.2f} "
                  f"{comm * 1e3:>9.2f} {mb:>15.1f}")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
