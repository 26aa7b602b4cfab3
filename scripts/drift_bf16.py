"""bf16 against fp32 state pages over a long decode: how far the rounded state drifts.

    python scripts/drift_bf16.py [--steps 4096] [--heads 4] [--requests 4] [--seed 0]
        [--json docs/data/drift_bf16.json] [--plot docs/drift_bf16.png]

Two copies of one synthetic layer (``kda.synthetic.make_layer``: a_log = log U(1, 16),
dt_bias ~ N(0, 0.5^2), fla's KDA initialisation) decode the same random tokens (T = 1,
``kda.synthetic.make_step``) with ``kda.reference.decode``, from zero state pages (fresh
requests), at ``lower_bound`` -5: one on an fp32 pool, one on a bf16 pool (the pages rounded
once per step, docs/contract.md "bf16 state pages"). The fp32 run is the reference; after
each step the script records

- the output error of the bf16 run's bf16 outputs against the fp32 run's: max abs, max abs
  relative to the reference's max |output|, max and mean ``|diff| / ulp(reference)`` in
  bf16 ulps (outputs at least 1/64 of their row's max), the fraction of outputs that differ;
- the state error of the bf16 pages against the fp32 ones (over all live pages): relative
  Frobenius norm ``||S_bf16 - S_fp32|| / ||S_fp32||`` and max abs, and the floor: the
  relative Frobenius norm of one rounding of the fp32 pages, ``||bf16(S_fp32) - S_fp32||``.

Writes the per-step series with the command, date and parameters as JSON and, unless
``--plot ''``, a two-panel PNG (Agg). CPU only; about a minute at the defaults on 2 cores.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/: _common

import torch  # noqa: E402
from _common import pyplot, save_figure  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kda import synthetic as kt  # noqa: E402

SERIES = (
    "out_max_abs",
    "out_rel",
    "out_max_ulps",
    "out_mean_ulps",
    "out_mismatch",
    "state_rel_fro",
    "state_max_abs",
    "state_floor_rel_fro",
)
CHECKPOINTS = (1, 16, 256, 1024, 4096)


FLOOR = 2.0**-6  # ulps are counted where |want| >= FLOOR * the row's max |want|


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The bf16 ulp at ``|x|`` (8 significant bits: ``2^(floor(log2 |x|) - 7)``), fp64."""
    _, exponent = torch.frexp(x.double().abs())
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), exponent - 8)


def output_error(got: torch.Tensor, want: torch.Tensor) -> dict:
    """Errors of bf16 outputs ``got`` against ``want`` ([rows, D], live rows). The ulp
    counts are ``|got - want| / ulp(want)`` over the outputs with ``|want|`` at least
    ``FLOOR`` of their row's max (near zero an ulp is meaningless: ``out_max_abs`` covers
    those)."""
    diff = (got.double() - want.double()).abs()
    magnitude = want.double().abs()
    scale = magnitude.max().item()
    counted = magnitude >= FLOOR * magnitude.amax(1, keepdim=True)
    ulps = (diff / bf16_ulp(want))[counted]
    return dict(
        out_max_abs=diff.max().item(),
        out_rel=diff.max().item() / scale if scale else 0.0,
        out_max_ulps=ulps.max().item(),
        out_mean_ulps=ulps.mean().item(),
        out_mismatch=(diff > 0).double().mean().item(),
    )


def state_error(got: torch.Tensor, want: torch.Tensor) -> dict:
    """Errors of the bf16 pages ``got`` against the fp32 pages ``want``."""
    diff = got.double() - want.double()
    norm = want.double().norm().item()
    floor = want.to(torch.bfloat16).double() - want.double()  # one rounding of the fp32 pages
    return dict(
        state_rel_fro=diff.norm().item() / norm if norm else 0.0,
        state_max_abs=diff.abs().max().item(),
        state_floor_rel_fro=floor.norm().item() / norm if norm else 0.0,
    )


def run(steps, heads, requests, seed, lower_bound=-5.0, progress=False) -> dict:
    """The two runs; returns ``{name: [per-step value]}`` for ``SERIES`` and ``step``."""
    torch.manual_seed(seed)
    pages = requests + 1
    high = kt.make_layer(heads, pages, window=3, seed=seed)
    high.state.zero_()
    low = high.clone()
    low.state = high.state.to(torch.bfloat16)
    live = torch.arange(1, pages)
    series = {name: [] for name in ("step", *SERIES)}
    start = time.time()
    for n in range(steps):
        step = kt.make_step(requests, 1, heads, pages=pages, seed=seed * 1_000_003 + n + 1)
        want = kt.run_reference(high, step, lower_bound=lower_bound)
        got = kt.run_reference(low, step, lower_bound=lower_bound)
        row = output_error(got, want) | state_error(low.state[live], high.state[live])
        series["step"].append(n + 1)
        for name in SERIES:
            series[name].append(float(f"{row[name]:.4g}"))
        if progress and (n + 1) % 512 == 0:
            print(f"step {n + 1}: {row} ({time.time() - start:.0f} s)", flush=True)
    return series


def summary(series) -> dict:
    """The series at the checkpoint steps that the run reached, and the max over the run."""
    out = {}
    for step in CHECKPOINTS:
        if step <= len(series["step"]):
            out[str(step)] = {name: series[name][step - 1] for name in SERIES}
    out["max"] = {name: max(series[name]) for name in SERIES}
    return out


def plot(data, out) -> None:
    """Output error (ulps, relative) and state error (relative Frobenius, max abs) against
    the step, log-log."""
    plt = pyplot()
    s, p = data["series"], data["parameters"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(s["step"], s["out_max_ulps"], lw=0.6, label="max |diff| / ulp (bf16)")
    left.plot(s["step"], s["out_mean_ulps"], lw=0.6, label="mean |diff| / ulp (bf16)")
    left.plot(s["step"], s["out_mismatch"], lw=0.6, label="fraction of outputs differing")
    left.set_title("output: bf16 pages vs fp32 pages")
    right.plot(s["step"], s["state_rel_fro"], lw=0.8, label="relative Frobenius")
    right.plot(s["step"], s["state_max_abs"], lw=0.8, label="max abs")
    right.plot(s["step"], s["state_floor_rel_fro"], lw=0.8, label="one rounding (rel. Frobenius)")
    right.set_title("state pages: bf16 vs fp32")
    left.set_yscale("symlog", linthresh=1e-2)  # step 1's output error is 0
    left.set_ylim(bottom=0)
    right.set_yscale("log")
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xlabel("decode step (T = 1)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"KDA reference, H={p['heads']} B={p['requests']}, lower_bound {p['lower_bound']}, "
        f"seed {p['seed']}",
        fontsize=9,
    )
    save_figure(fig, out, "bf16 state drift")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lower-bound", type=float, default=-5.0)
    parser.add_argument("--json", default=os.path.join(ROOT, "docs", "data", "drift_bf16.json"))
    parser.add_argument("--plot", default=os.path.join(ROOT, "docs", "drift_bf16.png"))
    parser.add_argument("--progress", action="store_true")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.heads < 1 or args.requests < 1:
        parser.error("--steps, --heads and --requests must be >= 1")
    start = time.time()
    series = run(args.steps, args.heads, args.requests, args.seed, args.lower_bound, args.progress)
    data = dict(
        command="python scripts/drift_bf16.py " + " ".join(sys.argv[1:] if argv is None else argv),
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        parameters=dict(
            **{k: getattr(args, k) for k in ("steps", "heads", "requests", "seed", "lower_bound")},
            tokens=1,
            initial_state="zero",
            layer="kda.synthetic.make_layer (a_log = log U(1, 16), dt_bias ~ N(0, 0.25))",
            inputs="kda.synthetic.make_step, fresh random activations per step",
            torch=torch.__version__,
            seconds=round(time.time() - start, 1),
        ),
        summary=summary(series),
        series=series,
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        head = {k: v for k, v in data.items() if k != "series"}
        series = json.dumps(data["series"], separators=(",", ":"))  # one line per run
        f.write(json.dumps(head, indent=1)[:-2] + f',\n "series": {series}\n}}\n')
    print(f"wrote {args.json}")
    if args.plot:
        plot(data, args.plot)
    return data


if __name__ == "__main__":
    main()
