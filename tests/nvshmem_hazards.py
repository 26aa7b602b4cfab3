"""tpcomm's hazard cases across real GPUs (nvshmem backend, one process per GPU).

    torchrun --nproc-per-node N tests/nvshmem_hazards.py      (N >= 2 GPUs)

Run by ``tests/test_launch_nvshmem_gpu.py::test_hazards_across_gpus``; prints
``HAZARDS OK`` on rank 0 when every case passed on every rank:

1. ``graph``: the mailbox all-reduce captured as two CUDA graphs (both parities) and
   replayed 1000 times back to back, no host synchronisation between replays (ranks drift
   apart; the parity double buffer, the re-arms and the sys fence must keep the steps
   apart); fresh partials every 100 replays, each checked bitwise on every rank.
2. ``delayed``: one rank sleeps 5 ms on its stream before each step (a straggler); the
   others wait inside their poll budget and every output is still bitwise right.
3. ``dead``: the last rank never launches a step; every live rank's error word names it
   (bit ``N - 1``) within the poll budget, nothing hangs; after ``reset`` on every rank the
   next step is right again.

Every rank draws every rank's partials from one seed (the same numbers on every GPU), so
each rank checks its output against ``tpcomm.mailbox.rank_order_sum`` locally. NVLink
multicast stays off (per-peer stores).
"""

from __future__ import annotations

import os
import sys
import time

for _var, _value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ[_var] = _value

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tpcomm import mailbox as mb  # noqa: E402
from tpcomm.allreduce import MailboxAllReduce  # noqa: E402
from tpcomm.backends import make_backend  # noqa: E402

TOKENS, HID = 4, 7168
REPLAYS = 1000
BUDGET_NS = 20_000_000
OK = "HAZARDS OK"


def partials(world, seed, device):
    g = torch.Generator(device="cpu").manual_seed(seed)
    p = (torch.randn(world, TOKENS, HID, generator=g) * 4).to(torch.bfloat16)
    return p.to(device)


def check(out, parts, what):
    want = mb.rank_order_sum(parts)
    same = out.view(torch.int16) == want.view(torch.int16)
    if not bool(same.all()):
        raise AssertionError(f"{what}: {int((~same).sum())} elements differ")


def main() -> int:
    backend = make_backend("nvshmem")
    rank, world = backend.rank, backend.world
    device = torch.device("cuda", torch.cuda.current_device())
    box = mb.Mailbox(backend, TOKENS, HID)
    ar = MailboxAllReduce(box, budget_ns=BUDGET_NS)
    partial = torch.empty(TOKENS, HID, dtype=torch.bfloat16, device=device)
    out = torch.empty(TOKENS, HID, dtype=torch.bfloat16, device=device)
    results = []

    def say(text):
        if rank == 0:
            print(text, flush=True)

    # compiled everywhere and every mailbox armed before anyone publishes or polls
    ar.function()
    torch.cuda.synchronize()
    backend.barrier()
    parts = partials(world, 1, device)
    partial.copy_(parts[rank])
    ar.run(partial, out, 0)
    torch.cuda.synchronize()
    if int(ar.errors.abs().sum()):
        raise AssertionError(f"warm step: error word {int(ar.error()):#x}")
    check(out, parts, "warm step")
    backend.barrier()

    # 1. graph replays
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream())
    graphs = []
    with torch.cuda.stream(stream):
        for parity in (1, 0):  # the warm step was step 0: continue with 1
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                ar.run(partial, out, parity, stream=stream)
            graphs.append(g)
    torch.cuda.current_stream().wait_stream(stream)
    backend.barrier()
    start = time.perf_counter()
    checked = 0
    with torch.cuda.stream(stream):
        for i in range(REPLAYS):
            if i % 100 == 0:
                parts = partials(world, 100 + i, device)
                partial.copy_(parts[rank])
            graphs[i % 2].replay()
            if i % 100 == 99:
                stream.synchronize()
                if int(ar.errors.abs().sum()):
                    raise AssertionError(f"replay {i}: error word {int(ar.error()):#x}")
                check(out, parts, f"replay {i}")
                checked += 1
    torch.cuda.synchronize()
    if int(ar.errors.abs().sum()):
        raise AssertionError(f"graph replays: error word {int(ar.error())}")
    per_replay = (time.perf_counter() - start) / REPLAYS * 1e6
    results.append(f"graph: {REPLAYS} replays, {checked} checks bitwise, {per_replay:.1f} us each")
    del graphs
    backend.barrier()

    # 2. a delayed rank (steps 2.., parity continues from the graphs' last step)
    step = REPLAYS + 1
    late = 1 % world
    for k in range(3):
        parts = partials(world, 3000 + k, device)
        partial.copy_(parts[rank])
        out.view(torch.int16).fill_(0x7F81)
        backend.barrier()
        if rank == late:
            torch.cuda._sleep(10_000_000)  # ~5 ms at 1.98 GHz
        ar.run(partial, out, step)
        step += 1
        torch.cuda.synchronize()
        if int(ar.errors.abs().sum()):
            raise AssertionError(f"delayed rank: error word {int(ar.error())}")
        check(out, parts, f"delayed rank step {k}")
    results.append(f"delayed: rank {late} 5 ms late, 3 steps bitwise right, no error")
    backend.barrier()

    # 3. a rank that never publishes
    dead = world - 1
    parts = partials(world, 4000, device)
    partial.copy_(parts[rank])
    out.view(torch.int16).fill_(0x7F81)
    backend.barrier()
    start = time.perf_counter()
    if rank != dead:
        ar.run(partial, out, step)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    step += 1
    err = int(ar.error())
    if rank != dead and err != 1 << dead:
        raise AssertionError(f"dead rank: rank {rank} error word {err:#x}, want {1 << dead:#x}")
    if rank != dead and elapsed > 50 * BUDGET_NS / 1e9:
        raise AssertionError(f"dead rank: rank {rank} took {elapsed:.3f} s")
    backend.barrier()
    ar.reset()
    backend.barrier()
    parts = partials(world, 5000, device)
    partial.copy_(parts[rank])
    ar.run(partial, out, step)
    torch.cuda.synchronize()
    if int(ar.errors.abs().sum()):
        raise AssertionError(f"after reset: error word {int(ar.error())}")
    check(out, parts, "step after reset")
    results.append(f"dead: rank {dead} silent, live ranks errored with mask {1 << dead:#x} "
                   f"after {elapsed * 1e3:.1f} ms (budget {BUDGET_NS / 1e6:.0f} ms); "
                   "reset, next step right")  # fmt: skip
    backend.barrier()
    for line in results:
        say(line)
    say(OK)
    backend.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
