"""CPU tests of the o-projection host API: the plan heuristic and argument validation."""

import pytest
import torch

from tpcomm.backends.loopback import LoopbackBackend, coresident_capacity
from tpcomm.oproj import allreduce as api
from tpcomm.oproj import plan
from tpcomm.oproj.all_ranks import AllRanks
from tpcomm.oproj.plan import group_ranks, min_blocks_per_sm, per_group


@pytest.mark.parametrize("tp, groups", [(1, 1), (2, 1), (4, 1), (5, 2), (8, 2), (12, 3), (16, 4)])
def test_groups_poll_at_most_four_slots(tp, groups):
    plan = api.choose(tp, 1, 7168)
    assert plan.groups == groups and not plan.twoshot
    assert per_group(tp, plan.groups) <= 4


def test_twoshot_choice():
    """Without a measured crossover, twoshot only with ``twoshot_available`` (the expected
    rule); the launch structure's one-shot (one launch, or asked) is never twoshot."""
    unmeasured = dict(plan.load_crossovers(), twoshot_from_rows={"8": None, "16": None})

    def pick(tp, rows, hid=7168, **kw):
        return api.choose(tp, rows, hid, crossovers=unmeasured, **kw)

    assert "no measured" in pick(16, 8).reason
    assert not pick(16, 8).twoshot
    assert pick(16, 8, twoshot_available=True).twoshot
    assert pick(8, 4, twoshot_available=True).twoshot
    assert not pick(8, 3, twoshot_available=True).twoshot
    assert not pick(4, 8, twoshot_available=True).twoshot
    assert pick(16, 8, 1024, twoshot_available=True).twoshot
    assert not pick(16, 8, twoshot_available=True, one_launch=True).twoshot
    assert pick(4, 8, twoshot=True).twoshot and "asked" in pick(4, 8, twoshot=True).reason
    with pytest.raises(ValueError, match="one-shot only"):
        pick(16, 8, one_launch=True, twoshot=True)
    with pytest.raises(ValueError, match="twoshot"):
        pick(3, 8, 1024, twoshot=True)  # 1024 % 24 != 0
    with pytest.raises(ValueError, match="twoshot"):
        pick(16, 8, twoshot=1)


def test_measured_crossovers_by_launch_structure():
    """crossovers.json as measured on the H200 (loopback): twoshot from TP 8 x 8 and
    TP 16 x 4 rows for per-rank launches (RowChunks, multi-GPU backends); one launch for
    every rank stays one-shot with the one-shot groups at every rows count (it beat both
    chunked variants at every measured row), and so does a per-rank path that asks for it."""
    data = plan.load_crossovers()
    assert data["twoshot_from_rows"] == {"8": 8, "16": 4} and "loopback" in data["device"]
    assert not data["one_launch"]["twoshot"]
    assert all(f["fastest"] for f in data["one_launch"]["fastest"].values())
    for tp, below, start in ((8, 4, 8), (16, 1, 4)):
        assert not api.choose(tp, below, 7168).twoshot
        assert f"below the measured twoshot crossover ({start} rows)" in api.choose(
            tp, below, 7168).reason  # fmt: skip
        for rows in (start, 32, 1024):
            per_rank = api.choose(tp, rows, 7168)
            assert per_rank.twoshot and per_rank.groups == 1, (tp, rows)
            assert "crossover of per-rank launches" in per_rank.reason
            assert per_rank.bytes == plan.buffer_bytes(tp, rows, 7168, True)
            for kw in (dict(one_launch=True), dict(twoshot=False)):
                one = api.choose(tp, rows, 7168, **kw)
                assert not one.twoshot and one.groups == tp // 4, (tp, rows, kw)
                assert one.bytes == plan.buffer_bytes(tp, rows, 7168, False)
            assert "one launch for every rank: one-shot" in api.choose(
                tp, rows, 7168, one_launch=True).reason  # fmt: skip
            assert "not applied" in api.choose(tp, rows, 7168, twoshot=False).reason
    assert not api.choose(2, 1024, 7168).twoshot  # no TP entry <= 2: one-shot
    assert not api.choose(12, 64, 7168).twoshot  # TP 8's entry; 7168 % 96 != 0


def test_choose_reads_measured_crossovers():
    data = plan.load_crossovers()
    assert "source" in data and set(data["twoshot_from_rows"]) == {"8", "16"}
    measured = dict(data, twoshot_from_rows={"8": 64, "16": 32})
    for tp, rows, want in ((8, 63, False), (8, 64, True), (16, 32, True), (16, 31, False),
                           (4, 1024, False)):  # fmt: skip
        got = api.choose(tp, rows, 7168, crossovers=measured)
        assert got.twoshot == want, (tp, rows, got)
        assert got.bytes == plan.buffer_bytes(tp, rows, 7168, want)
        assert ("measured crossover" in got.reason) == want
    assert api.choose(12, 64, 6144, crossovers=measured).twoshot  # TP 8's entry
    # a crossover the hidden width cannot split stays one-shot
    assert not api.choose(12, 64, 7168, crossovers=measured).twoshot


ROWS_PRODUCERS = [(1, "mma"), (8, "mma"), (9, "cublas"), (1024, "cublas")]


@pytest.mark.parametrize("rows, producer", ROWS_PRODUCERS)
def test_choose_every_rows_count(rows, producer):
    p = api.choose(16, rows, 7168, one_launch=True)
    assert p.producer == producer and ("cuBLAS" in p.reason) == (producer == "cublas")
    assert f"{p.bytes} B per rank" in p.reason
    assert p.bytes == 2 * 16 * rows * 7168 * 2  # the one-shot mailbox of this bucket
    two = api.choose(16, rows, 7168)  # per-rank launches: twoshot from 4 rows (measured)
    assert two.producer == producer and f"{two.bytes} B per rank" in two.reason
    assert two.bytes == (2 * rows * 7168 * 2 * 2 if rows >= 4 else p.bytes)


def test_load_crossovers_rejects_bad_data(tmp_path):
    bad = tmp_path / "c.json"
    bad.write_text('{"twoshot_from_rows": {"8": "many"}, "expected_from_rows": {}}')
    with pytest.raises(ValueError, match="twoshot_from_rows"):
        plan.load_crossovers(str(bad))


def test_group_ranks_cover_every_rank_once():
    for tp in range(1, 17):
        for groups in range(1, 5):
            seen = []
            for g in range(groups):
                first, count = group_ranks(tp, groups, g)
                seen += range(first, first + count)
            assert seen == list(range(tp)), (tp, groups)
    assert group_ranks(4, 3, 2) == (4, 0)  # the empty group adds +0.0
    assert [min_blocks_per_sm(g) for g in range(1, 5)] == [8, 4, 2, 2]


def _comm(nb=2, **kw):
    backend = LoopbackBackend(4, device="cpu")
    return api.OprojAllReduce(backend, 2, 2048, nb, **kw)


def consumer_args(nb=2, tokens=2, hid=2048):
    bf = dict(dtype=torch.bfloat16)
    return dict(
        prefix=torch.zeros(tokens, hid, **bf),
        blocks=torch.zeros(tokens, nb, hid, **bf) if nb else None,
        norm=torch.ones(hid, **bf),
        query=torch.ones(hid, **bf),
        out_norm=torch.ones(hid, **bf),
        output=torch.zeros(tokens, hid, **bf),
    )


def test_constructor_validation():
    with pytest.raises(ValueError, match="nb"):
        _comm(nb=9)
    with pytest.raises(ValueError, match="groups"):
        _comm(groups=0)
    with pytest.raises(ValueError, match="xmoe_reps"):
        _comm(xmoe_reps=-1)
    with pytest.raises(ValueError, match="budget_ns"):
        _comm(budget_ns=0)
    with pytest.raises(ValueError, match="eps"):
        _comm(eps=-1.0)
    comm = _comm()
    assert comm.groups == 1 and comm.mailbox.layout.shape == (2, 4, 2, 2048)
    assert (comm.mailbox.local(3).view(torch.int32) == -1).all()


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(prefix=torch.zeros(2, 1024, dtype=torch.bfloat16)), "prefix"),
        (dict(prefix=torch.zeros(2, 2048, dtype=torch.float32)), "prefix"),
        (dict(blocks=torch.zeros(2, 3, 2048, dtype=torch.bfloat16)), "nb"),
        (dict(blocks=torch.zeros(2, 9, 2048, dtype=torch.bfloat16)), "blocks"),
        (dict(norm=torch.ones(1024, dtype=torch.bfloat16)), "norm"),
        (dict(query=torch.ones(2048)), "query"),
        (dict(out_norm=torch.ones(2048, dtype=torch.bfloat16)[None]), "out_norm"),
        (dict(output=torch.zeros(2, 2048, dtype=torch.float16)), "output"),
        (dict(output=torch.zeros(2048, 2, dtype=torch.bfloat16).T), "output"),
        ({}, "CUDA"),  # valid arguments; the CPU mailbox cannot launch
    ],
)
def test_consume_validation(change, match):
    comm = _comm()
    a = dict(consumer_args(), **change)
    with pytest.raises(ValueError, match=match):
        comm.consume(a["prefix"], a["blocks"], a["norm"], a["query"], a["out_norm"],
                     a["output"], 0, rank=1)  # fmt: skip


def test_step_rank_xmoe_validation():
    comm = _comm()
    a = consumer_args()
    call = (a["prefix"], a["blocks"], a["norm"], a["query"], a["out_norm"], a["output"])
    with pytest.raises(ValueError, match="step"):
        comm.consume(*call, -1, rank=0)
    with pytest.raises(ValueError, match="rank"):
        comm.consume(*call, 0, rank=7)
    with pytest.raises(ValueError, match="xmoe"):
        comm.consume(*call, 0, rank=0, xmoe=torch.zeros(1, 2, 2048, dtype=torch.bfloat16))
    comm2 = _comm(xmoe_reps=2)
    with pytest.raises(ValueError, match="xmoe"):
        comm2.consume(*call, 0, rank=0, xmoe=torch.zeros(1, 2, 2048, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="partial"):
        comm.publish(torch.zeros(2, 1024, dtype=torch.bfloat16), 0, rank=0)
    with pytest.raises(ValueError, match="run_ranks"):
        AllRanks(comm).run_ranks(None, None, None, None, None, None, None, 0)


def test_twoshot_buffers_and_validation():
    comm = _comm(twoshot=True)
    assert comm.twoshot and comm.mailbox is None and comm.groups == 1
    assert comm.rows.receive_view(2).shape == (2, 4, 2, 512)
    assert comm.rows.gather_row(2).shape == (2, 2, 2048)
    assert comm.armed()
    comm.rows.gather_row(1)[0, 0, 0] = 1.0
    assert not comm.armed()
    comm.reset()
    assert comm.armed()
    assert not _comm().twoshot  # the plan keeps one-shot until twoshot is enabled
    backend = LoopbackBackend(3, device="cpu")
    with pytest.raises(ValueError, match="twoshot"):
        api.OprojAllReduce(backend, 1, 1024, 0, twoshot=True)  # 1024 % 24 != 0
    a = consumer_args()
    with pytest.raises(ValueError, match="CUDA"):
        comm.consume(a["prefix"], a["blocks"], a["norm"], a["query"], a["out_norm"],
                     a["output"], 0, rank=1)  # fmt: skip


def test_one_launch_validation():
    """run_ranks(mode="one-launch"): every rank stacked [TP, ...] contiguous, one-shot, all
    ranks; each refusal names its argument before any launch."""
    comm = _comm()
    a = consumer_args()
    bf = dict(dtype=torch.bfloat16)
    stacked = dict(prefixes=torch.zeros(4, 2, 2048, **bf), outputs=torch.zeros(4, 2, 2048, **bf))
    partials = torch.zeros(4, 2, 2048, **bf)

    def run(c=comm, partials=partials, **kw):
        s = dict(stacked)
        for k in ("prefixes", "outputs"):
            s[k] = kw.pop(k, s[k])
        kw.setdefault("mode", "one-launch")
        AllRanks(c).run_ranks(
            partials,
            s["prefixes"],
            a["blocks"],
            a["norm"],
            a["query"],
            a["out_norm"],
            s["outputs"],
            0,
            **kw,
        )

    with pytest.raises(ValueError, match="ranks and publishers"):
        run(ranks=(0, 1))
    with pytest.raises(ValueError, match="ranks and publishers"):
        run(publishers=(0, 1))
    with pytest.raises(ValueError, match="mode"):
        run(mode="fused-one-launch")
    with pytest.raises(ValueError, match="one-shot"):
        run(c=_comm(twoshot=True))
    with pytest.raises(ValueError, match="prefixes"):
        run(prefixes=torch.zeros(3, 2, 2048, **bf))
    with pytest.raises(ValueError, match="outputs"):
        run(outputs=torch.zeros(4, 2048, 2, **bf).transpose(1, 2))
    with pytest.raises(ValueError, match="step"):
        AllRanks(comm).run_ranks(partials, stacked["prefixes"], a["blocks"], a["norm"], a["query"],
                       a["out_norm"], stacked["outputs"], -1, mode="one-launch")  # fmt: skip
    with pytest.raises(ValueError, match="CUDA"):  # valid; the CPU mailbox cannot launch
        run()


def test_one_launch_all_reduce_skips_coresidency_and_refuses_per_rank_runs():
    comm = _comm(one_launch=True)
    assert comm.one_launch
    a = consumer_args()
    with pytest.raises(ValueError, match="one_launch=True"):
        AllRanks(comm).run_ranks(
            None, None, a["blocks"], a["norm"], a["query"], a["out_norm"], None, 0
        )
    with pytest.raises(ValueError, match="one-shot"):
        _comm(one_launch=True, twoshot=True)

    class Crowded(LoopbackBackend):  # a GPU that could never hold every rank's consumer
        def check_coresident(self, *args):
            raise ValueError("loopback: cannot all be resident")

    with pytest.raises(ValueError, match="resident"):
        api.OprojAllReduce(Crowded(4, device="cpu"), 2, 2048, 2)
    assert api.OprojAllReduce(Crowded(4, device="cpu"), 2, 2048, 2, one_launch=True).one_launch


def _bf(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)


PRODUCE_ALL_BAD = [  # message, attn_outs, w_os, step
    ("step must be a non-negative int", _bf(4, 2, 256), _bf(4, 2048, 256), -1),
    ("attn_outs must be a 3-D", _bf(2, 256), _bf(4, 2048, 256), 0),
    ("w_os must be a 3-D", _bf(4, 2, 256), _bf(2048, 256), 0),
    ("D_local must be a multiple of 128", _bf(4, 2, 200), _bf(4, 2048, 200), 0),
    ("w_o must have shape", _bf(4, 2, 256), _bf(4, 1024, 256), 0),
    (r"attn_outs must be \[TP, ...\] = \[4, 2, 256\]", _bf(3, 2, 256), _bf(4, 2048, 256), 0),
    (r"w_os must be \[TP, ...\]", _bf(4, 2, 256), _bf(3, 2048, 256), 0),
    ("attn_outs must be contiguous", _bf(8, 2, 256)[::2], _bf(4, 2048, 256), 0),
]


@pytest.mark.parametrize(
    "message,attn,w,step", PRODUCE_ALL_BAD, ids=[str(i) for i in range(len(PRODUCE_ALL_BAD))]
)
def test_produce_all_validates(message, attn, w, step):
    comm = _comm()
    with pytest.raises(ValueError, match=message):
        AllRanks(comm).produce_all(attn, w, step)
    assert comm.armed()


def test_publish_and_consume_all_validate():
    comm = _comm()
    with pytest.raises(ValueError, match=r"partials must be \[TP, ...\]"):
        AllRanks(comm).publish_all(_bf(3, 2, 2048), 0)
    with pytest.raises(ValueError, match="partials must be contiguous"):
        AllRanks(comm).publish_all(_bf(8, 2, 2048)[::2], 0)
    a = consumer_args()
    with pytest.raises(ValueError, match=r"prefixes must be \[TP, ...\]"):
        AllRanks(comm).consume_all(a["prefix"], a["blocks"], a["norm"], a["query"], a["out_norm"],
                         _bf(4, 2, 2048), 0)  # fmt: skip
    with pytest.raises(ValueError, match=r"xmoes must be \[TP, ...\]"):
        AllRanks(comm).consume_all(
            _bf(4, 2, 2048),
            a["blocks"],
            a["norm"],
            a["query"],
            a["out_norm"],
            _bf(4, 2, 2048),
            0,
            xmoes=_bf(4, 2, 2, 2048),
        )
    twoshot = _comm(twoshot=True)
    with pytest.raises(ValueError, match="one-shot only"):
        AllRanks(twoshot).publish_all(_bf(4, 2, 2048), 0)
    assert comm.armed()


def test_rows_beyond_eight():
    """Up to 1024 rows: buffers sized per rows bucket, the GEMM producer refused on the
    CPU before any launch, and more than 1024 rows refused with the limit."""
    backend = LoopbackBackend(4, device="cpu")
    comm = api.OprojAllReduce(backend, 100, 1024, 1, one_launch=True)
    assert comm.mailbox.layout.shape == (2, 4, 100, 1024)
    assert comm.bytes == comm.plan.bytes == 2 * 4 * 100 * 1024 * 2
    assert comm.plan.producer == "cublas" and not comm.twoshot
    bf = dict(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA"):
        comm.produce(torch.zeros(100, 128, **bf), torch.zeros(1024, 128, **bf), 0, rank=1)
    with pytest.raises(ValueError, match="attn_out"):
        comm.produce(torch.zeros(8, 128, **bf), torch.zeros(1024, 128, **bf), 0, rank=1)
    with pytest.raises(ValueError, match="1..1024"):
        api.OprojAllReduce(backend, 1025, 1024, 1, one_launch=True)
    with pytest.raises(ValueError, match="producer"):
        api.OprojAllReduce(backend, 9, 1024, 1, one_launch=True, producer="mma")
    assert api.OprojAllReduce(backend, 8, 1024, 1, producer="cublas").producer == "cublas"
    two = api.OprojAllReduce(backend, 64, 1024, 0, twoshot=True)
    assert two.bytes == 2 * 64 * 1024 * 2 * 2
    backend.teardown()


def test_buffers_that_do_not_fit_are_refused_before_allocation():
    class Small(LoopbackBackend):
        def symmetric_limit(self):
            return 1 << 20

    backend = Small(8, device="cpu")
    with pytest.raises(ValueError, match=r"7340032 B .* 1048576 B") as e:
        api.OprojAllReduce(backend, 32, 896 * 8, 0, one_launch=True)
    assert "32 rows" in str(e.value) and backend.allocated == 0
    api.OprojAllReduce(backend, 4, 1024, 0, one_launch=True)  # 131072 B fit
    assert backend.allocated == 2 * 8 * 4 * 1024 * 2
    backend.teardown()


def test_nvshmem_heap_setting():
    from tpcomm.backends.nvshmem import heap_bytes

    assert heap_bytes(None) == 1 << 30 and heap_bytes("") == 1 << 30
    assert heap_bytes("2G") == 2 << 30 and heap_bytes("512m") == 512 << 20
    assert heap_bytes("4096") == 4096 and heap_bytes("1kb") == 1024
    with pytest.raises(ValueError, match="NVSHMEM_SYMMETRIC_SIZE"):
        heap_bytes("lots")


def test_row_chunks():
    from tpcomm.oproj.rows import RowChunks

    backend = LoopbackBackend(4, device="cpu")
    chunks = RowChunks(backend, 10, 1024, 1, chunk=3, twoshot=True)
    assert [(a, b) for a, b, _ in chunks.parts] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert all(c.twoshot and c.tokens == b - a for a, b, c in chunks.parts)
    assert chunks.bytes == 2 * 10 * 1024 * 2 * 2  # one 10-row bucket's twoshot buffers
    assert chunks.armed() and chunks.error_masks() == [0, 0, 0, 0]
    assert RowChunks(backend, 10, 1024, 1).chunk == 10  # no co-residency rule on the CPU
    with pytest.raises(ValueError, match="chunk"):
        RowChunks(backend, 10, 1024, 1, chunk=11)
    with pytest.raises(ValueError, match="rows"):
        RowChunks(backend, 1025, 1024, 1)
    with pytest.raises(ValueError, match="xmoe"):
        RowChunks(backend, 10, 1024, 1, xmoe_reps=1)
    bf = dict(dtype=torch.bfloat16)
    t = torch.zeros(4, 10, 1024, **bf)
    with pytest.raises(ValueError, match="prefixes"):
        chunks.run_ranks(t, t[:, :9], None, None, None, None, t, 0)
    a = consumer_args(nb=1, tokens=10, hid=1024)
    with pytest.raises(ValueError, match="stream per rank"):  # CPU: refused before any launch
        chunks.run_ranks(t, t.clone(), a["blocks"], a["norm"], a["query"], a["out_norm"], t, 0)
    backend.teardown()


class H200(LoopbackBackend):
    """The loopback co-residency rule of an H200 (132 SMs, 2048 threads an SM) on the CPU."""

    def check_coresident(self, ctas, threads, min_blocks_per_sm):
        capacity = coresident_capacity(132, threads, min_blocks_per_sm, 2048)
        if ctas * self.world > capacity:
            raise ValueError(f"{self.world} ranks x {ctas} CTAs cannot all be resident")


@pytest.mark.parametrize(
    "tp, rows, twoshot, chunk",
    [
        (8, 1024, False, 4),  # 2 groups, 528 fit: 8 x 14 x 8 = 896 > 528 >= 8 x 14 x 4
        (8, 1024, True, 8),  # 1 group, 1056 fit: 8 x 14 x 16 > 1056 >= 8 x 14 x 8
        (8, 10, False, 3),  # 10, 5 (8 x 14 x 5 = 560 > 528), 3
        (16, 16, True, 4),  # 16 x 14 x 8 = 1792 > 1056 >= 16 x 14 x 4
        (4, 64, False, 16),  # 1 group: 4 x 14 x 32 = 1792 > 1056 >= 4 x 14 x 16
    ],
)
def test_row_chunks_leave_room_for_the_publishers(tp, rows, twoshot, chunk):
    """RowChunks' chunk: every rank's consumer CTAs and the publisher CTAs they wait on
    (``chunk_ctas``: 2 x HID / 1024 a row) resident together, halved from ``rows`` until
    they fit. In each case the consumers alone would fit twice the chunk (the old rule):
    that chunk, asked for, is refused naming the publishers, nothing allocated."""
    from tpcomm.oproj.rows import RowChunks, chunk_ctas

    hid = 7168
    backend = H200(tp, device="cpu")
    chunks = RowChunks(backend, rows, hid, 0, twoshot=twoshot)
    assert chunks.chunk == chunk and chunks.parts[-1][1] == rows
    assert all(b - a <= chunk for a, b, _ in chunks.parts)
    assert chunk_ctas(hid, chunk) == 2 * 7 * chunk
    assert backend.allocated == chunks.bytes  # no refused try allocated anything
    if 2 * chunk <= rows:
        g = chunks.groups
        backend.check_coresident(7 * 2 * chunk, 128 * g, min_blocks_per_sm(g))  # consumers
        with pytest.raises(ValueError, match="publisher CTAs they wait on"):
            RowChunks(backend, rows, hid, 0, twoshot=twoshot, chunk=2 * chunk)
        assert backend.allocated == chunks.bytes
    backend.teardown()


def test_row_chunks_refuse_before_any_launch():
    """Every chunk size's consumer arguments and every producer's are checked before the
    first chunk's launches (a CPU backend with stand-in streams: nothing can launch)."""
    from tpcomm.oproj.rows import RowChunks

    backend = LoopbackBackend(4, device="cpu")
    backend.streams = [None] * 4
    chunks = RowChunks(backend, 10, 1024, 1, chunk=4)  # sizes 4 and 2
    a = consumer_args(nb=1, tokens=10, hid=1024)
    t = torch.zeros(4, 10, 1024, dtype=torch.bfloat16)
    attn = torch.zeros(4, 10, 128, dtype=torch.bfloat16)
    w_os = torch.zeros(4, 1024, 128, dtype=torch.bfloat16)
    args = (t.clone(), a["blocks"], a["norm"], a["query"])
    with pytest.raises(ValueError, match="out_norm"):
        chunks.run_ranks(t, *args, a["norm"][:512], t, 0)
    with pytest.raises(ValueError, match="w_o"):
        chunks.run_ranks(attn, *args, a["out_norm"], t, 0, w_os=w_os[:, :512])
    with pytest.raises(ValueError, match="step"):
        chunks.run_ranks(attn, *args, a["out_norm"], t, -1, w_os=w_os)
    with pytest.raises(ValueError, match="partial"):
        chunks.run_ranks(t[:, :, :512], *args, a["out_norm"], t, 0)
    with pytest.raises(ValueError, match="inputs must be given"):
        chunks.run_ranks(None, *args, a["out_norm"], t, 0)
    with pytest.raises(ValueError, match="CUDA"):  # the first launch, on the CPU: refused
        chunks.run_ranks(attn, *args, a["out_norm"], t, 0, w_os=w_os)
    assert chunks.armed()


def test_measured_twoshot_is_not_the_default_on_one_gpu(monkeypatch):
    """On one GPU the measured crossover only drives RowChunks (which asks for twoshot);
    a default or one-launch all-reduce there is one-shot with the one-shot plan's groups
    (not the twoshot plan's single gather slot) and says why."""
    data = dict(plan.load_crossovers(), twoshot_from_rows={"8": 4, "16": 4})
    monkeypatch.setattr(plan, "load_crossovers", lambda path=None: data)
    backend = LoopbackBackend(8, device="cpu")
    assert api.choose(8, 16, 1024).twoshot  # the per-rank plan
    for kw in ({}, dict(one_launch=True)):
        comm = api.OprojAllReduce(backend, 16, 1024, 0, **kw)
        assert not comm.plan.twoshot and not comm.twoshot and comm.mailbox is not None
        assert comm.groups == comm.plan.groups == 2 and comm.bytes == comm.plan.bytes
    assert "not applied" in api.OprojAllReduce(backend, 16, 1024, 0).plan.reason
    assert "one launch" in api.OprojAllReduce(backend, 16, 1024, 0, one_launch=True).plan.reason
    two = api.OprojAllReduce(backend, 16, 1024, 0, twoshot=True)
    assert two.twoshot and two.plan.twoshot and two.groups == 1
    from tpcomm.oproj.rows import RowChunks

    chunks = RowChunks(backend, 16, 1024, 0)  # per-rank launches: the crossover's twoshot
    assert chunks.twoshot and all(c.twoshot for _, _, c in chunks.parts)
    one = RowChunks(backend, 16, 1024, 0, twoshot=False)
    assert not one.twoshot and one.groups == 2
    backend.teardown()
