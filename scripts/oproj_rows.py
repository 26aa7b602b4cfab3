"""The o-projection alone at 1..1024 rows per step (``bench_oproj.py --rows``), loopback.

Per (TP, rows), HID 7168, nb 8, D_local = heads * 128 / TP (Kimi: 96 heads), every rank's
producer + all-reduce + AttnRes + norm per step (CUDA graphs of ``iters`` steps, median
of ``repeats`` replays, us per step):

- ``oneshot_1l``: one-shot, every rank in one producer and one consumer launch (PDL),
  the plan's producer (mma.sync <= 8 rows, else cuBLAS + publisher): the launcher's path;
- ``oneshot_1l_cublas``: the same with the cuBLAS producer at <= 8 rows (the other
  producer where both can run);
- ``oneshot_chunks`` / ``twoshot_chunks``: per-rank launches on the rank streams
  (``RowChunks``: chunks whose consumers and publishers fit the GPU together): one-shot
  and twoshot under the same launch structure, which gives the measured twoshot crossover;
- ``peer``: torch ``bmm`` partials, their fp32 sum and the epilogue in torch ops.

Floor: max(HBM bytes / the copy bandwidth, GEMM FLOPs / a large cuBLAS GEMM's rate), both
measured in this run; HBM bytes = every rank's ``w_o`` and ``attn_out`` + the exchange's
buffers (one-shot: ``TP * plan.bytes / 2``, one parity) + the consumer's row traffic.
``--write-crossovers`` rewrites ``tpcomm/oproj/crossovers.json`` from the chunked pair (the
crossover of per-rank launches) and the one-launch comparison (one launch stays one-shot).
"""

from __future__ import annotations

import datetime
import json
import pathlib

import torch
from _common import cell, graph_us

from tpcomm.backends.loopback import LoopbackBackend
from tpcomm.oproj.all_ranks import AllRanks
from tpcomm.oproj.allreduce import OprojAllReduce, wgmma_device
from tpcomm.oproj.plan import CROSSOVERS, buffer_bytes, choose
from tpcomm.oproj.rows import RowChunks

ROWS = (1, 4, 8, 32, 128, 256, 512, 1024)  # requests {1, 8, 32, 128, 256} x tokens {1, 4}
EPS = 1e-6
BUDGET = 20_000_000


def gemm_tflops():
    """A large cuBLAS bf16 GEMM (8192^3), TFLOP/s."""
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.bfloat16)
    b = torch.randn(n, n, device="cuda").to(torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    us = graph_us(lambda i: torch.matmul(a, b, out=c), 5, 7)
    return 2 * n**3 / (us * 1e-6) / 1e12


def inputs(tp, rows, hid, nb, d_local):
    g = torch.Generator(device="cuda").manual_seed(tp * 1000 + rows)

    def bf(*shape, s=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g, device="cuda") * s + shift).to(torch.bfloat16)

    return dict(
        attn=bf(tp, rows, d_local),
        w_os=bf(tp, hid, d_local, s=d_local**-0.5),
        prefix=bf(rows, hid),
        blocks=bf(rows, nb, hid) if nb else None,
        norm=bf(hid, s=0.1, shift=1.0),
        query=bf(hid, s=0.2),
        out_norm=bf(hid, s=0.1, shift=1.0),
    )


def floor_us(tp, rows, hid, nb, d_local, exchange, tbps, tflops):
    row = rows * hid * 2
    per_rank = hid * d_local * 2 + rows * d_local * 2 + (3 + nb) * row  # w_o, attn, rows
    hbm = tp * per_rank + exchange
    return max(hbm / (tbps * 1e6), 2 * tp * rows * hid * d_local / (tflops * 1e6))


def torch_epilogue(p, a, out):
    """The peers' AttnRes (softmax over ``a["blocks"]`` [rows, nb, HID] and ``p``) and
    RMSNorm in fp32 torch ops into ``out``; ``p`` [..., rows, HID] is the new prefix."""
    pf = p.float()
    hid = pf.shape[-1]
    if a["blocks"] is None:
        h = pf
    else:
        w = a["norm"].float() * a["query"].float()
        blocks = a["blocks"].float().expand(*pf.shape[:-2], -1, -1, -1)
        v = torch.cat([blocks, pf[..., None, :]], dim=-2)  # [..., rows, nb + 1, HID]
        logits = (v @ w) * torch.rsqrt(v.pow(2).sum(-1) / hid + EPS)
        h = (torch.softmax(logits, dim=-1)[..., None] * v).sum(-2)
    out.copy_(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * a["out_norm"].float())


def peer_step(a, prefixes, outputs):
    """The composed peer: bmm partials, fp32 sum, residual, AttnRes, RMSNorm in torch."""
    partials = torch.bmm(a["attn"], a["w_os"].transpose(1, 2))
    total = partials.float().sum(0)
    p = (prefixes.float() + total.to(torch.bfloat16).float()).to(torch.bfloat16)
    prefixes.copy_(p)
    torch_epilogue(p, a, outputs)


def peer_us(a, iters, repeats):
    tp, rows, hid = a["attn"].shape[0], a["prefix"].shape[0], a["prefix"].shape[1]
    prefixes = a["prefix"][None].repeat(tp, 1, 1)
    outputs = torch.empty(tp, rows, hid, dtype=torch.bfloat16, device="cuda")
    return graph_us(lambda i: peer_step(a, prefixes, outputs), iters, repeats)


def _variant(tp, rows, hid, nb, a, iters, repeats, kind):
    """us per step of one variant (None and the reason when it cannot run)."""
    backend = LoopbackBackend(tp)
    try:
        bf = dict(dtype=torch.bfloat16, device="cuda")
        prefixes = a["prefix"][None].repeat(tp, 1, 1)
        outputs = torch.empty(tp, rows, hid, **bf)
        args = (a["blocks"], a["norm"], a["query"], a["out_norm"])
        kw = dict(eps=EPS, out_eps=EPS, budget_ns=BUDGET)
        if kind.startswith("oneshot_1l"):
            producer = "cublas" if kind.endswith("cublas") else None
            comm = OprojAllReduce(backend, rows, hid, nb, one_launch=True, producer=producer, **kw)

            def fn(i):
                AllRanks(comm).run_ranks(
                    a["attn"],
                    prefixes,
                    *args,
                    outputs,
                    i,
                    w_os=a["w_os"],
                    mode="one-launch",
                    pdl=True,
                )

            errors = comm.errors
        else:
            comm = RowChunks(backend, rows, hid, nb, twoshot=kind == "twoshot_chunks", **kw)

            def fn(i):
                AllRanks(comm).run_ranks(a["attn"], prefixes, *args, outputs, i, w_os=a["w_os"])

            errors = None
        us = graph_us(fn, iters, repeats)
        torch.cuda.synchronize()
        failed = comm.error_masks() if errors is None else errors[:, 0].tolist()
        if any(failed):
            return None, f"consumer timeouts {failed}"
        return us, getattr(comm, "chunk", rows)
    except ValueError as e:
        return None, str(e)
    finally:
        backend.teardown()
        torch.cuda.empty_cache()


def sweep(tps, rows_list, hid, nb, heads, iters, repeats, tbps, on_row=None):
    """Every (TP, rows) row; ``on_row(rows so far, tflops)`` after each (a cut run keeps
    what it measured). Where the plan's producer is not cuBLAS + publisher (mma.sync up to
    8 rows, wgmma above on sm_90), that one is timed beside it (``oneshot_1l_cublas``)."""
    tflops = gemm_tflops()
    print(f"cuBLAS bf16 GEMM 8192^3: {tflops:.0f} TFLOP/s; copy {tbps:.2f} TB/s")
    out = []
    for tp in tps:
        d_local = heads * 128 // tp
        for rows in rows_list:
            a = inputs(tp, rows, hid, nb, d_local)
            wgmma = wgmma_device()  # the producer OprojAllReduce picks here
            plan = choose(tp, rows, hid, one_launch=True, wgmma=wgmma)  # ours: one launch
            chunks = choose(tp, rows, hid, wgmma=wgmma)  # per-rank launches (RowChunks)
            exchange = tp * buffer_bytes(tp, rows, hid, False) // 2
            floor = floor_us(tp, rows, hid, nb, d_local, exchange, tbps, tflops)
            row = dict(tp=tp, rows=rows, hid=hid, nb=nb, d_local=d_local, floor_us=floor)
            row["plan"] = {k: getattr(plan, k) for k in ("producer", "twoshot", "bytes", "reason")}
            row["chunks_plan"] = dict(twoshot=chunks.twoshot, reason=chunks.reason)
            kinds = ["oneshot_1l", "oneshot_chunks", "twoshot_chunks"]
            if plan.producer != "cublas":
                kinds.insert(1, "oneshot_1l_cublas")
            for kind in kinds:
                us, note = _variant(tp, rows, hid, nb, a, iters, repeats, kind)
                row[f"{kind}_us"] = us
                row[f"{kind}_note"] = note
            row["peer_us"] = peer_us(a, iters, repeats)
            options = [row[f"{k}_us"] for k in kinds if row[f"{k}_us"] is not None]
            row["ours_us"] = row["oneshot_1l_us"]  # the launcher's loopback path
            row["best_us"] = min(options) if options else None
            out.append(row)
            print_row(row)
            if on_row is not None:
                on_row(out, tflops)
            torch.cuda.empty_cache()
    return out, tflops


def cell1(v, width=9):
    return cell(v, width, 1)


def print_row(r):
    ours, best, floor = r["ours_us"], r["best_us"], r["floor_us"]
    ratio = None if ours is None else ours / floor
    vs_best = None if ours is None or best is None else ours / best
    print(
        f"TP{r['tp']:>3} rows {r['rows']:>5}: ours {cell1(ours)} (x floor {cell(ratio, 5, 2)}, "
        f"x best {cell(vs_best, 5, 2)}) | 1-shot chunks {cell1(r['oneshot_chunks_us'])} | "
        f"2-shot chunks {cell1(r['twoshot_chunks_us'])} | cuBLAS 1l "
        f"{cell1(r.get('oneshot_1l_cublas_us'))} | peer {cell1(r['peer_us'])} | floor "
        f"{cell1(floor)} | {r['plan']['producer']}",
        flush=True,
    )


def crossovers(rows_out):
    """Per TP: the first rows count from which twoshot (chunks) beat one-shot (chunks) at
    that and every larger measured count; None when it never does."""
    table = {}
    for tp in sorted({r["tp"] for r in rows_out}):
        pts = sorted(
            (r["rows"], r["twoshot_chunks_us"], r["oneshot_chunks_us"])
            for r in rows_out
            if r["tp"] == tp
        )
        start = None
        for rows, two, one in reversed(pts):
            if two is None or one is None or two >= one:
                break
            start = rows
        table[str(tp)] = start
    return table


def one_launch_fastest(rows_out):
    """Per TP: the measured rows counts and whether one launch for every rank (one-shot,
    ``oneshot_1l``) beat both chunked variants (per-rank launches, one-shot and twoshot)
    at every one of them (a variant that did not run counts as beaten)."""
    table = {}
    for tp in sorted({r["tp"] for r in rows_out}):
        mine = sorted((r for r in rows_out if r["tp"] == tp), key=lambda r: r["rows"])
        wins = [
            r.get("oneshot_1l_us") is not None
            and all(
                r.get(k) is None or r["oneshot_1l_us"] < r[k]
                for k in ("oneshot_chunks_us", "twoshot_chunks_us")
            )
            for r in mine
        ]
        table[str(tp)] = dict(rows=[r["rows"] for r in mine], fastest=all(wins))
    return table


def write_crossovers(rows_out, device, path=CROSSOVERS, date=None):
    """Rewrite ``crossovers.json``: ``twoshot_from_rows`` (``crossovers``), the device, the
    one-launch comparison (``one_launch``) and ``source``; ``date`` (ISO) of the run,
    default today."""
    data = json.loads(pathlib.Path(path).read_text())
    data["twoshot_from_rows"] = crossovers(rows_out)
    data["device"] = device
    fastest = one_launch_fastest(rows_out)
    data["one_launch"] = {
        "twoshot": False,
        "fastest": fastest,
        "why": "one launch for every rank of one GPU (the loopback launcher's path, "
        "OprojAllReduce(one_launch=True)) exists one-shot only; where 'fastest' it beat "
        "chunked one-shot and chunked twoshot at every measured rows count, so choose("
        "..., one_launch=True) ignores twoshot_from_rows",
    }
    on = device if "loopback" in device else f"{device} (loopback)"
    measured = ", ".join(
        f"TP {tp} rows {'/'.join(map(str, f['rows']))}" for tp, f in fastest.items()
    )
    chunk = {}  # per TP the largest one-shot chunk the GPU held (its co-residency rule)
    for r in rows_out:
        if isinstance(r.get("oneshot_chunks_note"), int):
            tp = int(r["tp"])
            chunk[tp] = max(chunk.get(tp, 1), r["oneshot_chunks_note"])
    chunks = ", ".join(f"TP {tp}: {n}" for tp, n in sorted(chunk.items()))
    data["source"] = (
        f"measured {date or datetime.date.today()} on {on} by python scripts/bench_oproj.py "
        f"--rows ({measured}; HID 7168, nb 8): twoshot_from_rows[tp] = the first rows count "
        "from which twoshot beat one-shot, both as per-rank launches in row chunks "
        "(RowChunks), at that and every larger measured count; null: never. It applies to "
        "per-rank launches (multi-GPU backends, RowChunks). Measured on one GPU, where "
        "one-shot's per-rank chunks hold only what fits the GPU together (rows per chunk, "
        f"at most {chunks or '-'}): across GPUs it is provisional until re-measured there. "
        "The one-launch path stays one-shot (one_launch)."
    )
    pathlib.Path(path).write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}: twoshot_from_rows {data['twoshot_from_rows']}")
