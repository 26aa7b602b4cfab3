"""CPU tests of the KDA kernel choice (kda.dispatch) and kda.decode's input checks."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kda import dispatch
from kda import layer as kl
from kda import synthetic as kt


def test_one_wave_picks_wide():
    choice = dispatch.choose(32, 6, 1, sms=132)  # 192 items
    assert choice.kernel == "wide" and choice.ctas == 192 and choice.ahead == 0
    assert "one wave" in choice.reason
    assert dispatch.choose(8, 12, 4, sms=132).kernel == "wide"  # 96 items at T 4


def test_several_waves_pick_pipe_for_decode():
    choice = dispatch.choose(128, 96, 1, sms=132)
    assert choice.kernel == "pipe" and choice.ctas == 132  # one CTA per SM
    assert "waves" in choice.reason and "pipe" in choice.reason


def test_several_waves_verify_picks_wide_with_prefetch():
    choice = dispatch.choose(128, 96, 8, sms=132)
    assert choice.kernel == "wide" and choice.ahead == 264 and choice.ctas == 128 * 96
    assert "T = 8" in choice.reason


def test_stream_token_limit_is_the_switch(monkeypatch):
    """Pipe serves several waves at PIPE_TOKENS (1, 2, 4, 6: measured ahead), Stream the
    other T up to STREAM_MAX_TOKENS (4), Wide past it."""
    assert dispatch.STREAM_MAX_TOKENS == 4 and dispatch.PIPE_TOKENS == (1, 2, 4, 6)
    expect = {1: "pipe", 2: "pipe", 3: "stream", 4: "pipe", 5: "wide", 6: "pipe", 7: "wide"}
    for tokens, kernel in {**expect, 8: "wide"}.items():
        assert dispatch.choose(128, 12, tokens, sms=132).kernel == kernel, tokens
    monkeypatch.setattr(dispatch, "STREAM_MAX_TOKENS", 8)
    monkeypatch.setattr(dispatch, "PIPE_TOKENS", tuple(range(1, 9)))
    for tokens in range(1, 9):
        choice = dispatch.choose(128, 12, tokens, sms=132)
        assert choice.kernel == "pipe" and choice.ctas == 132, tokens
        assert f"T = {tokens}" in choice.reason
    assert dispatch.choose(8, 12, 4, sms=132).kernel == "wide"  # one wave: still wide


def test_records_never_pick_pipe():
    """A verify step that writes records (to recover from) gets a kernel with a record mode:
    stream up to STREAM_MAX_TOKENS, wide past it, where pipe would be the choice without."""
    for tokens in dispatch.PIPE_TOKENS:
        assert dispatch.choose(128, 12, tokens, sms=132).kernel == "pipe"
        choice = dispatch.choose(128, 12, tokens, sms=132, records=True)
        expect = "stream" if tokens <= dispatch.STREAM_MAX_TOKENS else "wide"
        assert choice.kernel == expect, tokens
        assert expect != "stream" or "with records" in choice.reason
    assert dispatch.choose(8, 12, 4, sms=132, records=True).kernel == "wide"  # one wave
    assert dispatch.choose(1, 6, 1, sms=132, records=True).kernel == "split"


def test_boundary_is_resident_ctas():
    assert dispatch.choose(22, 12, 1, sms=132).kernel == "wide"  # 264 items
    assert dispatch.choose(23, 12, 1, sms=132).kernel == "pipe"  # 276 items


def test_forced_kernels_and_ahead():
    wide = dispatch.choose(128, 96, 1, sms=132, kernel="wide")
    assert wide.kernel == "wide" and wide.ahead == 264 and "requested" in wide.reason
    small = dispatch.choose(1, 6, 1, sms=132, kernel="stream")
    assert small.kernel == "stream" and small.ctas == 6
    pipe = dispatch.choose(1, 6, 1, sms=132, kernel="pipe")
    assert pipe.kernel == "pipe" and pipe.ctas == 6


@pytest.mark.parametrize(
    "args",
    [(0, 1, 1), (1, 0, 1), (1, 1, 0), (1, 1, 9)],
)
def test_bad_shapes(args):
    with pytest.raises(ValueError):
        dispatch.choose(*args)


def test_bad_kernel_name():
    with pytest.raises(ValueError, match="kernel"):
        dispatch.choose(1, 1, 1, kernel="bogus")


def test_few_items_pick_split_with_the_largest_cluster_that_fits():
    choose = dispatch.choose
    one = choose(1, 6, 1, sms=132)
    assert one.kernel == "split" and one.cluster == 8 and one.ctas == 48
    assert "split" in one.reason
    eight = choose(8, 6, 4, sms=132)  # 48 items: cluster 2 (96 CTAs)
    assert eight.kernel == "split" and eight.cluster == 2 and eight.ctas == 96
    assert choose(4, 6, 1, sms=132).cluster == 4  # 24 items x 4 = 96
    # One CTA per SM: items x 2 <= SPLIT_MAX_CTAS_PER_SM x SMs, at any T.
    limit = dispatch.SPLIT_MAX_CTAS_PER_SM * 132 // 2
    assert choose(limit, 1, 4, sms=132).kernel == "split"
    assert choose(limit + 1, 1, 4, sms=132).kernel == "wide"
    # T = 1: cluster 2 up to two CTAs per SM (all co-resident), Wide past it.
    pairs = dispatch.SPLIT_PAIR_MAX_CTAS_PER_SM * 132 // 2
    assert pairs > limit
    mid = choose(8, 12, 1, sms=132)  # 96 items: 192 CTAs on 132 SMs
    assert mid.kernel == "split" and mid.cluster == 2 and mid.ctas == 192
    assert "2 CTA(s) per SM" in mid.reason
    assert choose(pairs, 1, 1, sms=132).cluster == 2
    assert choose(pairs + 1, 1, 1, sms=132).kernel == "wide"
    assert choose(32, 6, 1, sms=132).kernel == "wide"  # 192 items
    assert dispatch.split_cluster(48, 132, 1) == 2  # larger clusters stay at one per SM


def test_auto_takes_split_for_few_items():
    assert dispatch.choose(1, 6, 1, sms=132).kernel == "split"
    assert dispatch.choose(8, 12, 1, sms=132).kernel == "split"  # 96 items: split2 measured best


def test_forced_split_and_cluster():
    forced = dispatch.choose(128, 96, 1, sms=132, kernel="split")
    assert forced.kernel == "split" and forced.cluster == 2 and "requested" in forced.reason
    assert dispatch.choose(1, 6, 2, kernel="split", cluster=4).cluster == 4
    with pytest.raises(ValueError, match="cluster"):
        dispatch.choose(1, 6, 2, kernel="split", cluster=3)
    with pytest.raises(ValueError, match="cluster"):
        dispatch.choose(1, 6, 2, kernel="wide", cluster=2)


def test_arch_switch():
    assert dispatch.arch_of((9, 0)) == "sm_90a"
    assert dispatch.arch_of((10, 0)) == "sm_100a"
    assert dispatch.has_packed_fma("sm_100a") and not dispatch.has_packed_fma("sm_90a")
    with pytest.raises(ValueError):
        dispatch.arch_of((8, 0))


def _call(layer, step, **kw):
    import kda

    return kda.decode(
        step.x, layer.conv_weight, layer.conv_bias, layer.conv_state, step.f_a, step.beta,
        layer.a_log, layer.dt_bias, step.slots, layer.state, step.gate, layer.norm_weight,
        layer.f_b, lower_bound=kl.LOWER_BOUND, scale=kl.SCALE, eps=kl.EPS,
        accepted=step.accepted, **kw,
    )  # fmt: skip


def test_decode_rejects_bad_arguments_on_cpu():
    """ValueError before anything runs: CPU tensors, kernel names, gate modes."""
    layer = kt.make_layer(2, 8, seed=1)
    step = kt.make_step(2, 2, 2, pages=8, seed=2)
    state0 = layer.state.clone()
    with pytest.raises(ValueError, match="kernel"):
        _call(layer, step, kernel="bogus")
    with pytest.raises(ValueError, match="cluster"):
        _call(layer, step, kernel="split", cluster=16)
    for gate_mode in (2, 4):  # 2: the removed exact-for-every-value mode
        with pytest.raises(ValueError, match="gate_mode"):
            _call(layer, step, gate_mode=gate_mode)
    with pytest.raises(ValueError, match="CUDA"):
        _call(layer, step)
    assert torch.equal(layer.state, state0)


def test_recover_rejects_bad_arguments_on_cpu():
    """kda.recover: ValueError before anything runs (CPU state, then argument checks)."""
    import kda

    B, H, T = 2, 2, 3
    layer = kt.make_layer(H, 8, seed=1)
    step = kt.make_step(B, T, H, pages=8, seed=2)
    v = torch.zeros(B, H, T, 128)
    kg = torch.zeros(B, H, T, 256, dtype=torch.bfloat16)
    state0 = layer.state.clone()
    args = (step.slots, v, kg, layer.a_log, layer.dt_bias, step.accepted, step.accepted)
    with pytest.raises(ValueError, match="CUDA"):
        kda.recover(layer.state, *args, lower_bound=kl.LOWER_BOUND)
    assert torch.equal(layer.state, state0)


def test_default_gate_mode_is_the_exactly_rounded_one():
    """Every entry's default raw gate is mode 3 (bounded mma + exact recompute)."""
    import inspect

    from engine.layer import DecodeLayer
    from kda.decode import decode as ops_decode
    from kda.replay import replay_decode
    from kda.validate import check_options
    from launch import decode
    from launch.runner import Runner

    entries = [ops_decode, replay_decode, check_options, DecodeLayer, Runner]
    if importlib.util.find_spec("cutlass") is not None:
        from kda.kernels.replay import KdaReplay
        from kda.kernels.split import KdaSplit
        from kda.kernels.wide import KdaWide

        entries += [KdaWide, KdaSplit, KdaReplay]
    for entry in entries:
        assert inspect.signature(entry).parameters["gate_mode"].default == 3, entry
    assert decode.parse_args([]).gate_mode == 3
    assert dispatch.GATE_MODES == (0, 1, 3)


def test_replay_kernel_is_one_cta_per_item():
    for B, H, T, R in ((128, 96, 1, 8), (1, 1, 1, 2), (128, 96, 4, 16), (7, 3, 8, 8)):
        choice = dispatch.choose_replay(B, H, T, R, sms=132)
        assert choice.kernel == "wide" and choice.ctas == B * H, (B, H, T, R)
    assert "3 per SM" in dispatch.choose_replay(128, 96, 1, 8, sms=132).reason
    assert dispatch.choose_replay(128, 96, 1, 8, kernel="wide").kernel == "wide"
    for gone in ("stream", "split"):
        with pytest.raises(ValueError, match="kernel must be one of"):
            dispatch.choose_replay(128, 96, 1, 8, kernel=gone)
