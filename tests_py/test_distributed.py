"""Expert parallelism on torch.distributed (gloo on loopback): 2 and 4 ranks against the
single-process op, per-rank memory, and a dead peer failing the others instead of hanging."""

from __future__ import annotations

import os
import queue as queue_mod
import socket
import time

import pytest

if os.environ.get("CPUMOE_TEST_BACKEND", "") == "numpy":
    pytest.skip("needs torch (numpy backend)", allow_module_level=True)
torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)
mp = pytest.importorskip("torch.multiprocessing")

import cpumoe  # noqa: E402

# Ranks sum partial outputs that were each rounded to the input dtype (bf16 here), so the result
# can differ from the single-process op by a few bf16 ulps: well inside the op's tolerance.
ATOL_OF_SCALE = 2e-2

# A peer's death is noticed through gloo's timeout or a closed connection; the test allows this
# much before it calls the survivor hung.
DEAD_PEER_TIMEOUT_S = 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _problem(seed=0, T=13, E=8, k=2, H=64, I=32, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    w13, s13 = cpumoe.quantize_per_channel(torch.randn(E, 2 * I, H, generator=g) / H ** 0.5)
    w2, s2 = cpumoe.quantize_per_channel(torch.randn(E, H, I, generator=g) / I ** 0.5)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    tw = torch.softmax(torch.randn(T, k, generator=g), dim=-1)
    return x, w13, w2, s13, s2, tw, ids


def _worker(rank, world, port, queue, kill_rank):
    try:
        torch.set_num_threads(1)
        from datetime import timedelta
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=5))
        from cpumoe.distributed import ExpertParallelMoE
        x, w13, w2, s13, s2, tw, ids = _problem()
        layer = ExpertParallelMoE(w13, w2, s13, s2)
        if rank == kill_rank:
            os._exit(3)  # dies without a word, before the collective
        full = layer(x, tw, ids, "silu", mode="allreduce")
        # all-to-all: each rank brings its own slice of the batch.
        mine = slice(rank * x.shape[0] // world, (rank + 1) * x.shape[0] // world)
        part = layer(x[mine], tw[mine], ids[mine], "silu", mode="alltoall")
        # Plain arrays, not tensors: torch passes a tensor's storage through a file descriptor
        # the receiver must fetch from this process, which may have exited by then (the result
        # was lost that way on a loaded machine).
        queue.put((rank, "ok", full.float().numpy(), part.float().numpy(), mine,
                   layer.packed_bytes))
        dist.destroy_process_group()
    except Exception as e:  # reported to the parent, which asserts on it
        queue.put((rank, "error", f"{type(e).__name__}: {e}", None, None, None))


def _run(world, kill_rank=-1, timeout=120):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, queue, kill_rank))
             for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + timeout
    expected = world - (1 if kill_rank >= 0 else 0)
    while len(results) < expected and time.monotonic() < deadline:
        try:
            item = queue.get(timeout=1)
        except queue_mod.Empty:
            continue
        results[item[0]] = item
    for p in procs:
        p.join(timeout=max(1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_matches_single_process(world):
    x, w13, w2, s13, s2, tw, ids = _problem()
    ref = cpumoe.fused_moe_int8(x, cpumoe.prepack(w13, w2, s13, s2), tw, ids, "silu").float()
    total_bytes = cpumoe.prepack(w13, w2, s13, s2).packed_bytes
    results = _run(world)
    assert sorted(results) == list(range(world)), results
    scale = ref.abs().max().item()
    for rank, (_, status, full, part, mine, nbytes) in sorted(results.items()):
        assert status == "ok", full
        full, part = torch.from_numpy(full), torch.from_numpy(part)
        assert (full - ref).abs().max().item() <= ATOL_OF_SCALE * scale, rank
        assert (part - ref[mine]).abs().max().item() <= ATOL_OF_SCALE * scale, rank
        # Each rank packs its share of the experts only (8 experts split evenly).
        assert abs(nbytes - total_bytes / world) <= 0.01 * total_bytes, (nbytes, total_bytes)


def test_dead_peer_fails_the_others():
    t0 = time.monotonic()
    results = _run(2, kill_rank=1, timeout=60)
    elapsed = time.monotonic() - t0
    assert 0 in results, "rank 0 neither finished nor reported an error (hung)"
    _, status, msg, *_ = results[0]
    assert status == "error" and "ExpertParallelError" in msg and "peer" in msg, msg
    assert elapsed < 60


def test_placement_and_expert_map():
    from cpumoe.distributed import contiguous_placement
    assert contiguous_placement(8, 2) == [0] * 4 + [1] * 4
    assert contiguous_placement(5, 2) == [0, 0, 0, 1, 1]
    with pytest.raises(ValueError, match="num_experts"):
        contiguous_placement(0, 2)
