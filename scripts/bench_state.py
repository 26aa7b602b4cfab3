"""Benchmark the state-management paths (docs/state.md) on one GPU, each against its floor
measured in the same run.

- ``copy_state``: ``DecodeLayer.copy_state`` (KdaCopy, one launch) of ``--slots`` pairs of a
  ``--heads``-head layer (fp32 pages, bf16 conv pages of window 10), per-step and replay
  (ring R copied), under a CUDA graph; bytes = read + written of every pool's pages; % of a
  device-to-device copy (``_common.copy_bandwidth``, bytes read + written). Beside it
  torch's per-pool ``index_copy_`` (the obvious alternative) and, for a replay slot, the
  other choice: ``fold`` + a copy of the pages without the ring.
- ``fold``: ``DecodeLayer.fold`` (KdaFold) of the same slots with full rings (R committed
  entries each; the counters restored inside the graph before each fold), against its
  bytes' floor: every page read and written, every held entry read, at the copy bandwidth.
- ``export`` / ``import``: ``export_state`` / ``import_state`` of the slots on a side stream
  (pinned blobs), timed with events, against one plain pinned device-to-host /
  host-to-device copy of the same bytes in the same run.

Targets: copy >= 85% of the copy bandwidth; export / import >= 80% of the link;
fold >= 80% of its floor. ``--json`` writes the rows with the command and date.

Usage: python scripts/bench_state.py [--heads 12] [--slots 256] [--ring 4 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys

import torch
from _common import copy_bandwidth, time_graph, write_json

import kda
from engine import DecodeLayer

WINDOW = 10


def make_layer(heads, pages, kda_state, ring_size=4):
    from kda import synthetic as kt

    shard = kt.make_layer(heads, pages, window=WINDOW, seed=1, device="cuda")
    ones = torch.ones(1024, dtype=torch.bfloat16, device="cuda")
    w_o = torch.zeros(1024, heads * 128, dtype=torch.bfloat16, device="cuda")
    norms = dict(norm=ones, query=ones, out_norm=ones)
    return DecodeLayer(shard, w_o, {}, rank=0, kda_state=kda_state, ring_size=ring_size, **norms)


def page_bytes(layer, ring=True):
    S = layer.shard
    pools = [S.state, S.conv_state] + (list(layer.ring) if ring and layer.ring is not None else [])
    return sum(p[0].numel() * p.element_size() for p in pools)


def fill_rings(layer, held):
    ring = layer.ring
    ring.v.normal_()
    ring.kg.copy_(torch.randn(ring.kg.shape, device="cuda").bfloat16())
    ring.length.zero_()
    ring.length[..., 0] = held


def event_us(fn, stream, reps=7):
    """Median time (us) of ``fn()`` queued on ``stream``, CUDA events around it."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def row(name, us, nbytes, floor_tbs, peer=None):
    tbs = nbytes / (us * 1e-6) / 1e12
    out = dict(name=name, us=us, bytes=nbytes, tbs=tbs, pct=100 * tbs / floor_tbs)
    if peer is not None:
        out["peer_us"] = peer
    return out


def bench_copy(heads, slots, sizes, copy_tbs):
    rows = []
    src = torch.arange(1, slots + 1, dtype=torch.int32, device="cuda")
    dst = src + slots
    pages = 2 * slots + 1
    for kda_state, size in [("per-step", 4)] + [("replay", r) for r in sizes]:
        layer = make_layer(heads, pages, kda_state, size)
        nbytes = 2 * slots * page_bytes(layer)
        us = time_graph(lambda layer=layer: layer.copy_state(src, dst), replays=9)
        pools = [layer.shard.state, layer.shard.conv_state] + list(layer.ring or ())
        s, d = src.long(), dst.long()

        def torch_copy(pools=pools, s=s, d=d):
            for p in pools:
                p.index_copy_(0, d, p.index_select(0, s))

        peer = time_graph(torch_copy, replays=9)
        name = f"copy_state {kda_state}" + (f" R{size}" if layer.ring is not None else "")
        rows.append(row(name, us, nbytes, copy_tbs, peer))
        if layer.ring is not None:  # the other choice for a replay slot: fold, then pages only
            fill_rings(layer, size)
            saved = layer.ring.length.clone()

            def fold_then_copy(layer=layer, saved=saved):
                layer.ring.length.copy_(saved)
                layer.fold(src)
                kda.copy_state(layer.shard.state, layer.shard.conv_state, src, dst)

            both = time_graph(fold_then_copy, replays=9)
            rows.append(row(f"fold + copy (no ring) R{size}", both, nbytes, copy_tbs))
    return rows


def bench_fold(heads, slots, sizes, copy_tbs):
    rows = []
    src = torch.arange(1, slots + 1, dtype=torch.int32, device="cuda")
    for size in sizes:
        layer = make_layer(heads, slots + 1, "replay", size)
        fill_rings(layer, size)
        saved = layer.ring.length.clone()
        entry = 128 * 4 + 256 * 2  # v_new fp32 + k | raw gate bf16 per head and entry
        per_item = 2 * 128 * 128 * 4 + size * entry + 2 * 2 * 4  # page r+w, entries, counters
        nbytes = slots * heads * per_item

        def fold(layer=layer, saved=saved):
            layer.ring.length.copy_(saved)
            layer.fold(src)

        us = time_graph(fold, replays=9)
        rows.append(row(f"fold R{size}", us, nbytes, copy_tbs))
    return rows


def link_us(nbytes, to_host, stream):
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def copy():
        with torch.cuda.stream(stream):
            (host if to_host else device).copy_(device if to_host else host, non_blocking=True)

    return event_us(copy, stream)


def bench_swap(heads, slots):
    rows = []
    stream = torch.cuda.Stream()
    index = torch.arange(1, slots + 1, dtype=torch.int32, device="cuda")
    for kda_state in ("per-step", "replay"):
        layer = make_layer(heads, slots + 1, kda_state)
        blob = layer.export_state(index, stream=stream)
        blob.ready.synchronize()
        nbytes = slots * page_bytes(layer)
        out_us = event_us(lambda L=layer, b=blob: L.export_state(index, b, stream=stream), stream)
        in_us = event_us(lambda L=layer, b=blob: L.import_state(index, b, stream=stream), stream)
        d2h, h2d = link_us(nbytes, True, stream), link_us(nbytes, False, stream)
        d2h_gbs, h2d_gbs = nbytes / d2h / 1e3, nbytes / h2d / 1e3
        for name, us, link, link_us_ in (
            ("export", out_us, d2h_gbs, d2h),
            ("import", in_us, h2d_gbs, h2d),
        ):
            r = row(f"{name} {kda_state}", us, nbytes, link / 1e3, link_us_)
            rows.append(r)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--ring", type=int, nargs="+", default=[4, 8])
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    copy_tbs = copy_bandwidth()
    print(f"device-to-device copy: {copy_tbs:.2f} TB/s (bytes read + written)")
    rows = bench_copy(a.heads, a.slots, a.ring, copy_tbs)
    rows += bench_fold(a.heads, a.slots, a.ring, copy_tbs)
    rows += bench_swap(a.heads, a.slots)
    print(f"{'row':32s} {'us':>9s} {'MB':>8s} {'TB/s':>7s} {'% floor':>8s} {'peer us':>9s}")
    for r in rows:
        peer = f"{r['peer_us']:9.1f}" if "peer_us" in r else f"{'-':>9s}"
        print(
            f"{r['name']:32s} {r['us']:9.1f} {r['bytes'] / 1e6:8.1f} {r['tbs']:7.3f} "
            f"{r['pct']:7.1f}% {peer}"
        )
    print(
        "floor: copy rows and fold against the device copy; export / import against a "
        "plain pinned copy of the same bytes (peer us)"
    )
    if a.json:
        write_json(
            a.json,
            dict(
                command=" ".join(sys.argv),
                date=str(datetime.date.today()),
                copy_tbs=copy_tbs,
                heads=a.heads,
                slots=a.slots,
                rows=rows,
            ),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
