"""KdaPipe's item indices: no division by the runtime ``requests`` per item.

Compiled as the launcher compiles it (every batch extent dynamic, ``to_cute``'s views;
``fake_args``' static extents fold ``// requests`` into multiplies), KdaPipe's sm_90a PTX
held 19 ``div`` / ``rem`` instructions with fp32 pages at T = 1 (8 ``div.s32``, 11
``rem.s32``; 23 with bf16 pages' four stages at T = 2), most on the per-item paths of the
two loops. Each group now divides once, for its range's first item, and steps (head,
request) pairs (``kda.kernels.pipe_index``): 2 ``div.s32``, no ``rem``. The stepping itself
is checked in plain Python against ``divmod`` over every CTA's range."""

from __future__ import annotations

import re

import pytest
from compile_harness import require_dsl
from test_kda_compile import dynamic_args

pytestmark = pytest.mark.compile

DIVISIONS = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:div|rem)\.[su](?:32|64)\b", re.M)


CASES = {
    # state dtype, tokens, gate mode, has_bias, conv_dim_first, window
    "fp32-T1": ("fp32", 1, 3, True, True, 3),
    "bf16-T2": ("bf16", 2, 0, False, False, 5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pipe_divides_once_per_group(case, tmp_path):
    cute = require_dsl()
    from kda.kernels.pipe import KdaPipe

    dtype, tokens, gate_mode, has_bias, dim_first, window = CASES[case]
    kernel = KdaPipe(6, tokens, gate_mode, has_bias, dim_first, window, 8, state_dtype=dtype)
    args = dynamic_args(
        6, tokens, dtype, has_bias=has_bias, conv_dim_first=dim_first, window=window
    )
    options = f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}"
    ptx = cute.compile(kernel, *args, options=options).__ptx__
    found = DIVISIONS.findall(ptx)
    assert re.search(r"div\.s32\s", ptx), "no runtime division at all: extents not dynamic?"
    assert len(found) <= 2, found


def test_stepped_pairs_match_divmod(monkeypatch):
    """``first_item`` then ``next_item`` (1 to 5 steps at a time) over each CTA's range
    give ``divmod(item, requests)`` for every item in it and the items past it."""
    require_dsl()
    import cutlass

    from kda.kernels import pipe_index

    monkeypatch.setattr(cutlass, "select_", lambda c, a, b: a if c else b)
    monkeypatch.setattr(pipe_index, "Int32", int)
    for heads, requests, ctas in [(1, 1, 1), (2, 1, 8), (3, 5, 4), (6, 7, 132), (96, 33, 132)]:
        total = heads * requests
        for cta in range(ctas):
            first, end = cta * total // ctas, (cta + 1) * total // ctas
            count, head, request = pipe_index.first_item(first, end, requests)
            assert count == end - first
            for n in range(count + 3):
                assert (head, request) == divmod(first + n, requests)
                for steps in range(1, 6):
                    stepped = pipe_index.next_item(head, request, requests, steps)
                    assert stepped == divmod(first + n + steps, requests)
                head, request = pipe_index.next_item(head, request, requests)
