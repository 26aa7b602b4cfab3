"""CPU tests of the MoE hint waiter and reader launches (``tpcomm.oproj.hints``): what the
compiled code reads of its runtime arguments, and the reader's address arithmetic over
``wait_hints``' real launch values, against the consumer's writes of the copies and hints.

The waiter once read ``rows`` from ``xmoe.shape[1]`` of a tensor compiled as a compact
``(reps, ?, HID)`` fake but passed as ``to_cute``'s fully dynamic ``(?, ?, ?)``: the
compiled code took the first dynamic slot of the runtime descriptor, ``reps``, so it read
``reps`` rows of each rank (on the H200: rank 0's first copy right, every other copy
never read). ``test_waiter_fakes_are_the_runtime_layouts`` fails on that code.
"""

from types import SimpleNamespace

import pytest
import torch
from compile_harness import require_dsl

from tpcomm.oproj.plan import WORD_ROW_BYTES, slicing


def layout_mismatch(fake, real) -> str:
    """Empty when a function compiled with ``fake`` reads ``real``'s descriptor as ``real``
    lays it out (same dynamic shape and stride modes, same static values); else why not."""
    if len(fake.shape) != len(real.shape):
        return f"rank {len(fake.shape)} != {len(real.shape)}"
    if tuple(fake.dynamic_shapes_mask) != tuple(real.dynamic_shapes_mask):
        return f"dynamic extents {fake.dynamic_shapes_mask} != {real.dynamic_shapes_mask}"
    if tuple(fake.dynamic_strides_mask) != tuple(real.dynamic_strides_mask):
        return f"dynamic strides {fake.dynamic_strides_mask} != {real.dynamic_strides_mask}"
    for what, dyn, f, r in (
        ("extent", fake.dynamic_shapes_mask, fake.shape, real.shape),
        ("stride", fake.dynamic_strides_mask, fake.stride, real.stride),
    ):
        for i, d in enumerate(dyn):
            if not d and int(f[i]) != int(r[i]):
                return f"static {what} {i}: {f[i]} != {r[i]}"
    return ""


def _comm(tp, rows, hid, reps, ranks=None):
    """The fields of an ``OprojAllReduce`` that ``launch_values`` reads, on the CPU."""
    ranks = tuple(range(tp)) if ranks is None else ranks
    hint_words = torch.zeros(max(ranks) + 1, WORD_ROW_BYTES // 4, dtype=torch.int32)
    return SimpleNamespace(xmoe_reps=reps, tokens=rows, hid=hid, tp=tp, device=torch.device("cpu"),
                           backend=SimpleNamespace(ranks=ranks), budget_ns=50_000_000,
                           hint_words=hint_words)  # fmt: skip


def _copies(tp, rows, hid, reps):
    bf = dict(dtype=torch.bfloat16)
    return torch.zeros(tp, reps, rows, hid, **bf), torch.zeros(tp, reps, rows, hid, **bf)


SHAPES = [(4, 16, 2048, 2), (8, 1, 1024, 1), (2, 3, 7168, 8)]  # tp, rows, hid, reps


@pytest.mark.parametrize("every_rank", [True, False])
@pytest.mark.parametrize("tp, rows, hid, reps", SHAPES)
def test_waiter_fakes_are_the_runtime_layouts(every_rank, tp, rows, hid, reps):
    """Every tensor ``wait_hints`` passes has the layout the waiter and the reader were
    compiled for."""
    require_dsl()
    from tpcomm.cuteutil import to_cute
    from tpcomm.oproj.hints import fake_arguments, fake_waiter_arguments, launch_values

    comm = _comm(tp, rows, hid, reps)
    xmoes, dests = _copies(tp, rows, hid, reps)
    kw = dict(every_rank=True) if every_rank else dict(rank=1)
    x, d = (xmoes, dests) if every_rank else (xmoes[1], dests[1])
    _, x, d, hint_row, *_ = launch_values(comm, x, d, **kw)
    fakes = fake_arguments(hid, reps)
    real = (to_cute(x), to_cute(d), to_cute(hint_row, 4))
    for i, (fake, runtime) in enumerate(zip(fakes[:3], real, strict=True)):
        assert layout_mismatch(fake, runtime) == "", (i, layout_mismatch(fake, runtime))
    assert layout_mismatch(fake_waiter_arguments()[0], real[2]) == ""  # the waiter's hint row


def test_layout_mismatch_sees_the_old_waiter_fake():
    """The check fails on the fake the waiter was first compiled with (compact ``(reps, ?,
    HID)``), whose one dynamic extent the runtime descriptor keeps in its ``reps`` slot."""
    cute = require_dsl()
    from cutlass import BFloat16

    from tpcomm.cuteutil import fake_tensor, to_cute

    old = fake_tensor(BFloat16, (2, cute.sym_int(), 2048))
    real = to_cute(torch.zeros(2, 16, 2048, dtype=torch.bfloat16))
    assert "dynamic extents" in layout_mismatch(old, real)


def _reader_reads(ranks, x, d, hint_row, rows, reps, hid, ctas):
    """The reader's arithmetic (``HintReader.kernel``) over its launch values: per grid z,
    the hint row (the waiter's: it acquires word 0), the error word the reader checks and
    the 16-byte groups it copies (source, destination byte addresses)."""
    from tpcomm.oproj.hints import READER_THREADS, UNROLL

    per_rank = rows * reps * hid * 2
    groups = rows * (reps * hid // 8)
    stride = ctas * READER_THREADS
    out = []
    for r in range(ranks):
        a_x, a_d = x.data_ptr() + r * per_rank, d.data_ptr() + r * per_rank
        a_h = hint_row.data_ptr() + r * WORD_ROW_BYTES
        seen = []
        for cta in range(ctas):
            for tid in range(READER_THREADS):
                for g0 in range(cta * READER_THREADS + tid, groups, stride * UNROLL):
                    seen.extend(g for g in range(g0, g0 + UNROLL * stride, stride) if g < groups)
        assert sorted(seen) == list(range(groups)), "grid-stride loop: each group once"
        out.append((a_h, a_h + 8, {a_x + 16 * g for g in seen}, {a_d + 16 * g for g in seen}))
    return out


def _consumer_writes(x_rank0, hints_rank0, r, rows, hid, reps):
    """``OprojConsumerKernel`` (one launch, ``ranks`` = TP) for grid z = ``r``: the hint
    word it increments (once per CTA) and the 16-byte groups of the copies it writes
    (every CTA, lead thread, copy), per its address arithmetic."""
    per_rank = rows * hid * 2
    a_x = x_rank0.data_ptr() + r * reps * per_rank
    writes = set()
    cut = slicing(hid)
    for token in range(rows):
        for cta in range(cut.ctas):
            for tid in range(cut.threads):
                row_bytes = token * hid * 2 + (cta * cut.columns + tid * 8) * 2
                for rep in range(reps):
                    writes.add(a_x + rep * rows * hid * 2 + row_bytes)
    return hints_rank0.data_ptr() + r * WORD_ROW_BYTES, writes


@pytest.mark.parametrize(
    "tp, rows, hid, reps", [(4, 16, 2048, 2), (8, 3, 1024, 3), (2, 5, 2304, 2)]
)
@pytest.mark.parametrize("ctas", [1, 3, None])
def test_reader_reads_every_copy_the_consumer_writes(tp, rows, hid, reps, ctas):
    """Over ``wait_hints``' launch values, one launch for every rank and one per rank: the
    waiter of rank r acquires the word rank r's consumer increments, the reader reads
    exactly the groups that consumer writes (all reps x rows x HID of rank r, nothing else)
    into the same place of ``dests``, with the consumer's quota (one increment per CTA),
    whatever its CTAs per rank. (The launcher's failing eager run: TP 4, 16 rows, HID 2048,
    2 copies.)"""
    require_dsl()
    from tpcomm.oproj.hints import hint_quota, launch_values, reader_ctas

    comm = _comm(tp, rows, hid, reps)
    xmoes, dests = _copies(tp, rows, hid, reps)
    launches = [(0, launch_values(comm, xmoes, dests, every_rank=True))]
    launches += [(r, launch_values(comm, xmoes[r], dests[r], rank=r)) for r in range(tp)]
    for first, (ranks, x, d, hint_row, n, quota, budget) in launches:
        assert (n, quota, budget) == (rows, hint_quota(hid, rows), comm.budget_ns)
        assert quota == slicing(hid).ctas * rows  # consumer CTAs: one release increment each
        k = reader_ctas(n, reps, hid, ranks, 132) if ctas is None else ctas
        reads = _reader_reads(ranks, x, d, hint_row, n, reps, hid, k)
        for z, (a_h, a_err, src, dst) in enumerate(reads):
            r = first + z
            word, writes = _consumer_writes(xmoes[0], comm.hint_words[0], r, rows, hid, reps)
            assert a_h == word == comm.hint_words[r].data_ptr(), (first, z)
            assert a_err == comm.hint_words[r, 2:].data_ptr()
            assert src == writes, (first, z, len(src), len(writes))
            lo = xmoes[r].data_ptr()
            assert min(src) == lo and max(src) + 16 == lo + xmoes[r].nbytes
            offset = dests[r].data_ptr() - lo
            assert dst == {a + offset for a in src}


def test_launch_values_refuse_bad_input():
    require_dsl()
    from tpcomm.oproj.hints import launch_values

    comm = _comm(4, 16, 2048, 2)
    xmoes, dests = _copies(4, 16, 2048, 2)
    with pytest.raises(ValueError, match="xmoes"):
        launch_values(comm, xmoes[:, :1], dests, every_rank=True)
    with pytest.raises(ValueError, match="dests"):
        launch_values(comm, xmoes[0], dests[0, :1], rank=0)
    with pytest.raises(ValueError, match="rank 7"):
        launch_values(comm, xmoes[0], dests[0], rank=7)
    with pytest.raises(ValueError, match="budget_ns"):
        launch_values(comm, xmoes, dests, every_rank=True, budget_ns=0)
    with pytest.raises(ValueError, match="every_rank"):
        launch_values(_comm(4, 16, 2048, 2, ranks=(1, 2)), xmoes, dests, every_rank=True)
    with pytest.raises(ValueError, match="xmoe_reps"):
        launch_values(_comm(4, 16, 2048, 0), xmoes, dests, every_rank=True)
