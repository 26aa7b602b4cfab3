"""``OprojAllReduce``'s hazards across real GPUs (nvshmem backend, one process per GPU).

    torchrun --nproc-per-node N tests/nvshmem_hazards.py [DOMAIN]   (N >= 2 GPUs)

``domain_size=DOMAIN`` (default 1: every peer in another domain, so every partial travels by
``put_signal`` and every consumer slot waits on its signal word; ``N``: one domain, per-peer
stores, no signal words). Run by ``tests/test_launch_nvshmem_gpu.py::test_hazards_across_gpus``
and ``::test_hazards_across_domains``; prints ``HAZARDS OK`` on rank 0 when every case passed
on every rank:

0. ``warm``: the first step in the launcher's eager order (``launch/runner.py``
   ``enqueue(eager=True)``): every rank publishes and puts, synchronises and meets the
   others, and only then consumes, so no poll budget covers a peer's first-use host work
   (first put, first launch of each kernel); before any consumer polls, every signal word
   and slot of every other rank must already be in this rank's mailbox.
1. ``graph``: publish + put + consume captured as two CUDA graphs (both parities) and
   replayed 1000 times; each block of 99 back to back, no host synchronisation between
   replays, behind a sleep and an on-stream barrier (the launcher's ``timed_replays``: the
   host enqueues the block while the GPUs wait, so the budget covers GPU drift, not host
   skew); then fresh partials and one checked replay (prefix bitwise the rank-order sum,
   output within 1 bf16 ulp of ``tpcomm.oproj.reference.consume``).
2. ``delayed``: one rank sleeps 5 ms on its stream before each publish; every output right.
3. ``dead``: the last rank never publishes; every live rank's error word names it (bit
   ``N - 1``) within the poll budget, nothing hangs, no output is written; after ``reset``
   on every rank the next step is right again and every signal word is zero.

Every rank draws every rank's partials from one seed, so each checks locally. The ranks
agree on each case's outcome (gloo) before anyone goes on: a failure is named on every
rank (rank, case, error word as missing ranks), and no rank runs into the next case while
a peer has left (a leaving rank's teardown frees are nvshmem collectives that would meet
the survivors' barriers and let them run on against nobody).
"""

from __future__ import annotations

import os
import sys
import time

for _var, _value in (  # NVLink multicast off (per-peer stores), set before CUDA starts
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ[_var] = _value

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launch.checks import ulp_check  # noqa: E402
from launch.procs import Procs  # noqa: E402
from tpcomm import mailbox as mb  # noqa: E402
from tpcomm.backends import make_backend  # noqa: E402
from tpcomm.oproj import bound as B  # noqa: E402
from tpcomm.oproj import reference as R  # noqa: E402
from tpcomm.oproj.allreduce import OprojAllReduce  # noqa: E402

TOKENS, HID = 4, 7168
REPLAYS = 1000
BUDGET_NS = 20_000_000
NB = 3
EPS, OUT_EPS = 1e-6, 1e-5
POISON = 0x7F81
CHECK_EVERY = 100  # replays per block: 99 back to back, then a checked one
GATE_CYCLES = 40_000_000  # ~20 ms at 1.98 GHz (launch/runner.py): a block is enqueued meanwhile
OK = "HAZARDS OK"


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


def error_text(mask: int) -> str:
    """A consumer's error word: bit r set = nothing from rank r within the poll budget
    (its signal word, or its slot after the signal, never came)."""
    ranks = [r for r in range(mask.bit_length()) if mask >> r & 1]
    return f"error word {mask:#x} (nothing from rank(s) {ranks} within {BUDGET_NS / 1e6:g} ms)"


def main() -> int:
    domain = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    backend = make_backend("nvshmem", domain_size=domain)
    rank, world = backend.rank, backend.world
    device = torch.device("cuda", torch.cuda.current_device())
    procs = Procs(world, rank)
    comm = OprojAllReduce(backend, TOKENS, HID, NB, groups=1, eps=EPS, out_eps=OUT_EPS,
                          budget_ns=BUDGET_NS)  # fmt: skip
    bf = dict(dtype=torch.bfloat16, device=device)
    partial, prefix = torch.empty(TOKENS, HID, **bf), torch.empty(TOKENS, HID, **bf)
    out = torch.empty(TOKENS, HID, **bf)
    remote = backend.domain.remote(rank)
    results = []

    def publish(s, stream=None):
        comm.publish(partial, s, stream=stream)

    def consume(a, s, stream=None):
        comm.consume(prefix, a["blocks"], a["norm"], a["query"], a["out_norm"], out, s,
                     stream=stream)  # fmt: skip

    def step(a, s, stream=None):
        publish(s, stream)
        consume(a, s, stream)

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

    t0 = time.perf_counter()

    def progress(text):  # every rank, so a case that stalls names itself and its rank
        print(f"rank {rank} {time.perf_counter() - t0:7.2f} s: {text}", file=sys.stderr, flush=True)

    def outcome(what, a=None):
        """None when this rank's last step was right, else why not (this rank's view)."""
        if errors():
            return f"{what}: {error_text(int(comm.error()))}"
        if a is not None:
            try:
                check(a, prefix, out, what)
            except AssertionError as e:
                return str(e)
        return None

    def agree(case, failure):
        """Every rank's outcome of ``case``; each rank raises naming every failed rank."""
        failed = [f"rank {r}: {f}" for r, f in enumerate(procs.objects(failure)) if f]
        if failed:
            progress(f"{case} FAILED on {len(failed)} rank(s)")
            raise AssertionError(f"{case} failed: " + "; ".join(failed))

    def landed(s):
        """After every rank's put of step ``s`` and a barrier, before any consumer polls:
        the ranks whose signal word (other domains) or slot this rank's mailbox lacks."""
        words = backend.local(comm.remote.signals, rank)[s & 1].tolist() if remote else []
        box = comm.mailbox.local(rank)[s & 1]
        unsignalled = [p for p in remote if words[p] != 1]
        empty = [p for p in range(world) if not bool(mb.published(box[p]).all())]
        return sorted(set(unsignalled) | set(empty))

    def gate(stream):
        """Every GPU behind a sleep, then an on-stream barrier (the launcher's
        ``timed_replays``): the host enqueues what follows while the GPUs wait, so what it
        enqueues starts on every GPU together whatever the hosts' skew."""
        import nvshmem.core as nv

        from tpcomm.backends.nvshmem import TorchStream

        torch.cuda._sleep(GATE_CYCLES)
        nv.barrier_all(TorchStream(stream))

    # compiled everywhere and every slot and signal armed before anyone publishes or polls
    comm.functions()
    torch.cuda.synchronize()
    backend.barrier()

    # 0. the warm step, in the launcher's eager order (publish + put, synchronise, meet,
    #    consume): its first puts and first launches are outside every poll budget
    progress(f"compiled; warm step (domain size {domain}: ranks {list(remote)} by put)")
    a = load(1)
    start = time.perf_counter()
    publish(0)
    torch.cuda.synchronize()
    put_ms = (time.perf_counter() - start) * 1e3
    backend.barrier()
    lost = landed(0)
    progress(f"warm step: published and put in {put_ms:.1f} ms; after the barrier the "
             f"mailbox lacks ranks {lost}")  # fmt: skip
    failure = f"after every rank's put and a barrier, no signal or slot from ranks {lost}"
    agree("warm step (puts)", failure if lost else None)
    consume(a, 0)
    torch.cuda.synchronize()
    agree("warm step", outcome("warm step", a))
    backend.barrier()

    progress("warm step right; capturing the graphs")
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
    progress("captured; replaying")
    gpu_ms, checked = 0.0, 0
    with torch.cuda.stream(stream):
        for first in range(0, REPLAYS, CHECK_EVERY):
            last = min(first + CHECK_EVERY, REPLAYS) - 1
            gate(stream)
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record(stream)
            for i in range(first, last):  # back to back: no host synchronisation
                graphs[i % 2].replay()
            end.record(stream)
            stream.synchronize()
            gpu_ms += begin.elapsed_time(end)
            a = load(100 + last, captured)  # the checked replay starts from a known prefix
            gate(stream)
            graphs[last % 2].replay()
            stream.synchronize()
            block = f"replays {first}..{last}"  # the error word covers the whole block
            agree(block, outcome(block, a))
            checked += 1
            each = begin.elapsed_time(end) * 1e3 / max(1, last - first)
            progress(f"replays {first}..{last} right ({each:.1f} us each back to back)")
    torch.cuda.synchronize()
    agree("graph replays", outcome("graph replays"))
    per_replay = gpu_ms * 1e3 / (REPLAYS - checked)
    results.append(f"graph: {REPLAYS} replays, {checked} checked, {per_replay:.1f} us each "
                   "back to back")  # fmt: skip
    del graphs
    backend.barrier()

    progress("graph replays done")
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
        agree(f"delayed rank step {k}", outcome(f"delayed rank step {k}", a))
    results.append(f"delayed: rank {late} 5 ms late, 3 steps right, no error")
    backend.barrier()

    progress("delayed rank done")
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
    failure = None
    if rank != dead:
        if err != 1 << dead:
            failure = f"{error_text(err)}, want {1 << dead:#x} (rank {dead} alone)"
        elif not bool((out.view(torch.int16) == POISON).all()):
            failure = "wrote output"
        elif elapsed > 50 * BUDGET_NS / 1e9:
            failure = f"took {elapsed:.3f} s"
    progress(f"dead rank: {error_text(err)} after {elapsed * 1e3:.1f} ms")
    agree("dead rank", failure)
    backend.barrier()
    comm.reset()
    backend.barrier()
    a = load(5000)
    step(a, s)
    torch.cuda.synchronize()
    failure = outcome("step after reset", a)
    backend.barrier()
    signals = backend.local(comm.remote.signals, rank) if remote else torch.zeros(1)
    if failure is None and int(signals.abs().sum()):
        failure = f"after reset: signal words {signals.tolist()} not zero"
    agree("after reset", failure)
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
