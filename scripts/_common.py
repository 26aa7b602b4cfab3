"""What the benchmarks and plots share: CUDA-event timing of a call or of a graph's replays,
and the plots' matplotlib backend and image writing. torch and matplotlib are imported on
first use, so a plot never needs torch and a benchmark never needs matplotlib."""

from __future__ import annotations

import os
import statistics


def event_us(fn) -> float:
    """Microseconds of ``fn()`` on the current stream, between two CUDA events."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def replay_us(graph, reps: int, per: int = 1) -> float:
    """Median microseconds of ``reps`` timed replays of the CUDA ``graph``, divided by
    ``per`` (the steps one replay holds)."""
    return statistics.median(event_us(graph.replay) / per for _ in range(reps))


def json_rows(paths) -> tuple[list, list]:
    """(the ``rows`` of every benchmark JSON in ``paths``, the devices they name, in order;
    a device measured on loopback, as ``docs/data``'s files record, marked so)."""
    import json

    rows, devices = [], []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        rows += data["rows"]
        device = data.get("device")
        if device and "loopback" in data.get("measured", {}).get("machine", ""):
            device += " (loopback)"
        if device and device not in devices:
            devices.append(device)
    return rows, devices


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (images only, no display); ImportError
    without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def rows_axes(ax, ticks) -> None:
    """A rows-per-step panel: x log2 with a tick at each measured rows count (``ticks``),
    y log10 with 1-2-5 labels in plain numbers."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    if ticks:
        ax.set_xticks(sorted(ticks), [str(x) for x in sorted(ticks)])
        ax.minorticks_off()


def finish_rows_panel(ax, ticks, xlabel, ylabel, title, legend=7) -> None:
    """A rows-per-step panel's axes (``rows_axes``), labels, title, grid and legend."""
    rows_axes(ax, ticks)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize=legend)


def save_figure(fig, out: str, what: str = "", dpi: int = 120) -> None:
    """``fig`` laid out tight, written to ``out`` (its folder made first) and closed; prints
    ``wrote out (what)``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    print(f"wrote {out}" + (f" ({what})" if what else ""))
