"""The step model's report (``scripts/model_step.py``): text tables, the JSON written to
docs/data/tp_model.json (``to_json``; ``validate`` is its schema) and the plot.

The JSON holds {"what", "generated": {"command", "date"}, "limit", "parameters": {name:
{value, unit, kind, source}}, "calibration": [{name, measured_us, predicted_us, error,
loo_error, group, source}], "misses": [names], "predictions": [{tp, requests, tokens, rows,
domain, nodes, ours: {us, kda, producer, comm, consumer, fixed, remote, path}, peer: {us,
kda, producer, comm, consumer}, speedup, hierarchical?: {us, comm, consumer}}],
"assumptions": [text]}; errors are fractions (predicted / measured - 1).
"""

from __future__ import annotations

import math

SCHEMA = {
    "top": (
        "what",
        "generated",
        "limit",
        "parameters",
        "calibration",
        "misses",
        "predictions",
        "assumptions",
    ),
    "param": ("value", "unit", "kind", "source"),
    "calibration": ("name", "measured_us", "predicted_us", "error", "loo_error", "group", "source"),
    "prediction": (
        "tp",
        "requests",
        "tokens",
        "rows",
        "domain",
        "nodes",
        "ours",
        "peer",
        "speedup",
    ),
    "ours": ("us", "kda", "producer", "comm", "consumer", "fixed", "remote", "path"),
    "peer": ("us", "kda", "producer", "comm", "consumer"),
}
KINDS = ("measured", "derived", "stated", "fitted")


def misses(table: list[dict], limit: float) -> list[str]:
    """Names of the rows whose error, or leave-one-out error, exceeds ``limit``."""
    return [
        r["name"]
        for r in table
        if abs(r["error"]) > limit or (r["loo_error"] is not None and abs(r["loo_error"]) > limit)
    ]


def to_json(
    params: dict,
    table: list[dict],
    predictions: list[dict],
    *,
    command: str,
    date: str,
    limit: float,
    assumptions: list[str],
) -> dict:
    """The report as plain data (see the module docstring); ``params`` name -> Param."""
    return {
        "what": "step-latency model of one KDA decode layer per TP rank, one rank per GPU, "
        "Kimi shapes (96 heads, HID 7168, nb 8): ours against the fla + cuBLAS + NCCL peer",
        "generated": {"command": command, "date": date},
        "limit": limit,
        "parameters": {
            name: {"value": p.value, "unit": p.unit, "kind": p.kind, "source": p.source}
            for name, p in params.items()
        },
        "calibration": table,
        "misses": misses(table, limit),
        "predictions": predictions,
        "assumptions": list(assumptions),
    }


def _need(obj, keys, where):
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected an object, got {type(obj).__name__}")
    missing = [k for k in keys if k not in obj]
    if missing:
        raise ValueError(f"{where}: missing {missing}")


def _number(value, where):
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{where}: expected a finite number, got {value!r}")


def validate(report: dict) -> dict:
    """``report`` unchanged if it has the schema's keys, finite numbers, known parameter
    kinds and a source for every parameter; else ValueError naming the first bad field."""
    _need(report, SCHEMA["top"], "report")
    _need(report["generated"], ("command", "date"), "generated")
    for name, p in report["parameters"].items():
        _need(p, SCHEMA["param"], f"parameters.{name}")
        _number(p["value"], f"parameters.{name}.value")
        if p["kind"] not in KINDS:
            raise ValueError(f"parameters.{name}.kind: {p['kind']!r} is not one of {KINDS}")
        if not p["source"]:
            raise ValueError(f"parameters.{name}.source: empty")
    for i, r in enumerate(report["calibration"]):
        _need(r, SCHEMA["calibration"], f"calibration[{i}]")
        for key in ("measured_us", "predicted_us", "error"):
            _number(r[key], f"calibration[{i}].{key}")
    for i, r in enumerate(report["predictions"]):
        _need(r, SCHEMA["prediction"], f"predictions[{i}]")
        for side in ("ours", "peer"):
            _need(r[side], SCHEMA[side], f"predictions[{i}].{side}")
            for key in SCHEMA[side]:
                if key != "path":
                    _number(r[side][key], f"predictions[{i}].{side}.{key}")
    return report


def _pct(x):
    return "-" if x is None else f"{100 * x:+.1f}%"


def calibration_lines(table: list[dict], limit: float) -> list[str]:
    """Measured against predicted at every two-GPU row; '!' marks a miss of ``limit``."""
    lines = [f"{'two-GPU measurement':<58}{'measured':>9}{'model':>8}{'error':>8}{'loo':>8}  group"]
    flagged = set(misses(table, limit))
    for r in table:
        mark = "!" if r["name"] in flagged else " "
        lines.append(
            f"{r['name']:<58}{r['measured_us']:>9.1f}{r['predicted_us']:>8.1f}"
            f"{_pct(r['error']):>8}{_pct(r['loo_error']):>8} {mark}{r['group']}"
        )
    return lines


def prediction_lines(predictions: list[dict]) -> list[str]:
    """One line per (TP, B, T): ours and its parts, the peer and its parts, the ratio."""
    lines = [
        f"{'TP':>3}{'B':>5}{'T':>3}{'ours':>8}  {'KDA':>7}{'prod':>6}{'comm':>7}"
        f"{'cons':>7}{'fix':>6}  {'path':<9}{'peer':>8}  {'fla':>7}{'gemm':>6}{'nccl':>7}"
        f"{'torch':>7}{'peer/ours':>10}{'hier.':>8}"
    ]
    for r in predictions:
        o, p = r["ours"], r["peer"]
        hier = r.get("hierarchical")
        lines.append(
            f"{r['tp']:>3}{r['requests']:>5}{r['tokens']:>3}{o['us']:>8.1f}  {o['kda']:>7.1f}"
            f"{o['producer']:>6.1f}{o['comm']:>7.1f}{o['consumer']:>7.1f}{o['fixed']:>6.1f}  "
            f"{o['path']:<9}{p['us']:>8.1f}  {p['kda']:>7.1f}{p['producer']:>6.1f}"
            f"{p['comm']:>7.1f}{p['consumer']:>7.1f}{r['speedup']:>9.2f}x"
            f"{'-' if hier is None else format(hier['us'], '.1f'):>8}"
        )
    return lines


def param_lines(params: dict) -> list[str]:
    """Every parameter: name, value, unit, kind (sources are in the JSON)."""
    return [f"  {name:<26}{p.value:>10.3f} {p.unit:<8}{p.kind}" for name, p in params.items()]


def _log_log(ax, xlabel: str, ylabel: str, title: str) -> None:
    """Both axes logarithmic, labelled, with major and minor grid lines."""
    ax.set(xscale="log", yscale="log", xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(True, which="both", alpha=0.3)


def plot(predictions: list[dict], table: list[dict], path: str, limit: float) -> None:
    """Ours (solid) and the NCCL peer (dashed) per TP against requests, T 1 and T 4; TP 16's
    hierarchical what-if dotted; a third panel: every two-GPU row, model against measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    colours = {2: "tab:gray", 4: "tab:green", 8: "tab:blue", 16: "tab:red"}
    for ax, tokens in zip(axes[:2], (1, 4), strict=True):
        for tp, colour in colours.items():
            rows = [r for r in predictions if r["tp"] == tp and r["tokens"] == tokens]
            xs = [r["requests"] for r in rows]
            ax.plot(xs, [r["ours"]["us"] for r in rows], "-o", color=colour, label=f"ours TP {tp}")
            ax.plot(
                xs,
                [r["peer"]["us"] for r in rows],
                "--s",
                color=colour,
                alpha=0.7,
                label=f"NCCL peer TP {tp}",
            )
            if rows and "hierarchical" in rows[0]:
                ax.plot(
                    xs,
                    [r["hierarchical"]["us"] for r in rows],
                    ":^",
                    color=colour,
                    label=f"TP {tp} hierarchical (not built)",
                )
        _log_log(
            ax, "requests per step (B)", "us per step, one rank", f"predicted step, T = {tokens}"
        )
    axes[0].legend(fontsize=7, ncol=2)
    ax = axes[2]
    groups = sorted({r["group"] for r in table})
    for group in groups:
        rows = [r for r in table if r["group"] == group]
        ax.scatter(
            [r["measured_us"] for r in rows], [r["predicted_us"] for r in rows], label=group, s=18
        )
    lo = min(min(r["measured_us"], r["predicted_us"]) for r in table) * 0.8
    hi = max(max(r["measured_us"], r["predicted_us"]) for r in table) * 1.2
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    for f in (1 - limit, 1 + limit):
        ax.plot([lo, hi], [lo * f, hi * f], "k:", lw=0.8)
    title = f"calibration: every two-GPU row (dotted: +-{100 * limit:.0f}%)"
    _log_log(ax, "measured us (two H200)", "model us", title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
