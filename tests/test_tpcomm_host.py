"""Host backend (gloo) under torchrun and mpirun, on the CPU.

This file is both a script (run by torchrun / mpirun: every rank checks the host
all-reduce against the reference and rank 0 prints ``TPCOMM_HOST_OK`` last) and the
pytest cases that spawn it on a free port and check that last line.
"""

import os
import shutil
import subprocess
import sys

import pytest
import torch

SENTINEL_LINE = "TPCOMM_HOST_OK"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def independent_sum(partials):
    """The SPEC's rank-order sum written out, not from tpcomm: fp32 additions in rank order
    from rank 0's value (each the exact float64 sum rounded once), one bf16 rounding; a
    sentinel word (0xFFFFFFFF) is a canonical NaN pair, which stays NaN (bf16 0x7FC0)."""
    words = partials.contiguous().view(torch.int32)
    sentinel = (words == -1).repeat_interleave(2, dim=-1)  # per bf16 element
    values = partials.double()
    acc = values[0].float()
    for r in range(1, partials.shape[0]):
        acc = (acc.double() + values[r]).float()
    out = acc.to(torch.bfloat16)
    nan = sentinel.any(dim=0)
    out.view(torch.int16)[nan] = 0x7FC0
    return out


def test_independent_sum_rounds_in_rank_order():
    """2^24 + 1 + 1 in rank order stays 2^24 in fp32 (each +1 is a tie to even); a float64
    sum would give 2^24 + 2."""
    p = torch.tensor([[2.0**24] * 2, [1.0] * 2, [1.0] * 2]).to(torch.bfloat16)
    assert independent_sum(p).float().tolist() == [2.0**24] * 2
    q = torch.ones(2, 1, 4, dtype=torch.bfloat16)
    q.view(torch.int32)[1, 0, 1] = -1
    got = independent_sum(q)
    assert torch.isnan(got[0, 2:]).all() and got[0, :2].tolist() == [2.0, 2.0]


def main() -> None:
    from tpcomm import mailbox as mb
    from tpcomm.backends import make_backend

    backend = make_backend("host")
    rank, world = backend.rank, backend.world
    generator = torch.Generator().manual_seed(1234)
    partials = (torch.randn(world, 3, 1024, generator=generator) * 10).to(torch.bfloat16)
    partials.view(torch.int32)[0, 0, 0] = -1  # a sentinel word: canonicalised first
    box = mb.Mailbox(backend, tokens=3, hid=1024)
    assert (box.local().view(torch.int32) == -1).all(), "mailbox not armed"
    got = backend.all_reduce(partials[rank])
    want = independent_sum(partials)
    nan = torch.isnan(want)  # NaN compared as NaN: its payload is not specified
    assert nan.any() and torch.equal(torch.isnan(got), nan), f"rank {rank}: NaN positions"
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan]), f"rank {rank}"
    gathered = backend.all_gather(partials[rank])
    assert torch.equal(gathered.view(torch.int16), partials.view(torch.int16))
    if world > 1:
        try:
            box.peer((rank + 1) % world)
        except ValueError as exc:
            assert "cannot load/store" in str(exc)
        else:
            raise AssertionError("host backend gave a peer view")
    backend.barrier()
    backend.teardown()
    backend.teardown()
    if rank == 0:
        print(f"world={world}", flush=True)
        print(SENTINEL_LINE, flush=True)


def _run(cmd, env):
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=90)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert lines and lines[-1] == SENTINEL_LINE, proc.stdout[-2000:] + proc.stderr[-2000:]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.mark.distributed
def test_host_backend_torchrun():
    from tpcomm.host import free_port

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        __file__,
    ]
    _run(cmd, _env())


@pytest.mark.distributed
def test_host_backend_mpirun():
    pytest.importorskip("mpi4py")
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun not installed")
    _run([mpirun, "-np", "2", sys.executable, __file__], _env())


def test_host_backend_single_process():
    """No launcher: one rank, a group of one created and destroyed by the backend."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    from tpcomm.backends.host import HostBackend

    backend = HostBackend()
    assert (backend.world, backend.rank, backend.ranks) == (1, 0, (0,))
    partial = torch.randn(2, 1024).to(torch.bfloat16)
    out = backend.all_reduce(partial)
    assert torch.equal(out.view(torch.int16), partial.view(torch.int16))  # one rank: itself
    with pytest.raises(ValueError, match="peer pointers"):
        backend.peer_pointers(backend.allocate((8,)))
    with pytest.raises(ValueError, match="bf16"):
        backend.all_reduce(partial.float())
    backend.teardown()
    assert not dist.is_initialized()


if __name__ == "__main__":
    main()
