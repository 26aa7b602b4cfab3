"""GPU tests (one H200, loopback backend): ``OprojGemmProducer`` (``producer="wgmma"``),
the TMA + wgmma GEMM that publishes from its epilogue (issue 33).

The published partials are read where the peers read them (every rank's mailbox slot, or
every owner's twoshot receive view) before any consumer runs: every copy identical, each
within 1 bf16 ulp of ``reference.project`` (fp32 sums in another order, one rounding),
the other parity's slots still armed (nothing stored out of place), rows 9..1024 (partial
tiles of rows, whole and partial M tiles), one launch for every rank (PDL) and per-rank
launches, one-shot and twoshot. Then the consumers run on them: the prefix bitwise the
reference's rank-order sum of the partials as published, outputs within 1 ulp, buffers
re-armed, no error word; graph replay of two steps bitwise the eager steps.

    python -m pytest -q -s tests/test_oproj_gemm_gpu.py
"""

import pytest
import torch
from test_oproj_consumer_gpu import EPS, OUT_EPS, poison, random_inputs, ulp_check
from test_oproj_rows_gpu import _bits, _check, _projection

from tpcomm.backends.loopback import LoopbackBackend
from tpcomm.oproj import reference as R
from tpcomm.oproj.all_ranks import AllRanks
from tpcomm.oproj.allreduce import OprojAllReduce

pytestmark = pytest.mark.gpu
TP, HID = 8, 7168
SENTINEL_WORD = -1


def _armed(t):
    return bool((t.contiguous().view(torch.int32) == SENTINEL_WORD).all())


def _one_shot_partials(comm, step):
    """Rank r's partial as every rank's mailbox holds it (all copies equal), [TP, rows, HID]."""
    layout, out, tp = comm.mailbox.layout, [], comm.tp
    for r in range(tp):
        copies = [layout.slot(comm.mailbox.local(d), step, r) for d in range(tp)]
        for d in range(1, tp):
            assert torch.equal(_bits(copies[d]), _bits(copies[0])), f"rank {r} in mailbox {d}"
        assert all(_armed(layout.slot(comm.mailbox.local(d), step + 1, r)) for d in range(tp))
        out.append(copies[0].clone())
    return torch.stack(out)


def _twoshot_partials(comm, step):
    """Rank r's partial reassembled from every owner's receive view, [TP, rows, HID]."""
    parity, tp = step & 1, comm.tp
    views = [comm.rows.receive_view(o) for o in range(tp)]
    for o in range(tp):
        assert _armed(views[o][1 - parity]), f"owner {o}: the other parity was written"
    return torch.stack([torch.cat([views[o][parity, r] for o in range(tp)], dim=-1)
                        for r in range(tp)])  # fmt: skip


@pytest.mark.parametrize(
    "rows, hid", [(r, HID) for r in (9, 64, 100, 256, 1024)] + [(100, 2304), (256, 5120)]
)
def test_one_launch_publishes_the_projection(rows, hid):
    nb = 4
    backend = LoopbackBackend(TP)
    comm = OprojAllReduce(backend, rows, hid, nb, eps=EPS, out_eps=OUT_EPS, one_launch=True,
                          producer="wgmma")  # fmt: skip
    a = random_inputs(TP, rows, hid, nb, seed=rows)
    attn, w_os = _projection(TP, rows, seed=rows + 1, hid=hid)
    bf = dict(dtype=torch.bfloat16, device="cuda")
    prefixes = a["prefix"][None].repeat(TP, 1, 1)
    outputs = torch.empty(TP, rows, hid, **bf)
    prefix, ranks = a["prefix"], AllRanks(comm)
    for step in range(2):
        poison(outputs)
        ranks.produce_all(attn, w_os, step, pdl=True)
        torch.cuda.synchronize()
        partials = _one_shot_partials(comm, step)
        for r in range(TP):
            ulp_check(partials[r], R.project(attn[r], w_os[r]))
        ranks.consume_all(prefixes, a["blocks"], a["norm"], a["query"], a["out_norm"], outputs,
                          step, pdl=True)  # fmt: skip
        torch.cuda.synchronize()
        assert int(comm.errors.abs().sum()) == 0 and comm.armed()
        prefix, _ = _check(prefixes, outputs, partials, a, prefix, comm.groups, TP)
    backend.teardown()


@pytest.mark.parametrize(
    "tp, rows, twoshot, hid",
    [(8, r, t, HID) for r in (9, 300, 1024) for t in (False, True)]
    + [(16, 300, True, HID), (16, 9, False, HID)]
    # 144-column shards: a 256-feature tile publishes to two owners; 5 x 1024 one-shot
    + [(16, 300, True, 2304), (8, 64, False, 2304), (8, 200, False, 5120)],
)
def test_per_rank_publishes_the_projection(tp, rows, twoshot, hid):
    nb = 2
    backend = LoopbackBackend(tp)
    backend.check_coresident = lambda *args: None  # no consumer runs in this test
    comm = OprojAllReduce(backend, rows, hid, nb, eps=EPS, out_eps=OUT_EPS, twoshot=twoshot,
                          producer="wgmma")  # fmt: skip
    assert comm.twoshot == twoshot
    attn, w_os = _projection(tp, rows, seed=rows + 5, hid=hid)
    for r in range(tp):
        comm.produce(attn[r], w_os[r], 1, rank=r)
    torch.cuda.synchronize()
    partials = _twoshot_partials(comm, 1) if twoshot else _one_shot_partials(comm, 1)
    for r in range(tp):
        ulp_check(partials[r], R.project(attn[r], w_os[r]))
    backend.teardown()


def test_graph_replay_matches_eager():
    rows, nb = 200, 2
    backend = LoopbackBackend(TP)
    comm = OprojAllReduce(backend, rows, HID, nb, eps=EPS, out_eps=OUT_EPS, one_launch=True,
                          producer="wgmma")  # fmt: skip
    a = random_inputs(TP, rows, HID, nb, seed=3)
    attn, w_os = _projection(TP, rows, seed=4)
    bf = dict(dtype=torch.bfloat16, device="cuda")
    ranks = AllRanks(comm)

    def two_steps(prefixes, outputs):
        for step in range(2):
            ranks.produce_all(attn, w_os, step, pdl=True)
            ranks.consume_all(prefixes, a["blocks"], a["norm"], a["query"], a["out_norm"],
                              outputs[step], step, pdl=True)  # fmt: skip

    eager_p = a["prefix"][None].repeat(TP, 1, 1)
    eager_o = torch.empty(2, TP, rows, HID, **bf)
    two_steps(eager_p, eager_o)
    torch.cuda.synchronize()
    graph_p = a["prefix"][None].repeat(TP, 1, 1)
    graph_o = torch.empty(2, TP, rows, HID, **bf)
    poison(graph_o)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        two_steps(graph_p, graph_o)
    graph_p.copy_(a["prefix"][None].expand_as(graph_p))
    graph.replay()
    torch.cuda.synchronize()
    assert int(comm.errors.abs().sum()) == 0 and comm.armed()
    assert torch.equal(_bits(graph_o), _bits(eager_o))
    assert torch.equal(_bits(graph_p), _bits(eager_p))
    backend.teardown()
