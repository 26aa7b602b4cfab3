"""Benchmark the fused KDA decode step against fla's kernels on one GPU.

For H in {6, 12, 96}, B in {1, 8, 32, 128}, T in {1, 4}: our kernel (``kda.decode``,
the dispatcher's choice, and each kernel forced) under CUDA graphs, and in the same run
the peers: fla's ``fused_recurrent_kda`` (recurrence only: in-kernel gate with lower
bound, V-first state, continuous batching / spec decoding slot indices) and the composed
stock path (fla ``causal_conv1d_update`` with SiLU, the gate projection as a torch matmul,
``fused_recurrent_kda``, fla ``rms_norm_gated`` with a sigmoid gate; T = 1 only: the
stock conv update takes one token per sequence). Each graph holds ``R`` launches on
disjoint slot tables (>= 256 MB of state per graph, so L2 is rotated); the time per step
is the median over replays divided by R. State traffic counts (1 + T) x 64 KB per
(request, head) (one read, T writes); % of copy is against a device-to-device copy
measured in the same run (bytes read + written).

``--small``: the small-batch table of issue 5 (H in {6, 12}, B in {1, 2, 4, 8}, T in
{1, 4}) with KdaSplit (each cluster size) beside Wide, Stream and the peers; plot it with
``scripts/plot_kda.py``.

``--verify``: verify steps (H in {12, 96}, B in {32, 128}, T in {2, 4, 8}), Wide beside
Stream, for ``STREAM_MAX_TOKENS`` in ``kda/dispatch.py`` (docs/kda_dispatch.md).

Replay rows (issue 15; after the default table, or alone with ``--replay-only``): the grid
``replay_grid()`` of H in {6, 12, 96}, B in {8, 32, 128, 256}, T in {1, 4}, ring size R in
{4, 8, 16}, the headline rows H96 B128 T1 / T4 R8 first. Each times ``kda.replay_decode``
(KdaReplay, the dispatcher's choice) on the per-step rows' pools and steps, with a ring
whose fill levels are staggered (1/R of the items fold per decode step), R steps per
rotation in one graph. Beside
it, on the same (H, B, T): the per-step path (``kda.decode``, the dispatcher's kernel, timed
exactly as the per-step rows) and fla's recurrence (timed here where the per-step table did
not run, as with ``--replay-only``). Bytes
per step (``replay_bytes``): state traffic as the per-step rows count it, the page read, the
ring entries each item holds read, the step's entries written and the pages its folds write
back, from the ring counters over the timed steps. ``--replay-only``
times the replay grid and the per-step kernel for its shapes only (``--quick``: the two
headline rows); the JSON (``rows``: per-step rows, ``replay_rows``) is rewritten after every
row, so a run cut short keeps what it measured.

``--state-dtype fp32 | bf16 | both``: the per-step rows on fp32 or bf16 state pages, or
each row for both in one run (bytes, TB/s and % of copy with the dtype's page: 64 KB or
32 KB; rotations sized by it); the replay rows run on fp32 pages. ``--deployed``: the
deployed shapes H in {6, 12, 96}, B in {8, 32, 128, 256}, T in {1, 4}. ``--heads H ...
--requests B ... --tokens T ...``: the product of the three (e.g. the KDA-bandwidth grid H 6
12 24 96, B 1 8 32 128 256, one T per run to stay within a device call). ``--kernels auto``:
only the dispatcher's choice of ours per row (no forced wide / stream / pipe: a quarter of
the compiles); ``--pdl``: ours launched with programmatic dependent launch, as
``launch/decode.py`` launches them (the replay rows without).

``--peers fla composed sglang`` (default: the two fla peers): which peers run beside ours;
``sglang`` adds SGLang 0.5.23's fused K3 kernel (``kda_peers.py`` says how it is loaded) at
H 3 / 6 / 12, T 1: timed in the same graph harness on its own copies of the pools, its
outputs and pages checked against ``kda.reference`` (it uses fast math: its ulps are
reported). On those rows both kernels run on a window-first conv pool of 3 taps (its
layout). ``--peer-grid``: H 3, 6, 12 x B 1, 8, 32, 64, 128, 256, T 1; with ``--state-dtype
both`` each bf16 row is set against SGLang's fp32 kernel of its shape.

Usage: python scripts/bench_kda.py [--json out.json] [--quick | --small | --verify |
       --deployed] [--state-dtype both] [--replay-only] [--diag] [--kernels auto] [--pdl]
"""

from __future__ import annotations

import argparse
import math

import torch
from _common import copy_bandwidth, time_graph, write_json
from kda_peers import (
    SGLANG_HEADS,
    fla_composed,
    fla_recurrence,
    sglang_fused,
    sglang_module,
    sglang_numerics,
    window_first,
)

from kda import layer as kl
from kda import synthetic as kt

PAGE = 128 * 128 * 4
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ROTATE_BYTES = 256 << 20


def setup(H, B, T, rotations, seed=0, device="cuda", state_dtype="fp32", dim_first=True):
    pages = 1 + rotations * B * T
    layer = kt.make_layer(
        H, pages, window=T + 2, conv_dim_first=dim_first, bias=True, seed=seed, device=device
    )
    layer.state = layer.state.to(STATE_DTYPES[state_dtype])
    steps = []
    for r in range(rotations):
        table = 1 + r * B * T + torch.arange(B * T, dtype=torch.int32).view(B, T)
        steps.append(
            kt.make_step(B, T, H, pages=pages, slot_table=table, seed=seed + r, device=device)
        )
    return layer, steps


def ours(layer, steps, kernel, gate_mode=3, cluster=None, pdl=False):
    """``kda.decode`` over the rotations; ``pdl``: launched as the deployment launches it
    (programmatic dependent launch: each launch's prologue overlaps the previous one's
    tail; the rotations keep consecutive launches' pages apart from 2 rotations on)."""
    import kda

    out = torch.empty_like(steps[0].gate)
    extra = {} if cluster is None else {"cluster": cluster}

    def fn():
        for s in steps:
            operands = kl.step_operands(layer, s)
            kda.decode(**operands, kernel=kernel, out=out, gate_mode=gate_mode, pdl=pdl, **extra)

    return fn


ENTRY = 128 * 4 + 256 * 2  # a ring entry of one head: v_new fp32, k and raw gate bf16
REPLAY_HEADS, REPLAY_REQUESTS, REPLAY_TOKENS = (96, 12, 6), (128, 32, 256, 8), (1, 4)
REPLAY_SIZES = (8, 4, 16)  # ring sizes R, in the order each shape times them
HEADLINE = ((96, 128, 1, 8), (96, 128, 4, 8))


def replay_grid(quick=False):
    """The replay rows (H, B, T, R) in the order they are timed: the headline rows first,
    then shape by shape (H 96, 12, 6; B 128, 32, 256, 8; T 1 before 4), R 8, 4, 16 each."""
    if quick:
        return list(HEADLINE)
    rows = list(HEADLINE)
    for B in REPLAY_REQUESTS:
        for H in REPLAY_HEADS:
            for T in REPLAY_TOKENS:
                rows += [(H, B, T, R) for R in REPLAY_SIZES if (H, B, T, R) not in rows]
    return rows


def rotations_for(H, B, T, page=PAGE):
    """Slot tables per graph (>= ROTATE_BYTES of state, at most 64) and the per-step state
    traffic of one launch, (1 + T) pages (64 KB fp32, 32 KB bf16) per item."""
    per_launch = B * H * (1 + T) * page
    return max(1, min(64, math.ceil(ROTATE_BYTES / per_launch))), per_launch


def replay_setup(layer, size, seed=0):
    """A ring of ``size`` for the pool, each step's slots staggered in their fill level
    (slot s holds ``replay_fill(s, size)`` committed finite entries), so that 1/size of the
    items fold per decode step."""
    from kda.operands import make_ring

    ring = make_ring(layer.state, size)
    device = layer.state.device
    g = torch.Generator(device=device).manual_seed(seed)
    ring.v.copy_(torch.randn(ring.v.shape, generator=g, device=device) * 0.05)
    ring.kg.copy_(torch.randn(ring.kg.shape, generator=g, device=device).to(torch.bfloat16))
    slots = torch.arange(ring.length.shape[0], device=device, dtype=torch.int32)
    ring.length[:, :, 0] = replay_fill(slots, size)[:, None]
    return ring


def replay_fill(slot, size):
    """Committed entries ``replay_setup`` gives slot ``slot`` (1..size)."""
    return 1 + slot % size


def replay(layer, steps, ring, gate_mode=3, kernel="auto"):
    """``size`` replay steps over the rotations (one fold per decode item per call)."""
    import kda

    out = torch.empty_like(steps[0].gate)

    def fn():
        for _ in range(ring.size):
            for s in steps:
                kda.replay_decode(
                    **kl.step_operands(layer, s),
                    ring=ring,
                    gate_mode=gate_mode,
                    kernel=kernel,
                    out=out,
                )

    return fn


def replay_bytes(heads, size, tokens, slots, accepted=None, calls=9, timed=7):
    """State bytes of one replay launch (all items), averaged over the last ``timed`` of
    ``calls`` calls of ``replay``'s ``fn`` (``size`` passes over the rotations each) from
    ``replay_setup``'s ring: per live item the page read, the entries it holds read (the
    committed ones and the pending ones it commits), its T entries written and, when it
    folds, the page written back (``kda.reference.replay_decode``'s counters). ``slots``:
    per rotation the requests' replay slots (``slots[b, 0]`` at T > 1); ``accepted``: per
    rotation the requests' accepted counts (T > 1). time_graph's fn runs ``replays + 2``
    times (a warm-up, the first replay, the timed ones)."""
    counts = {s: (int(replay_fill(s, size)), 0) for rot in slots for s in rot if s > 0}
    total = launches = 0
    for call in range(calls):
        for _ in range(size):
            for r, rot in enumerate(slots):
                moved = 0
                for b, s in enumerate(rot):
                    if s <= 0:
                        continue
                    committed, pending = counts[s]
                    commit = 1 if tokens == 1 else accepted[r][b]
                    held = committed + min(commit, pending)
                    moved += PAGE + (held + tokens) * ENTRY
                    if held + tokens > size:  # fold: the page written back, the ring empty
                        moved += PAGE
                        held = 0
                    counts[s] = (held + 1, 0) if tokens == 1 else (held, tokens)
                if call >= calls - timed:
                    total += moved * heads
                    launches += 1
    return total / launches


def sglang_row(result, layer, steps, peer_dir, rotations, dtype, sglang_fp32):
    """SGLang's fused kernel on ``result``'s row (fp32 pages only) on its own copies of the
    pools, its numerics against the reference on the first step; errors reported."""
    H, B = result["H"], result["B"]
    if dtype != "fp32":
        return
    try:
        module = sglang_module(peer_dir)
        result.update(
            {f"sglang_{k}": v for k, v in sglang_numerics(module, layer, steps[0]).items()}
        )
        state = layer.state.float().clone()
        conv = window_first(layer.conv_state, layer.conv_dim_first).clone()
        us = time_graph(sglang_fused(module, layer, steps, state, conv), inner=rotations)
        result["sglang_us"] = sglang_fp32[(H, B)] = us
        del state, conv
    except Exception as error:  # report, keep going
        result["sglang_us"], result["sglang_error"] = None, repr(error)[:300]


def diagnose():
    """Where the kernels' bf16 intermediates differ from the reference (record mode)."""
    import kda

    H, B, T = 96, 130, 4
    pages = 1 + B * T
    for kernel in ("wide", "stream"):
        for gate_mode in (3, 0):
            layer = kt.make_layer(H, pages, window=T + 2, seed=1, device="cuda")
            step = kt.make_step(B, T, H, pages=pages, seed=2, device="cuda")
            ref_layer = layer.clone()
            rec = [
                (
                    torch.zeros(B, H, T, 128, device="cuda"),
                    torch.zeros(B, H, T, 256, dtype=torch.bfloat16, device="cuda"),
                )
                for _ in range(2)
            ]
            ref = kt.run_reference(ref_layer, step, records=rec[0])
            options = dict(records=rec[1], kernel=kernel, gate_mode=gate_mode)
            out = kda.decode(**kl.step_operands(layer, step), **options)
            torch.cuda.synchronize()
            rk, gk = rec[0][1], rec[1][1]
            k_bad = (rk[..., :128] != gk[..., :128]).any(-1).any(-1)
            g_bad = (rk[..., 128:] != gk[..., 128:]).any(-1).any(-1)
            d = (out.float() - ref.float()).abs().view(B, T, H, 128)
            ulp = torch.exp2(torch.floor(torch.log2(ref.float().abs().clamp_min(1e-30))) - 7)
            bad = (d > ulp.view(B, T, H, 128)).any(-1).any(1)
            print(
                f"{kernel} gate_mode {gate_mode}: k mismatches "
                f"{int((rk[..., :128] != gk[..., :128]).sum())}, raw_g mismatches "
                f"{int((rk[..., 128:] != gk[..., 128:]).sum())} of {B * H * T * 128}; "
                f"heads with an output > 1 ulp {int(bad.sum())} (with raw_g diff "
                f"{int((bad & g_bad).sum())}, with k diff {int((bad & k_bad).sum())}, "
                f"neither {int((bad & ~g_bad & ~k_bad).sum())}); exact outputs "
                f"{(out == ref).float().mean().item():.5f}"
            )


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the tables (after every row)")
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    parser.add_argument(
        "--small", action="store_true", help="small batches: H 6, 12; B 1..8; split included"
    )
    parser.add_argument(
        "--verify", action="store_true", help="verify steps: H 12, 96; B 32, 128; T 2, 4, 8"
    )
    parser.add_argument(
        "--splits", action="store_true", help="also time KdaSplit (cluster 2, 4, 8) on every row"
    )
    parser.add_argument(
        "--replay-only",
        action="store_true",
        help="only the replay rows, each beside the per-step kernel (--quick: H96 B128 R8)",
    )
    parser.add_argument("--diag", action="store_true", help="numerics diagnosis, no timing")
    parser.add_argument("--gate-mode", type=int, default=3, choices=(0, 1, 3))
    parser.add_argument(
        "--kernels",
        nargs="+",
        default=["auto", "wide", "stream", "pipe"],
        choices=("auto", "wide", "stream", "pipe"),
        help="ours to time per row (auto first; the others for auto / best; fewer compile faster)",
    )
    parser.add_argument(
        "--pdl", action="store_true", help="launch ours with PDL, as launch/decode.py does"
    )
    parser.add_argument(
        "--peers",
        nargs="+",
        default=["fla", "composed"],
        choices=("fla", "composed", "sglang"),
        help="peers timed beside ours: fla's recurrence, fla's composed T = 1 step, SGLang's "
        "fused K3 kernel (H 3 / 6 / 12, T 1, fp32 pages; both on a window-first conv pool)",
    )
    parser.add_argument(
        "--peer-dir", default="/tmp/peer", help="where .peer/peer.tar.xz is unpacked"
    )
    parser.add_argument(
        "--peer-grid",
        action="store_true",
        help="the SGLang grid: H 3, 6, 12 x B 1, 8, 32, 64, 128, 256, T 1 (with --peers sglang)",
    )
    parser.add_argument(
        "--state-dtype",
        choices=("fp32", "bf16", "both"),
        default="fp32",
        help="state pages of the per-step rows (both: each row for fp32 then bf16)",
    )
    parser.add_argument(
        "--deployed", action="store_true", help="H 6, 12, 96; B 8, 32, 128, 256; T 1, 4"
    )
    grid = "the per-step rows: the product of --heads, --requests and --tokens"
    parser.add_argument("--heads", type=int, nargs="+", default=None, help=grid)
    parser.add_argument("--requests", type=int, nargs="+", default=None, help=grid)
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help=grid)
    parser.add_argument(
        "--replay-sizes",
        type=int,
        nargs="+",
        default=None,
        help="with the grid: replay rows of every grid shape at these ring sizes (e.g. 4 8)",
    )
    args = parser.parse_args(argv)
    given = [args.heads, args.requests, args.tokens]
    if any(v is not None for v in given) and not all(v is not None for v in given):
        parser.error("--heads, --requests and --tokens go together")
    if args.replay_sizes is not None and args.heads is None:
        parser.error("--replay-sizes goes with --heads, --requests and --tokens")
    if args.replay_only and (args.small or args.verify or args.splits or args.diag):
        parser.error("--replay-only times the replay grid alone (with --quick at most)")
    if "auto" not in args.kernels:
        parser.error("--kernels: auto (the dispatcher's choice, every row's figure) is timed")
    return args


def per_step_shapes(args):
    """The per-step table's (H, B, T) rows (none with ``--replay-only``)."""
    if args.replay_only:
        return []
    if args.heads is not None:
        return [(H, B, T) for T in args.tokens for H in args.heads for B in args.requests]
    if args.peer_grid:
        return [(H, B, 1) for H in SGLANG_HEADS for B in (1, 8, 32, 64, 128, 256)]
    if args.quick:
        return [(6, 1, 1), (12, 128, 1), (96, 128, 1), (96, 128, 4), (12, 128, 4)]
    if args.small:
        return [(H, B, T) for T in (1, 4) for H in (6, 12) for B in (1, 2, 4, 8)]
    if args.verify:
        return [(H, B, T) for T in (2, 4, 8) for H in (12, 96) for B in (32, 128)]
    if args.deployed:
        return [(H, B, T) for T in (1, 4) for H in (6, 12, 96) for B in (8, 32, 128, 256)]
    return [(H, B, T) for T in (1, 4) for H in (6, 12, 96) for B in (1, 8, 32, 128)]


def replay_shapes(args):
    """The replay rows (H, B, T, R) this run times: after the default or quick table, or
    alone with ``--replay-only``; with the grid, its shapes at ``--replay-sizes`` (fp32
    pages); none after ``--small`` / ``--verify``."""
    grid = args.heads is not None
    if grid and args.replay_sizes and args.state_dtype != "bf16":
        shapes = [(H, B, T) for T in args.tokens for H in args.heads for B in args.requests]
        return [(H, B, T, R) for H, B, T in shapes for R in args.replay_sizes]
    if args.small or args.verify or args.deployed or grid or args.peer_grid:
        return []
    if args.state_dtype == "bf16":
        return []
    return replay_grid(quick=args.quick)


def f(v, w=8, p=1):
    return f"{v:>{w}.{p}f}" if v is not None else f"{'-':>{w}}"


def replay_table(grid, per_step, gate_mode, copy_tbs, emit):
    """Time the replay rows ``grid`` in order; ``per_step`` maps (H, B, T) to its per-step
    row (timed here for shapes the per-step table did not run, exactly as it times
    ``auto_us`` and ``fla_us``); ``emit(row)`` after every row. Each shape's pools are
    built when first needed and dropped after its last row."""
    from collections import Counter

    from kda.decode import plan
    from kda.dispatch import choose_replay

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    left = Counter((H, B, T) for H, B, T, _ in grid)
    built = {}
    print(
        "replay rows: kda.replay_decode (us per step; MB of state per step), beside the "
        "per-step kda.decode (step us, step MB) and fla's recurrence"
    )
    print(
        f"{'H':>3} {'B':>4} {'T':>2} {'R':>2} {'kernel':>7} {'replay':>8} {'MB/step':>8} "
        f"{'TB/s':>6} {'%copy':>6} {'step us':>8} {'step MB':>8} {'x step':>6} "
        f"{'fla rec':>8} {'x rec':>6}"
    )
    for H, B, T, size in grid:
        shape = (H, B, T)
        if shape not in built:
            rotations, per_launch = rotations_for(H, B, T)
            built[shape] = (rotations, per_launch, *setup(H, B, T, rotations))
        rotations, per_launch, layer, steps = built[shape]
        if shape not in per_step:  # the per-step path, timed as the per-step rows time it
            us = time_graph(ours(layer, steps, "auto", gate_mode), inner=rotations)
            kernel = plan(B, H, T, "cuda").kernel
            row = dict(kernel=kernel, auto_us=us, fla_us=None, state_bytes=per_launch)
            per_step[shape] = dict(H=H, B=B, T=T, **row)
            try:  # the peer in the same run, as the per-step rows time it
                fn = fla_recurrence(layer, steps, H, B, T)
                per_step[shape]["fla_us"] = time_graph(fn, inner=rotations)
            except Exception as error:  # the peer is optional: report, keep going
                per_step[shape]["fla_error"] = repr(error)[:200]
            fn = None
        step_row = per_step[shape]
        choice = choose_replay(B, H, T, size, sms=sms)
        row = dict(
            H=H, B=B, T=T, R=size, kernel=choice.kernel, reason=choice.reason, rotations=rotations
        )
        us = None
        try:  # from the staggered fill levels (a fresh ring)
            fn = replay(layer, steps, replay_setup(layer, size), gate_mode)
            us = time_graph(fn, inner=rotations * size)
        except Exception as error:  # report, keep going
            row["replay_error"] = repr(error)[:200]
        fn = None  # the ring goes with it
        row["replay_us"] = us
        slots = [s.slots.view(B, -1)[:, 0].tolist() for s in steps]
        accepted = None if T == 1 else [s.accepted.tolist() for s in steps]
        moved = row["replay_bytes"] = replay_bytes(H, size, T, slots, accepted)
        row["replay_tbs"] = moved / (us * 1e-6) / 1e12 if us else None
        row["pct_copy"] = 100 * row["replay_tbs"] / copy_tbs if us else None
        step_us, fla = step_row["auto_us"], step_row.get("fla_us")
        row.update(per_step_us=step_us, per_step_kernel=step_row["kernel"])
        row.update(per_step_bytes=per_launch, fla_us=fla)
        row["speedup_per_step"] = step_us / us if us else None
        row["speedup_fla"] = fla / us if us and fla else None
        print(
            f"{H:>3} {B:>4} {T:>2} {size:>2} {choice.kernel:>7} {f(us)} "
            f"{f(moved / 1e6)} {f(row['replay_tbs'], 6, 2)} "
            f"{f(row['pct_copy'], 6)} {f(step_us)} {f(per_launch / 1e6)} "
            f"{f(row['speedup_per_step'], 6, 2)} {f(fla)} {f(row['speedup_fla'], 6, 2)}"
        )
        if "replay_error" in row:
            print(f"    replay_error: {row['replay_error']}")
        emit(row)
        left[shape] -= 1
        if not left[shape]:
            del built[shape], layer, steps
            torch.cuda.empty_cache()


def main(argv=None):
    args = parse_args(argv)
    if args.diag:
        diagnose()
        return
    copy_tbs = copy_bandwidth()
    print(f"device copy bandwidth (read + write): {copy_tbs:.2f} TB/s")
    rows, replay_rows = [], []
    payload = dict(
        device=torch.cuda.get_device_name(), copy_tbs=copy_tbs, rows=rows, replay_rows=replay_rows
    )

    def save():
        if args.json:
            write_json(args.json, payload)

    shapes = per_step_shapes(args)
    if shapes:
        header = (
            f"{'H':>3} {'B':>4} {'T':>2} {'state':>5} {'kernel':>7} {'us':>8} {'TB/s':>6} "
            f"{'%copy':>6} {'wide':>8} {'stream':>8} {'pipe':>8} {'fla rec':>8} {'x rec':>6} "
            f"{'fla comp':>9} {'x comp':>6}"
        )
        print(header)
    dtypes = ("fp32", "bf16") if args.state_dtype == "both" else (args.state_dtype,)
    sglang_fp32 = {}  # (H, B) -> SGLang's us on fp32 pages (the bf16 rows' peer)
    for H, B, T, dtype in [(*shape, d) for shape in shapes for d in dtypes]:
        page = PAGE // 2 if dtype == "bf16" else PAGE
        rotations, per_launch = rotations_for(H, B, T, page)
        # SGLang's kernel takes a window-first pool of 3 taps: ours runs on the same layout
        peer = "sglang" in args.peers and H in SGLANG_HEADS and T == 1
        layer, steps = setup(H, B, T, rotations, state_dtype=dtype, dim_first=not peer)
        from kda.decode import plan

        choice = plan(B, H, T, "cuda", state_dtype=dtype)
        result = dict(H=H, B=B, T=T, state_dtype=dtype, kernel=choice.kernel, reason=choice.reason)
        result.update(rotations=rotations, state_bytes=per_launch)
        result["pdl"] = args.pdl
        for name in args.kernels:
            try:
                fn = ours(layer, steps, name, args.gate_mode, pdl=args.pdl)
                result[f"{name}_us"] = time_graph(fn, inner=rotations)
            except ValueError as error:  # a kernel that refuses the shape: report, keep going
                result[f"{name}_us"], result[f"{name}_error"] = None, repr(error)[:200]
        if args.small or args.splits:
            for cluster in (2, 4, 8):
                try:
                    fn = ours(layer, steps, "split", args.gate_mode, cluster, args.pdl)
                    result[f"split{cluster}_us"] = time_graph(fn, inner=rotations)
                except Exception as error:  # report, keep going
                    result[f"split{cluster}_us"] = None
                    result[f"split{cluster}_error"] = repr(error)[:200]
        named = ("wide", "stream", "pipe", "split2", "split4", "split8")
        kernels = {
            k[:-3]: v for k, v in result.items() if k.endswith("_us") and v and k[:-3] in named
        }
        if kernels:  # the forced kernels timed (``--kernels``)
            best = min(kernels, key=kernels.get)
            result["best"], result["auto_vs_best"] = best, result["auto_us"] / kernels[best]
        result["fla_us"] = result["composed_us"] = None
        if "fla" in args.peers:
            try:
                fn = fla_recurrence(layer, steps, H, B, T)
                result["fla_us"] = time_graph(fn, inner=rotations)
            except Exception as error:  # the peer is optional: report, keep going
                result["fla_error"] = repr(error)[:200]
        if peer:
            sglang_row(result, layer, steps, args.peer_dir, rotations, dtype, sglang_fp32)
        if T == 1 and "composed" in args.peers:
            try:
                fn = fla_composed(layer, steps, H, B)
                result["composed_us"] = time_graph(fn, inner=rotations)
            except Exception as error:
                result["composed_error"] = repr(error)[:200]
        us = result["auto_us"]
        result["state_tbs"] = per_launch / (us * 1e-6) / 1e12
        result["pct_copy"] = 100 * result["state_tbs"] / copy_tbs
        if result.get("sglang_us"):
            peer_tbs = per_launch / (result["sglang_us"] * 1e-6) / 1e12
            result["sglang_pct_copy"] = 100 * peer_tbs / copy_tbs
        fla, comp = result["fla_us"], result["composed_us"]
        result["speedup_fla"] = fla / us if fla else None
        result["speedup_composed"] = comp / us if comp else None
        peer_us = result.get("sglang_us") or sglang_fp32.get((H, B))
        result["vs_sglang"] = peer_us / us if peer_us else None
        rows.append(result)
        save()

        line = (
            f"{H:>3} {B:>4} {T:>2} {dtype:>5} {choice.kernel:>7} {f(us)} "
            f"{f(result['state_tbs'], 6, 2)} "
            f"{f(result['pct_copy'], 6)} {f(result.get('wide_us'))} "
            f"{f(result.get('stream_us'))} {f(result.get('pipe_us'))} "
            f"{f(fla)} {f(result['speedup_fla'], 6, 2)} {f(comp, 9)} "
            f"{f(result['speedup_composed'], 6, 2)}"
        )
        print(line)
        if peer and dtype != "fp32":
            print(f"    SGLang's fp32 kernel {f(peer_us)} us: ours {f(result['vs_sglang'], 5, 2)}x")
        elif peer:
            print(
                f"    sglang {f(result.get('sglang_us'))} us ({f(result.get('sglang_pct_copy'), 4)}"
                f"% copy; fp32 kernel {f(peer_us)}): ours {f(result['vs_sglang'], 5, 2)}x; "
                f"its pages {result.get('sglang_page_diff', float('nan')):.2e} of the page max "
                f"off the reference, outputs <= {result.get('sglang_out_max_ulps', 0):.0f} bf16 "
                f"ulps ({100 * result.get('sglang_out_over_1ulp', 0):.1f}% > 1 ulp)"
            )
        if args.small or args.splits:
            splits = " ".join(f"split{c} {f(result[f'split{c}_us'])}" for c in (2, 4, 8))
            best = f"best {result.get('best')}, auto / best {result.get('auto_vs_best', 0):.3f}"
            print(f"    {splits}; {best}")
        timed = ("wide", "stream", "pipe", "split2", "split4", "split8", "fla", "composed")
        timed += ("sglang",)
        for key in (f"{name}_error" for name in timed):
            if key in result:
                print(f"    {key}: {result[key]}")
        del layer, steps
        torch.cuda.empty_cache()
    grid = replay_shapes(args)
    if grid:
        per_step = {(r["H"], r["B"], r["T"]): r for r in rows if r["state_dtype"] == "fp32"}

        def emit(row):
            replay_rows.append(row)
            save()

        replay_table(grid, per_step, args.gate_mode, copy_tbs, emit)
    save()


if __name__ == "__main__":
    main()
