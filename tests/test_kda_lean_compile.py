"""CPU compile checks of the two-kernel "lean" path (KdaPrepare + KdaLean) for sm_90a and
sm_100a, and a ptxas register / spill report (sm_90a) where ptxas is on PATH."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
from compile_harness import ARCHS, compile_for, fake_stream, fake_tensor, require_dsl
from test_kda_compile import fake_args

pytestmark = pytest.mark.compile

B = 3


def prepare_args(heads, tokens, *, record=False, has_bias=True, conv_dim_first=True, window=None):
    """Fake tensors in KdaPrepare's argument order (with the stream)."""
    require_dsl()
    from cutlass import Float32

    from kda.prepass import SCRATCH_WIDTH

    wide = fake_args(
        heads, tokens, record=record, has_bias=has_bias, conv_dim_first=conv_dim_first,
        window=window,
    )  # fmt: skip
    x, cw, cb, cs, fa, beta, a_log, dt, slots, _state, _out, gate, _nw = wide[:13]
    lower_bound, scale, _eps, f_b, accepted, _v, kg, stream = wide[13:]
    scratch = fake_tensor(Float32, (B, tokens, heads, SCRATCH_WIDTH))
    return [x, cw, cb, cs, fa, beta, a_log, dt, slots, gate, lower_bound, scale, f_b,
            accepted, kg, scratch, stream]  # fmt: skip


def lean_args(heads, tokens, *, record=False):
    """Fake tensors in KdaLean's argument order (with the stream)."""
    require_dsl()
    from cutlass import Float32

    from kda.prepass import SCRATCH_WIDTH

    wide = fake_args(heads, tokens, record=record)
    slots, state, output, nw = wide[8], wide[9], wide[10], wide[12]
    eps, accepted, v_records = wide[15], wide[17], wide[18]
    scratch = fake_tensor(Float32, (B, tokens, heads, SCRATCH_WIDTH))
    return [slots, accepted, state, output, nw, eps, v_records, scratch, fake_stream()]


PREPARE_CASES = [
    # heads, tokens, record, gate_mode, has_bias, conv_dim_first, window, pdl
    (2, 1, False, 0, True, True, 3, False),
    (3, 4, False, 1, False, False, 8, True),
    (2, 8, True, 2, True, False, 10, False),
    (2, 4, True, 0, False, True, 6, True),
    (3, 1, False, 2, False, False, 3, True),
    (2, 8, False, 1, True, True, 11, False),
]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", PREPARE_CASES, ids=lambda c: "H{}T{}r{}g{}b{}d{}W{}p{}".format(*c))
def test_prepare_compiles(arch, case):
    require_dsl()
    from kda.prepass import KdaPrepare

    heads, tokens, record, gate_mode, has_bias, dim_first, window, pdl = case
    kernel = KdaPrepare(heads, tokens, record, gate_mode, has_bias, arch=arch, pdl=pdl)
    args = prepare_args(
        heads, tokens, record=record, has_bias=has_bias, conv_dim_first=dim_first, window=window
    )
    assert compile_for(arch, kernel, *args) is not None


LEAN_CASES = [
    # heads, tokens, record, ctas
    (2, 1, False, 4),
    (3, 4, False, 5),
    (2, 4, True, 2),
    (2, 8, False, 3),
    (3, 8, True, 7),
    (2, 2, False, 1),
]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", LEAN_CASES, ids=lambda c: "H{}T{}r{}c{}".format(*c))
def test_lean_compiles(arch, case):
    require_dsl()
    from kda.lean import KdaLean

    heads, tokens, record, ctas = case
    kernel = KdaLean(heads, tokens, record, ctas, arch=arch)
    assert compile_for(arch, kernel, *lean_args(heads, tokens, record=record)) is not None


def test_lean_config_errors():
    require_dsl()
    from kda.lean import KdaLean
    from kda.prepass import KdaPrepare

    with pytest.raises(ValueError, match="ctas"):
        KdaLean(2, 1, False, 0)
    with pytest.raises(ValueError, match="ctas_per_sm"):
        KdaLean(2, 1, False, 4, ctas_per_sm=4)
    with pytest.raises(ValueError, match="record"):
        KdaLean(2, 1, True, 4)
    with pytest.raises(ValueError, match="tokens"):
        KdaPrepare(2, 9)


def test_lean_occupancy_plan():
    from kda import dispatch

    assert dispatch.lean_ctas_per_sm(1, three=True) == 3  # shared memory fits at T = 1
    assert all(dispatch.lean_ctas_per_sm(t, three=True) == 2 for t in range(2, 9))
    assert dispatch.lean_ctas_per_sm(1) == (3 if dispatch.LEAN_THREE_PER_SM else 2)
    assert 2 * (dispatch.lean_smem_bytes(8) + 1024) <= dispatch.LEAN_SMEM_PER_SM
    choice = dispatch.choose(128, 96, 1, sms=132, kernel="lean")
    assert choice.kernel == "lean" and choice.ctas == dispatch.lean_ctas_per_sm(1) * 132
    assert dispatch.choose(2, 3, 4, sms=132, kernel="lean").ctas == 6  # no more than items
    assert dispatch.choose(128, 96, 1, sms=132).kernel == "stream"  # lean is never auto


def ptxas_report(kernel, args, tmp_path, arch="sm_90a"):
    """(registers, spill store bytes, spill load bytes, PTX text) from ``ptxas -v``."""
    import cutlass.cute as cute

    options = f"--gpu-arch {arch} --keep-ptx --dump-dir {tmp_path}"
    text = cute.compile(kernel, *args, options=options).__ptx__
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("no ptxas on PATH for the register / spill report")
    source = tmp_path / "kernel.ptx"
    source.write_text(text)
    result = subprocess.run(
        [ptxas, f"-arch={arch}", "-v", str(source), "-o", os.devnull],
        capture_output=True,
        text=True,
        check=True,
    )
    registers = [int(r) for r in re.findall(r"Used (\d+) registers", result.stderr)]
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", result.stderr)
    assert registers and spills, result.stderr
    return max(registers), max(int(s[0]) for s in spills), max(int(s[1]) for s in spills), text


REPORT_CASES = ["prepare-T1", "prepare-T8-record", "lean-T1", "lean-T4", "lean-T8-record"]


@pytest.mark.parametrize("which", REPORT_CASES)
def test_static_resources(which, tmp_path, capsys):
    """ptxas (sm_90a): Lean fits its CTAs per SM without spilling; prints the figures."""
    require_dsl()
    from kda import dispatch
    from kda.lean import KdaLean
    from kda.prepass import KdaPrepare

    tokens = int(re.search(r"T(\d)", which).group(1))
    record = which.endswith("record")
    if which.startswith("prepare"):
        kernel = KdaPrepare(6, tokens, record, 0, True)
        args = prepare_args(6, tokens, record=record)
    else:
        kernel = KdaLean(6, tokens, record, 8)
        args = lean_args(6, tokens, record=record)
    registers, stores, loads, text = ptxas_report(kernel, args, tmp_path)
    with capsys.disabled():
        print(f"\n  {which}: {registers} registers, spill {stores} B stores / {loads} B loads")
    if which.startswith("lean"):
        assert registers <= 65536 // (256 * dispatch.lean_ctas_per_sm(tokens))
        # Three barriers per item (two CTA-wide, one among the 128 output threads).
        assert text.count("bar.sync") + text.count("barrier.sync") == 3
        if tokens == 1:  # the decode kernel: no local memory at two CTAs per SM
            assert (stores, loads) == (0, 0)
