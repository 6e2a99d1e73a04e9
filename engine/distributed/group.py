"""The ranks of one tensor-parallel engine and the two channels between them.

``plan`` (gloo, on CPU tensors) carries rank 0's step plans to the workers; ``reduce`` sums
the partial outputs of the row-parallel linears: the same gloo group on CPU, an NCCL group on
CUDA (one GPU per rank). Both are built straight from a ``TCPStore`` rendezvous, so nothing
lands in ``torch.distributed``'s process-global default group: one process could hold several
engines, and tests can start and stop engines one after another.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

# Workers wait in a broadcast for the next step as long as the engine is idle, which can be
# days: the plan channel must not time out on an idle engine. A dead peer is noticed another
# way (engine.distributed.leader watches its worker processes; workers watch their parent).
IDLE_TIMEOUT = datetime.timedelta(days=365)
LOOPBACK = "127.0.0.1"


def rendezvous_store(
    rank: int, world_size: int, port: int = 0, timeout_s: float = 600.0
) -> dist.TCPStore:
    """Rank 0 listens (``port`` 0: a free port, read back from ``store.port``); the others
    connect to it. Single host: tensor parallelism spans the devices of one machine."""
    return dist.TCPStore(
        LOOPBACK,
        port,
        world_size,
        rank == 0,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def _gloo(store: dist.Store, prefix: str, rank: int, world_size: int) -> dist.ProcessGroup:
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
    options._timeout = IDLE_TIMEOUT
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world_size, options)  # type: ignore[return-value]


class TensorParallelGroup:
    """This process's place among the ``world_size`` ranks of one engine.

    Every rank makes the same calls in the same order (rank 0 decides, through the plans it
    broadcasts). Not thread-safe: the engine's step thread, and only it, calls in.
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, device: torch.device) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.plan = _gloo(store, "plan", rank, world_size)
        self.reduce = self.plan
        if device.type == "cuda":
            nccl = dist.ProcessGroupNCCL.Options()
            self.reduce = dist.ProcessGroupNCCL(
                dist.PrefixStore("reduce", store), rank, world_size, nccl
            )  # type: ignore[assignment]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; every rank gets the same bits back."""
        self.reduce.allreduce([x]).wait()
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's CPU tensor ``x`` into every rank's ``x`` (same shape and dtype), in place."""
        self.plan.broadcast(x, 0).wait()
        return x

    def min_int(self, value: int) -> int:
        """The smallest ``value`` any rank holds (e.g. KV blocks that fit on every device)."""
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]
        self.plan.allreduce([t], opts).wait()
        return int(t.item())
