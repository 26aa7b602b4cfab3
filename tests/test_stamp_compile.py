"""CPU compile tests: the trace stamp kernel (``tpcomm.stamp``) for sm_90a and sm_100a, and
its host entry's refusals (before any launch)."""

import pytest
import torch
from compile_harness import ARCHS, require_dsl

pytestmark = pytest.mark.compile


@pytest.mark.parametrize("arch", ARCHS)
def test_stamp_compiles(arch, tmp_path):
    cute = require_dsl()
    from tpcomm.stamp import StampKernel, fake_arguments

    options = f"--gpu-arch {arch} --keep-ptx --dump-dir {tmp_path}"
    text = cute.compile(StampKernel(), *fake_arguments(), options=options).__ptx__
    assert ".reqntid 1, 1, 1" in text
    clock = text.index("mov.u64") if "mov.u64" in text else -1
    assert clock >= 0 and "%globaltimer" in text[clock : clock + 40], "no globaltimer read"
    # the clock is read before the cursor is loaded or anything is stored
    assert clock < text.index("ld.global") < text.index("st.global.b64")
    assert "griddepcontrol" not in text  # ordered by its stream, never PDL


def test_stamp_compiled_once():
    require_dsl()
    from tpcomm.stamp import compiled

    assert compiled("sm_90a") is compiled("sm_90a")


def test_stamp_refusals():
    """Each argument refused by name before any launch (CPU tensors reach every check; the
    device check comes last)."""
    require_dsl()
    from tpcomm.stamp import stamp

    trace = torch.zeros(2, 3, 6, dtype=torch.int64)
    cursor = torch.zeros(2, dtype=torch.int32)
    cases = [
        (dict(trace=trace.float()), "trace must be an int64"),
        (dict(trace=trace[0]), "trace must be an int64"),
        (dict(cursor=cursor[:1]), "cursor must be an int32 \\[2\\] tensor on cpu"),
        (dict(cursor=cursor.long()), "cursor must be an int32"),
        (dict(cursor=[0, 0]), "cursor must be an int32"),
        (dict(slot=6), "slot must be in 0..5; got 6"),
        (dict(slot=-1), "slot must be in 0..5; got -1"),
        (dict(first=1, count=2), "first, count must pick lanes of 0..1; got 1, 2"),
        (dict(count=0), "first, count must pick lanes"),
        (dict(first=-1), "first, count must pick lanes"),
        (dict(), "trace and cursor must be contiguous CUDA tensors; got cpu"),
    ]
    for override, message in cases:
        kwargs = dict(trace=trace, cursor=cursor, slot=0) | override
        with pytest.raises(ValueError, match=message):
            stamp(**kwargs)
    assert not trace.any() and not cursor.any()
