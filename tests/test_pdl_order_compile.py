"""CPU PTX checks of every PDL kernel's contract: each global load of an operand that the
kernel right before may write is reached only through ``griddepcontrol.wait`` (on every
path of the control-flow graph, ``ptx_order.loads_before_wait``).

The contracts (module docstrings): the KDA decode kernels read the state and conv pages,
slots, ``accepted`` and weights before the wait, x, f_a, beta and gate after it;
KdaRecover reads everything after it; the o-proj producer reads ``attn_out`` after it, the
publisher its partial; the fused kernel ``attn_out``, the mailbox and ``prefix`` after it.
"""

from __future__ import annotations

import pytest
from compile_harness import require_dsl
from ptx_order import loads_before_wait

pytestmark = pytest.mark.compile

KDA_AFTER_WAIT = ("x", "f_a", "beta", "gate")


def _ptx(kernel, args, tmp_path):
    cute = require_dsl()
    tmp_path.mkdir(parents=True, exist_ok=True)
    options = f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}"
    return cute.compile(kernel, *args, options=options).__ptx__


def _check(text, names, after_wait):
    """``names``: the kernel's parameters in order; ``after_wait``: those that must be read
    only after the wait (each read at least once, so the check is not vacuous)."""
    assert "griddepcontrol.wait" in text
    early, read = loads_before_wait(text)
    index = {n: i for i, n in enumerate(names)}
    for name in after_wait:
        assert index[name] in read, f"{name}: no load found (the check would be vacuous)"
    bad = sorted(n for n in after_wait if index[n] in early)
    assert not bad, f"read on a path without griddepcontrol.wait: {bad}"
    return {names[i] for i in early}


def _kda_names():
    from kda.operands import KernelOperands

    return KernelOperands._fields


KDA_CASES = [  # kernel, heads, tokens, record, gate_mode, has_bias, dim_first
    ("wide", 2, 1, False, 3, True, True),
    ("wide", 3, 3, True, 0, False, True),
    ("wide", 2, 4, False, 1, True, True),
    ("stream", 2, 1, False, 3, True, True),
    ("stream", 2, 3, True, 0, False, False),
    ("split", 2, 1, False, 3, True, True),
    ("split", 3, 2, True, 1, False, False),
    ("wide", 2, 2, True, 3, True, True),
    ("stream", 2, 1, False, 3, True, False),
    ("split", 2, 3, False, 3, True, True),
    ("pipe", 2, 1, False, 3, True, True),
    ("pipe", 3, 3, False, 0, False, False),
]


@pytest.mark.parametrize("case", KDA_CASES, ids=lambda c: "{}-H{}T{}r{}g{}b{}d{}".format(*c))
def test_kda_reads_step_inputs_after_the_wait(tmp_path, case):
    require_dsl()
    from test_kda_compile import fake_args

    kernel_name, heads, tokens, record, gate_mode, has_bias, dim_first = case
    window = tokens + 3
    if kernel_name == "wide":
        from kda.kernels.wide import KdaWide

        kernel = KdaWide(heads, tokens, record, gate_mode, has_bias, 0, pdl=True)
    elif kernel_name == "pipe":
        from kda.kernels.pipe import KdaPipe

        kernel = KdaPipe(heads, tokens, gate_mode, has_bias, dim_first, window, ctas=8, pdl=True)
    elif kernel_name == "stream":
        from kda.kernels.stream import KdaStream

        kernel = KdaStream(heads, tokens, record, gate_mode, has_bias, dim_first, window,
                           ctas=8, pdl=True)  # fmt: skip
    else:
        from kda.kernels.split import KdaSplit

        kernel = KdaSplit(heads, tokens, record, gate_mode, has_bias, 2, pdl=True)
    args = fake_args(heads, tokens, record=record, has_bias=has_bias, conv_dim_first=dim_first,
                     window=window)  # fmt: skip
    early = _check(_ptx(kernel, args, tmp_path), _kda_names(), KDA_AFTER_WAIT)
    # what the contract lets them read early, they do (the state page is staged early)
    assert "state" in early


def test_recover_reads_everything_after_the_wait(tmp_path):
    require_dsl()
    from test_kda_recover_compile import recover_args

    from kda.kernels.recover import KdaRecover
    from kda.operands import RecoverKernelOperands

    names = RecoverKernelOperands._fields
    text = _ptx(KdaRecover(3, 4, pdl=True), recover_args(3, 4), tmp_path)
    tensors = [n for n in names if n != "lower_bound"]
    assert _check(text, names, tensors) == set()


@pytest.mark.parametrize("twoshot", [False, True])
def test_producer_reads_attn_out_after_the_wait(tmp_path, twoshot):
    require_dsl()
    from tpcomm.oproj.kernels.producer import OprojProducer, fake_producer_arguments

    names = ("attn", "w", "peers", "multicast_base", "tokens", "rank", "step")
    kernel = OprojProducer(8, 2048, 512, pdl=True, twoshot=twoshot)
    _check(_ptx(kernel, fake_producer_arguments(8, 2048, 512), tmp_path), names, ("attn",))


def test_one_launch_producer_and_publisher_read_after_the_wait(tmp_path):
    require_dsl()
    from tpcomm.oproj.kernels.producer import (
        OprojProducer,
        PartialPublisher,
        fake_producer_arguments,
        fake_publisher_arguments,
    )

    names = ("attn", "w", "peers", "multicast_base", "tokens", "rank", "step")
    kernel = OprojProducer(4, 1024, 256, pdl=True, ranks=4)
    _check(_ptx(kernel, fake_producer_arguments(4, 1024, 256), tmp_path / "p"), names,
           ("attn",))  # fmt: skip
    names = ("partial", "peers", "multicast_base", "tokens", "rank", "step")
    for ranks in (1, 4):
        kernel = PartialPublisher(4, 1024, pdl=True, ranks=ranks)
        text = _ptx(kernel, fake_publisher_arguments(4, 1024), tmp_path / f"q{ranks}")
        _check(text, names, ("partial",))


def test_fused_reads_attn_mailbox_and_prefix_after_the_wait(tmp_path):
    require_dsl()
    from tpcomm.oproj.kernels.fused import OprojFused, fake_fused_arguments

    names = ("attn", "w", "peers", "multicast_base", "mailbox", "prefix", "blocks", "norm",
             "query", "out_norm")  # fmt: skip
    kernel = OprojFused(8, 2048, 3, 512, groups=2, pdl=True)
    text = _ptx(kernel, fake_fused_arguments(8, 2048, 3, 512), tmp_path)
    early = _check(text, names, ("attn", "mailbox", "prefix"))
    assert "blocks" in early  # the snapshots are prefetched before the wait


def test_the_check_sees_a_missing_wait(tmp_path):
    """The same analysis on KdaWide's PTX with its waits deleted: every input is early."""
    require_dsl()
    from test_kda_compile import fake_args

    from kda.kernels.wide import KdaWide

    text = _ptx(KdaWide(2, 1, False, 3, True, 0, pdl=True), fake_args(2, 1), tmp_path)
    early, _ = loads_before_wait(text.replace("griddepcontrol.wait;", ""))
    index = {n: i for i, n in enumerate(_kda_names())}
    assert {index[n] for n in KDA_AFTER_WAIT} <= early


def test_predecessor_releases_before_it_spins_and_writes(tmp_path):
    """The test predecessor (tests/pdl_predecessor.py): launch_dependents first, then the
    globaltimer spin, then its loads and stores; it never waits itself."""
    require_dsl()
    from pdl_predecessor import PredecessorKernel, fake_arguments

    lines = _ptx(PredecessorKernel(4), fake_arguments(4), tmp_path).splitlines()

    def first(needle):
        return next(i for i, x in enumerate(lines) if needle in x)

    assert first("griddepcontrol.launch_dependents") < first("%globaltimer") < first("ld.global")
    assert first("ld.global") < first("st.global")
    assert not any("griddepcontrol.wait" in x for x in lines)
