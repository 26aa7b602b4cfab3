"""KdaPipe's gate batches at T <= 4 (``kda.kernels.pipe_prep``), in plain Python: the prep
loop starts a batch at its range's first item, every ``GATE_COLUMNS // T`` items and at
every head's first item; ``batch_size`` items from there share one mma tile (column j:
token j % T of item n + j // T) and the item's decays are rows ``place * T + t`` of it.
Over every CTA's range: each item lies in the batch started ``place`` items before it, a
batch never crosses a head or the range's end nor exceeds the tile's eight token columns,
and the rows prefetched for the next batch (``batch_follower``) are the next batch's first
request's."""

from __future__ import annotations

import pytest
from compile_harness import require_dsl

pytestmark = pytest.mark.compile


@pytest.mark.parametrize("tokens", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "heads,requests,ctas",
    [(1, 1, 1), (2, 1, 8), (3, 5, 4), (6, 7, 132), (12, 130, 132), (96, 33, 132), (6, 9, 2)],
)
def test_batches_cover_each_item_once_within_a_head(monkeypatch, tokens, heads, requests, ctas):
    require_dsl()
    import cutlass

    from kda.kernels import pipe_prep

    monkeypatch.setattr(cutlass, "select_", lambda c, a, b: a if c else b)
    monkeypatch.setattr(pipe_prep, "Int32", int)
    total = heads * requests
    items = pipe_prep.GATE_COLUMNS // tokens
    for cta in range(ctas):
        first, end = cta * total // ctas, (cta + 1) * total // ctas
        count = end - first
        place, start_n, size, prefetched = items, None, 0, None
        for n in range(count):
            head, request = divmod(first + n, requests)
            if place == items or request == 0:  # the prep loop's start
                if start_n is not None:  # the previous batch ended exactly here
                    assert n == start_n + size
                    assert prefetched == request  # its rows were the prefetched ones
                place, start_n = 0, n
                size = pipe_prep.batch_size(n, count, request, requests, items)
                assert size >= 1 and size * tokens <= pipe_prep.GATE_COLUMNS
                assert divmod(first + n + size - 1, requests)[0] == head  # one head
                assert n + size <= count
                prefetched = None
                if n + size < count:
                    prefetched = pipe_prep.batch_follower(request, size, requests)
            assert place < size and n == start_n + place
            place += 1
        if count:
            assert start_n + size == count  # the last batch ends with the range
