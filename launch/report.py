"""The decode job's report: checks, latency (a step's is its slowest rank's), a table.

A report is one JSON-able dict: ``config``, ``steps`` (total and per kind), ``latency``,
``checks`` (passed / of per check), ``worst`` (error / bound figures) and ``ok``; the
GPU job adds ``breakdown``, ``bytes`` and (one process per rank) ``per_rank``. ``finish``
writes the JSON, prints the table and the last line, ``DECODE OK`` or ``DECODE FAILED: ...``.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch

from kda.validate import HEAD_DIM
from launch.checks import SEED_GATE_MODES

MAX_SHOWN = 8  # failures spelled out on the last line
COPY_TBPS = 4.16  # H200 device-to-device copy TB/s, bytes read + written (measured)
PAGE_BYTES = HEAD_DIM * HEAD_DIM * 4
ENTRY_BYTES = HEAD_DIM * 4 + 2 * HEAD_DIM * 2  # a ring entry of one head: v_new fp32, k | g bf16


def refuse(message: str, speak: bool = True) -> int:
    """A job that cannot run: the last line (from the speaking process); exit status 2."""
    if speak:
        print(f"DECODE FAILED: {message}", flush=True)
    return 2


def percentile(values, q):
    """The ``q`` quantile of ``values`` by nearest rank (no interpolation)."""
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


class Checks:
    """Named pass/fail counts over steps; the failures as one line each."""

    def __init__(self):
        self.counts: dict[str, list[int]] = {}
        self.failures: list[str] = []

    def __call__(self, name, ok, step, detail=""):
        c = self.counts.setdefault(name, [0, 0])
        c[0] += int(bool(ok))
        c[1] += 1
        if not ok:
            self.failures.append(f"{name} (step {step})" + (f": {detail}" if detail else ""))
        return bool(ok)

    def as_dict(self):
        return {k: {"passed": v[0], "of": v[1]} for k, v in self.counts.items()}


def config(cfg, backend, launcher, **extra):
    """The configuration block of a report."""
    return {
        "backend": backend,
        "launcher": launcher,
        "tp": cfg.tp,
        "heads": cfg.heads,
        "heads_per_rank": cfg.heads_per_rank,
        "hidden": cfg.hidden,
        "requests": cfg.requests,
        "tokens": cfg.tokens,
        "blocks": cfg.blocks,
        "groups": cfg.groups,
        "conv_layout": "dim-first" if cfg.conv_dim_first else "window-first",
        "seed": cfg.seed,
        "kda_state": cfg.kda_state,
        "ring": cfg.ring if cfg.replay else None,
        "state_dtype": cfg.state_dtype,
        "gate": cfg.gate,
        **extra,
    }


def config_line(c) -> str:
    """The report's configuration (``config``'s block) as its one line."""
    return (
        f"config   backend {c['backend']} ({c['launcher']}), TP {c['tp']}, heads {c['heads']} "
        f"({c['heads_per_rank']}/rank), hidden {c['hidden']}, requests {c['requests']}, "
        f"tokens {c['tokens']}, blocks {c['blocks']}, groups {_groups(c['groups'])}, "
        f"conv {c['conv_layout']}, seed {c['seed']}, domain {c.get('domain_size', c['tp'])}, "
        f"kda state {c['kda_state']}"
        + (f" (ring {c['ring']})" if c["ring"] else "")
        + f", state pages {c.get('state_dtype', 'fp32')}, gate {c.get('gate', 'lower-bound')}"
    )


_announced: list[str] = []  # the configuration line printed before the steps
clock = time.monotonic  # Progress's (a test sets its own)


class Progress:
    """Process 0's lines while the job runs: the configuration first (``config``'s block),
    then at most one ``progress`` line every ``every_s`` seconds (none in a short run)."""

    def __init__(self, speak: bool, block: dict, total: int, every_s: float = 5.0):
        self.speak, self.total, self.every_s = speak, total, every_s
        self.start = self.last = clock()
        if speak:
            line = config_line(block)
            _announced.append(line)
            print(line, flush=True)

    def __call__(self, done: int) -> None:
        now = clock()
        if self.speak and now - self.last >= self.every_s and done < self.total:
            self.last = now
            print(f"progress step {done}/{self.total}, {now - self.start:.0f} s", flush=True)


def print_config(r):
    line = config_line(r["config"])
    if line not in _announced:  # printed before the steps: not again
        print(line)
    kinds = ", ".join(f"{v} {k}" for k, v in r["steps"].items() if k != "total")
    print(f"steps    {r['steps']['total']} ({kinds})")


def _groups(g):
    if isinstance(g, dict):
        return ", ".join(f"{v} at {k} tokens" for k, v in g.items())
    return "auto" if g is None else str(g)


def print_checks(r):
    print("checks")
    for name, v in r["checks"].items():
        mark = "ok  " if v["passed"] == v["of"] else "FAIL"
        print(f"  {mark} {name}: {v['passed']}/{v['of']} steps")


def check_json_path(path) -> str | None:
    """Why ``--json path`` cannot be written (checked at the start), or None."""
    if path is None:
        return None
    full = os.path.abspath(path)
    parent = os.path.dirname(full)
    if os.path.isdir(full):
        return f"--json {path}: is a directory"
    if not os.path.isdir(parent):
        return f"--json {path}: directory {parent} does not exist"
    if not os.access(parent, os.W_OK | os.X_OK) or (
        os.path.exists(full) and not os.access(full, os.W_OK)
    ):
        return f"--json {path}: not writable"
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident set (``VmHWM`` of /proc/self/status; 0 if unknown)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def finish(report, failures, json_path, printer) -> int:
    """Print the table, write the JSON, print the last line; the exit status (0 or 1)."""
    printer(report)
    if json_path:
        try:
            with open(json_path, "w") as f:
                json.dump(report, f, indent=2)
        except OSError as e:
            print(f"DECODE FAILED: --json {json_path}: {e.strerror or e}", flush=True)
            return 1
    if report["ok"]:
        print("DECODE OK", flush=True)
        return 0
    shown = failures[:MAX_SHOWN] or ["a check failed on another rank"]
    more = f"; ... ({len(failures) - MAX_SHOWN} more)" if len(failures) > MAX_SHOWN else ""
    print("DECODE FAILED: " + "; ".join(shown) + more, flush=True)
    return 1


def step_bytes(cfg, kind: str, tokens: int) -> dict:
    """Bytes a step moves with every request live (state pages read + written in the
    job's state dtype, w_o read) and the HBM floor they give at the H200's copy bandwidth.
    Replay steps: the checkpoint page and the ring's R entries read, the step's T entries
    written (a fold's page write, one in about R / T steps, not counted)."""
    page = PAGE_BYTES // 2 if getattr(cfg, "state_dtype", "fp32") == "bf16" else PAGE_BYTES
    if kind.startswith("replay"):
        state = cfg.requests * cfg.heads * (page + (cfg.ring + tokens) * ENTRY_BYTES)
    else:
        pages = {"decode": 2, "verify": 1 + tokens, "verify+record+recover": 2 + tokens}[kind]
        state = cfg.requests * cfg.heads * pages * page
    w_o = cfg.hidden * cfg.heads * HEAD_DIM * 2
    rows = cfg.requests * tokens
    mailbox = cfg.tp * cfg.tp * rows * cfg.hidden * 2
    floor_us = (state + w_o) / (COPY_TBPS * 1e6)
    return {"state": state, "w_o": w_o, "mailbox_stores": mailbox, "floor_us": floor_us}


def stats(values):
    """Median, p99 (nearest rank), max and count of GPU latencies (us)."""
    median, p99 = statistics.median(values), percentile(values, 0.99)
    return {"median_us": median, "p99_us": p99, "max_us": max(values), "n": len(values)}


def slowest_per_step(per_process):
    """Per step, the slowest process's replay: ``per_process`` is every process's list of
    (kind, us); returns {kind: [us per step]} (a step's latency is its slowest rank's)."""
    latency: dict[str, list[float]] = {}
    for entries in zip(*per_process, strict=True):
        latency.setdefault(entries[0][0], []).append(max(us for _, us in entries))
    return latency


def gpu_report(
    args, cfg, runner, launcher, kinds, per_process, stages, check, worst, ok, steady=None
):
    """The GPU job's report (process 0): ``per_process`` latencies, ``stages`` breakdowns,
    ``steady``: every process's (kind, [us per back-to-back step]) or Nones."""
    buckets = sorted(runner.buckets.values(), key=lambda b: (b.tokens, b.record))
    latency = slowest_per_step(per_process)
    everything = [v for vs in latency.values() for v in vs]
    lat = {k: stats(v) for k, v in latency.items()}
    if everything:
        lat["step"] = stats(everything)
    if steady and all(s is not None for s in steady):
        kind = steady[0][0]  # per step: the slowest process's
        per_step = zip(*(s[1] for s in steady), strict=True)
        lat[f"{kind} back to back"] = stats([max(us) for us in per_step])
    per_rank = None
    if len(per_process) > 1 and everything:  # nvshmem: one process per rank
        per_rank = [stats([us for _, us in entries]) for entries in per_process]
    breakdown = {}
    for kind in {k for d in stages for k in d}:
        names = next(d[kind] for d in stages if kind in d)
        breakdown[kind] = {n: max(d[kind][n] for d in stages if kind in d) for n in names}
    props = torch.cuda.get_device_properties(runner.device)
    multicast = any(c.multicast_base for c in runner.comms.values())
    extra = {
        "device": props.name,
        "processes": runner.procs.count,
        "kernel": {b.kind: b.kda_choice.kernel for b in buckets if b.kda_choice},
        "kernel_reason": {b.kind: b.kda_choice.reason for b in buckets if b.kda_choice},
        "gate_mode": args.gate_mode,
        "pdl": bool(args.pdl),
        "groups_chosen": {str(n): c.groups for n, c in sorted(runner.comms.items())},
        "publish": "multicast" if multicast else "per peer",
        "oproj_launch": runner.oproj_launch,
        "oproj_plan": {
            str(n): {
                "producer": c.plan.producer,
                "twoshot": c.twoshot,
                "bytes_per_rank": c.bytes,
                "reason": c.plan.reason,
            }
            for n, c in sorted(runner.comms.items())
        },
        "xmoe": runner.xmoe,
        "exact_gate_grids": args.gate_mode in SEED_GATE_MODES,
    }
    report = {
        "config": config(
            cfg, runner.backend.name, launcher, **extra, domain_size=runner.backend.domain.size
        ),
        "steps": {"total": sum(kinds.values()), **kinds},
        "latency": lat,
        "breakdown": {b.kind: breakdown[b.kind] for b in buckets if b.kind in breakdown},
        "bytes": {b.kind: step_bytes(cfg, b.kind, b.tokens) for b in buckets},
        "checks": check.as_dict(),
        "worst": worst,
        "ok": ok,
    }
    if per_rank is not None:
        report["per_rank"] = per_rank
    return report


def print_gpu(r):
    print_config(r)
    c = r["config"]
    kernels = ", ".join(f"{k}: {v}" for k, v in c["kernel"].items())
    groups = ", ".join(f"{v} at {k} rows" for k, v in c["groups_chosen"].items())
    twoshot = [k for k, v in c.get("oproj_plan", {}).items() if v.get("twoshot")]
    if twoshot:
        groups += f" (twoshot at {', '.join(twoshot)} rows)"
    print(
        f"gpu      {c['device']} x {c['processes']} process(es); KDA {kernels}; gate mode "
        f"{c['gate_mode']}, pdl {c['pdl']}; consumer groups {groups}; publish {c['publish']}; "
        f"o-projection launches {c['oproj_launch']}"
    )
    title = "latency (graph replay, all ranks)"
    if c["processes"] > 1:
        title = "latency (graph replay, max over ranks)"
    print(f"{title:<40}{'median us':>11}{'p99 us':>10}{'max us':>10}{'steps':>7}{'floor us':>10}")
    for name, v in r["latency"].items():
        floor = r["bytes"].get(name, {}).get("floor_us")
        f = f"{floor:>10.2f}" if floor is not None else f"{'':>10}"
        print(
            f"  {name:<38}{v['median_us']:>11.2f}{v['p99_us']:>10.2f}{v['max_us']:>10.2f}"
            f"{v['n']:>7}{f}"
        )
    for rank, v in enumerate(r.get("per_rank", [])):
        print(
            f"  {'rank ' + str(rank) + ' alone':<38}{v['median_us']:>11.2f}"
            f"{v['p99_us']:>10.2f}{v['max_us']:>10.2f}{v['n']:>7}"
        )
    where = "each stage of all ranks" if c["processes"] == 1 else "each stage, max over ranks"
    print(f"breakdown ({where} as its own graph, events, us)")
    for kind, stages in r["breakdown"].items():
        cells = ", ".join(f"{k} {v:.2f}" for k, v in stages.items())
        print(f"  {kind:<38}{cells}; sum {sum(stages.values()):.2f}")
    print("bytes per step (every request live; floor = (state + w_o) / 4.16 TB/s)")
    for kind, b in r["bytes"].items():
        print(
            f"  {kind:<38}state {b['state'] / 1e6:.2f} MB, w_o {b['w_o'] / 1e6:.2f} MB, "
            f"mailbox stores {b['mailbox_stores'] / 1e6:.2f} MB"
        )
    print_checks(r)
    w = r["worst"]
    print(
        f"  worst: kda {w['kda_ulp']:.2f} ulp (exact >= {w['kda_exact']:.4f}), state "
        f"{w['state']:.2e} of page max, partials {w['partial_ulp']:.2f} ulp, output "
        f"{w['output_ulp']:.2f} ulp; error / bound: prefix vs unsharded o-proj "
        f"{w['prefix']:.3f}, output vs fp64 epilogue {w['output']:.3f}"
    )

    print_replay(r, "per_step_ulp", "replay: vs per-step not compared", GPU_REPLAY)


GPU_REPLAY = (  # the report's replay line, the worst errors by name
    "replay: kda vs per-step reference {per_step_ulp:.2f} ulp, ring v_new {ring:.2e} of max, "
    "materialized state {materialized:.2e} of page max, {ring_folds} ring folds in the checked "
    "steps"
)
HOST_REPLAY = (
    "replay vs per-step: {per_step_rows} head rows not bitwise (o near a bf16 midpoint), "
    "materialized state {materialized:.2e} of page max, {ring_folds} ring folds"
)


def print_replay(r, key, skipped, compared) -> None:
    """The report's replay line, when the checks compared replay with the per-step path
    (``key`` in the worst errors): ``compared`` filled from them, or on bf16 pages
    ``skipped`` (the per-step path rounds at every store, replay once per fold)."""
    w = r["worst"]
    if key not in w:
        return
    bf16 = r["config"].get("state_dtype", "fp32") == "bf16"
    text = f"{skipped} (bf16 pages), {w['ring_folds']} ring folds" if bf16 else compared
    print("  " + text.format(**w))


def host_report(
    cfg, backend, info, kinds, slowest, stages, checks, worst, ok, rss=None, domain_size=None
):
    """The host job's report (rank 0): ``slowest`` [stage, step] seconds, slowest rank;
    ``rss``: every rank's peak resident set in bytes (``peak_rss_bytes``)."""
    ms = (slowest * 1e3).tolist()
    lat = {
        name: {"median_ms": percentile(ms[i], 0.5), "p99_ms": percentile(ms[i], 0.99)}
        for i, name in enumerate((*stages, "step"))
    }
    return {
        "config": config(cfg, backend, info.launcher, domain_size=domain_size or cfg.tp),
        "steps": {"total": cfg.steps, **kinds},
        "latency": lat,
        "checks": checks.as_dict(),
        "worst": worst,
        "ok": ok,
        "peak_rss_bytes": {"per_rank": list(rss or []), "total": sum(rss or [])},
    }


def print_host(r):
    print_config(r)
    print(f"{'latency (slowest rank)':<26}{'median ms':>12}{'p99 ms':>12}")
    for name, v in r["latency"].items():
        print(f"  {name:<24}{v['median_ms']:>12.3f}{v['p99_ms']:>12.3f}")
    print_checks(r)
    w = r["worst"]
    print(
        f"  worst error / bound: prefix vs unsharded o-proj {w['prefix']:.3f}, "
        f"output vs fp64 epilogue {w['output']:.3f}"
    )

    print_replay(r, "per_step_rows", "replay vs per-step: not compared", HOST_REPLAY)
    rss = r["peak_rss_bytes"]
    if rss["per_rank"]:
        print(
            f"memory   peak RSS {rss['total'] / 2**30:.2f} GiB over {len(rss['per_rank'])} "
            f"ranks (rank 0 {rss['per_rank'][0] / 2**30:.2f} GiB, largest other "
            f"{max(rss['per_rank'][1:], default=0) / 2**30:.2f} GiB)"
        )
