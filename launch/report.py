"""The decode job's report, shared by the host and GPU runners: checks, latency, a table.

A report is one JSON-able dict: ``config``, ``steps`` (total and per kind), ``latency``,
``checks`` (passed / of per check), ``worst`` (error / bound figures) and ``ok``; the
GPU runner adds ``breakdown`` and ``bytes``. ``finish`` writes the JSON, prints the table
and the last line, ``DECODE OK`` or ``DECODE FAILED: ...``.
"""

from __future__ import annotations

import json

MAX_SHOWN = 8  # failures spelled out on the last line


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
        **extra,
    }


def print_config(r):
    c = r["config"]
    print(
        f"config   backend {c['backend']} ({c['launcher']}), TP {c['tp']}, heads {c['heads']} "
        f"({c['heads_per_rank']}/rank), hidden {c['hidden']}, requests {c['requests']}, "
        f"tokens {c['tokens']}, blocks {c['blocks']}, groups {_groups(c['groups'])}, "
        f"conv {c['conv_layout']}, seed {c['seed']}"
    )
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


def finish(report, failures, json_path, printer) -> int:
    """Write the JSON, print the table and the last line; the exit status (0 or 1)."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
    printer(report)
    if report["ok"]:
        print("DECODE OK", flush=True)
        return 0
    shown = failures[:MAX_SHOWN] or ["a check failed on another rank"]
    more = f"; ... ({len(failures) - MAX_SHOWN} more)" if len(failures) > MAX_SHOWN else ""
    print("DECODE FAILED: " + "; ".join(shown) + more, flush=True)
    return 1
