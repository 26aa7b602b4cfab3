"""CPU checks of ``scripts/probe_rows.py`` (a value row per thread): its page copies land
every chunk of a page once, swizzled as its row reads expect; its reference is the
reference's recurrence; it compiles for sm_90a and sm_100a, and on sm_90a without spills,
at T = 1 with whole pages and direct stores within the 232 registers a state warpgroup could
take beside two 128-register ones (``setmaxnreg``)."""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch
from compile_harness import ARCHS, ptxas_sm90a, require_dsl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))

import probe_rows  # noqa: E402


@pytest.mark.parametrize("parts", [1, 2, 4])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_page_copies_cover_the_page_swizzled(dtype, parts):
    kernel = probe_rows.RowState(dtype, 1, 2, 132, parts=parts)
    assert kernel.unit * parts == kernel.page and kernel.threads * parts == 128
    assert [kernel.split(u) for u in range(2 * parts)] == [
        (u // parts, u % parts) for u in range(2 * parts)
    ]
    places = set()
    for tid in range(kernel.threads):
        for j, shared in kernel.page_chunks(0, tid):
            row, col = divmod(j * kernel.threads + tid, kernel.chunks)
            # where the row's reader (load_row: chunk col at col ^ (row % chunks)) looks
            assert shared == row * kernel.row + (col ^ (row % kernel.chunks)) * 16
            places.add(shared)
    assert places == {16 * c for c in range(kernel.unit // 16)}
    # a warp's row reads of one chunk index touch eight distinct 16-byte bank groups per
    # quarter (conflict-free)
    for j in range(kernel.chunks):
        for quarter in range(4):
            rows = range(8 * quarter, 8 * quarter + 8)
            banks = {((r * kernel.row + ((r % kernel.chunks) ^ j) * 16) // 16) % 8 for r in rows}
            assert len(banks) == 8


def test_reference_is_the_recurrence():
    """Two tokens of the probe's reference against the recurrence written out in float64."""
    vectors = probe_rows.make_vectors(2, "cpu")[:3]
    pages = 0.05 * torch.randn(3, 128, 128, generator=torch.Generator().manual_seed(1))
    S, o = probe_rows.reference(pages, vectors)
    D = pages.double()
    for t in range(2):
        q, k, v, decay, beta = vectors[:, t].double().unbind(1)
        D = D * decay[:, None, :]
        v_new = (v - (D @ k[..., None])[..., 0]) * beta[:, :1]
        D = D + k[:, None, :] * v_new[..., None]
        torch.testing.assert_close(o[:, t].double(), (D @ q[..., None])[..., 0], rtol=0, atol=1e-6)
    torch.testing.assert_close(S.double(), D, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="stages"):
        probe_rows.RowState("fp32", 1, 4, 132)  # four 66.5 KB stages do not fit
    with pytest.raises(ValueError, match="store"):
        probe_rows.RowState("fp32", 1, 2, 132, store="bulk")


@pytest.mark.compile
@pytest.mark.parametrize(
    "config",
    [
        "fp32:1:2:1:direct",
        "fp32:1:2:1:staged",
        "bf16:1:4:1:direct",
        "bf16:4:4:1:direct",
        "fp32:1:3:2:direct:2",
        "bf16:1:4:2:direct:2",
    ],
)
def test_probe_compiles(config, tmp_path):
    require_dsl()
    dtype, tokens, stages, per_sm, store, parts = probe_rows.parse_config(config)
    for arch in ARCHS:
        kernel = probe_rows.RowState(dtype, tokens, stages, 132, per_sm, store, arch, parts)
        options = f"--keep-ptx --dump-dir {tmp_path}"
        compiled = probe_rows.compile_probe(kernel, None, arch, options)
        if arch != "sm_90a":
            continue
        report = ptxas_sm90a(compiled.__ptx__, tmp_path / "probe.ptx")
        registers = max(int(r) for r in re.findall(r"Used (\d+) registers", report))
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
        assert spills and all(st == ld == "0" for st, ld in spills), report
        # T = 1, whole pages, direct: what a 384-thread KdaPipe's state warpgroup would run
        if (tokens, parts, store) == (1, 1, "direct"):
            assert registers <= 232, report
