"""CPU tests of ``scripts/bench_decode.py``'s plain parts: ``--kda-state`` / ``--ring``
reach the runner's config, and the bytes a replay row states are the replay step's."""

import argparse
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))

import _common  # noqa: E402
import bench_decode  # noqa: E402

from launch.layer import step_kind  # noqa: E402
from launch.report import step_bytes  # noqa: E402


def _args(kda_state="per-step", ring=4, state_dtype="fp32"):
    return argparse.Namespace(
        heads=96, hidden=7168, blocks=8, kda_state=kda_state, ring=ring, state_dtype=state_dtype
    )


def test_config_carries_the_state_mode():
    per_step = bench_decode._config(8, 4, _args())
    assert not per_step.replay
    replay = bench_decode._config(8, 4, _args("replay", 8), tokens=4)
    assert replay.replay and replay.ring == 8 and replay.tokens == 4
    kind = step_kind(4, False, replay.replay)
    assert kind == "replay verify"
    # checkpoint page + R entries read + T written, per (request, head), against 1 + T pages
    ring_bytes = step_bytes(replay, kind, 4)["state"]
    page_bytes = step_bytes(per_step, "verify", 4)["state"]
    assert ring_bytes == 4 * 96 * (128 * 128 * 4 + (8 + 4) * 1024)  # every head of the layer
    assert page_bytes == 4 * 96 * 5 * 128 * 128 * 4
    bf16 = bench_decode._config(8, 4, _args(state_dtype="bf16"))
    assert step_bytes(bf16, "verify", 4)["state"] == page_bytes // 2  # 32 KB pages


def test_ring_shorter_than_the_verify_tokens_is_refused():
    with pytest.raises(ValueError, match="--ring 2 must be >= --tokens 4"):
        bench_decode._config(8, 4, _args("replay", 2), tokens=4)


def test_replay_samples_span_a_ring_cycle():
    """Replay mode times windows of R consecutive steps (one fold per request in each): the
    median of the windows' means, not of single steps (which would skip the folds)."""
    per_step = bench_decode._config(8, 4, _args())
    replay = bench_decode._config(8, 4, _args("replay", 4))
    assert bench_decode._cycle(per_step) == 1 and bench_decode._cycle(replay) == 4
    steps = [10.0, 10.0, 10.0, 50.0] * 3 + [10.0]  # a fold every 4th step, a partial window
    assert _common.cycle_means(steps, 4) == [20.0, 20.0, 20.0]
    assert _common.cycle_means(steps, 1) == steps
    with pytest.raises(ValueError, match="cycle"):
        _common.cycle_means(steps, 0)
