"""KdaPipe's item indices without a division per item: item = head * requests + request
(``requests`` a runtime value, each ``//`` or ``%`` by it some 20-30 SASS instructions).
Each group divides once, for its range's first item; its loops count items from 0 and
step (head, request) pairs with ``next_item``."""

from __future__ import annotations

import cutlass
from cutlass import Int32


def first_item(first, end, requests):
    """(the count of items in [first, end), head, request of ``first``): one division."""
    head = first // requests
    return end - first, head, first - head * requests


def next_item(head, request, requests, steps=1):
    """(head, request) of the item ``steps`` (a trace-time int) after (head, request):
    ``steps`` compares and selects, no division."""
    for _ in range(steps):
        wrap = request + 1 == requests
        head, request = (
            cutlass.select_(wrap, head + 1, head),
            cutlass.select_(wrap, Int32(0), request + 1),
        )
    return head, request
