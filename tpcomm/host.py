"""CPU process-group bootstrap and collectives (torch.distributed over gloo).

``init_distributed`` works under ``torchrun`` (env:// rendezvous), under ``mpirun`` (rank
0 picks a free TCP port and broadcasts host and port with mpi4py) and as a single plain
process. Collectives move bf16 as raw bytes (gloo has no 16-bit integer or bf16 type).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

_MPI_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")
_rendezvous: tuple[str, int] | None = None  # the TCP store init_distributed used (mpirun)


@dataclass(frozen=True)
class ProcessInfo:
    rank: int
    world: int
    local_rank: int
    launcher: str  # "torchrun", "mpirun" or "single"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def launcher() -> str:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return "torchrun"
    if any(v in os.environ for v in _MPI_RANK_VARS):
        return "mpirun"
    return "single"


def init_distributed(backend: str = "gloo", timeout_s: float = 300.0) -> ProcessInfo:
    """Join (or create) the default process group; returns this process's place in it."""
    from datetime import timedelta

    global _rendezvous
    how = launcher()
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        if how == "torchrun":
            dist.init_process_group(backend, timeout=timeout)
        elif how == "mpirun":
            try:
                from mpi4py import MPI
            except ImportError as e:  # pragma: no cover - depends on the extra
                raise RuntimeError("mpirun launch needs mpi4py: pip install '.[mpi]'") from e
            comm = MPI.COMM_WORLD
            rank, world = comm.Get_rank(), comm.Get_size()
            addr = comm.bcast((socket.gethostname(), free_port()) if rank == 0 else None, root=0)
            host = "127.0.0.1" if addr[0] == socket.gethostname() else addr[0]
            _rendezvous = (host, addr[1])
            dist.init_process_group(
                backend,
                init_method=f"tcp://{host}:{addr[1]}",
                rank=rank,
                world_size=world,
                timeout=timeout,
            )
        else:
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
            )
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(
        os.environ.get("LOCAL_RANK")
        or os.environ.get("MPI_LOCALRANKID")
        or os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK")
        or rank
    )
    return ProcessInfo(rank=rank, world=world, local_rank=local, launcher=how)


def store_client(timeout_s: float = 300.0):
    """A new client of the job's rendezvous TCP store (torchrun: its agent's, or rank 0's;
    mpirun: rank 0's), or None (a single process, or a group made elsewhere)."""
    if launcher() == "torchrun" and "MASTER_ADDR" in os.environ:
        where = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    elif _rendezvous is not None:
        where = _rendezvous
    else:
        return None
    from datetime import timedelta

    return dist.TCPStore(*where, is_master=False, timeout=timedelta(seconds=timeout_s))


def store_on_rank0() -> bool:
    """Whether rank 0's process hosts the rendezvous store (it dies with rank 0)."""
    return not (
        launcher() == "torchrun" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    )


def gather(t: torch.Tensor, dst: int = 0) -> torch.Tensor | None:
    """Every rank's ``t`` stacked in rank order on rank ``dst`` ([world, *t.shape]); None on
    the other ranks (they send only)."""
    src = _bits(t)
    world = dist.get_world_size()
    parts = [torch.empty_like(src) for _ in range(world)] if dist.get_rank() == dst else None
    dist.gather(src, parts, dst=dst)
    return None if parts is None else torch.stack(parts).view(t.dtype)


def finalize() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(torch.uint8) if t.dtype in (torch.bfloat16, torch.float16) else t


def all_gather(t: torch.Tensor) -> torch.Tensor:
    """Every rank's ``t`` stacked in rank order: [world, *t.shape], same dtype."""
    world = dist.get_world_size()
    src = _bits(t)
    out = [torch.empty_like(src) for _ in range(world)]
    dist.all_gather(out, src)
    return torch.stack(out).view(t.dtype)


def broadcast(t: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Rank ``src``'s ``t`` on every rank (a new tensor)."""
    buf = _bits(t).clone()
    dist.broadcast(buf, src)
    return buf.view(t.dtype)


def all_true(flag: bool) -> bool:
    """Logical AND of ``flag`` over the ranks."""
    value = torch.tensor([0 if flag else 1], dtype=torch.int64)
    dist.all_reduce(value)
    return int(value.item()) == 0


def barrier() -> None:
    dist.barrier()
