"""Step-latency model of one KDA decode layer at TP 2 / 4 / 8 / 16.

    python3 scripts/model_step.py [--data docs/data] [--json docs/data/tp_model.json]
                                  [--plot docs/tp_model.png] [--no-write]
                                  [--vary NAME=VALUE ...]

Contract. Per TP rank and step, one rank per GPU, Kimi shapes (96 heads, HID 7168, nb 8),
B requests of T tokens (rows = B x T), in us (``model_parts.Model``):

- ours = KDA + producer + consumer + fixed + exchange + sync. KDA, producer and consumer
  are one GPU's measured kernel figures; ``fixed`` makes their sum at B 8 equal to the
  measured chain of one rank alone (the anchor, ``bench_decode.py --quick``), so away from
  B 8 the chain is that measurement plus the kernel figures' differences; ``exchange`` is
  the partial's trip between GPUs from the link parameters (stores into the peers'
  mailboxes inside an NVLink domain, one-shot or the plan's twoshot; one host-initiated
  put-with-signal per rank of another domain, over InfiniBand between nodes); ``sync`` is
  what meeting the peers costs on real GPUs beyond that, fitted to the two-GPU steps.
- peer (``bench_step.py``'s NCCL variant) = fla's KDA (recurrence + the composed path's
  conv / gate / norm kernels) + the cuBLAS partial + NCCL all_reduce (NCCL's own tuning
  model) + the torch epilogue, fitted to the two-GPU NCCL rows.

``build`` reads every measured figure from docs/data (a later measurement there replaces
it), ``calibrate`` fits the few fitted parameters to the two-GPU rows and reports every
row's error (and, for fitted rows, its leave-one-out error), ``predict`` prices TP 2 / 4 /
8 / 16 as deployed (TP 16: two nodes of 8). The report (tables, JSON, plot) is
``model_report.py``; docs/tp_model.md the method and the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from model_parts import (  # noqa: E402
    ASSUMPTIONS,
    BF16,
    BLOCKS,
    DATA,
    HEADS,
    HIDDEN,
    LIMIT,
    REQUESTS,
    STATED,
    TOKENS,
    TPS,
    Model,
    Param,
    Topology,
    deployed,
    derived,
    measured,
)

LINKS_FILE = "links.json"  # two-GPU link measurements; replace STATED key by key
FITS = {  # group -> the parameters it fits (a constant, or a constant and a per-row slope)
    "sync": ("sync_us",),
    "bench": ("bench_us",),
    "epilogue": ("epilogue_us", "epilogue_row_us"),
}
FITTED = [name for names in FITS.values() for name in names]


def load(data: Path, name: str) -> dict:
    with open(data / name) as f:
        return json.load(f)


# --- the model from docs/data ------------------------------------------------------------


def kernel_points(data: Path, figures: dict) -> tuple[dict, dict]:
    """({T: [(items, us)]} of kda.decode, {T: [(items, us)]} of fla's recurrence): the
    kernel table (replay_rows_h200.json's per-step path and fla) and the small-batch rows."""
    kda: dict = {1: [], 4: []}
    fla: dict = {1: [], 4: []}
    seen = set()
    for r in load(data, "replay_rows_h200.json")["replay_rows"]:
        key = (r["H"], r["B"], r["T"])
        if key in seen or r["T"] not in kda:
            continue
        seen.add(key)
        kda[r["T"]].append((r["H"] * r["B"], r["per_step_us"]))
        fla[r["T"]].append((r["H"] * r["B"], r["fla_us"]))
    for r in figures["one_gpu"]["kda_small_batch"]["rows"]:
        kda[r["tokens"]].append((r["heads"] * r["requests"], r["us"]))
    for r in figures["one_gpu"]["fla_composed"]["rows"]:
        if r["requests"] < 8:  # the table's larger rows are replay_rows_h200.json's own run
            fla[1].append((r["heads"] * r["requests"], r["recurrence_us"]))
    return kda, fla


def loopback_fits(data: Path, copy: float, rate: float, launch: float) -> dict:
    """From the loopback rows tables (every TP rank on one GPU, each stage its own graph),
    rows >= 32: the consumers' bandwidth per TP (median of the consume stage's bytes / time)
    and cuBLAS's efficiency and the publisher's share of the copy bandwidth: the grid point
    whose produce stage = ``launch`` (a stage graph's own) + max(w_o / copy, FLOPs / rate) /
    efficiency + the one-launch publisher's bytes / (copy x share) misses least (max)."""
    cons: dict = {}
    stages = []
    for tp in (8, 16):
        for r in load(data, f"decode_rows_tp{tp}.json")["rows"]:
            if r["rows"] < 32:
                continue
            part = r["rows"] * HIDDEN * BF16
            s = r["stages_us"]
            cons.setdefault(tp, []).append(tp * part * (tp + BLOCKS + 3) / s["consume"] / 1e6)
            work = max(r["w_o_bytes"] / (copy * 1e6), r["gemm_flops"] / (rate * 1e6))
            publish = (tp * tp + tp) * part / (copy * 1e6)  # one launch: every rank's mailboxes
            stages.append((work, publish, s["produce"]))
    grid = [(e / 100, p / 100) for e in range(30, 101) for p in range(30, 151)]
    err, e, p = min(
        (max(abs((launch + w / e + pub / p) / t - 1) for w, pub, t in stages), e, p)
        for e, p in grid
    )
    return {
        "consumer_tbps": {tp: statistics.median(v) for tp, v in cons.items()},
        "gemm_efficiency": e,
        "publish_share": p,
        "max_miss": err,
    }


def stage_launch(data: Path) -> float:
    """A stage graph's own launch: the mean over KDA / producer / consumer of the stage
    graph's time less the same stage's traced time inside the step (trace_tp2.json)."""
    trace = load(data, "trace_tp2.json")
    alone = trace["breakdown"]["decode"]
    traced = trace["timeline"]["summary"]["per_rank"]
    return statistics.fmean(
        alone[s] - statistics.fmean(r[f"{s}_us"] for r in traced)
        for s in ("kda", "produce", "consume")
    )


def kernel_params(data: Path, figures: dict) -> dict:
    """The measured and derived parameters of one GPU's kernels (docs/data)."""
    one = figures["one_gpu"]
    rows8, rows16 = load(data, "decode_rows_tp8.json"), load(data, "decode_rows_tp16.json")
    copy = statistics.fmean([rows8["copy_tbps"], rows16["copy_tbps"]])
    rate = statistics.fmean([rows8["gemm_tflops"], rows16["gemm_tflops"]])
    src = "docs/data/decode_rows_tp8.json, decode_rows_tp16.json"
    trace = load(data, "trace_tp2.json")["timeline"]["summary"]["per_rank"]
    launch = stage_launch(data)
    fits = loopback_fits(data, copy, rate, launch)
    prod, cons = one["producer_one_rank"], one["consumer_one_rank"]
    tail = cons["rows"] * HIDDEN * BF16 * (cons["tp"] + BLOCKS + 3)
    tail /= fits["consumer_tbps"][cons["tp"]] * 1e6
    comp = [
        r["composed_us"] - r["recurrence_us"]
        for r in one["fla_composed"]["rows"]
        if r["heads"] >= 12
    ]
    fit_why = (
        f"{src}, rows >= 32: the grid fit of the produce stage (its graph's launch + "
        "cuBLAS work / efficiency + the one-launch publisher's bytes / (copy x share)); "
        f"max miss {100 * fits['max_miss']:.0f}%"
    )
    p = {
        "copy_tbps": measured(copy, "TB/s", f"device copy bandwidth, mean of {src}"),
        "gemm_tflops": measured(rate, "TFLOP/s", f"a large cuBLAS GEMM's rate, mean of {src}"),
        "launch_us": measured(
            statistics.fmean(r["launch_us"] for r in trace),
            "us",
            "one kernel boundary inside a step's graph: trace_tp2.json "
            "(summary launch_us, mean over the ranks)",
        ),
        "stage_launch_us": derived(
            launch,
            "us",
            "a stage graph's own launch: trace_tp2.json, "
            "mean over the stages of the stage graph (breakdown) less "
            "the traced stage inside the step",
        ),
        "gemm_efficiency": derived(fits["gemm_efficiency"], "", fit_why),
        "publish_share": derived(fits["publish_share"], "", fit_why),
        "producer_tbps": derived(
            prod["d_local"] * HIDDEN * BF16 / prod["us"] / 1e6,
            "TB/s",
            f"w_o bytes / time of one rank's mma.sync producer at TP 16, "
            f"{prod['us']} us (readme_figures.json: {prod['stated_in']})",
        ),
        "consumer_fixed_us": derived(
            cons["us"] - tail,
            "us",
            f"one rank's consumer at TP 16, 1 row, {cons['us']} us "
            "(readme_figures.json) less its bytes at "
            "consumer_tbps_tp16",
        ),
        "fla_extra_us": derived(
            statistics.median(comp),
            "us",
            "median of fla composed - recurrence at H 12 / 96 "
            "(readme_figures.json fla_composed; the H 6 rows, 3x their "
            "recurrence at B >= 32, left out)",
        ),
    }
    for tp, tbps in fits["consumer_tbps"].items():
        p[f"consumer_tbps_tp{tp}"] = derived(
            tbps,
            "TB/s",
            f"decode_rows_tp{tp}.json: median over rows >= 32 of the consume "
            "stage's bytes (every rank's TP + nb + 3 rows of HID) / time; for TP "
            f"{'<= 8' if tp == 8 else tp}",
        )
    return p


def anchors_from(figures: dict) -> dict:
    """{tp: {tp, requests, heads_per_rank, us (mean of the runs), runs}} of the measured
    one-rank chains (readme_figures.json chain_alone)."""
    anchors: dict = {}
    for r in figures["one_gpu"]["chain_alone"]["rows"]:
        a = anchors.setdefault(
            r["tp"],
            {
                "tp": r["tp"],
                "requests": r["requests"],
                "heads_per_rank": HEADS // r["tp"],
                "runs": [],
            },
        )
        a["runs"].append(r["us"])
    for a in anchors.values():
        a["us"] = statistics.fmean(a["runs"])
    return anchors


def build(data: Path = DATA) -> Model:
    """The model with every measured, derived and stated parameter; the fitted ones 0 until
    ``calibrate``. ``data/links.json`` ({"command", "date", "values": {name: value}}), once
    the links are measured on two GPUs, replaces those stated figures."""
    figures = load(data, "readme_figures.json")
    p = dict(STATED)
    if (data / LINKS_FILE).exists():
        links = load(data, LINKS_FILE)
        for name, value in links["values"].items():
            p[name] = measured(
                value, STATED[name].unit, f"{LINKS_FILE}: {links['command']} ({links['date']})"
            )
    p.update(kernel_params(data, figures))
    for name in FITTED:
        p[name] = Param(0.0, "us/row" if name.endswith("row_us") else "us", "fitted", "not yet")
    kda, fla = kernel_points(data, figures)
    model = Model(p, kda, fla, anchors_from(figures))
    return model.with_params("derived", **split_costs(model, figures["two_gpu"]))


def split_costs(model: Model, two: dict) -> dict:
    """``put_us`` and ``split_us`` from the two-GPU ``--domain-size 1`` run: one put's issue
    cost = its producer stage's growth less the put's bytes on NVLink; the rest of the step's
    growth is the consumer's signal wait and re-arm."""
    d1 = two["step_domain1"]
    _, bw = model.link("nvlink")
    wire = 8 * HIDDEN * BF16 / bw  # B 8, T 1: the put's bytes
    put = d1["stages_us"]["produce"] - d1["load_store"]["stages_us"]["produce"] - wire
    # the model's step grows by put + wire + remote latency - (latency + wire) + split
    split = d1["back_to_back_us"] - d1["load_store"]["back_to_back_us"] - put
    why = f"readme_figures.json two_gpu.step_domain1 ({d1['stated_in']})"
    return {
        "put_us": (put, f"{why}: the produce stage's growth less the bytes on NVLink"),
        "split_us": (split, f"{why}: the step's growth less the put and its link"),
    }


# --- calibration against the two-GPU measurements ----------------------------------------


@dataclass(frozen=True)
class Row:
    """One two-GPU measurement and how the model predicts it. ``group``: the fitted
    parameter group it calibrates ("sync", "bench", "epilogue"), "derived" (a parameter was
    derived from it) or "check" (not used by any parameter)."""

    name: str
    measured: float
    predict: object  # Model -> us
    group: str
    source: str
    rows: int = 1


FIT_WHAT = {
    "sync": "ours' two-GPU steps (step_tp2.json, trace_tp2.json, the README's B 8 run)",
    "bench": "ours' two-GPU bench_allreduce.py rows (readme_figures.json)",
    "epilogue": "the NCCL peer's two-GPU rows (step_tp2.json, bench_allreduce.py)",
}


def two_gpu_rows(data: Path = DATA) -> list[Row]:
    """Every two-GPU measurement in docs/data, with its prediction (TP 2 at 24 heads: one
    TP 8 rank's shard; bench_allreduce at 96 heads: 6144 columns of w_o per rank)."""
    tp2, d1 = Topology(2, 2, "nvlink"), Topology(2, 1, "nvlink")
    out: list[Row] = []

    def add(name, us, predict, group, source, rows):
        out.append(Row(name, us, predict, group, source, rows))

    def step(m, b):
        return m.ours(tp2, b, 1, heads=24, path="one-shot")

    run = load(data, "step_tp2.json")
    src = f"step_tp2.json ({run['measured']['date']})"
    for r in run["rows"]:
        b, v = r["requests"], r["variants"]
        add(
            f"TP 2 step B {b}: ours",
            v["ours"]["median_us"],
            lambda m, b=b: step(m, b)["us"],
            "sync",
            src,
            b,
        )
        add(
            f"TP 2 step B {b}: NCCL peer",
            v["nccl"]["median_us"],
            lambda m, b=b: m.peer(tp2, b, 1, heads=24)["us"],
            "epilogue",
            src,
            b,
        )
    trace = load(data, "trace_tp2.json")
    b = trace["config"]["requests"]
    src = f"trace_tp2.json ({trace['measured']['date']})"
    add(
        f"TP 2 step B {b}: ours, trace run's back to back",
        trace["latency"]["decode back to back"]["median_us"],
        lambda m: step(m, b)["us"],
        "sync",
        src,
        b,
    )
    for stage, part in (("kda", "kda"), ("produce", "producer"), ("consume", "consumer")):
        traced = statistics.fmean(
            r[f"{stage}_us"] for r in trace["timeline"]["summary"]["per_rank"]
        )
        add(
            f"TP 2 B {b}: traced {stage} stage (+1 kernel boundary)",
            traced,
            lambda m, part=part: step(m, b)[part] + m.v("launch_us"),
            "check",
            src,
            b,
        )
    two = load(data, "readme_figures.json")["two_gpu"]
    run = two["step_issue14"]
    add(
        "TP 2 step B 8: ours, the first two-GPU run",
        run["back_to_back_us"],
        lambda m: step(m, 8)["us"],
        "sync",
        f"readme_figures.json ({run['stated_in']})",
        8,
    )
    run = two["step_domain1"]
    add(
        "TP 2 step B 8: ours, --domain-size 1 (puts)",
        run["back_to_back_us"],
        lambda m: m.ours(d1, 8, 1, heads=24)["us"],
        "derived",
        f"readme_figures.json ({run['stated_in']})",
        8,
    )
    ar = two["allreduce_tp2"]
    src, cols = f"readme_figures.json ({ar['stated_in']})", ar["d_local"]
    for r in ar["rows"]:
        n = r["rows"]
        add(
            f"TP 2 exchange {n} rows: ours producer + consumer",
            r["ours_us"],
            lambda m, n=n: m.oproj(tp2, n, cols)["ours"],
            "bench",
            src,
            n,
        )
        add(
            f"TP 2 exchange {n} rows: ours consumer alone",
            r["consumer_us"],
            lambda m, n=n: m.oproj(tp2, n, cols)["consumer"],
            "bench",
            src,
            n,
        )
        add(
            f"TP 2 exchange {n} rows: NCCL GEMM + all_reduce + torch",
            r["nccl_us"],
            lambda m, n=n: m.peer_oproj(tp2, n, cols),
            "epilogue",
            src,
            n,
        )
    return out


def fit(model: Model, rows: list[Row], group: str) -> dict:
    """Least squares of the relative error over ``rows`` for ``group``'s parameters (their
    current values taken as 0): {name: value}."""
    names = FITS[group]
    base = model.with_params(**{n: (0.0, "") for n in names})
    # residual_i = theta . x_i, x_i = (1,) or (1, rows_i); weight 1 / measured_i^2
    xs = [(1.0, float(r.rows))[: len(names)] for r in rows]
    ys = [r.measured - r.predict(base) for r in rows]
    ws = [1.0 / r.measured**2 for r in rows]
    if len(names) == 1:
        return {names[0]: sum(w * y for w, y in zip(ws, ys, strict=True)) / sum(ws)}
    s = [
        [sum(w * x[i] * x[j] for w, x in zip(ws, xs, strict=True)) for j in range(2)]
        for i in range(2)
    ]
    t = [sum(w * x[i] * y for w, x, y in zip(ws, xs, ys, strict=True)) for i in range(2)]
    det = s[0][0] * s[1][1] - s[0][1] * s[1][0]
    return {
        names[0]: (t[0] * s[1][1] - t[1] * s[0][1]) / det,
        names[1]: (s[0][0] * t[1] - s[1][0] * t[0]) / det,
    }


def calibrate(model: Model, rows: list[Row]) -> tuple[Model, list[dict]]:
    """Fit each group in turn (sync, then bench, then the epilogue); returns the fitted
    model and per row {name, measured, predicted, error, loo (the row's error with its
    group refitted without it; None outside fitted groups), group, source}."""
    loo: dict = {}
    for group in FITS:
        members = [r for r in rows if r.group == group]
        for r in members:
            others = [o for o in members if o is not r]
            if len(others) >= len(FITS[group]):
                m = model.with_params(**{n: (v, "") for n, v in fit(model, others, group).items()})
                loo[r.name] = r.predict(m) / r.measured - 1
        values = fit(model, members, group)
        model = model.with_params(
            **{n: (v, f"fitted to {FIT_WHAT[group]}") for n, v in values.items()}
        )
    table = []
    for r in rows:
        predicted = r.predict(model)
        table.append(
            {
                "name": r.name,
                "measured_us": r.measured,
                "predicted_us": predicted,
                "error": predicted / r.measured - 1,
                "loo_error": loo.get(r.name),
                "group": r.group,
                "source": r.source,
            }
        )
    return model, table


# --- predictions ---------------------------------------------------------------------------


def predict(model: Model, tps=TPS, requests=REQUESTS, tokens=TOKENS) -> list[dict]:
    """Every (TP, B, T) as deployed (``deployed``): ours, the NCCL peer, their ratio."""
    out = []
    for tp in tps:
        topo = deployed(tp)
        for t in tokens:
            for b in requests:
                ours, peer = model.ours(topo, b, t), model.peer(topo, b, t)
                row = {
                    "tp": tp,
                    "requests": b,
                    "tokens": t,
                    "rows": b * t,
                    "domain": topo.domain,
                    "nodes": topo.nodes,
                    "ours": ours,
                    "peer": peer,
                    "speedup": peer["us"] / ours["us"],
                }
                if topo.domain < tp:
                    row["hierarchical"] = model.hierarchical(topo, b, t)
                out.append(row)
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(DATA), help="the measurements' folder")
    p.add_argument("--json", default=str(DATA / "tp_model.json"), help="report JSON path")
    p.add_argument("--plot", default=str(DATA.parent / "tp_model.png"), help="plot path")
    p.add_argument("--no-write", action="store_true", help="print only")
    p.add_argument(
        "--vary",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a measured, derived or stated parameter's value for this run (the "
        "fitted ones are refitted around it): what the predictions owe to it",
    )
    args = p.parse_args(argv)
    try:
        args.vary = {k: float(v) for k, v in (item.split("=", 1) for item in args.vary)}
    except ValueError:
        p.error(f"--vary takes NAME=VALUE (a number); got {args.vary}")
    return args


def shown(path) -> str:
    """``path`` relative to the checkout when inside it (what the output prints)."""
    path = Path(path).resolve()
    root = DATA.parents[1]
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def run(data: Path = DATA, vary: dict | None = None) -> tuple[Model, list[dict], list[dict]]:
    """(the calibrated model, the calibration table, the predictions) from ``data``, with
    ``vary`` {name: value} replacing parameters before the fit (ValueError: a fitted one or
    an unknown name)."""
    model = build(data)
    for name, value in (vary or {}).items():
        if name not in model.p or name in FITTED:
            raise ValueError(f"--vary {name}: not a measured, derived or stated parameter")
        p = model.p[name]
        model.p[name] = Param(value, p.unit, p.kind, f"{p.source} [--vary: was {p.value:g}]")
    model, table = calibrate(model, two_gpu_rows(data))
    return model, table, predict(model)


def main(argv=None) -> int:
    import datetime

    import model_report as rep

    args = parse_args(argv)
    model, table, predictions = run(Path(args.data), args.vary)
    command = "python3 scripts/model_step.py" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
    report = rep.validate(
        rep.to_json(
            model.p,
            table,
            predictions,
            command=command,
            date=datetime.date.today().isoformat(),
            limit=LIMIT,
            assumptions=ASSUMPTIONS,
        )
    )
    print(
        "parameters (kind: measured / derived from docs/data, stated, fitted; sources in the JSON)"
    )
    print("\n".join(rep.param_lines(model.p)))
    print(
        f"\ncalibration: every two-GPU measurement in {shown(args.data)} (error = model / "
        "measured - 1; loo = the row left out of its group's fit; '!' beyond "
        f"{100 * LIMIT:.0f}%)"
    )
    print("\n".join(rep.calibration_lines(table, LIMIT)))
    print(
        "\npredicted step per rank as deployed (TP 16: two nodes), us; ours = KDA + prod + "
        "comm + cons + fix; peer = fla + gemm + nccl + torch; hier. = TP 16 what-if"
    )
    print("\n".join(rep.prediction_lines(predictions)))
    if not args.no_write:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
        rep.plot(predictions, table, args.plot, LIMIT)
        print(f"\nwrote {shown(args.json)} and {shown(args.plot)}")
    missed = report["misses"]
    print(
        f"MODEL: {len(table) - len(missed)} of {len(table)} two-GPU rows within "
        f"{100 * LIMIT:.0f}% (fit and leave-one-out); beyond: {'; '.join(missed) or 'none'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
