"""``launch/decode.py --trace``: where a step's time goes, per rank, from GPU clock stamps.

After the checked steps and the back-to-back steps, both parities' step graphs are captured
again with a stamp kernel (``tpcomm.stamp``: one thread writing ``%globaltimer``) on each
rank's stream at the points ``SLOTS``: ``start`` and ``launch`` back to back before KDA
(their difference is what one kernel boundary of the graph costs), then after KDA, after
``recover`` (recorded verify steps), after the producer and after the consumer (a launch
for every rank at once on loopback stamps every rank's lane alike). ``steps`` + 1 steps
replay back to back, parities in turn, behind one on-stream barrier; the first is left out
(it has no step before it). The job runs without PDL then: a stamp between two PDL kernels
would break their overlap, so the traced step would not be the step measured.

Per rank and step (``timeline``, microseconds): each stage's [start, end] relative to the
step's earliest stamp over all ranks (a stage runs from the previous stamp to its own, so
it includes one kernel boundary), the gap before the step (its ``start`` minus the previous
step's last stamp) and the rank's skew (its ``start`` minus the earliest rank's). The
consumer's median time minus its stage-pass time (its graph alone behind a barrier, all
partials there) estimates its polling. ``%globaltimer`` is per GPU; across GPUs its offset
is the driver's, so a skew below about 1 us is not resolved.
"""

from __future__ import annotations

import statistics

import torch

from launch.runner import GATE_CYCLES

SLOTS = ("start", "launch", "kda", "recover", "produce", "consume")
NOTE = (
    "stamps (1-thread kernels reading %globaltimer) between stages on each rank's stream, "
    "PDL off; a stage's time includes one kernel boundary (launch_us); globaltimer is per "
    "GPU and its cross-GPU offset is the driver's, so skew below ~1 us is not resolved"
)


def run(runner, bk, parity: int, steps: int):
    """Trace ``steps`` back-to-back steps of bucket ``bk`` from ``parity`` (the one after
    the last step run). Collective; returns ``report["timeline"]`` on process 0, None
    elsewhere. RuntimeError when a consumer timed out; ValueError (process 0) when a stamp
    is missing."""
    from tpcomm.stamp import stamp  # the CuTe DSL: only on a GPU job

    n, device = len(runner.ranks), runner.device
    trace = torch.zeros(n, steps + 1, len(SLOTS), dtype=torch.int64, device=device)
    cursor = torch.zeros(n, dtype=torch.int32, device=device)

    def mark(r, point):
        first, count = (0, n) if r is None else (runner.local[r], 1)
        stamp(
            trace, cursor, SLOTS.index(point), first=first, count=count, advance=point == "consume"
        )

    mark(None, "start")  # loads the kernel outside the capture
    torch.cuda.synchronize(device)
    trace.zero_()
    cursor.zero_()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    graphs = []
    for p in (parity, parity ^ 1):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=side):
            runner.enqueue(bk, p, stamp=mark)
        graphs.append(g)
    runner.sync_all()
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(GATE_CYCLES)  # the host enqueues every step while this runs
    runner.stream_barrier()
    for i in range(steps + 1):
        graphs[i % 2].replay()
    torch.cuda.synchronize(device)
    runner.raise_on_timeout(bk, "traced steps")
    alone = (bk.stage_us or {}).get("consume")
    mine = [(trace[i].tolist(), alone) for i in range(n)]
    every = runner.procs.objects(mine)
    if not runner.procs.root:
        return None
    return report([lane for process in every for lane in process], bk.kind, bk.record)


def stage_names(record: bool) -> tuple[str, ...]:
    """The stages of a step, in order (``recover`` after a recorded verify step)."""
    return ("kda", "recover", "produce", "consume") if record else ("kda", "produce", "consume")


def timeline(stamps, stages, *, warm: int = 1, consume_alone=None) -> dict:
    """The timeline of raw stamps: ``stamps[rank][row][slot]`` in ns (``SLOTS`` order;
    rows are steps, the first ``warm`` only give the next one's gap), ``stages`` as
    ``stage_names``; ``consume_alone``: per rank, its consumer's stage-pass us (or None).
    Returns ``stages``, ``steps``, ``step_at_us`` (each step's earliest stamp after the
    first step's), ``ranks`` (per rank, per step: ``skew_us``, ``gap_us`` (None without a
    step before), ``launch_us``, each stage's [start, end], ``end_us``, ``step_us``; us
    from the step's earliest stamp) and ``summary`` (medians). ValueError on a stamp
    never written."""
    stages = tuple(stages)
    if not stages or any(s not in SLOTS[2:] for s in stages) or stages[-1] != "consume":
        raise ValueError(f"stages must be {SLOTS[2:]} in order, ending in consume; got {stages}")
    ranks = len(stamps)
    rows = len(stamps[0]) if ranks else 0
    if ranks < 1 or rows <= warm or warm < 0:
        raise ValueError(f"stamps must hold >= 1 rank and more than warm={warm} rows")
    points = ("start", "launch", *stages)
    for r, lane in enumerate(stamps):
        if len(lane) != rows or any(len(row) != len(SLOTS) for row in lane):
            raise ValueError(f"stamps: rank {r} is not [{rows}][{len(SLOTS)}]")
        for s, row in enumerate(lane):
            for p in points:
                if row[SLOTS.index(p)] == 0:
                    raise ValueError(f"stamps: rank {r} step {s} {p} was never written")
    at = {p: SLOTS.index(p) for p in points}
    origin = min(lane[warm][at["start"]] for lane in stamps)
    step_at, per_rank = [], [[] for _ in range(ranks)]
    for row in range(warm, rows):
        first = min(lane[row][at["start"]] for lane in stamps)
        step_at.append(_us(first - origin))
        for r, lane in enumerate(stamps):
            t = lane[row]
            entry = {
                "skew_us": _us(t[at["start"]] - first),
                "gap_us": _us(t[at["start"]] - lane[row - 1][at["consume"]]) if row else None,
                "launch_us": _us(t[at["launch"]] - t[at["start"]]),
            }
            previous = "launch"
            for stage in stages:
                entry[stage] = [_us(t[at[previous]] - first), _us(t[at[stage]] - first)]
                previous = stage
            entry["end_us"] = _us(t[at["consume"]] - first)
            entry["step_us"] = _us(t[at["consume"]] - t[at["start"]])
            per_rank[r].append(entry)
    out = {"stages": list(stages), "steps": rows - warm, "step_at_us": step_at, "ranks": per_rank}
    out["summary"] = summary(out, consume_alone)
    return out


def summary(tl: dict, consume_alone=None) -> dict:
    """Medians over steps: per rank each stage's time, ``step_us``, ``gap_us``,
    ``launch_us``, ``skew_us`` and the consumer's polling estimate (its time minus
    ``consume_alone[rank]``, its stage-pass time); over ranks ``skew_us`` (the latest
    rank's start after the earliest's) and ``span_us`` (earliest start to latest end)."""
    med = statistics.median
    per_rank = []
    for r, entries in enumerate(tl["ranks"]):
        row = {f"{s}_us": _round(med(e[s][1] - e[s][0] for e in entries)) for s in tl["stages"]}
        for key in ("step_us", "launch_us", "skew_us"):
            row[key] = _round(med(e[key] for e in entries))
        gaps = [e["gap_us"] for e in entries if e["gap_us"] is not None]
        row["gap_us"] = _round(med(gaps)) if gaps else None
        alone = consume_alone[r] if consume_alone else None
        row["consume_alone_us"] = None if alone is None else _round(alone)
        row["polling_us"] = None if alone is None else _round(row["consume_us"] - alone)
        per_rank.append(row)
    steps = range(tl["steps"])
    return {
        "per_rank": per_rank,
        "skew_us": _round(med(max(lane[s]["skew_us"] for lane in tl["ranks"]) for s in steps)),
        "span_us": _round(med(max(lane[s]["end_us"] for lane in tl["ranks"]) for s in steps)),
    }


def report(traced, kind: str, record: bool) -> dict:
    """``report["timeline"]`` from every rank's (stamps ``[steps + 1][len(SLOTS)]`` ns,
    stage-pass consume us or None), in rank order; the first row is the warm step."""
    stamps = [lane for lane, _ in traced]
    tl = timeline(stamps, stage_names(record), warm=1, consume_alone=[a for _, a in traced])
    return {"kind": kind, "note": NOTE, **tl}


def print_timeline(tl: dict) -> None:
    """The summary: per rank the medians, then the skew."""
    print(
        f"timeline ({tl['kind']}, {tl['steps']} traced steps back to back; medians, us; "
        f"a stage includes one kernel boundary)"
    )
    for r, row in enumerate(tl["summary"]["per_rank"]):
        stages = ", ".join(f"{s} {row[s + '_us']:.2f}" for s in tl["stages"])
        gap = "-" if row["gap_us"] is None else f"{row['gap_us']:.2f}"
        poll = ""
        if row["polling_us"] is not None:
            poll = f" (alone {row['consume_alone_us']:.2f}: polling ~{row['polling_us']:.2f})"
        print(
            f"  rank {r:<3} step {row['step_us']:.2f}: boundary {row['launch_us']:.2f}, "
            f"{stages}{poll}; gap before {gap}, skew {row['skew_us']:.2f}"
        )
    s = tl["summary"]
    print(
        f"  all ranks: span {s['span_us']:.2f}, skew {s['skew_us']:.2f} (globaltimer per "
        "GPU: skew below ~1 us is not resolved across GPUs)"
    )


def _us(ns) -> float:
    return _round(ns / 1e3)


def _round(x) -> float:
    return round(float(x), 3)
