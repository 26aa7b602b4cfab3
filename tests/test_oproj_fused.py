"""CPU tests of the fused o-projection's plain-Python parts: the tile map, the
co-residency rule and its refusal, and the host API's validation (no DSL, no GPU)."""

import pytest
import torch
from test_oproj_api import consumer_args

from tpcomm.backends.loopback import LoopbackBackend
from tpcomm.oproj import allreduce as api
from tpcomm.oproj import plan as P
from tpcomm.oproj.all_ranks import AllRanks
from tpcomm.oproj.plan import min_blocks_per_sm, smem_bytes

H200 = P.DeviceLimits(sms=132)


@pytest.mark.parametrize(
    "hid, groups",
    [(h, g) for h in (1024, 2048, 7168, 8192) for g in (1, 2, 3, 4)]
    + [(2304, 4), (1280, 4), (2560, 2), (5120, 3), (6400, 4)],
)
@pytest.mark.parametrize("tiles", [1, 2, 4, 16, 64])
def test_tiles_cover_every_feature_once(hid, groups, tiles):
    ctas, teams = P.slicing(hid).ctas, P.producer_teams(hid, groups)
    assert teams == P.slicing(hid).threads * groups // 128
    rows = P.producer_rows(hid, groups, tiles)
    seen = []
    for row in range(rows):
        for cta in range(ctas):
            for e in range(teams):
                for t in range(tiles):
                    i = P.tile_index(row, cta, e, t, ctas, teams, tiles)
                    if i < P.tile_count(hid):
                        seen.append(i)
    assert sorted(seen) == list(range(hid // 16))
    # one row fewer would leave tiles out
    assert (rows - 1) * ctas * teams * tiles < hid // 16


def test_tiles_candidates_end_at_one_row():
    assert P.tiles_candidates(7168, 4) == [1, 2, 4, 8, 16]
    assert P.tiles_candidates(7168, 1) == [1, 2, 4, 8, 16, 32, 64]
    assert P.tiles_candidates(7168, 3)[-1] == 32
    assert P.tiles_candidates(2304, 4) == [1, 2, 4, 8, 16]  # 3 teams of 768 / 16 = 48 tiles
    for hid, g in [(7168, 1), (7168, 2), (7168, 3), (7168, 4), (2304, 4), (1280, 4)]:
        assert P.producer_rows(hid, g, P.tiles_candidates(hid, g)[-1]) == 1


def test_producer_teams_need_whole_128_thread_teams():
    """The fused CTA's threads split into 128-thread producer teams: at 1024-column slices
    the groups themselves; 2304 (96-thread groups) with 4 groups is 3 teams, with 1 or 2
    groups refused (naming groups) before any plan or compile."""
    assert [P.producer_teams(7168, g) for g in (1, 2, 3, 4)] == [1, 2, 3, 4]
    assert P.producer_teams(2304, 4) == 3 and P.producer_teams(256, 4) == 1
    for hid, groups in ((2304, 1), (2304, 2), (256, 2), (2816, 2)):
        with pytest.raises(ValueError, match="groups"):
            P.producer_teams(hid, groups)
        with pytest.raises(ValueError, match="groups"):
            P.plan_fused(16, 1, hid, 0, groups, H200)


def test_smem_is_consumer_plus_producer_fragments():
    for nb in (0, 3, 8):
        for groups in (1, 2, 4):
            base = smem_bytes(7168, nb, groups)
            assert P.fused_smem_bytes(7168, nb, groups) == -(-base // 16) * 16 + groups * 2048
    base = smem_bytes(2304, 8, 4)  # 3 teams
    assert P.fused_smem_bytes(2304, 8, 4) == -(-base // 16) * 16 + 3 * 2048


def test_ctas_per_sm_names_the_limit():
    assert P.ctas_per_sm(512, 46048, 2, H200) == (2, "launch bound (registers)")
    assert P.ctas_per_sm(128, 31712, 8, H200) == (7, "shared memory")  # 7 x 32.7 KB
    small = P.DeviceLimits(sms=132, max_threads_per_sm=1024)
    assert P.ctas_per_sm(512, 1000, 4, small) == (2, "threads")
    few = P.DeviceLimits(sms=132, max_ctas_per_sm=4)
    assert P.ctas_per_sm(128, 1000, 8, few) == (4, "CTA slots")


def test_resident_ctas_leave_cluster_slack_per_gpc():
    assert H200.gpc_bound == 9  # >= the H200's 8 GPCs
    assert P.resident_ctas(2, 1, H200) == 264  # no clusters: SMs x CTAs/SM
    assert P.resident_ctas(2, 7, H200) == 210  # (264 - 9 x 6) / 7 clusters
    assert P.resident_ctas(2, 7, P.DeviceLimits(sms=132, gpcs=8)) == 217  # ceil(216 / 7)
    assert P.resident_ctas(1, 8, P.DeviceLimits(sms=8, gpcs=1)) == 8  # one full GPC
    assert P.resident_ctas(1, 8, P.DeviceLimits(sms=7, gpcs=1)) == 0
    assert P.resident_ctas(3, 7, P.DeviceLimits(sms=16, gpcs=2)) == 42  # 2 x (24 // 7) * 7


def test_plan_one_rank_per_gpu_uses_every_tile_row():
    """TP16 HID 7168 on its own GPU: T = 1, 16 producer rows (112 CTAs of 16 warps)."""
    for tokens in (1, 4, 8):
        p = P.plan_fused(16, tokens, 7168, 8, 4, H200)
        assert (p.tiles, p.rows, p.grid) == (1, 16, (7, 16 + tokens, 1))
        assert p.ctas == 7 * (16 + tokens) and p.threads == 512 and p.launch_bound == 2
        assert p.ctas <= p.capacity == 210
        assert "T=1" in p.reason


def test_plan_loopback_counts_every_rank_and_grows_tiles():
    p = P.plan_fused(8, 4, 7168, 8, 2, H200, launches=8)
    assert p.tiles == 8 and p.rows == 4 and 8 * p.ctas <= p.capacity
    assert P.plan_fused(8, 4, 7168, 8, 2, H200, launches=1).tiles == 1
    with pytest.raises(ValueError, match="co-resident"):  # T = 4: 8 x 7 x (8 + 4) > 469
        P.plan_fused(8, 4, 7168, 8, 2, H200, launches=8, tiles=4)


def test_plan_refuses_when_not_coresident():
    # every loopback rank's launch on one GPU: 16 x 7 x (1 + 1) = 224 > 210 even at T = 16
    with pytest.raises(ValueError, match="co-resident") as e:
        P.plan_fused(16, 1, 7168, 8, 4, H200, launches=16)
    text = str(e.value)
    assert "16 launch(es)" in text and "224 CTAs > 210" in text and "launch bound" in text
    # a forced T that does not fit
    with pytest.raises(ValueError, match="co-resident"):
        P.plan_fused(8, 4, 7168, 8, 2, H200, launches=8, tiles=1)
    # shared memory the limit (a made-up GPU with 100 KiB per SM: 3 CTAs of 27 KiB)
    with pytest.raises(ValueError, match="shared memory"):
        P.plan_fused(16, 8, 7168, 8, 1, P.DeviceLimits(sms=132, smem_per_sm=100 * 1024),
                     launches=16)  # fmt: skip
    # on the H200 the same shape fits: one group allocates no helper sums, so 8 CTAs per
    # SM (the launch bound), not 7
    fits = P.plan_fused(16, 8, 7168, 8, 1, H200, launches=16)
    assert fits.per_sm == 8 and fits.tiles == 64
    # fits on a bigger (made-up) GPU
    assert P.plan_fused(16, 1, 7168, 8, 4, P.DeviceLimits(sms=264), launches=16).tiles == 8


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tokens=0), "tokens"),
        (dict(tokens=9), "tokens"),
        (dict(tiles=0), "tiles"),
        (dict(launches=0), "launches"),
        (dict(groups=5), "groups"),
        (dict(nb=9), "nb"),
        (dict(hid=1000), "hid"),
    ],
)
def test_plan_validation(kwargs, match):
    a = dict(tp=8, tokens=1, hid=7168, nb=8, groups=2)
    a.update(kwargs)
    with pytest.raises(ValueError, match=match):
        P.plan_fused(a["tp"], a["tokens"], a["hid"], a["nb"], a["groups"], H200,
                     tiles=a.get("tiles"), launches=a.get("launches", 1))  # fmt: skip


def test_launch_bound_is_the_consumers():
    for groups in range(1, 5):
        p = P.plan_fused(4, 1, 1024, 0, groups, H200)
        assert p.launch_bound == min_blocks_per_sm(groups)


# --- host API ---------------------------------------------------------------------


def _comm(tp=4, tokens=2, hid=2048, nb=2, **kw):
    backend = LoopbackBackend(tp, device="cpu")
    return api.OprojAllReduce(backend, tokens, hid, nb, **kw)


def _args(nb=2, tokens=2, hid=2048, d_local=256):
    bf = dict(dtype=torch.bfloat16)
    return dict(
        attn_out=torch.zeros(tokens, d_local, **bf),
        w_o=torch.zeros(hid, d_local, **bf),
        **consumer_args(nb, tokens, hid),
    )


def _call(comm, a, step=0, **kw):
    comm.produce_consume(a["attn_out"], a["w_o"], a["prefix"], a["blocks"], a["norm"],
                         a["query"], a["out_norm"], a["output"], step, **kw)  # fmt: skip


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(attn_out=torch.zeros(2, 100, dtype=torch.bfloat16)), "D_local"),
        (dict(attn_out=torch.zeros(3, 256, dtype=torch.bfloat16)), "attn_out"),
        (dict(attn_out=torch.zeros(2, 256)), "attn_out"),
        (dict(attn_out=None), "attn_out"),
        (dict(w_o=torch.zeros(2048, 128, dtype=torch.bfloat16)), "w_o"),
        (dict(w_o=torch.zeros(1024, 256, dtype=torch.bfloat16)), "w_o"),
        (dict(prefix=torch.zeros(2, 1024, dtype=torch.bfloat16)), "prefix"),
        (dict(blocks=torch.zeros(2, 3, 2048, dtype=torch.bfloat16)), "nb"),
        (dict(norm=torch.ones(1024, dtype=torch.bfloat16)), "norm"),
        (dict(output=torch.zeros(2, 2048, dtype=torch.float16)), "output"),
        ({}, "CUDA"),  # valid arguments; the CPU mailbox cannot launch
    ],
)
def test_produce_consume_validation(change, match):
    comm = _comm()
    with pytest.raises(ValueError, match=match):
        _call(comm, dict(_args(), **change), rank=1)


def test_produce_consume_step_rank_xmoe():
    comm = _comm()
    a = _args()
    with pytest.raises(ValueError, match="step"):
        _call(comm, a, step=-1)
    with pytest.raises(ValueError, match="rank"):
        _call(comm, a, rank=9)
    with pytest.raises(ValueError, match="xmoe"):
        _call(comm, a, xmoe=torch.zeros(1, 2, 2048, dtype=torch.bfloat16))


def test_fused_plan_on_the_api():
    comm = _comm(tp=8, tokens=4, hid=7168, nb=8)  # plan: 2 groups
    p = comm.fused_plan(limits=H200)  # loopback: all 8 ranks share the GPU
    assert p.launches == 8 and p.tiles == 8 and comm.groups == 2
    assert comm.fused_plan(limits=H200, launches=1).tiles == 1
    assert comm.fused_plan(limits=H200) is p  # cached
    with pytest.raises(ValueError, match="CUDA"):
        comm.fused_plan()  # no device limits on the CPU
    big = _comm(tp=16, tokens=1, hid=7168, nb=8)
    assert big.groups == 4
    with pytest.raises(ValueError, match="co-resident"):
        big.fused_plan(limits=H200)
    assert big.fused_plan(limits=H200, launches=1).tiles == 1


def test_run_ranks_fused_needs_streams():
    comm = _comm()
    with pytest.raises(ValueError, match="run_ranks"):
        AllRanks(comm).run_ranks(None, None, None, None, None, None, None, 0, mode="fused")
