"""CPU tests of scripts/bench_kda.py's plain parts: the replay grid and its order, the
tables each flag selects, the replay rows' byte count against the ring's counters (closed
form at T = 1, kda.reference.replay_decode's counters at T = 4), the staggered ring, the
JSON written whole, and the replay table's rows with a stand-in timer on CPU pools (every
call it would time passes the entries' checks and is refused only for want of a GPU)."""

import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))

import bench_kda  # noqa: E402

from kda import layer as kl  # noqa: E402
from kda import reference as ref  # noqa: E402
from kda import synthetic as kt  # noqa: E402


def test_replay_grid_covers_the_issue_headline_first():
    grid = bench_kda.replay_grid()
    assert grid[:2] == [(96, 128, 1, 8), (96, 128, 4, 8)]
    want = {(H, B, T, R) for H in (6, 12, 96) for B in (8, 32, 128, 256) for T in (1, 4)
            for R in (4, 8, 16)}  # fmt: skip
    assert len(grid) == len(want) == 72 and set(grid) == want
    assert all(R >= T for _, _, T, R in grid)
    # then the rest of H96 B128 before any other shape, R 8 first within each new shape
    assert {g[:3] for g in grid[:6]} == {(96, 128, 1), (96, 128, 4)}
    assert grid[6] == (12, 128, 1, 8)
    assert bench_kda.replay_grid(quick=True) == grid[:2]


@pytest.mark.parametrize(
    "argv, per_step, replays",
    [
        ([], 24, 72),
        (["--quick"], 5, 2),
        (["--replay-only"], 0, 72),
        (["--replay-only", "--quick"], 0, 2),
        (["--small"], 16, 0),
        (["--verify"], 12, 0),
        (["--peer-grid", "--peers", "sglang"], 18, 0),
    ],
)
def test_flags_select_the_tables(argv, per_step, replays):
    args = bench_kda.parse_args([*argv, "--json", "out.json"])
    assert len(bench_kda.per_step_shapes(args)) == per_step
    assert len(bench_kda.replay_shapes(args)) == replays
    assert args.json == "out.json" and args.gate_mode == 3


@pytest.mark.parametrize("extra", [["--small"], ["--verify"], ["--splits"], ["--diag"]])
def test_replay_only_refuses_other_tables(extra, capsys):
    with pytest.raises(SystemExit):
        bench_kda.parse_args(["--replay-only", *extra])
    assert "--replay-only" in capsys.readouterr().err


def test_replay_bytes_decode_closed_form():
    """T = 1 from the staggered fill levels 1..R: each item cycles through them, reading
    (R + 1) / 2 entries on average, writing one, and its page every R-th step."""
    H, B = 12, 32
    for size in (4, 8, 16):
        for rotations in (1, 3):
            slots = [[1 + r * B + b for b in range(B)] for r in range(rotations)]
            got = bench_kda.replay_bytes(H, size, 1, slots)
            page, entry = bench_kda.PAGE, bench_kda.ENTRY
            want = B * H * (page + (size + 1) / 2 * entry + entry + page / size)
            assert got == pytest.approx(want, rel=1e-12)
    padded = bench_kda.replay_bytes(2, 4, 1, [[1, -1, 3, 0]])  # padding items move nothing
    assert padded == bench_kda.replay_bytes(2, 4, 1, [[1, 3]])


def test_replay_bytes_follows_the_reference_counters():
    """T = 4: the counters the byte count walks are the reference's (held entries, folds)
    over the same steps from replay_setup's ring."""
    H, B, T, size, calls = 2, 3, 4, 8, 3
    pages = 1 + 2 * B * T
    layer = kt.make_layer(H, pages, window=T + 2, seed=1)
    steps = []
    for r in range(2):
        table = 1 + r * B * T + torch.arange(B * T, dtype=torch.int32).view(B, T)
        steps.append(kt.make_step(B, T, H, pages=pages, slot_table=table, seed=r))
    ring = bench_kda.replay_setup(layer, size)
    assert ring.length[:, :, 0].tolist() == [[1 + s % size] * H for s in range(pages)]
    moved, folds = 0, 0
    for _ in range(calls * size):
        for s in steps:
            slot = s.slots[:, 0].long()
            committed, pending = ring.length[slot, 0].long().unbind(1)
            held = committed + torch.minimum(s.accepted.long(), pending)
            fold = held + T > size
            moved += int((bench_kda.PAGE + (held + T) * bench_kda.ENTRY).sum()) * H
            moved += int(fold.sum()) * bench_kda.PAGE * H
            folds += int(fold.sum())
            ref.replay_decode(
                s.x, layer.conv_weight, layer.conv_bias, layer.conv_state, s.f_a, s.beta,
                layer.a_log, layer.dt_bias, s.slots, layer.state, s.gate, layer.norm_weight,
                layer.f_b, lower_bound=kl.LOWER_BOUND, scale=kl.SCALE, eps=kl.EPS,
                accepted=s.accepted, ring=ring,
            )  # fmt: skip
    assert folds > 0
    slots = [s.slots[:, 0].tolist() for s in steps]
    accepted = [s.accepted.tolist() for s in steps]
    got = bench_kda.replay_bytes(H, size, T, slots, accepted, calls=calls, timed=calls)
    assert got == pytest.approx(moved / (calls * size * len(steps)), rel=1e-12)


def test_write_json_replaces_the_file_whole(tmp_path):
    path = tmp_path / "replay.json"
    for n in range(3):
        bench_kda.write_json(str(path), dict(rows=[], replay_rows=[{"R": 8}] * n))
        assert len(json.loads(path.read_text())["replay_rows"]) == n
    assert os.listdir(tmp_path) == ["replay.json"]


def test_replay_table_rows_on_cpu_pools(monkeypatch):
    """The table's rows in grid order: each shape built once, the per-step path timed once
    per shape unless the per-step table did (its fla time then carried over)."""
    built, timed = [], []
    setup = bench_kda.setup

    def cpu_setup(H, B, T, rotations):
        built.append((H, B, T))
        return setup(H, B, T, rotations, device="cpu")

    def fake_time_graph(fn, replays=7, inner=1):
        with pytest.raises(ValueError, match="CUDA tensor"):  # every other check passed
            fn()
        timed.append(inner)
        return 100.0 if len(timed) == 1 else 40.0

    monkeypatch.setattr(bench_kda, "setup", cpu_setup)
    monkeypatch.setattr(bench_kda, "rotations_for", lambda H, B, T: (2, B * H * (1 + T) * 65536))
    monkeypatch.setattr(bench_kda, "time_graph", fake_time_graph)
    plan = lambda B, H, T, device: SimpleNamespace(kernel="wide")  # noqa: E731
    monkeypatch.setattr(sys.modules["kda.decode"], "plan", plan)  # kda.decode: the function
    props = SimpleNamespace(multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    grid = [(2, 3, 1, 4), (2, 3, 4, 16), (2, 3, 1, 8), (3, 2, 4, 4)]
    per_step = {(3, 2, 4): dict(auto_us=80.0, kernel="stream", fla_us=120.0)}
    rows = []
    bench_kda.replay_table(grid, per_step, 3, 4.0, rows.append)
    assert [(r["H"], r["B"], r["T"], r["R"]) for r in rows] == grid
    assert built == [(2, 3, 1), (2, 3, 4), (3, 2, 4)]
    # per-step (2, 3, 1) and (2, 3, 4) once each (inner 2), each replay row R x 2
    assert timed == [2, 8, 2, 32, 16, 8]
    first, verify, third, carried = rows
    assert first["per_step_us"] == 100.0 and first["speedup_per_step"] == 2.5
    assert first["kernel"] == "wide" and first["replay_us"] == 40.0
    assert verify["replay_us"] == 40.0 and "replay_error" not in verify
    assert third["per_step_us"] == 100.0  # not timed again
    assert carried["fla_us"] == 120.0 and carried["speedup_fla"] == 3.0
    assert carried["per_step_kernel"] == "stream"
    assert all(r["replay_bytes"] > 0 and r["pct_copy"] > 0 for r in rows)


def test_deployed_shapes_and_state_dtypes():
    """``--deployed --state-dtype both``: H 6 / 12 / 96, B 8..256, T 1 and 4, no replay
    rows; a bf16 page is half the bytes (more rotations for the same L2 rotation)."""
    args = bench_kda.parse_args(["--deployed", "--state-dtype", "both"])
    shapes = bench_kda.per_step_shapes(args)
    assert len(shapes) == 24 and (96, 256, 4) in shapes and (6, 8, 1) in shapes
    assert bench_kda.replay_shapes(args) == []
    assert bench_kda.replay_shapes(bench_kda.parse_args(["--state-dtype", "bf16"])) == []
    fp32 = bench_kda.rotations_for(12, 128, 1)
    bf16 = bench_kda.rotations_for(12, 128, 1, bench_kda.PAGE // 2)
    assert bf16[1] * 2 == fp32[1] and bf16[0] >= fp32[0]


def test_grid_flags_are_the_product():
    """``--heads / --requests / --tokens``: their product, no replay rows; all three or none."""
    argv = ["--heads", "6", "24", "--requests", "1", "256", "--tokens", "2"]
    args = bench_kda.parse_args(argv)
    assert bench_kda.per_step_shapes(args) == [(6, 1, 2), (6, 256, 2), (24, 1, 2), (24, 256, 2)]
    assert bench_kda.replay_shapes(args) == []
    with pytest.raises(SystemExit):
        bench_kda.parse_args(["--heads", "6"])


def test_grid_replay_sizes():
    """``--replay-sizes``: replay rows of every grid shape at each ring size (fp32 pages:
    none with ``--state-dtype bf16``); only with the grid."""
    argv = ["--heads", "6", "96", "--requests", "32", "--tokens", "1", "4"]
    args = bench_kda.parse_args([*argv, "--replay-sizes", "4", "8"])
    rows = bench_kda.replay_shapes(args)
    assert len(rows) == 8 and rows[:2] == [(6, 32, 1, 4), (6, 32, 1, 8)]
    assert {(H, B, T) for H, B, T, _ in rows} == set(bench_kda.per_step_shapes(args))
    bf16 = bench_kda.parse_args([*argv, "--replay-sizes", "4", "--state-dtype", "bf16"])
    assert bench_kda.replay_shapes(bf16) == []
    with pytest.raises(SystemExit):
        bench_kda.parse_args(["--replay-sizes", "4"])


def test_kernels_and_pdl_flags():
    """``--kernels``: which of ours each row times (auto always: every row's figure);
    ``--pdl``: launched as the deployment launches them; default all four, no PDL."""
    args = bench_kda.parse_args([])
    assert args.kernels == ["auto", "wide", "stream", "pipe"] and args.pdl is False
    args = bench_kda.parse_args(["--kernels", "auto", "--pdl"])
    assert args.kernels == ["auto"] and args.pdl is True
    with pytest.raises(SystemExit):
        bench_kda.parse_args(["--kernels", "wide", "pipe"])


def test_sglang_operands_are_its_layout():
    """SGLang's arguments from our layer and step: its shapes and dtypes (bf16 activations,
    fp32 conv taps / bias / norm weight, the full-rank gate bf16(f_a . f_b)), the pools
    passed as given; other head counts, T > 1 and a dim-first pool refused."""
    import kda_peers

    H, B, pages = 3, 4, 9
    layer = kt.make_layer(H, pages, window=3, conv_dim_first=False, bias=False)
    step = kt.make_step(B, 1, H, pages=pages)
    conv = kda_peers.window_first(layer.conv_state, layer.conv_dim_first)
    args = kda_peers.sglang_operands(layer, step, layer.state, conv)
    D = H * 128
    x, a, beta, pool, wq, wk, wv, bias, a_log, dt_bias, gate, norm, state, slots, out = args
    assert x is step.x and pool is conv and state is layer.state and slots is step.slots
    assert a.dtype == torch.bfloat16 and a.shape == (B, D)
    assert torch.equal(a, (step.f_a.float() @ layer.f_b.float().T).to(torch.bfloat16))
    for t, p in zip((wq, wk, wv), range(3), strict=True):
        assert t.dtype == torch.float32 and torch.equal(t, layer.conv_weight[p].float())
    assert bias.shape == (3 * D,) and not bias.any()  # no conv bias: zeros
    assert norm.dtype == torch.float32 and norm.shape == (128,)
    assert beta.dtype == gate.dtype == out.dtype == torch.bfloat16 and out.shape == (B, D)
    assert a_log.shape == (H,) and dt_bias.shape == (D,)
    with pytest.raises(ValueError, match="H in"):
        big = kt.make_layer(4, pages, window=3, conv_dim_first=False)
        kda_peers.sglang_operands(big, kt.make_step(B, 1, 4, pages=pages), big.state, conv)
    dim_first = kt.make_layer(H, pages, window=3)
    with pytest.raises(ValueError, match="conv pool"):
        kda_peers.sglang_operands(dim_first, step, dim_first.state, dim_first.conv_state)
    assert kda_peers.window_first(dim_first.conv_state, True).shape == (pages, 3, 3 * D)
