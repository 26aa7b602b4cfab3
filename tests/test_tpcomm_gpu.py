"""GPU tests (one H200): loopback mailbox all-reduce and the one-PE nvshmem backend.

Loopback runs every TP rank as a CUDA stream on one GPU. Every rank's output must equal
``tpcomm.mailbox.rank_order_sum`` of the partials bit for bit (NaN positions compared as
NaN: the device rounds NaN to its own canonical pattern).

This file is also a script: ``python tests/test_tpcomm_gpu.py nvshmem`` runs the nvshmem
checks in a fresh process (the pytest case spawns it, so a failing init cannot take the
test session down) and prints ``TPCOMM_NVSHMEM_OK`` last.
"""

import os
import subprocess
import sys
import time

import pytest
import torch
from shared_gpu import poll_budget_ns

from tpcomm import mailbox as mb
from tpcomm.allreduce import MailboxAllReduce
from tpcomm.backends.loopback import LoopbackBackend

pytestmark = pytest.mark.gpu
NVSHMEM_OK = "TPCOMM_NVSHMEM_OK"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _partials(tp, tokens, hid, seed, sentinel=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    p = (torch.randn(tp, tokens, hid, generator=g, device="cuda") * 4).to(torch.bfloat16)
    if sentinel:  # must be canonicalised, else that group would never look published
        p.view(torch.int32)[tp - 1, tokens - 1, 5] = -1
    return p


def _assert_matches(out, partials):
    want = mb.rank_order_sum(partials)
    for r in range(out.shape[0]):
        got = out[r]
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan), f"rank {r}: NaN positions differ"
        same = got.view(torch.int16)[~nan] == want.view(torch.int16)[~nan]
        assert same.all(), f"rank {r}: {int((~same).sum())} elements differ"


def _poison(out):
    out.view(torch.int16).fill_(0x7F81)  # a NaN the kernel never produces


class _Group:
    def __init__(self, tp, tokens, hid, **kwargs):
        self.backend = LoopbackBackend(tp)
        self.box = mb.Mailbox(self.backend, tokens, hid)
        self.ar = MailboxAllReduce(self.box, **kwargs)
        self.out = torch.empty(tp, tokens, hid, dtype=torch.bfloat16, device="cuda")

    def close(self):
        self.backend.teardown()


@pytest.mark.parametrize("tp", [2, 4, 8, 16])
def test_loopback_bitwise_all_tokens(tp):
    hid = 2048
    for tokens in range(1, 9):
        group = _Group(tp, tokens, hid)
        for step in range(3):  # odd count: both parities, ends on parity 0
            partials = _partials(tp, tokens, hid, seed=100 * tokens + step, sentinel=step == 1)
            _poison(group.out)
            group.ar.run_ranks(partials, group.out, step)
            torch.cuda.synchronize()
            assert int(group.ar.errors.abs().sum()) == 0, f"tokens={tokens} step={step}"
            _assert_matches(group.out, partials)
        assert (group.box.local(0).view(torch.int32) == -1).all(), "mailbox not re-armed"
        group.close()


def test_loopback_full_width_tp16_eight_tokens():
    group = _Group(16, 8, 7168)
    partials = _partials(16, 8, 7168, seed=7)
    for step in range(2):
        _poison(group.out)
        group.ar.run_ranks(partials, group.out, step)
        torch.cuda.synchronize()
        _assert_matches(group.out, partials)
    assert int(group.ar.errors.abs().sum()) == 0
    group.close()


def test_loopback_thousand_steps():
    tp, tokens, hid, pool = 8, 4, 2048, 5
    group = _Group(tp, tokens, hid)
    inputs = [_partials(tp, tokens, hid, seed=s) for s in range(pool)]
    wants = [mb.rank_order_sum(p).view(torch.int16) for p in inputs]
    mismatches = torch.zeros((), dtype=torch.int64, device="cuda")
    for step in range(1000):
        _poison(group.out)
        group.ar.run_ranks(inputs[step % pool], group.out, step)
        mismatches += (group.out.view(torch.int16) != wants[step % pool][None]).sum()
    torch.cuda.synchronize()
    assert int(group.ar.errors.abs().sum()) == 0
    assert int(mismatches) == 0


@pytest.mark.parametrize("tp, tokens", [(4, 2), (16, 8)])
def test_loopback_cuda_graph_replay(tp, tokens):
    hid = 1024
    group = _Group(tp, tokens, hid)
    inputs = [_partials(tp, tokens, hid, seed=s) for s in (11, 12)]
    wants = [mb.rank_order_sum(p).view(torch.int16) for p in inputs]
    outs = [torch.empty_like(group.out) for _ in range(2)]
    mismatches = torch.zeros((), dtype=torch.int64, device="cuda")
    for step in range(2):  # compile and load outside the capture
        group.ar.run_ranks(inputs[step], outs[step], step)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for step in range(2):  # one parity each: the graph replays as two steps
            _poison(outs[step])
            group.ar.run_ranks(inputs[step], outs[step], step)
            mismatches += (outs[step].view(torch.int16) != wants[step][None]).sum()
    for _ in range(500):
        graph.replay()
    torch.cuda.synchronize()
    assert int(group.ar.errors.abs().sum()) == 0
    assert int(mismatches) == 0
    group.close()


def test_loopback_current_stream_is_a_rank_stream():
    """Launching from inside rank 1's stream must not chain the other ranks behind it."""
    tp, tokens, hid = 4, 1, 1024
    group = _Group(tp, tokens, hid)
    partials = _partials(tp, tokens, hid, seed=21)
    with torch.cuda.stream(group.backend.streams[1]):
        for step in range(2):
            _poison(group.out)
            group.ar.run_ranks(partials, group.out, step)
    torch.cuda.synchronize()
    assert int(group.ar.errors.abs().sum()) == 0
    _assert_matches(group.out, partials)
    group.close()


def test_loopback_delayed_rank():
    tp, tokens, hid = 4, 3, 2048
    group = _Group(tp, tokens, hid)
    for step in range(3):
        partials = _partials(tp, tokens, hid, seed=40 + step)
        _poison(group.out)
        group.ar.run_ranks(partials, group.out, step, delays={step % tp: 5_000_000})
        torch.cuda.synchronize()
        assert int(group.ar.errors.abs().sum()) == 0
        _assert_matches(group.out, partials)
    group.close()


@pytest.mark.parametrize("tp,dead", [(4, 2), (8, 5)])
def test_loopback_dead_rank_errors_within_budget(tp, dead):
    """The error word names the dead rank in rank numbering (ranks past the first chunk
    of four too)."""
    tokens, hid = 2, 1024
    budget_ns = poll_budget_ns(20_000_000)
    group = _Group(tp, tokens, hid, budget_ns=budget_ns)
    partials = _partials(tp, tokens, hid, seed=5)
    group.ar.run_ranks(partials, group.out, 0)  # warm: compiled and loaded
    torch.cuda.synchronize()
    live = [r for r in range(tp) if r != dead]
    _poison(group.out)
    start = time.perf_counter()
    group.ar.run_ranks(partials, group.out, 1, ranks=live)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    for r in live:
        assert int(group.ar.error(r)) == 1 << dead, f"rank {r} error word"
    assert int(group.ar.error(dead)) == 0
    assert elapsed < 20 * budget_ns / 1e9, f"took {elapsed:.3f} s"
    mask = 1 << dead
    print(f"dead rank {dead}: live ranks errored, mask {mask:#x}, after {elapsed * 1e3:.1f} ms")
    # the process survives: reset, and the next step is right again
    group.ar.reset()
    _poison(group.out)
    group.ar.run_ranks(partials, group.out, 2)
    torch.cuda.synchronize()
    assert int(group.ar.errors.abs().sum()) == 0
    _assert_matches(group.out, partials)
    group.close()


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

    for cycle in range(2):  # init, allocate, views, all-reduce, teardown; twice
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
        ar = MailboxAllReduce(box)
        partial = _partials(1, 2, 1024, seed=cycle, sentinel=True)
        out = torch.empty(1, 2, 1024, dtype=torch.bfloat16, device="cuda")
        for step in range(3):
            _poison(out)
            ar.run(partial[0], out[0], step)
            torch.cuda.synchronize()
            assert int(ar.errors.abs().sum()) == 0
            _assert_matches(out, partial)
        backend.barrier()
        backend.teardown()
        backend.teardown()  # second call is a no-op
        assert backend.closed
    print(NVSHMEM_OK, flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["nvshmem"]:
        nvshmem_main()
