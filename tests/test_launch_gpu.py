"""launch/decode.py on the GPU (loopback backend: every TP rank a stream of one GPU).

GPU cases run the job as a subprocess (CUDA_DEVICE_MAX_CONNECTIONS must be set before
CUDA starts) and read its JSON report: ``DECODE OK``, every check passed on every step,
graph replay bitwise equal to the eager run, and the checks catching a corrupted rank.
The CPU cases cover the runner's plain-Python parts and the CLI's refusals.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from test_launch_trace import check_timeline

from kda import layer as kl
from kda import synthetic as kt
from launch import checks, decode, report, runner
from launch.layer import Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "launch", "decode.py")


def run_decode(*args, timeout=900):
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path)
    p = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                       timeout=timeout, env=env, cwd=ROOT)  # fmt: skip
    lines = [line for line in p.stdout.splitlines() if line.strip()]
    return p, lines


def assert_ok(p, lines, report_path):
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert lines and lines[-1] == "DECODE OK", p.stdout[-4000:]
    report = json.loads(report_path.read_text())
    assert report["ok"]
    for name, v in report["checks"].items():
        assert v["passed"] == v["of"], (name, v)
    assert report["checks"]["graph replay == eager (bitwise)"]["of"] >= 1
    assert report["checks"]["stage pass == eager (bitwise)"]["of"] >= 1
    return report


# --- GPU: end to end on loopback -----------------------------------------------------------


@pytest.mark.gpu
def test_loopback_tp2(tmp_path):
    out = tmp_path / "tp2.json"
    p, lines = run_decode(
        "--backend", "loopback", "--tp", "2", "--heads", "4", "--hidden", "1024",
        "--requests", "2", "--tokens", "3", "--blocks", "2", "--steps", "7",
        "--json", str(out),
    )  # fmt: skip
    report = assert_ok(p, lines, out)
    assert "TP 2, heads 4 (2/rank)" in p.stdout
    assert report["steps"]["decode"] == 1 and report["steps"]["verify+record+recover"] == 3
    assert report["checks"]["kda outputs vs unsharded (1 ulp + o's flip)"]["of"] == 7
    assert set(report["breakdown"]["verify+record+recover"]) == set(runner.STAGES)
    print(p.stdout)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "tokens,ring,launches", [(3, 4, "both"), (1, 2, "per-rank")], ids=["verify", "decode"]
)
def test_loopback_replay(tmp_path, tokens, ring, launches):
    """--kda-state replay (kda.replay_decode through each rank's DecodeLayer): every step
    against the unsharded replay reference (outputs, checkpoint pages, rings) and the
    per-step reference (outputs); more steps than the ring holds, so rings fold; then
    every rank materialises and the pages match the per-step reference's state."""
    out = tmp_path / "replay.json"
    p, lines = run_decode(
        "--backend", "loopback", "--tp", "2", "--heads", "4", "--hidden", "1024",
        "--requests", "2", "--tokens", str(tokens), "--blocks", "2", "--steps", "7",
        "--kda-state", "replay", "--ring", str(ring), "--oproj-launch", launches,
        "--json", str(out),
    )  # fmt: skip
    report = assert_ok(p, lines, out)
    kinds = {"replay decode": 7} if tokens == 1 else {"replay decode": 1, "replay verify": 6}
    assert report["steps"] == {"total": 7, **kinds}
    assert report["config"]["kda_state"] == "replay" and report["config"]["ring"] == ring
    every_step = (
        "kda outputs vs unsharded (1 ulp + o's flip)",
        "kda outputs vs per-step reference (1 ulp + o's flip)",
        "checkpoint pages vs unsharded (1e-5 of page max)",
        "ring vs unsharded (counters, k, raw gate bitwise; v_new 1e-5 of max)",
    )
    for name in every_step:
        assert report["checks"][name]["of"] == 7, name
    assert report["checks"]["materialized state vs per-step reference (1e-5 of page max)"]
    assert report["worst"]["ring_folds"] >= 1
    assert all("recover" not in stages for stages in report["breakdown"].values())
    print(p.stdout)


@pytest.mark.gpu
@pytest.mark.parametrize("kda_state", ["per-step", "replay"])
def test_loopback_softplus_gate(tmp_path, kda_state):
    """--gate softplus (Kimi-Linear's decay) through the ranks' DecodeLayers: every check
    against the unsharded softplus reference (per-step: recorded verify steps recovered;
    replay: rings folded, then materialised)."""
    out = tmp_path / "softplus.json"
    p, lines = run_decode(
        "--backend", "loopback", "--tp", "2", "--heads", "4", "--hidden", "1024",
        "--requests", "2", "--tokens", "3", "--blocks", "2", "--steps", "7", "--ring", "4",
        "--gate", "softplus", "--kda-state", kda_state, "--json", str(out),
    )  # fmt: skip
    report = assert_ok(p, lines, out)
    assert report["config"]["gate"] == "softplus" and "gate softplus" in p.stdout
    assert report["checks"]["kda outputs vs unsharded (1 ulp + o's flip)"]["of"] == 7
    print(p.stdout)


@pytest.mark.gpu
@pytest.mark.parametrize("launches", ["per-rank", "both"])
def test_loopback_tp16(tmp_path, launches):
    out = tmp_path / "tp16.json"
    p, lines = run_decode(
        "--backend", "loopback", "--tp", "16", "--heads", "16", "--hidden", "2048",
        "--requests", "2", "--tokens", "2", "--blocks", "3", "--steps", "5",
        "--json", str(out), "--oproj-launch", launches,
    )  # fmt: skip
    report = assert_ok(p, lines, out)
    assert report["config"]["tp"] == 16 and report["config"]["heads_per_rank"] == 1
    assert report["config"]["oproj_launch"] == launches
    print(p.stdout)


@pytest.mark.gpu
def test_loopback_tp16_kimi_shapes(tmp_path):
    """The issue's latency shape: 96 heads (6 per rank), HID 7168, 8 requests, T = 1, nb = 8."""
    out = tmp_path / "kimi.json"
    p, lines = run_decode(
        "--backend", "loopback", "--tp", "16", "--heads", "96", "--hidden", "7168",
        "--requests", "8", "--tokens", "1", "--blocks", "8", "--steps", "12",
        "--check-every", "4", "--padding", "0", "--json", str(out),
    )  # fmt: skip
    report = assert_ok(p, lines, out)
    assert report["steps"] == {"total": 12, "decode": 12}
    steady = report["latency"]["decode back to back"]  # 50 steps after the checked ones
    assert steady["n"] == 50 and steady["median_us"] > 0
    print(p.stdout)


@pytest.mark.gpu
@pytest.mark.parametrize("launches", ["per-rank", "both"])
def test_loopback_kimi_linear_width(tmp_path, launches):
    """Kimi-Linear's hidden width, 2304 = 3 consumer CTAs of 768 columns (plan.slicing), 32
    heads at TP 8, verify steps of 2 tokens and nb 8: every stage's checks pass."""
    out = tmp_path / "kimi_linear.json"
    p, lines = run_decode(
        "--backend", "loopback", "--tp", "8", "--heads", "32", "--hidden", "2304",
        "--requests", "4", "--tokens", "2", "--blocks", "8", "--steps", "5",
        "--json", str(out), "--oproj-launch", launches,
    )  # fmt: skip
    report = assert_ok(p, lines, out)
    assert report["config"]["hidden"] == 2304 and report["config"]["heads_per_rank"] == 4
    print(p.stdout)


@pytest.mark.gpu
@pytest.mark.parametrize("launches", ["per-rank", "both"])
def test_loopback_trace(tmp_path, launches):
    """``--trace``: every rank's stamps around every stage of a recorded verify step (the
    last step's bucket), stages tiling each step, and the timeline plotted."""
    out = tmp_path / "trace.json"
    p, lines = run_decode(
        "--backend", "loopback", "--tp", "2", "--heads", "4", "--hidden", "1024",
        "--requests", "2", "--tokens", "3", "--blocks", "2", "--steps", "7", "--trace", "6",
        "--oproj-launch", launches, "--json", str(out),
    )  # fmt: skip
    report = assert_ok(p, lines, out)
    assert report["config"]["pdl"] is False  # --trace runs without PDL
    tl = report["timeline"]
    assert tl["kind"] == "verify+record+recover"
    check_timeline(tl, 2, 6, ("kda", "recover", "produce", "consume"))
    if launches == "both":  # one producer and one consumer launch: one stamp for all ranks
        for first, second in zip(*tl["ranks"], strict=True):
            assert first["consume"][1] == second["consume"][1]
    assert "timeline (verify+record+recover, 6 traced steps" in p.stdout
    pytest.importorskip("matplotlib")
    png = tmp_path / "timeline.png"
    script = os.path.join(ROOT, "scripts", "plot_timeline.py")
    plot = subprocess.run([sys.executable, script, str(out), "--out", str(png)],
                          capture_output=True, text=True)  # fmt: skip
    assert plot.returncode == 0 and png.read_bytes()[:4] == b"\x89PNG", plot.stderr
    print(p.stdout)


@pytest.mark.gpu
def test_loopback_window_first_groups_and_gate_mode(tmp_path):
    out = tmp_path / "wf.json"
    p, lines = run_decode(
        "--backend", "loopback", "--tp", "4", "--heads", "8", "--hidden", "3072",
        "--requests", "4", "--tokens", "2", "--blocks", "0", "--steps", "6",
        "--conv-layout", "window-first", "--groups", "2", "--gate-mode", "1", "--no-pdl",
        "--json", str(out),
    )  # fmt: skip
    report = assert_ok(p, lines, out)
    assert report["config"]["groups_chosen"] == {"4": 2, "8": 2}
    assert report["config"]["gate_mode"] == 1 and report["config"]["exact_gate_grids"]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "fault,check",
    [("output", "outputs identical on all ranks"), ("state", "state pages")],
)
def test_loopback_checks_catch_a_corrupted_rank(fault, check):
    p, lines = run_decode(
        "--backend", "loopback", "--tp", "2", "--heads", "4", "--requests", "2",
        "--tokens", "2", "--steps", "3", "--fault", fault,
    )  # fmt: skip
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    assert lines and lines[-1].startswith("DECODE FAILED") and check in lines[-1], (
        p.stdout[-3000:] + p.stderr[-3000:]
    )


@pytest.mark.gpu
def test_loopback_refuses_too_many_rows():
    p, lines = run_decode(
        "--backend", "loopback", "--tp", "2", "--requests", "257", "--tokens", "4"
    )  # fmt: skip
    assert p.returncode == 2
    assert "--requests x --tokens = 257 x 4 = 1028" in lines[-1] and "at most 1024" in lines[-1]


@pytest.mark.gpu
@pytest.mark.parametrize("launches", ["per-rank", "both"])
def test_loopback_rows_beyond_eight(tmp_path, launches):
    """16 and 24 rows per step (the cuBLAS producer + publisher) in every launch mode:
    decode, verify, record and recover steps with padding rows, every check passing."""
    out = tmp_path / "rows.json"
    p, lines = run_decode(
        "--backend", "loopback", "--tp", "2", "--heads", "8", "--hidden", "2048",
        "--requests", "12", "--tokens", "2", "--blocks", "3", "--steps", "6",
        "--json", str(out), "--oproj-launch", launches,
    )  # fmt: skip
    report = assert_ok(p, lines, out)
    assert report["steps"]["verify+record+recover"] >= 1
    assert set(report["config"]["groups_chosen"]) == {"12", "24"}
    print(p.stdout)


@pytest.mark.gpu
@pytest.mark.parametrize("tp,requests", [(8, 8), (16, 4)])
def test_loopback_per_rank_deployed_plan(tmp_path, tp, requests):
    """``--oproj-launch per-rank`` runs the plan of one rank per GPU: twoshot past the
    measured crossovers (TP 8 from 8 rows, TP 16 from 4) at HID 7168, decode and verify
    steps (TP 8: 16 rows, the cuBLAS producer + the twoshot publisher), every check passing
    with the partials read back from the receive views."""
    out = tmp_path / "deployed.json"
    p, lines = run_decode(
        "--backend", "loopback", "--tp", str(tp), "--heads", str(2 * tp), "--hidden", "7168",
        "--requests", str(requests), "--tokens", "2", "--blocks", "8", "--steps", "5",
        "--oproj-launch", "per-rank", "--json", str(out),
    )  # fmt: skip
    report = assert_ok(p, lines, out)
    plans = report["config"]["oproj_plan"]
    assert set(plans) == {str(requests), str(2 * requests)}
    assert all(v["twoshot"] for v in plans.values()), plans
    assert report["checks"]["partials landed in every receive view (twoshot)"]["of"] == 5
    print(p.stdout)


@pytest.mark.gpu
def test_loopback_issue_example_sixteen_requests(tmp_path):
    """The issue's refused command: TP 8, 96 heads, HID 7168, 16 requests x 1 token."""
    out = tmp_path / "b16.json"
    p, lines = run_decode(
        "--backend", "loopback", "--tp", "8", "--heads", "96", "--hidden", "7168",
        "--requests", "16", "--tokens", "1", "--steps", "4", "--json", str(out),
    )  # fmt: skip
    assert_ok(p, lines, out)
    print(p.stdout)


@pytest.mark.gpu
def test_loopback_large_batch(tmp_path):
    """512 rows per verify step (128 requests x 4 tokens) at TP 8 with Kimi's hidden width:
    the one-launch o-projection, padding rows, verify + record + recover, every check."""
    out = tmp_path / "b512.json"
    p, lines = run_decode(
        "--backend", "loopback", "--tp", "8", "--heads", "48", "--hidden", "7168",
        "--requests", "128", "--tokens", "4", "--blocks", "8", "--steps", "3",
        "--check-every", "1", "--json", str(out), timeout=420,
    )  # fmt: skip
    report = assert_ok(p, lines, out)
    assert report["steps"]["verify+record+recover"] >= 1
    print(p.stdout)


# --- CPU: the plain-Python parts -------------------------------------------------------------


def test_check_rows():
    runner.check_rows(8, 1)
    runner.check_rows(256, 4)
    runner.check_rows(1024, 1)
    with pytest.raises(ValueError, match=r"--requests x --tokens = 129 x 8 = 1032 .* at most 1024"):
        runner.check_rows(129, 8)


def test_shard_inputs_matches_shard_step():
    heads, tp, B, T = 8, 4, 2, 3
    step = kt.make_step(B, T, heads, pages=1 + B * T, seed=3)
    x, gate, beta = runner.shard_inputs(step, tp)
    per = heads // tp
    for r in range(tp):
        want = kl.shard_step(step, heads, r * per, per)
        assert torch.equal(x[r], want.x)
        assert torch.equal(gate[r], want.gate)
        assert torch.equal(beta[r], want.beta)


def test_ulp_check():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(4, 256, generator=g).to(torch.bfloat16)
    ok, exact, worst, _ = checks.ulp_check(ref.clone(), ref)
    assert ok and exact == 1.0 and worst == 0.0
    one_ulp = (ref.view(torch.int16) + 1).view(torch.bfloat16)
    assert checks.ulp_check(one_ulp, ref)[0]
    two_ulp = (ref.view(torch.int16) + 2).view(torch.bfloat16)
    assert not checks.ulp_check(two_ulp, ref)[0]
    assert not checks.ulp_check(torch.full_like(ref, float("nan")), ref)[0]


def test_state_check():
    g = torch.Generator().manual_seed(1)
    before = torch.randn(3, 2, 128, 128, generator=g)
    ref = before.clone()
    ref[1] *= 0.5  # the step wrote page 1
    got = ref.clone()
    got[1, 0, 0, 0] += 1e-7
    assert checks.state_check(got, ref, before)[:2] == (True, True)
    got[1, 0, 0, 0] += 1e-3
    assert checks.state_check(got, ref, before)[0] is False
    got = ref.clone()
    got.view(torch.int32)[2, 1, 5, 5] ^= 1  # a page the step leaves alone, changed
    assert checks.state_check(got, ref, before)[1] is False


def test_step_bytes():
    """Hand-computed for TP 16, 96 heads, HID 7168, 8 requests: a state page is 64 KiB;
    decode reads and writes one page per (request, head): 8 * 96 * 2 * 64 KiB = 96 MiB;
    w_o is 7168 x 12288 bf16 = 168 MiB; 16 ranks store 16 slots of 8 x 7168 bf16 each =
    28 MiB; floor (96 + 168) MiB at 4.16 TB/s = 66.544 us. Verify T = 3: 4 pages, 24 rows;
    with record + recover: 5 pages."""
    cfg = Config(16, 96, 7168, 8, 1, 8, 1)
    b = report.step_bytes(cfg, "decode", 1)
    assert (b["state"], b["w_o"], b["mailbox_stores"]) == (100_663_296, 176_160_768, 29_360_128)
    assert b["floor_us"] == pytest.approx(66.5442, abs=1e-4)
    b = report.step_bytes(cfg, "verify", 3)
    assert (b["state"], b["mailbox_stores"]) == (201_326_592, 88_080_384)
    assert report.step_bytes(cfg, "verify+record+recover", 3)["state"] == 251_658_240


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer of --backend auto")
def test_auto_is_host_without_cuda(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMI_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert decode.resolve_backend("auto") == "host"
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert decode.resolve_backend("auto") == "host"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer of --backend loopback")
def test_loopback_without_cuda_fails_clearly(capsys):
    assert decode.main(["--backend", "loopback", "--tp", "2"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out
    assert decode.main(["--backend", "loopback", "--requests", "300", "--tokens", "4"]) == 2
    assert "at most 1024" in capsys.readouterr().out
    assert decode.main(["--backend", "host", "--xmoe", "1"]) == 2
    assert "--xmoe runs on the GPU backends" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer of --backend nvshmem")
def test_nvshmem_without_cuda_fails_clearly(capsys):
    assert decode.main(["--backend", "nvshmem"]) == 2
    assert "needs a CUDA GPU per process" in capsys.readouterr().out
    assert decode.main(["--backend", "nvshmem", "--tp", "4"]) == 2
    assert "--tp 4 is for the loopback backend" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.parametrize("launches", ["per-rank", "both"])
def test_loopback_xmoe_hints(tmp_path, launches):
    """--xmoe 2: the consumer's latent copies and hints; the MoE stand-in waits for each
    rank's hints on its own stream, then reads the copies; copies poisoned before every
    step, what it read bitwise the output (no row read before its hint)."""
    out = tmp_path / "xmoe.json"
    p, lines = run_decode(
        "--backend", "loopback", "--tp", "4", "--heads", "8", "--hidden", "2048",
        "--requests", "16", "--tokens", "2", "--blocks", "2", "--steps", "5", "--xmoe", "2",
        "--json", str(out), "--oproj-launch", launches,
    )  # fmt: skip
    report = assert_ok(p, lines, out)
    moe = report["checks"]["MoE copies read after their hints == output (bitwise)"]
    assert moe["of"] == 5 and report["config"]["xmoe"] == 2
    print(p.stdout)


def test_runner_replay_pools_on_cpu(monkeypatch):
    """The runner's replay plumbing without a GPU (its rank streams stubbed): the rings are
    part of each rank's pools, ``gather_ring`` reassembles the whole layer's ring from the
    ranks' (bitwise the unsharded replay's after the same reference steps, folds included),
    and ``materialize`` leaves each request's page within 1e-5 of the per-step state."""
    from launch.layer import Model, Schedule, Unsharded, run_replay
    from tpcomm.backends.loopback import LoopbackBackend

    monkeypatch.setattr(torch.cuda, "Stream", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    cfg = Config(2, 4, 1024, 2, 3, 2, 4, kda_state="replay", ring=4)
    model = Model(cfg)
    job = runner.Runner(cfg, model, LoopbackBackend(2, device="cpu"))
    assert [len(pool) for pool in job.pools()] == [5, 5]  # state, conv, ring v / kg / length
    unsharded, schedule = Unsharded(model), Schedule(cfg)
    for _ in range(cfg.steps):
        plan = schedule.next()
        step, _, _ = model.step_inputs(plan)
        for r, layer in enumerate(job.decode_layers):
            first, count = model.rank_heads(r)
            run_replay(layer.shard, layer.ring, kl.shard_step(step, cfg.heads, first, count))
        unsharded.attention(plan, step)
    assert job.bucket(3, False).kind == "replay verify" and unsharded.folds >= 1
    ok, ratio, _ = checks.ring_check(job.gather_ring(), unsharded.ring)
    assert ok and ratio == 0.0
    state, conv = job.gather_pools()
    assert torch.equal(state, unsharded.kda.state) and torch.equal(conv, unsharded.kda.conv_state)
    pages = model.slot_table()[:, 0].contiguous()
    job.materialize(pages, schedule.accepted)
    per_step = unsharded.per_step
    ok, ratio = checks.materialized_check(job.gather_pools()[0], pages.long(), per_step.kda.state,
                                          per_step.request_pages(schedule.accepted))  # fmt: skip
    assert ok, ratio
