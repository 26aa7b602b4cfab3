"""What the GPU tests share when ``pytest -n N`` runs N of them on one GPU at a time.

The GPU then time-slices between the workers' contexts: a kernel that spins on a flag can
be switched out for several slices while its peer is already done, so a poll budget that
is ample alone expires under load. ``poll_budget_ns`` scales a budget by the number of
workers sharing the GPU; tests that check how fast a dead peer is named scale their bound
with it.
"""

from __future__ import annotations

import os


def workers() -> int:
    """The pytest-xdist workers sharing this GPU (1 without xdist)."""
    return max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


def poll_budget_ns(ns: int) -> int:
    """``ns`` (a budget measured on an unshared GPU) for a GPU shared by ``workers()``."""
    return ns * workers()
