"""The runner's o-projection plan on the CPU: ``--oproj-launch per-rank`` runs the plan of
one rank per GPU (twoshot past the measured crossovers), ``both`` stays one-shot, a split
domain one-shot; the launcher's checks read twoshot partials back from the receive views
(a stand-in publisher on a CPU loopback backend). The GPU runs: ``test_launch_gpu.py``'s
``test_loopback_per_rank_deployed_plan``."""

import pytest
import torch

from launch import runner
from launch.bucket import oproj_plan, twoshot_partials
from launch.layer import Config, Model
from tpcomm.backends.loopback import LoopbackBackend
from tpcomm.oproj import reference as oref
from tpcomm.oproj.plan import choose


@pytest.mark.parametrize(
    "tp,rows,twoshot",
    [
        (8, 4, False),
        (8, 8, True),
        (8, 256, True),
        (16, 1, False),
        (16, 4, True),
        (16, 1024, True),
        (2, 256, False),
    ],  # fmt: skip
)
def test_per_rank_is_the_deployment_plan(tp, rows, twoshot):
    plan = oproj_plan(tp, rows, 7168, "per-rank")
    assert plan.twoshot is twoshot and plan == choose(tp, rows, 7168)  # one rank per GPU's
    assert not oproj_plan(tp, rows, 7168, "both").twoshot  # one launch: one-shot
    assert not oproj_plan(tp, rows, 7168, "per-rank", split=True).twoshot  # puts: one-shot
    if twoshot:
        assert plan.groups == 1 and "crossover" in plan.reason


def test_twoshot_partials_reassemble_the_owners_shards():
    tp, n, hid = 4, 3, 64
    partials = torch.randn(tp, n, hid).to(torch.bfloat16)
    shard = hid // tp
    views = torch.stack([partials[:, :, o * shard : (o + 1) * shard] for o in range(tp)])
    got = twoshot_partials(views)
    assert torch.equal(got.view(torch.int16), partials.view(torch.int16))
    with pytest.raises(ValueError, match="TP, TP"):
        twoshot_partials(views[:2])


def test_twoshot_reference_is_one_shot_with_one_group():
    """The check's TP reference with twoshot (shards reduced into the gather row first) is
    bitwise the one-shot rank-order sum of one group."""
    model = Model(Config(8, 8, 1024, 2, 1, 2, 1))
    partials = torch.randn(8, 2, 1024).to(torch.bfloat16)
    prefix = torch.randn(2, 1024).to(torch.bfloat16)
    blocks = torch.randn(2, 2, 1024).to(torch.bfloat16)
    two = model.consume(partials, prefix, blocks, 1, True)
    one = model.consume(partials, prefix, blocks, 1, False)
    assert all(
        torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(two, one, strict=True)
    )


def _cpu_runner(monkeypatch, launches, tp=8, requests=8, tokens=1):
    monkeypatch.setattr(torch.cuda, "Stream", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    cfg = Config(tp, tp, 1024, requests, tokens, 2, 2, groups=None, padding=0.0)
    return runner.Runner(cfg, Model(cfg), LoopbackBackend(tp, device="cpu"), oproj_launch=launches)


@pytest.mark.parametrize("launches", ["per-rank", "both"])
def test_runner_buckets_take_the_plan(monkeypatch, launches):
    job = _cpu_runner(monkeypatch, launches)
    comm = job.bucket(1, False).comm  # 8 rows at TP 8: past the crossover
    assert comm.twoshot is (launches == "per-rank") and comm.one_launch is (launches == "both")
    want = oproj_plan(8, 8, 1024, launches)
    assert (comm.plan.twoshot, comm.plan.producer, comm.bytes) == (
        want.twoshot,
        want.producer,
        want.bytes,
    )
    assert comm.groups == want.groups


def test_runner_reads_twoshot_partials_back(monkeypatch):
    """``Runner.partials`` with twoshot: each rank's producer (a stand-in storing
    ``bf16(attn @ w_o^T)`` into every owner's receive view, as the twoshot publisher does)
    read back from the receive views, every slot landed, everything re-armed after."""
    job = _cpu_runner(monkeypatch, "per-rank")
    bk = job.bucket(1, False)
    comm = bk.comm
    assert comm.twoshot
    bk.attn.copy_(torch.randn(bk.attn.shape).to(torch.bfloat16))
    shard = comm.hid // comm.tp

    def produce(attn, w_o, step, rank=None, stream=None):
        partial = oref.project(attn, w_o)
        for o in range(comm.tp):
            comm.rows.receive_view(o)[step & 1, rank] = partial[:, o * shard : (o + 1) * shard]

    monkeypatch.setattr(comm, "produce", produce)
    partials, landed = job.partials(bk, 1)
    assert landed and comm.armed()
    for r in range(comm.tp):
        want = oref.project(bk.attn[r], job.w_o[r])
        assert torch.equal(partials[r].view(torch.int16), want.view(torch.int16)), r
    monkeypatch.setattr(comm, "produce", lambda *args, **kwargs: None)  # a rank never stores
    assert job.partials(bk, 1)[1] is False
