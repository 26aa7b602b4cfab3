"""The job's processes: who they are (launcher environment), how checks and latencies
cross them (``Procs``, torch.distributed over gloo on CPU copies), and the nvshmem
bootstrap of one rank per process (``nvshmem_job``)."""

from __future__ import annotations

import contextlib
import importlib.util
import os

import torch

from tpcomm import host

_RANK_VARS = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")
_MPI_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def env_rank() -> int:
    """This process's rank from the launcher's environment (0 for a plain process)."""
    for var in _RANK_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def job_processes() -> int:
    """Processes of this job from the launcher's environment (1 for a plain process)."""
    if host.launcher() == "torchrun":
        return int(os.environ["WORLD_SIZE"])
    for var in _MPI_SIZE_VARS:
        if var in os.environ:
            return int(os.environ[var])
    return 2 if host.launcher() == "mpirun" else 1  # a launcher that hides its size


def nvshmem_installed() -> bool:
    return importlib.util.find_spec("nvshmem") is not None


class Procs:
    """The job's processes as the checks see them: one (loopback) or one per rank
    (nvshmem, through the default torch.distributed group, gloo on CPU copies)."""

    def __init__(self, count: int = 1, rank: int = 0):
        self.count, self.rank = count, rank

    @property
    def root(self) -> bool:
        return self.rank == 0

    def objects(self, obj) -> list:
        """Every process's ``obj`` (picklable), in process order."""
        if self.count == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.count
        dist.all_gather_object(out, obj)
        return out

    def all_true(self, flag) -> bool:
        if self.count == 1:
            return bool(flag)
        return host.all_true(bool(flag))

    def gather(self, t: torch.Tensor) -> torch.Tensor | None:
        """Every process's CPU copy of ``t`` concatenated along dim 0, on process 0 (None on
        the others). Every process must call it with the same shape and dtype."""
        t = t.detach().to("cpu").contiguous()
        if self.count == 1:
            return t
        import torch.distributed as dist

        raw = t.view(torch.uint8) if t.dtype in (torch.bfloat16, torch.float16) else t
        parts = [torch.empty_like(raw) for _ in range(self.count)] if self.root else None
        dist.gather(raw, parts, dst=0)
        if not self.root:
            return None
        return torch.cat([p.view(t.dtype) for p in parts], dim=0)


@contextlib.contextmanager
def nvshmem_job(
    launcher: str, multicast: bool = False, timeout_s: float = 300.0, domain_size: int | None = None
):
    """One rank in this process: the gloo group (checks, the uid broadcast; ``timeout_s``)
    first, then the nvshmem PE on the process's GPU; yields (backend, Procs). On exit the
    backend's teardown frees and finalizes nvshmem, then the group is destroyed."""
    from tpcomm.backends import make_backend

    if not multicast:  # no NVLS (cuMulticastCreate) unless asked
        os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    info = host.init_distributed(timeout_s=timeout_s)
    try:
        device = info.local_rank % torch.cuda.device_count()
        backend = make_backend("nvshmem", device=device, launcher=launcher, domain_size=domain_size)
        try:
            if (backend.rank, backend.world) != (info.rank, info.world):
                raise RuntimeError(
                    f"nvshmem PE {backend.rank} of {backend.world} is torch.distributed rank "
                    f"{info.rank} of {info.world}: the launcher's ranks disagree"
                )
            yield backend, Procs(info.world, info.rank)
        finally:
            backend.teardown()
    finally:
        host.finalize()
