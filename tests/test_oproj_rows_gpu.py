"""GPU tests (one H200, loopback backend): the o-projection all-reduce at 9..1024 rows.

One-shot, every rank in one launch (``run_ranks(mode="one-launch")``, PDL): ready partials
(publisher) or the cuBLAS GEMM producer above 8 rows. Twoshot and per-rank one-shot as
``RowChunks`` (chunks whose per-rank consumers fit the GPU together). Checks over two steps
(both parities, the prefix chained): prefix bitwise the reference's rank-order sum (of the
partials actually produced), output within 1 bf16 ulp, every rank identical, buffers
re-armed, no error word; outputs poisoned first and a guard rank's rows untouched; the
GEMM's partials within 1 ulp of ``reference.project``; xmoe copies and hint counts; graph
replay bitwise the eager steps; a dead rank at large rows errors within the budget (no
hang), writes nothing, and the next step after ``reset`` is right again.

    python -m pytest -q -s tests/test_oproj_rows_gpu.py
"""

import time

import pytest
import torch
from shared_gpu import poll_budget_ns
from test_oproj_consumer_gpu import EPS, OUT_EPS, poison, random_inputs, ulp_check

from tpcomm.backends.loopback import LoopbackBackend
from tpcomm.mailbox import arm
from tpcomm.oproj import bound as B
from tpcomm.oproj import reference as R
from tpcomm.oproj.all_ranks import AllRanks
from tpcomm.oproj.allreduce import OprojAllReduce
from tpcomm.oproj.plan import slicing
from tpcomm.oproj.rows import RowChunks

pytestmark = pytest.mark.gpu
TP, HID, D_LOCAL = 8, 7168, 768
ROWS = [9, 64, 512, 1024]
# (rows, hid): Kimi-K3's width at every rows count, then other multiples of 256 (3 CTAs of
# 768 columns, 5 of 1024, 1 of 256; plan.slicing)
WIDTHS = [(r, HID) for r in ROWS] + [(64, 2304), (512, 2304), (100, 5120), (64, 256)]


def _bits(t):
    return t.contiguous().view(torch.int16)


def _projection(tp, rows, seed, hid=HID):
    g = torch.Generator(device="cuda").manual_seed(seed)
    attn = torch.randn(tp, rows, D_LOCAL, generator=g, device="cuda").to(torch.bfloat16)
    w = torch.randn(tp, hid, D_LOCAL, generator=g, device="cuda") * D_LOCAL**-0.5
    return attn, w.to(torch.bfloat16)


def _check(prefixes, outputs, partials, a, prefix, groups, tp, *, twoshot=False):
    """Every rank: prefix bitwise the reference's, output identical to rank 0's and within
    1 ulp of the reference, or where its terms cancel a rounding of a value within
    ``bound.allowance`` of the exact output. Returns (new prefix, worst ulps)."""
    want_out, want_prefix = R.consume(
        partials, prefix, a["blocks"], a["norm"], a["query"], a["out_norm"], eps=EPS,
        out_eps=OUT_EPS, has_delta=True, groups=groups, twoshot=twoshot,
    )  # fmt: skip
    for r in range(tp):
        assert torch.equal(_bits(prefixes[r]), _bits(want_prefix)), f"rank {r}: prefix"
        assert torch.equal(_bits(outputs[r]), _bits(outputs[0])), f"rank {r}: output"
    final, bound = B.allowance(want_prefix, a["blocks"], a["norm"], a["query"], a["out_norm"],
                               eps=EPS, out_eps=OUT_EPS)  # fmt: skip
    allow = B.within(outputs[0], final, bound)
    return want_prefix, ulp_check(outputs[0], want_out, allow)[1]


@pytest.mark.parametrize("project", [False, True])
@pytest.mark.parametrize("rows, hid", WIDTHS)
def test_one_shot_one_launch(rows, hid, project):
    nb, xmoe = 8, 1
    backend = LoopbackBackend(TP)
    # projecting: cuBLAS + publisher, whose staged partials the test reads back (the plan's
    # producer on sm_90, OprojGemmProducer, stages none: tests/test_oproj_gemm_gpu.py)
    comm = OprojAllReduce(backend, rows, hid, nb, eps=EPS, out_eps=OUT_EPS, xmoe_reps=xmoe,
                          one_launch=True, producer="cublas" if project else None)  # fmt: skip
    sm90 = torch.cuda.get_device_capability() == (9, 0)
    assert comm.plan.producer == ("wgmma" if sm90 else "cublas") and not comm.twoshot
    a = random_inputs(TP, rows, hid, nb, seed=rows)
    attn, w_os = _projection(TP, rows, seed=rows + 1, hid=hid)
    bf = dict(dtype=torch.bfloat16, device="cuda")
    prefixes = torch.empty(TP + 1, rows, hid, **bf)  # a guard rank past the last
    outputs = torch.empty(TP + 1, rows, hid, **bf)
    xmoes = torch.empty(TP + 1, xmoe, rows, hid, **bf)
    prefixes.copy_(a["prefix"][None].expand_as(prefixes))
    poison(xmoes)
    guard = (prefixes[TP].clone(), outputs[TP].clone(), xmoes[TP].clone())
    prefix, worst = a["prefix"], 0.0
    for step in range(2):
        poison(outputs[:TP])
        AllRanks(comm).run_ranks(attn if project else a["partials"], prefixes[:TP], a["blocks"],
                       a["norm"], a["query"], a["out_norm"], outputs[:TP], step,
                       xmoes=xmoes[:TP], w_os=w_os if project else None, mode="one-launch",
                       pdl=True)  # fmt: skip
        torch.cuda.synchronize()
        assert int(comm.errors.abs().sum()) == 0, comm.errors[:, 0].tolist()
        assert comm.armed(), f"step {step}: mailbox not re-armed"
        partials = a["partials"]
        if project:  # the GEMM's partials, as published
            partials = comm.staging()[:TP].clone()
            for r in range(TP):
                ulp_check(partials[r], R.project(attn[r], w_os[r]))
        prefix, ulps = _check(prefixes, outputs, partials, a, prefix, comm.groups, TP)
        worst = max(worst, ulps)
        for r in range(TP):
            assert torch.equal(_bits(xmoes[r, 0]), _bits(outputs[r])), f"rank {r}: xmoe"
    want = 2 * slicing(hid).ctas * rows  # one release increment per CTA, two steps
    assert comm.hint_words[:TP, 0].tolist() == [want] * TP
    for t, g in zip((prefixes[TP], outputs[TP], xmoes[TP]), guard, strict=True):
        assert torch.equal(_bits(t), _bits(g)), "the guard rank's rows were written"
    print(f"\none-shot one launch TP{TP} hid{hid} rows {rows} project={project}: "
          f"worst {worst:.2f} ulp")  # fmt: skip
    backend.teardown()


def test_cublas_producer_at_few_rows():
    """The other producer where both can run (4 rows): cuBLAS + publisher, one launch; its
    partials within 1 ulp of the projection, the prefix bitwise their rank-order sum."""
    rows, nb = 4, 8
    backend = LoopbackBackend(TP)
    comm = OprojAllReduce(backend, rows, HID, nb, eps=EPS, out_eps=OUT_EPS, one_launch=True,
                          producer="cublas")  # fmt: skip
    a = random_inputs(TP, rows, HID, nb, seed=41)
    attn, w_os = _projection(TP, rows, seed=42)
    bf = dict(dtype=torch.bfloat16, device="cuda")
    prefixes = a["prefix"][None].repeat(TP, 1, 1)
    outputs = torch.empty(TP, rows, HID, **bf)
    poison(outputs)
    AllRanks(comm).run_ranks(
        attn,
        prefixes,
        a["blocks"],
        a["norm"],
        a["query"],
        a["out_norm"],
        outputs,
        0,
        w_os=w_os,
        mode="one-launch",
        pdl=True,
    )
    torch.cuda.synchronize()
    assert int(comm.errors.abs().sum()) == 0 and comm.armed()
    partials = comm.staging()[:TP].clone()
    for r in range(TP):
        ulp_check(partials[r], R.project(attn[r], w_os[r]))
    _check(prefixes, outputs, partials, a, a["prefix"], comm.groups, TP)
    backend.teardown()


@pytest.mark.parametrize("twoshot", [True, False])
@pytest.mark.parametrize("rows, hid", WIDTHS)
def test_per_rank_chunks(rows, hid, twoshot):
    nb = 3
    backend = LoopbackBackend(TP)
    chunks = RowChunks(backend, rows, hid, nb, twoshot=twoshot, eps=EPS, out_eps=OUT_EPS)
    assert chunks.twoshot == twoshot and chunks.chunk >= 1
    bf = dict(dtype=torch.bfloat16, device="cuda")
    prefixes = torch.empty(TP, rows, hid, **bf)
    outputs = torch.empty(TP, rows, hid, **bf)
    worst = 0.0
    for step in range(2):
        a = random_inputs(TP, rows, hid, nb, seed=700 + rows + step)
        prefixes.copy_(a["prefix"][None].expand_as(prefixes))
        poison(outputs)
        chunks.run_ranks(a["partials"], prefixes, a["blocks"], a["norm"], a["query"],
                         a["out_norm"], outputs, step)  # fmt: skip
        torch.cuda.synchronize()
        assert chunks.error_masks() == [0] * TP
        assert chunks.armed(), f"step {step}: buffers not re-armed"
        _, ulps = _check(prefixes, outputs, a["partials"], a, a["prefix"], chunks.groups, TP,
                         twoshot=twoshot)  # fmt: skip
        worst = max(worst, ulps)
    # the producer (cuBLAS GEMM above 8 rows per chunk, else mma.sync) through the chunks
    attn, w_os = _projection(TP, rows, seed=rows + 2, hid=hid)
    a = random_inputs(TP, rows, hid, nb, seed=rows + 3)
    prefixes.copy_(a["prefix"][None].expand_as(prefixes))
    poison(outputs)
    chunks.run_ranks(attn, prefixes, a["blocks"], a["norm"], a["query"], a["out_norm"],
                     outputs, 2, w_os=w_os)  # fmt: skip
    torch.cuda.synchronize()
    assert chunks.error_masks() == [0] * TP and chunks.armed()
    for r in range(TP):
        assert torch.equal(_bits(outputs[r]), _bits(outputs[0])), f"rank {r}: output"
    print(f"\nper-rank chunks of {chunks.chunk} TP{TP} hid{hid} rows {rows} twoshot={twoshot}: "
          f"worst {worst:.2f} ulp; {chunks.bytes} B per rank")  # fmt: skip
    backend.teardown()


def test_graph_replay_large_rows():
    rows, nb = 512, 8
    backend = LoopbackBackend(TP)
    comms = [OprojAllReduce(backend, rows, HID, nb, eps=EPS, out_eps=OUT_EPS, one_launch=True)
             for _ in range(2)]  # fmt: skip
    a = random_inputs(TP, rows, HID, nb, seed=11)
    attn, w_os = _projection(TP, rows, seed=12)
    bf = dict(dtype=torch.bfloat16, device="cuda")
    prefixes = [torch.empty(TP, rows, HID, **bf) for _ in comms]
    outputs = [torch.empty(TP, rows, HID, **bf) for _ in comms]
    for p in prefixes:
        p.copy_(a["prefix"][None].expand_as(p))

    def steps(i):
        for step in range(2):
            AllRanks(comms[i]).run_ranks(attn, prefixes[i], a["blocks"], a["norm"], a["query"],
                               a["out_norm"], outputs[i], step, w_os=w_os, mode="one-launch",
                               pdl=True)  # fmt: skip

    steps(0)
    steps(1)  # compiled and loaded; cuBLAS warmed
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        steps(0)
    for _ in range(5):
        graph.replay()
        steps(1)
    torch.cuda.synchronize()
    for c in comms:
        assert int(c.errors.abs().sum()) == 0 and c.armed()
    assert torch.equal(_bits(prefixes[0]), _bits(prefixes[1]))
    assert torch.equal(_bits(outputs[0]), _bits(outputs[1]))
    backend.teardown()


@pytest.mark.parametrize("project", [False, True])
def test_dead_rank_one_launch_large_rows(project):
    """Rank 3's partial never lands (its slot re-armed after the publish, or, projecting,
    after the plan's producer published it from its GEMM): every rank's consumer reports
    it within the budget, writes nothing; after reset the step is right."""
    rows, nb, dead, budget_ns = 1024, 3, 3, poll_budget_ns(2_000_000)
    backend = LoopbackBackend(TP)
    comm = OprojAllReduce(backend, rows, HID, nb, eps=EPS, out_eps=OUT_EPS, budget_ns=budget_ns,
                          one_launch=True)  # fmt: skip
    a = random_inputs(TP, rows, HID, nb, seed=5)
    bf = dict(dtype=torch.bfloat16, device="cuda")
    prefixes = torch.empty(TP, rows, HID, **bf)
    outputs = torch.empty(TP, rows, HID, **bf)
    prefixes.copy_(a["prefix"][None].expand_as(prefixes))
    args = (a["blocks"], a["norm"], a["query"], a["out_norm"])
    AllRanks(comm).run_ranks(a["partials"], prefixes, *args, outputs, 0, mode="one-launch")  # warm
    torch.cuda.synchronize()
    assert int(comm.errors.abs().sum()) == 0
    before = prefixes.clone()
    poison(outputs)
    if project:  # OprojGemmProducer on sm_90
        sm90 = torch.cuda.get_device_capability() == (9, 0)
        assert comm.producer == ("wgmma" if sm90 else "cublas")
        attn, w_os = _projection(TP, rows, seed=6)
        AllRanks(comm).produce_all(attn, w_os, 1, pdl=True)
    else:
        AllRanks(comm).publish_all(a["partials"], 1)
    torch.cuda.synchronize()
    for r in range(TP):
        arm(comm.mailbox.local(r)[1, dead])
    start = time.perf_counter()
    AllRanks(comm).consume_all(prefixes, *args, outputs, 1)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    assert comm.errors[:TP, 0].tolist() == [1 << dead] * TP
    assert elapsed < 30.0, f"took {elapsed:.1f} s"
    assert torch.equal(prefixes, before), "an erroring consumer wrote prefix"
    assert (outputs.view(torch.int16) == 0x7F81).all(), "an erroring consumer wrote output"
    comm.reset()
    assert comm.armed()
    prefixes.copy_(a["prefix"][None].expand_as(prefixes))
    AllRanks(comm).run_ranks(a["partials"], prefixes, *args, outputs, 2, mode="one-launch")
    torch.cuda.synchronize()
    assert int(comm.errors.abs().sum()) == 0
    _check(prefixes, outputs, a["partials"], a, a["prefix"], comm.groups, TP)
    print(f"\ndead rank {dead} at {rows} rows: every rank errored in {elapsed * 1e3:.0f} ms")
    backend.teardown()


def test_dead_rank_twoshot_chunks():
    """Rank 5 never publishes: every rank's chunks report an error within the budget, write
    no prefix. The budget (the default 50 ms, not less) also covers the host's launches
    of a chunk's consumers in the warm step: twoshot consumers wait on each other's second
    hop, which no enqueue order can put before them."""
    rows, nb, dead = 64, 3, 5
    backend = LoopbackBackend(TP)
    chunks = RowChunks(backend, rows, HID, nb, twoshot=True, eps=EPS, out_eps=OUT_EPS,
                       budget_ns=poll_budget_ns(50_000_000))  # fmt: skip
    a = random_inputs(TP, rows, HID, nb, seed=9)
    bf = dict(dtype=torch.bfloat16, device="cuda")
    prefixes = torch.empty(TP, rows, HID, **bf)
    outputs = torch.empty(TP, rows, HID, **bf)
    prefixes.copy_(a["prefix"][None].expand_as(prefixes))
    args = (a["blocks"], a["norm"], a["query"], a["out_norm"])
    chunks.run_ranks(a["partials"], prefixes, *args, outputs, 0)  # warm
    torch.cuda.synchronize()
    assert chunks.error_masks() == [0] * TP
    before = prefixes.clone()
    poison(outputs)
    start = time.perf_counter()
    chunks.run_ranks(a["partials"], prefixes, *args, outputs, 1,
                     publishers=[r for r in range(TP) if r != dead])  # fmt: skip
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    masks = chunks.error_masks()
    assert all(m != 0 for m in masks), masks
    assert elapsed < 30.0, f"took {elapsed:.1f} s"
    assert torch.equal(prefixes, before)
    chunks.reset()
    assert chunks.armed()
    backend.teardown()


@pytest.mark.parametrize("rows", [64, 1024])
def test_xmoe_hints_gate_every_read(rows):
    """The waiter (another stream, forked before a sleep that holds the consumer back,
    enqueued after the consumer so its budget never covers the host's launches) spins
    before any copy is written and reads every copy only after its hint: the copies are
    poisoned before each step, so a read before the hint would land poison in ``dests``.
    Three steps (the quota taken back each time; in at least one the host enqueued the
    waiter while the sleep still ran), then a waiter with no consumer times out and reads
    nothing."""
    from tpcomm.oproj.hints import hint_quota, wait_hints

    nb, reps = 3, 2
    backend = LoopbackBackend(TP)
    comm = OprojAllReduce(backend, rows, HID, nb, eps=EPS, out_eps=OUT_EPS, xmoe_reps=reps,
                          one_launch=True)  # fmt: skip
    a = random_inputs(TP, rows, HID, nb, seed=31)
    bf = dict(dtype=torch.bfloat16, device="cuda")
    prefixes = torch.empty(TP, rows, HID, **bf)
    outputs = torch.empty(TP, rows, HID, **bf)
    xmoes = torch.empty(TP, reps, rows, HID, **bf)
    dests = torch.empty(TP, reps, rows, HID, **bf)
    prefixes.copy_(a["prefix"][None].expand_as(prefixes))
    args = (a["blocks"], a["norm"], a["query"], a["out_norm"])
    AllRanks(comm).run_ranks(
        a["partials"], prefixes, *args, outputs, 0, xmoes=xmoes, mode="one-launch"
    )
    poison(dests)
    wait_hints(comm, xmoes, dests, every_rank=True)  # compiled, loaded; takes step 0's quota
    torch.cuda.synchronize()
    assert comm.hint_words[:TP, :3].abs().sum() == 0, comm.hint_words[:TP]
    for r in range(TP):  # after the consumer on its stream: every copy of every rank read
        for rep in range(reps):
            assert torch.equal(_bits(dests[r, rep]), _bits(outputs[r])), (0, r, rep)
    side = torch.cuda.Stream()
    early = []  # per step: the sleep still ran when the host had enqueued the waiter
    for step in range(1, 4):
        poison(xmoes)
        poison(dests)
        main = torch.cuda.current_stream()
        fork, slept, consumed = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        fork.record(main)
        torch.cuda._sleep(200_000_000)  # ~0.1 s: the consumer held back
        slept.record(main)
        AllRanks(comm).run_ranks(
            a["partials"], prefixes, *args, outputs, step, xmoes=xmoes, mode="one-launch"
        )
        consumed.record(main)
        side.wait_event(fork)  # the waiter after the consumer on the host, before it on the GPU
        waited = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):  # its budget covers the rest of the sleep
            wait_hints(comm, xmoes, dests, every_rank=True, budget_ns=2_000_000_000)
            waited.record(side)
        early.append(not slept.query())
        main.wait_stream(side)
        torch.cuda.synchronize()
        assert int(comm.errors.abs().sum()) == 0
        # on a timeout: when the sleep, the consumer and the waiter ended (ms from the fork),
        # and the counters (a counter at the quota: the consumer's hints came after the budget)
        when = [round(fork.elapsed_time(e), 3) for e in (slept, consumed, waited)]
        assert comm.hint_words[:TP, 2].tolist() == [0] * TP, (
            f"a waiter timed out: step {step}, sleep / consumer / waiter end at {when} ms, "
            f"hint words {comm.hint_words[:TP, :3].tolist()} (quota {hint_quota(HID, rows)})"
        )
        assert comm.hint_words[:TP, :2].abs().sum() == 0, "quota not taken back"
        for r in range(TP):
            for rep in range(reps):
                assert torch.equal(_bits(dests[r, rep]), _bits(outputs[r])), (step, r, rep)
    assert any(early), "the host took longer than the sleep: no waiter spun before the copies"
    # no consumer: the waiter times out within its budget, reads nothing
    poison(dests)
    start = time.perf_counter()
    wait_hints(comm, xmoes, dests, every_rank=True, budget_ns=poll_budget_ns(5_000_000))
    torch.cuda.synchronize()
    assert time.perf_counter() - start < 10.0
    assert comm.hint_words[:TP, 2].tolist() == [1] * TP
    assert (dests.view(torch.int16) == 0x7F81).all(), "read before its hint"
    assert hint_quota(HID, rows) == 7 * rows
    comm.reset()
    backend.teardown()
