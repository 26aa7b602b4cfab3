"""Loopback mailbox all-reduce latency on one GPU, beside torch's sum over the stacked partials.

Every TP rank is a CUDA stream; one step = TP launches (publish to every rank, poll,
rank-order sum, re-arm). Timing: CUDA graph of ``--steps`` consecutive steps (both
parities), replayed ``--reps`` times between events; the median replay over ``steps``
is the per-step latency. The peer: ``torch.sum(partials, 0)`` over the same
``[TP, tokens, HID]`` bf16 stack, in a graph of the same length. Inputs rotate over
``--sets`` buffers so neither side reads the same partials twice in a row.

Bytes: each rank stores its ``tokens x HID`` partial to TP mailboxes and reads TP slots,
so a step moves ``2 x TP x TP x tokens x HID x 2`` bytes through L2 (stores + loads).

    python scripts/bench_mailbox.py [--hid 7168] [--tp 2 4 8 16] [--tokens 1 2 ... 8]
        [--json out.json]
"""

import argparse
import json
import os
import sys

# every rank needs its own hardware queue; must be set before CUDA initialises
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import torch  # noqa: E402
from _common import replay_us  # noqa: E402


def _time_graph(fn, steps, reps, warmup=3):
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for s in range(steps):
            fn(s)
    for _ in range(warmup):
        graph.replay()
    return replay_us(graph, reps, steps)


def bench(tp, tokens, hid, steps, reps, sets):
    from tpcomm import mailbox as mb
    from tpcomm.allreduce import MailboxAllReduce
    from tpcomm.backends.loopback import LoopbackBackend

    backend = LoopbackBackend(tp)
    box = mb.Mailbox(backend, tokens, hid)
    ar = MailboxAllReduce(box)
    inputs = [torch.randn(tp, tokens, hid, device="cuda").to(torch.bfloat16) for _ in range(sets)]
    outs = [torch.empty_like(inputs[0]) for _ in range(2)]
    torch_out = torch.empty(tokens, hid, dtype=torch.bfloat16, device="cuda")
    # warm up (compile, load) at both parities outside any capture
    ar.run_ranks(inputs[0], outs[0], 0)
    ar.run_ranks(inputs[1 % sets], outs[1], 1)
    torch.cuda.synchronize()
    counter = [2]

    def mailbox_step(s):
        step = counter[0]
        counter[0] += 1
        ar.run_ranks(inputs[step % sets], outs[step % 2], step)

    mailbox_us = _time_graph(mailbox_step, steps, reps)
    torch.cuda.synchronize()
    errors = int(ar.errors.abs().sum())
    want = mb.rank_order_sum(inputs[(counter[0] - 1) % sets])
    exact = bool(
        torch.equal(outs[(counter[0] - 1) % 2][0].view(torch.int16), want.view(torch.int16))
    )

    def torch_step(s):
        torch.sum(inputs[s % sets], dim=0, out=torch_out)

    torch_us = _time_graph(torch_step, steps, reps)
    backend.teardown()
    moved = 2 * tp * tp * tokens * hid * 2
    return dict(
        tp=tp,
        tokens=tokens,
        hid=hid,
        mailbox_us=mailbox_us,
        torch_sum_us=torch_us,
        bytes=moved,
        gbps=moved / mailbox_us / 1e3,
        errors=errors,
        bitwise=exact,
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hid", type=int, default=7168)
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--tokens", type=int, nargs="+", default=list(range(1, 9)))
    parser.add_argument("--steps", type=int, default=20, help="steps per graph (even)")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--sets", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.steps % 2:
        parser.error("--steps must be even (the graph replays both parities)")
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    rows = []
    header = (
        f"{'TP':>3} {'tok':>3} {'mailbox us':>10} {'torch sum us':>12} "
        f"{'KB moved':>9} {'GB/s':>7} {'err':>3} {'bitwise':>7}"
    )
    print(f"# {torch.cuda.get_device_name()}, HID {args.hid}")
    print(header)
    for tp in args.tp:
        for tokens in args.tokens:
            r = bench(tp, tokens, args.hid, args.steps, args.reps, args.sets)
            rows.append(r)
            print(
                f"{tp:>3} {tokens:>3} {r['mailbox_us']:>10.2f} {r['torch_sum_us']:>12.2f} "
                f"{r['bytes'] / 1024:>9.0f} {r['gbps']:>7.1f} {r['errors']:>3} "
                f"{str(r['bitwise']):>7}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(device=torch.cuda.get_device_name(), hid=args.hid, rows=rows), f, indent=1
            )
    return 0 if all(r["errors"] == 0 and r["bitwise"] for r in rows) else 2


if __name__ == "__main__":
    sys.exit(main())
