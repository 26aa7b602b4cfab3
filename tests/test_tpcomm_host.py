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
    want = mb.rank_order_sum(partials)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"rank {rank} differs"
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
    from tpcomm import mailbox as mb
    from tpcomm.backends.host import HostBackend

    backend = HostBackend()
    assert (backend.world, backend.rank, backend.ranks) == (1, 0, (0,))
    partial = torch.randn(2, 1024).to(torch.bfloat16)
    out = backend.all_reduce(partial)
    assert torch.equal(out.view(torch.int16), mb.rank_order_sum(partial[None]).view(torch.int16))
    with pytest.raises(ValueError, match="peer pointers"):
        backend.peer_pointers(backend.allocate((8,)))
    with pytest.raises(ValueError, match="bf16"):
        backend.all_reduce(partial.float())
    backend.teardown()
    assert not dist.is_initialized()


if __name__ == "__main__":
    main()
