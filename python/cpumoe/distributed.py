"""Expert parallelism on torch.distributed: a layer's experts split across the ranks of a process
group, each rank holding (and packing) only its own experts.

Two ways to run a batch, both giving every rank the full output of the layer:

- ``"allreduce"``: every rank runs the op on the whole batch with its ``expert_map`` (slots of
  other ranks' experts cost nothing), and the partial outputs are summed with ``all_reduce``.
  Traffic per rank and call: one [T, H] fp32 reduction.
- ``"alltoall"``: each token goes only to the ranks that own at least one of its experts
  (point-to-point sends of the token rows, ids and weights), each rank returns its partial rows,
  and the owner sums them. Traffic: 2 x H values per token and remote owner, plus its ids and
  weights; nothing for tokens whose experts are all local.

Needs torch with the gloo backend for CPU tensors. A peer that dies makes the others raise
:class:`ExpertParallelError` once the group's timeout expires (set it in ``init_process_group``),
instead of hanging.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from .ops import fused_moe_int8, prepack

MODES = ("allreduce", "alltoall")


class ExpertParallelError(RuntimeError):
    """A collective of the expert-parallel layer failed (a peer died, timed out, or disagreed)."""


def contiguous_placement(num_experts: int, world_size: int) -> List[int]:
    """Owner rank of each expert: contiguous blocks, the first ``E % R`` ranks one expert more."""
    if num_experts < 1 or world_size < 1:
        raise ValueError(f"num_experts and world_size must be >= 1, got {num_experts}, "
                         f"{world_size}")
    base, extra = divmod(num_experts, world_size)
    owners: List[int] = []
    for r in range(world_size):
        owners += [r] * (base + (1 if r < extra else 0))
    return owners


def _check_placement(placement: Sequence[int], num_experts: int, world_size: int) -> List[int]:
    owners = [int(r) for r in placement]
    if len(owners) != num_experts:
        raise ValueError(f"placement: must name an owner for each of the {num_experts} experts, "
                         f"got {len(owners)}")
    bad = [r for r in owners if not 0 <= r < world_size]
    if bad:
        raise ValueError(f"placement: owner ranks must be in [0, {world_size}), got {bad[0]}")
    return owners


class ExpertParallelMoE:
    """One MoE layer whose experts are sharded over a process group.

    Args:
      w13, w2, s13, s2, b13, b2: the whole layer's weights as for :func:`cpumoe.prepack`
        ([E, 2I, H] int8, ...); only this rank's experts are packed (and kept). To avoid holding
        the whole layer at all, use :meth:`from_local_shard`.
      group: the process group (default: the world).
      placement: owner rank of each expert (default :func:`contiguous_placement`).
      isa: path cap passed to prepack.
    """

    def __init__(self, w13: Any, w2: Any, s13: Any, s2: Any, b13: Any = None, b2: Any = None, *,
                 group: Optional[Any] = None, placement: Optional[Sequence[int]] = None,
                 isa: Optional[str] = None):
        E = int(w13.shape[0])
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        owners = (_check_placement(placement, E, world) if placement is not None
                  else contiguous_placement(E, world))
        local = [e for e in range(E) if owners[e] == rank]
        pick = (lambda t: None if t is None else t[local]) if local else None
        self._init(E, owners, group,
                   prepack(*(pick(t) for t in (w13, w2, s13, s2, b13, b2)), isa=isa)
                   if local else None)

    @classmethod
    def from_local_shard(cls, num_experts: int, w13: Any, w2: Any, s13: Any, s2: Any,
                         b13: Any = None, b2: Any = None, *, group: Optional[Any] = None,
                         placement: Optional[Sequence[int]] = None,
                         isa: Optional[str] = None) -> "ExpertParallelMoE":
        """Builds the layer from this rank's experts only (in ascending global id order)."""
        self = cls.__new__(cls)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        owners = (_check_placement(placement, num_experts, world) if placement is not None
                  else contiguous_placement(num_experts, world))
        n_local = sum(1 for r in owners if r == rank)
        if int(w13.shape[0]) != n_local:
            raise ValueError(f"w13: this rank owns {n_local} experts, the shard has "
                             f"{int(w13.shape[0])}")
        self._init(num_experts, owners, group,
                   prepack(w13, w2, s13, s2, b13, b2, isa=isa) if n_local else None)
        return self

    def _init(self, num_experts: int, owners: List[int], group: Any, packed: Any) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.num_experts = num_experts
        self.owners = torch.tensor(owners, dtype=torch.int64)
        self.local_experts = [e for e in range(num_experts) if owners[e] == self.rank]
        self.packed = packed
        emap = torch.full((num_experts,), -1, dtype=torch.int32)
        emap[self.local_experts] = torch.arange(len(self.local_experts), dtype=torch.int32)
        self.expert_map = emap
        # Seconds spent in the last call: "compute" (the op) and "comm" (collectives, sends).
        self.last_timing: Dict[str, float] = {"compute": 0.0, "comm": 0.0}

    @property
    def packed_bytes(self) -> int:
        """Bytes of packed weights held by this rank."""
        return 0 if self.packed is None else int(self.packed.packed_bytes)

    # -- the local part ------------------------------------------------------------------------
    def _local(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
               activation: str, skip_weighted: bool) -> torch.Tensor:
        """This rank's contribution, fp32 [T, H] (zeros where no local expert is routed)."""
        if self.packed is None or x.shape[0] == 0:
            return torch.zeros(x.shape, dtype=torch.float32)
        t0 = time.perf_counter()
        out = fused_moe_int8(x, self.packed, topk_weights, topk_ids, activation, skip_weighted,
                             expert_map=self.expert_map)
        self.last_timing["compute"] += time.perf_counter() - t0
        return out.to(torch.float32)

    def _collective(self, what: str, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        except (RuntimeError, ValueError) as e:  # gloo reports a dead or timed-out peer this way
            raise ExpertParallelError(f"cpumoe.distributed: {what} failed on rank {self.rank} "
                                      f"(a peer rank may have died or timed out): {e}") from e
        finally:
            self.last_timing["comm"] += time.perf_counter() - t0

    def _exchange(self, what: str, reqs_fn) -> None:
        """Posts the point-to-point requests reqs_fn() returns and waits for all of them."""
        def run():
            for q in reqs_fn():
                q.wait()
        self._collective(what, run)

    # -- the two modes --------------------------------------------------------------------------
    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 activation: str = "silu", skip_weighted: bool = False,
                 mode: str = "allreduce") -> torch.Tensor:
        """The layer's output [T, H] in x's dtype, on every rank (each passes the same batch in
        ``"allreduce"`` mode; in ``"alltoall"`` mode each rank passes its own tokens)."""
        self.last_timing = {"compute": 0.0, "comm": 0.0}
        if mode == "allreduce":
            return self.forward_allreduce(x, topk_weights, topk_ids, activation, skip_weighted)
        if mode == "alltoall":
            return self.forward_alltoall(x, topk_weights, topk_ids, activation, skip_weighted)
        raise ValueError(f"mode: must be one of {', '.join(MODES)}, got {mode!r}")

    def forward_allreduce(self, x, topk_weights, topk_ids, activation="silu",
                          skip_weighted=False) -> torch.Tensor:
        """Every rank holds the same batch; partial outputs are summed with all_reduce."""
        part = self._local(x, topk_weights, topk_ids, activation, skip_weighted)
        self._collective("all_reduce", dist.all_reduce, part, dist.ReduceOp.SUM, self.group)
        return part.to(x.dtype)

    def forward_alltoall(self, x, topk_weights, topk_ids, activation="silu",
                         skip_weighted=False) -> torch.Tensor:
        """Each rank holds its own tokens; each token visits only the ranks owning its experts."""
        R, me = self.world_size, self.rank
        ids = topk_ids.to(torch.int64)
        if ids.numel() and (ids.min() < 0 or ids.max() >= self.num_experts):
            raise ValueError(f"topk_ids: ids must be in [0, {self.num_experts})")
        owner = self.owners[ids]  # [T, k]
        # Which of my tokens go to rank r (at least one expert there).
        send_idx = [torch.nonzero((owner == r).any(dim=1)).flatten() for r in range(R)]
        counts = torch.tensor([len(i) for i in send_idx], dtype=torch.int64)
        all_counts = [torch.zeros(R, dtype=torch.int64) for _ in range(R)]
        self._collective("all_gather of counts", dist.all_gather, all_counts, counts, self.group)
        recv_counts = [int(all_counts[src][me]) for src in range(R)]

        H, k = x.shape[1], ids.shape[1]
        xs_bits = x.contiguous()
        w = topk_weights.to(torch.float32).contiguous()
        # Exchange token rows, ids and weights (the ids stay global: expert_map sorts them out).
        recv = {r: (torch.empty((recv_counts[r], H), dtype=x.dtype),
                    torch.empty((recv_counts[r], k), dtype=torch.int64),
                    torch.empty((recv_counts[r], k), dtype=torch.float32))
                for r in range(R) if r != me and recv_counts[r]}

        def token_reqs():
            reqs = [dist.irecv(b, r, self.group) for r, bufs in recv.items() for b in bufs]
            for r in range(R):
                if r != me and len(send_idx[r]):
                    i = send_idx[r]
                    reqs += [dist.isend(t.contiguous(), r, self.group)
                             for t in (xs_bits[i], ids[i], w[i])]
            return reqs
        self._exchange("token exchange", token_reqs)

        # Local work: my own tokens routed here, then every received block.
        out = torch.zeros((x.shape[0], H), dtype=torch.float32)
        mine = send_idx[me]
        if len(mine):
            out[mine] += self._local(x[mine], w[mine], ids[mine], activation, skip_weighted)
        results = {r: self._local(bx, bw, bi, activation, skip_weighted)
                   for r, (bx, bi, bw) in recv.items()}
        # Send partial rows back to their owners; add what comes back.
        back = {r: torch.empty((len(send_idx[r]), H), dtype=torch.float32)
                for r in range(R) if r != me and len(send_idx[r])}
        self._exchange("result exchange", lambda: (
            [dist.irecv(buf, r, self.group) for r, buf in back.items()]
            + [dist.isend(res, r, self.group) for r, res in results.items()]))
        for r, buf in back.items():
            out[send_idx[r]] += buf
        return out.to(x.dtype)

    @staticmethod
    def alltoall_bytes_per_token(hidden: int, dtype_size: int, topk: int) -> int:
        """Bytes one token moves per remote owner rank in ``"alltoall"`` mode (there and back)."""
        return hidden * dtype_size + topk * (8 + 4) + hidden * 4
