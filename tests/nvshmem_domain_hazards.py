"""The hazard cases of ``nvshmem_hazards.py`` on the cross-domain path (issue 14, part 6).

    torchrun --nproc-per-node N tests/nvshmem_domain_hazards.py [DOMAIN]   (N >= 2 GPUs)

``OprojAllReduce`` on the nvshmem backend with ``domain_size=DOMAIN`` (default 1: every
peer in another domain, so every partial travels by ``put_signal`` and every consumer slot
waits on its signal word). Run by ``tests/test_launch_nvshmem_gpu.py::
test_hazards_across_domains``; prints ``DOMAIN HAZARDS OK`` on rank 0 when every case
passed on every rank:

1. ``graph``: publish + put + consume captured as two CUDA graphs (both parities) and
   replayed 1000 times back to back, no host synchronisation between replays; fresh
   partials every 100 replays, each checked (prefix bitwise the rank-order sum, output
   within 1 bf16 ulp of ``tpcomm.oproj.reference.consume``).
2. ``delayed``: one rank sleeps 5 ms on its stream before each publish; every output right.
3. ``dead``: the last rank never publishes; every live rank's error word names it (bit
   ``N - 1``) within the poll budget, nothing hangs, no output is written; after ``reset``
   on every rank the next step is right again and every signal word is zero.

Every rank draws every rank's partials from one seed, so each checks locally.
"""

from __future__ import annotations

import sys
import time

import torch

# the multicast-off environment (set before CUDA starts), sys.path, the shared constants
from nvshmem_hazards import BUDGET_NS, HID, REPLAYS, TOKENS

from launch.checks import ulp_check
from tpcomm.backends import make_backend
from tpcomm.oproj import bound as B
from tpcomm.oproj import reference as R
from tpcomm.oproj.api import OprojAllReduce

NB = 3
EPS, OUT_EPS = 1e-6, 1e-5
POISON = 0x7F81
OK = "DOMAIN HAZARDS OK"


def inputs(world, seed, device):
    """Every rank's partials and the step's other operands, the same on every rank."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def bf(*shape, s=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g) * s + shift).to(torch.bfloat16).to(device)

    return dict(partials=bf(world, TOKENS, HID, s=0.5), prefix=bf(TOKENS, HID),
                blocks=bf(TOKENS, NB, HID), norm=bf(HID, s=0.1, shift=1.0),
                query=bf(HID, s=0.2), out_norm=bf(HID, s=0.1, shift=1.0))  # fmt: skip


def check(a, prefix, out, what):
    """Prefix bitwise the reference's (the rank-order sum on ``a["prefix"]``), output
    within 1 bf16 ulp of it or, where AttnRes terms cancel, within ``bound.allowance``."""
    want_out, want_prefix = R.consume(a["partials"], a["prefix"], a["blocks"], a["norm"],
                                      a["query"], a["out_norm"], eps=EPS, out_eps=OUT_EPS,
                                      groups=1)  # fmt: skip
    if not torch.equal(prefix.view(torch.int16), want_prefix.view(torch.int16)):
        bad = int((prefix.view(torch.int16) != want_prefix.view(torch.int16)).sum())
        raise AssertionError(f"{what}: {bad} prefix elements differ from the rank-order sum")
    final, bound = B.allowance(want_prefix, a["blocks"], a["norm"], a["query"], a["out_norm"],
                               eps=EPS, out_eps=OUT_EPS)  # fmt: skip
    ok, _, _, detail = ulp_check(out, want_out, allow=B.within(out, final, bound))
    if not ok:
        raise AssertionError(f"{what}: output {detail}")


def main() -> int:
    domain = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    backend = make_backend("nvshmem", domain_size=domain)
    rank, world = backend.rank, backend.world
    device = torch.device("cuda", torch.cuda.current_device())
    if not backend.domain.split:
        raise SystemExit(f"domain size {domain} does not split {world} ranks")
    comm = OprojAllReduce(backend, TOKENS, HID, NB, groups=1, eps=EPS, out_eps=OUT_EPS,
                          budget_ns=BUDGET_NS)  # fmt: skip
    bf = dict(dtype=torch.bfloat16, device=device)
    partial, prefix = torch.empty(TOKENS, HID, **bf), torch.empty(TOKENS, HID, **bf)
    out = torch.empty(TOKENS, HID, **bf)
    results = []

    def step(a, s, stream=None):
        comm.publish(partial, s, stream=stream)
        comm.consume(prefix, a["blocks"], a["norm"], a["query"], a["out_norm"], out, s,
                     stream=stream)  # fmt: skip

    def load(seed, operands=None):
        """New partials and prefix into the step's buffers; ``operands``: the other
        tensors a captured graph reads (default: this seed's)."""
        a = inputs(world, seed, device)
        partial.copy_(a["partials"][rank])
        prefix.copy_(a["prefix"])
        if operands is not None:
            a.update({k: operands[k] for k in ("blocks", "norm", "query", "out_norm")})
        return a

    def errors():
        return int(comm.errors.abs().sum())

    def say(text):
        if rank == 0:
            print(text, flush=True)

    # compiled everywhere and every slot and signal armed before anyone publishes or polls
    comm.functions()
    torch.cuda.synchronize()
    backend.barrier()
    a = load(1)
    step(a, 0)
    torch.cuda.synchronize()
    if errors():
        raise AssertionError(f"warm step: error word {int(comm.error()):#x}")
    check(a, prefix, out, "warm step")
    backend.barrier()

    # 1. graph replays: the captured operands; partials and prefix reloaded in place
    #    before each checked replay (the prefix accumulates in the others)
    captured = a
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream())
    graphs = []
    with torch.cuda.stream(stream):
        for parity in (1, 0):  # the warm step was step 0: continue with 1
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                step(a, parity, stream=stream)
            graphs.append(g)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    backend.barrier()
    start, checked = time.perf_counter(), 0
    with torch.cuda.stream(stream):
        for i in range(REPLAYS):
            if i % 100 == 99:  # the checked replay starts from a known prefix
                stream.synchronize()
                a = load(100 + i, captured)
            graphs[i % 2].replay()
            if i % 100 == 99:
                stream.synchronize()
                if errors():
                    raise AssertionError(f"replay {i}: error word {int(comm.error()):#x}")
                check(a, prefix, out, f"replay {i}")
                checked += 1
    torch.cuda.synchronize()
    if errors():
        raise AssertionError(f"graph replays: error word {int(comm.error()):#x}")
    per_replay = (time.perf_counter() - start) / REPLAYS * 1e6
    results.append(f"graph: {REPLAYS} replays, {checked} checked, {per_replay:.1f} us each")
    del graphs
    backend.barrier()

    # 2. a delayed rank
    s = REPLAYS + 1
    late = 1 % world
    for k in range(3):
        a = load(3000 + k)
        out.view(torch.int16).fill_(POISON)
        torch.cuda.synchronize()
        backend.barrier()
        if rank == late:
            torch.cuda._sleep(10_000_000)  # ~5 ms at 1.98 GHz
        step(a, s)
        s += 1
        torch.cuda.synchronize()
        if errors():
            raise AssertionError(f"delayed rank: error word {int(comm.error()):#x}")
        check(a, prefix, out, f"delayed rank step {k}")
    results.append(f"delayed: rank {late} 5 ms late, 3 steps right, no error")
    backend.barrier()

    # 3. a rank that never publishes
    dead = world - 1
    a = load(4000)
    out.view(torch.int16).fill_(POISON)
    torch.cuda.synchronize()
    backend.barrier()
    start = time.perf_counter()
    if rank != dead:
        step(a, s)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    s += 1
    err = int(comm.error())
    if rank != dead:
        if err != 1 << dead:
            raise AssertionError(f"dead rank: rank {rank} error word {err:#x}, want {1 << dead:#x}")
        if not bool((out.view(torch.int16) == POISON).all()):
            raise AssertionError(f"dead rank: rank {rank} wrote output")
        if elapsed > 50 * BUDGET_NS / 1e9:
            raise AssertionError(f"dead rank: rank {rank} took {elapsed:.3f} s")
    backend.barrier()
    comm.reset()
    backend.barrier()
    a = load(5000)
    step(a, s)
    torch.cuda.synchronize()
    if errors():
        raise AssertionError(f"after reset: error word {int(comm.error()):#x}")
    check(a, prefix, out, "step after reset")
    backend.barrier()
    signals = backend.local(comm.remote.signals, rank)
    if int(signals.abs().sum()):
        raise AssertionError(f"after reset: signal words {signals.tolist()} not zero")
    results.append(f"dead: rank {dead} silent, live ranks errored with mask {1 << dead:#x} "
                   f"after {elapsed * 1e3:.1f} ms (budget {BUDGET_NS / 1e6:.0f} ms), no "
                   "output; reset, next step right, signals zero")  # fmt: skip
    backend.barrier()
    for line in results:
        say(line)
    say(OK)
    backend.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
