"""GPU tests (one GPU): the loopback backend's residency check and the one-PE nvshmem backend.

This file is also a script: ``python tests/test_tpcomm_gpu.py nvshmem`` runs the nvshmem
checks in a fresh process (the pytest case spawns it, so a failing init cannot take the
test session down) and prints ``TPCOMM_NVSHMEM_OK`` last.
"""

import os
import subprocess
import sys

import pytest
import torch

from tpcomm import mailbox as mb
from tpcomm.backends.loopback import LoopbackBackend

pytestmark = pytest.mark.gpu
NVSHMEM_OK = "TPCOMM_NVSHMEM_OK"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_loopback_refuses_what_cannot_be_resident():
    backend = LoopbackBackend(16)
    with pytest.raises(ValueError, match="resident"):
        backend.check_coresident(ctas=100, threads=128, min_blocks_per_sm=8)
    backend.teardown()


def test_nvshmem_one_pe():
    pytest.importorskip("nvshmem.core")
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    for key in ("RANK", "WORLD_SIZE", "PMI_RANK", "PMI_SIZE"):
        env.pop(key, None)
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "nvshmem"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    print(proc.stdout)
    lines = proc.stdout.strip().splitlines()
    detail = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0 and lines and lines[-1] == NVSHMEM_OK, detail


def nvshmem_main():
    from tpcomm.backends import make_backend

    for cycle in range(2):  # init, allocate, views, teardown; twice
        backend = make_backend("nvshmem")
        assert (backend.world, backend.rank) == (1, 0)
        box = mb.Mailbox(backend, tokens=2, hid=1024)
        local = box.local()
        assert local.is_cuda and local.shape == (2, 1, 2, 1024)
        assert (local.view(torch.int32) == -1).all()
        assert box.peer(0).data_ptr() == local.data_ptr()
        assert box.peer_pointers().tolist() == [local.data_ptr()]
        multicast = box.multicast()
        print(f"cycle {cycle}: multicast {'available' if multicast is not None else 'absent'}")
        backend.barrier()
        backend.teardown()
        backend.teardown()  # second call is a no-op
        assert backend.closed
    print(NVSHMEM_OK, flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["nvshmem"]:
        nvshmem_main()
