"""launch/decode.py on the host backend: torchrun and mpirun jobs as subprocesses."""

import os
import shutil
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "launch", "decode.py")
HOST = ["--backend", "host"]  # explicit: on a multi-GPU machine auto would pick nvshmem
SMALL = ["--hidden", "1024", "--requests", "3", "--tokens", "3", "--blocks", "2", "--steps", "4"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(n, *args, timeout=600):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={n}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        SCRIPT,
        *HOST,
        *args,
    ]
    return _run(cmd, timeout)


def mpirun(n, *args, timeout=600):
    exe = shutil.which("mpirun") or shutil.which("mpiexec")
    if exe is None:
        pytest.skip("no mpirun (pip install '.[mpi]')")
    pytest.importorskip("mpi4py")
    return _run([exe, "-np", str(n), sys.executable, SCRIPT, *HOST, *args], timeout)


def _run(cmd, timeout):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    lines = [line for line in p.stdout.splitlines() if line.strip()]
    return p, lines


def assert_ok(p, lines):
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert lines and lines[-1] == "DECODE OK", p.stdout[-3000:]
    assert "FAIL" not in p.stdout


@pytest.mark.distributed
@pytest.mark.parametrize("n, hidden", [(2, 1024), (4, 1024), (2, 2304)])  # 2304: Kimi-Linear
def test_torchrun(n, hidden):
    p, lines = torchrun(n, "--heads", "8", *SMALL, "--hidden", str(hidden))
    assert_ok(p, lines)
    assert f"TP {n}, heads 8 ({8 // n}/rank), hidden {hidden}," in p.stdout
    assert "1 decode" in p.stdout and "verify+record+recover" in p.stdout
    assert "ok   state pages == unsharded (bitwise): 4/4 steps" in p.stdout


@pytest.mark.distributed
def test_torchrun_window_first_decode_only(tmp_path):
    out = tmp_path / "report.json"
    p, lines = torchrun(
        2,
        "--heads",
        "4",
        "--tokens",
        "1",
        "--blocks",
        "0",
        "--steps",
        "3",
        "--conv-layout",
        "window-first",
        "--json",
        str(out),
    )
    assert_ok(p, lines)
    import json

    report = json.loads(out.read_text())
    assert report["ok"] and report["steps"] == {"total": 3, "decode": 3}
    assert report["config"]["conv_layout"] == "window-first"
    assert all(v["passed"] == v["of"] == 3 for v in report["checks"].values())


REPLAY_CHECKS = (
    "kda outputs == unsharded (bitwise)",
    "checkpoint pages == unsharded (bitwise)",
    "ring entries and counters == unsharded (bitwise)",
    "kda outputs vs per-step reference (bitwise off o's bf16 midpoints, else 1 ulp + o's)",
    "output, prefix == TP reference (bitwise)",
)
MATERIALIZED_CHECKS = (
    "materialized pages == unsharded materialized (bitwise)",
    "materialized state vs per-step reference (1e-5 of page max)",
)


def read_report(path, p, lines):
    import json

    assert_ok(p, lines)
    report = json.loads(path.read_text())
    assert report["ok"] and all(v["passed"] == v["of"] for v in report["checks"].values())
    return report


@pytest.mark.distributed
def test_torchrun_replay_verify(tmp_path):
    """--kda-state replay, TP 2, verify steps T = 3 with ring R = 4: the rings fold from the
    third step on; every step's replay checks, then the materialised state."""
    out = tmp_path / "replay.json"
    p, lines = torchrun(2, "--heads", "4", *SMALL, "--kda-state", "replay", "--json", str(out))
    report = read_report(out, p, lines)
    assert report["config"]["kda_state"] == "replay" and report["config"]["ring"] == 4
    assert report["steps"] == {"total": 4, "replay decode": 1, "replay verify": 3}
    for name in REPLAY_CHECKS:
        assert report["checks"][name]["of"] == 4, name
    for name in MATERIALIZED_CHECKS:
        assert report["checks"][name]["of"] == 1, name
    assert report["worst"]["ring_folds"] >= 1 and report["worst"]["materialized"] <= 1e-5
    assert "recover" not in p.stdout


@pytest.mark.distributed
@pytest.mark.parametrize("kda_state", ["per-step", "replay"])
def test_torchrun_decode_checked_every_other_step(tmp_path, kda_state):
    """T = 1, --check-every 2: the unsharded layer follows the unchecked steps too; in
    replay mode R = 2, so every request's ring folds from the third step on."""
    out = tmp_path / "every2.json"
    p, lines = torchrun(2, "--heads", "4", "--tokens", "1", "--blocks", "0", "--steps", "5",
                        "--requests", "3", "--check-every", "2", "--kda-state", kda_state,
                        "--ring", "2", "--json", str(out))  # fmt: skip
    report = read_report(out, p, lines)
    assert report["checks"]["kda outputs == unsharded (bitwise)"]["of"] == 3
    if kda_state == "replay":
        assert report["steps"] == {"total": 5, "replay decode": 5}
        assert report["checks"][MATERIALIZED_CHECKS[1]]["of"] == 1
        assert report["worst"]["ring_folds"] >= 3
    else:
        assert report["config"]["ring"] is None
        assert report["checks"]["state pages == unsharded (bitwise)"]["passed"] == 3


@pytest.mark.distributed
def test_mpirun():
    p, lines = mpirun(2, "--heads", "4", *SMALL)
    assert_ok(p, lines)
    assert "(mpirun), TP 2" in p.stdout


@pytest.mark.distributed
@pytest.mark.parametrize(
    "fault,state,check",
    [
        ("output", "per-step", "outputs identical on all ranks"),
        ("state", "per-step", "state pages == unsharded"),
        ("state", "replay", "checkpoint pages == unsharded"),
    ],
)
def test_checks_catch_a_corrupted_rank(fault, state, check):
    p, lines = torchrun(2, "--heads", "4", *SMALL, "--fault", fault, "--kda-state", state,
                        timeout=300)  # fmt: skip
    assert p.returncode == 1
    assert lines[-1].startswith("DECODE FAILED") and check in lines[-1]


@pytest.mark.distributed
def test_bad_configuration_is_reported():
    p, lines = torchrun(4, "--heads", "6", *SMALL, timeout=300)
    assert p.returncode != 0
    assert any("heads (6) must be a positive multiple of TP (4)" in line for line in lines)
    # every rank refuses with status 2 on one clock tick: none is stopped by torchrun first
    assert p.stderr.count("exitcode  : 2") == 4, p.stderr[-3000:]


@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_16_ranks():
    p, lines = torchrun(
        16,
        "--heads",
        "16",
        "--hidden",
        "1024",
        "--requests",
        "2",
        "--tokens",
        "2",
        "--blocks",
        "2",
        "--steps",
        "4",
        timeout=900,
    )
    assert_ok(p, lines)
    assert "TP 16, heads 16 (1/rank)" in p.stdout


def test_moe_problems_names_the_failing_part():
    """``MoeWaiters.problems`` (CPU tensors): "" when copies, waiter reads and hint words are
    right; else which rank / copy / rows differ (and how many still hold the poison) and
    the hint words, so a failing GPU run says which part of the MoE check failed."""
    from types import SimpleNamespace

    import torch

    from launch.moe import POISON_BITS, MoeWaiters

    n, reps, rows, hid = 2, 2, 3, 1024
    out = torch.randn(n, rows, hid).to(torch.bfloat16)
    xmoe = out[:, None].expand(n, reps, rows, hid).clone()
    moe_in = xmoe.clone()
    words = torch.zeros(n, 4, dtype=torch.int32)
    waiters = MoeWaiters(reps, "cpu", (0, 1), every_rank=False)
    bk = SimpleNamespace(output=out, xmoe=xmoe, moe_in=moe_in, rows=rows,
                         comm=SimpleNamespace(hint_words=words))  # fmt: skip
    assert waiters.problems(bk) == ""
    moe_in[1, 0, 2].view(torch.int16).fill_(POISON_BITS)
    words[1, 0] = 8
    words[1, 2] = 1
    got = waiters.problems(bk)
    assert "rank 1 copy 0: waiter read != output in 1/3 rows (1 still poison)" in got, got
    assert "copies" not in got and "[0, 0, 0], [8, 0, 1]" in got and "quota 3" in got, got
    waiters.poison(bk)
    assert (xmoe.view(torch.int16) == POISON_BITS).all() and torch.isnan(moe_in).all()


@pytest.mark.parametrize("kda_state", ["per-step", "replay"])
def test_job_layer_takes_the_gate(kda_state):
    """``Config(gate="softplus")``: the ranks' and the unsharded layer's KDA steps are the
    reference's with the softplus gate (not the lower-bound one), a recorded verify step's
    recover and replay's ring included, and the ranks' outputs are the unsharded layer's."""
    import torch

    from kda import layer as kl
    from kda import synthetic as kt
    from launch.host import host_attend, host_layer
    from launch.layer import Config, Model, Schedule, Unsharded
    from tpcomm.backends import make_backend

    cfg = Config(tp=2, heads=4, hidden=1024, requests=2, tokens=2, blocks=0, steps=3,
                 kda_state=kda_state, gate="softplus")  # fmt: skip
    model, schedule = Model(cfg), Schedule(cfg)
    unsharded, ranks = Unsharded(model), [model.shard(r) for r in range(cfg.tp)]
    backend = make_backend("loopback", world=cfg.tp, device="cpu")
    layers = [host_layer(model, r, backend) for r in ranks]  # the job's DecodeLayers
    assert all(L.gate_form == "softplus" and L.lower_bound is None for L in layers)
    lower = model.fresh_layer()
    for _ in range(3):
        plan = schedule.next()
        step, _, _ = model.step_inputs(plan)
        want, _ = unsharded.attention(plan, step)
        got = [host_attend(L, r, plan, step) for L, r in zip(layers, ranks, strict=True)]
        got = torch.cat(got, dim=1)
        assert torch.equal(got, want)
        other = kt.run_reference(lower, step, **kl.gate_scalars("lower-bound"))
        assert not torch.equal(other, want), "the lower-bound gate's outputs"
    with pytest.raises(ValueError, match="gate must be one of"):
        Config(tp=2, heads=4, hidden=1024, requests=2, tokens=2, blocks=0, steps=1,
               gate="relu").validate()  # fmt: skip


@pytest.mark.distributed
@pytest.mark.parametrize("kda_state", ["per-step", "replay"])
def test_torchrun_softplus_gate(tmp_path, kda_state):
    """--gate softplus (Kimi-Linear's decay), TP 2: every check of the job, the report's
    configuration says the gate."""
    out = tmp_path / "softplus.json"
    p, lines = torchrun(2, "--heads", "4", *SMALL, "--gate", "softplus",
                        "--kda-state", kda_state, "--json", str(out))  # fmt: skip
    report = read_report(out, p, lines)
    assert report["config"]["gate"] == "softplus" and "gate softplus" in p.stdout
    assert report["checks"]["kda outputs == unsharded (bitwise)"]["of"] == 4
