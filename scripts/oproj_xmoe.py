"""The MoE copies at serving batch (``bench_oproj.py --xmoe``), loopback, one launch.

Per (TP, rows), HID 7168, nb 8: the consumer stage of every rank as the launcher runs it
(``consume_all``, and with ``reps`` copies the MoE stand-in forked before it on a stream
of its own, joined after: ``wait_hints``' waiter and reader), CUDA graphs of ``iters``
steps, median of ``repeats`` replays, us per step; every mailbox refilled by a copy
before each step, whose time (measured alone) is subtracted:

- ``base_us``: no copies (``xmoe_reps`` = 0);
- ``xmoe_us``: ``reps`` copies, the waiter and the reader;
- ``consumer_only_us``: ``reps`` copies, no waiter (the consumer's share of the cost).

Copies' bytes: the consumer's stores of ``TP x reps x rows x HID x 2`` bytes, read back
and written once more by the reader: ``copy_bytes`` = 3 x that. Target:
``xmoe_us <= 1.1 x (base_us + copy_bytes / the copy bandwidth measured in the run)``.
After the timed steps the hint words must be zero (each waiter took its quota back, none
timed out) and the reader's copies bitwise the outputs.
"""

from __future__ import annotations

import torch
from _common import graph_us
from oproj_rows import BUDGET, EPS, inputs

from tpcomm.backends.loopback import LoopbackBackend
from tpcomm.oproj.all_ranks import AllRanks
from tpcomm.oproj.allreduce import OprojAllReduce

ROWS = (8, 32, 128, 256, 1024)
TARGET = 1.1


def copy_bytes(tp: int, rows: int, hid: int, reps: int) -> int:
    """The copies' HBM bytes per step: the consumer's stores, the reader's loads and stores."""
    return 3 * tp * reps * rows * hid * 2


def stage_us(tp, rows, hid, nb, reps, iters, repeats, *, waiter=True):
    """(us per step of the consumer stage less the refill, the refill alone, problems)."""
    from tpcomm.oproj.hints import wait_hints  # the CuTe DSL: on the GPU only

    a = inputs(tp, rows, hid, nb, 128)
    backend = LoopbackBackend(tp)
    try:
        kw = dict(eps=EPS, out_eps=EPS, budget_ns=BUDGET, one_launch=True, xmoe_reps=reps)
        comm = OprojAllReduce(backend, rows, hid, nb, **kw)
        bf = dict(dtype=torch.bfloat16, device="cuda")
        prefixes = a["prefix"][None].repeat(tp, 1, 1)
        outputs = torch.empty(tp, rows, hid, **bf)
        xmoes = torch.empty(tp, reps, rows, hid, **bf) if reps else None
        dests = torch.empty(tp, reps, rows, hid, **bf) if reps else None
        epilogue = (a["blocks"], a["norm"], a["query"], a["out_norm"])
        boxes = comm.mailbox.buffer.payload  # [TP ranks, 2, TP slots, rows, HID]
        partials = torch.randn(tp, rows, hid, device="cuda").mul_(0.5).to(torch.bfloat16)
        stacked = partials[None].expand(tp, -1, -1, -1)
        side = torch.cuda.Stream()

        def refill(i):
            boxes[:, i & 1].copy_(stacked)

        def step(i):
            refill(i)
            main = torch.cuda.current_stream()
            fork = torch.cuda.Event()
            fork.record(main)
            AllRanks(comm).consume_all(prefixes, *epilogue, outputs, i, xmoes=xmoes)
            if reps and waiter:
                side.wait_event(fork)
                with torch.cuda.stream(side):
                    wait_hints(comm, xmoes, dests, every_rank=True)
                main.wait_stream(side)

        t_copy = graph_us(refill, iters, repeats)
        t_step = graph_us(step, iters, repeats)
        torch.cuda.synchronize()
        problems = []
        if int(comm.errors.abs().sum()):
            problems.append(f"consumer error words {comm.errors[:, 0].tolist()}")
        if reps and waiter:
            words = comm.hint_words[:tp, :3]
            if int(words.abs().sum()):
                problems.append(f"hint words {words.tolist()}")
            for r in range(tp):
                same = (dests[r].view(torch.int16) == outputs[r].view(torch.int16)).all()
                if not bool(same):
                    problems.append(f"rank {r}: reader's copies != output")
        return t_step - t_copy, t_copy, "; ".join(problems)
    finally:
        backend.teardown()
        torch.cuda.empty_cache()


def sweep(tps, rows_list, hid, nb, reps, iters, repeats, tbps, on_row=None):
    out = []
    for tp in tps:
        for rows in rows_list:
            row = dict(tp=tp, rows=rows, hid=hid, nb=nb, reps=reps)
            row["base_us"], row["refill_us"], p0 = stage_us(tp, rows, hid, nb, 0, iters, repeats)
            row["xmoe_us"], _, p1 = stage_us(tp, rows, hid, nb, reps, iters, repeats)
            only = stage_us(tp, rows, hid, nb, reps, iters, repeats, waiter=False)
            row["consumer_only_us"] = only[0]
            row["copy_bytes"] = copy_bytes(tp, rows, hid, reps)
            row["copy_us"] = row["copy_bytes"] / (tbps * 1e6)
            row["target_us"] = TARGET * (row["base_us"] + row["copy_us"])
            row["ratio"] = row["xmoe_us"] / (row["base_us"] + row["copy_us"])
            row["met"] = row["xmoe_us"] <= row["target_us"]
            row["problems"] = "; ".join(p for p in (p0, p1, only[2]) if p)
            out.append(row)
            print_row(row)
            if on_row is not None:
                on_row(out)
    return out


def print_row(r):
    print(
        f"TP{r['tp']:>3} rows {r['rows']:>5} reps {r['reps']}: xmoe 0 {r['base_us']:8.1f} | "
        f"xmoe {r['reps']} {r['xmoe_us']:8.1f} (consumer alone {r['consumer_only_us']:8.1f}) | "
        f"copies {r['copy_bytes'] / 1e6:7.1f} MB = {r['copy_us']:6.1f} us | target "
        f"{r['target_us']:8.1f} | x(base+copies) {r['ratio']:5.2f} "
        f"{'met' if r['met'] else 'MISSED'}" + (f" | {r['problems']}" if r["problems"] else ""),
        flush=True,
    )
