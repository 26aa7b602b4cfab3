"""What the benchmarks and plots share: CUDA-event timing of a call or of a graph's replays
(``time_graph``), the copy bandwidth, JSON written whole, and the plots' matplotlib backend
and image writing. torch and matplotlib are imported on
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


HOST_AHEAD_CYCLES = 4_000_000  # ~2 ms of GPU sleep: the host enqueues the timed call meanwhile


def median_replays(fn, replays, before=None, cycle=1) -> float:
    """Median GPU time (us) of ``fn()`` over ``replays`` samples, each the mean of
    ``cycle`` consecutive calls, every call after an untimed ``before()``. ``cycle``: the
    ring size R in replay mode, where each call advances every ring, so each window of R
    calls holds exactly one fold per request (the median of single calls would skip the
    folding ones). The GPU sleeps ~2 ms before each start event, so the host has enqueued
    the call before the GPU reaches it: the time is the GPU's, not the host's dispatch
    (``host_us``)."""
    import torch

    times = []
    for _ in range(replays * cycle):
        if before is not None:
            before()
        torch.cuda._sleep(HOST_AHEAD_CYCLES)
        times.append(event_us(fn))
    return statistics.median(cycle_means(times, cycle))


def cycle_means(times, cycle) -> list:
    """Means of consecutive windows of ``cycle`` times (a trailing partial window dropped)."""
    if cycle < 1:
        raise ValueError(f"cycle must be >= 1; got {cycle}")
    return [statistics.fmean(times[i : i + cycle]) for i in range(0, len(times) - cycle + 1, cycle)]


def host_us(fn, calls, before=None) -> float:
    """Host time (us) of one ``before(); fn()`` call, the GPU kept busy meanwhile (its
    sleep covers every call's dispatch, so no call waits for the GPU)."""
    import time

    import torch

    torch.cuda.synchronize()
    torch.cuda._sleep(HOST_AHEAD_CYCLES * 10)
    t0 = time.perf_counter()
    for _ in range(calls):
        if before is not None:
            before()
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return us


def captured(fn):
    """``fn()`` (already run once: compiled) captured as a CUDA graph on a side stream."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        fn()
    return graph


def graph_us(fn, iters, repeats) -> float:
    """Median us per step of a graph of ``iters`` calls ``fn(i)`` (i: the step)."""
    import torch

    fn(0)
    torch.cuda.synchronize()
    graph = captured(lambda: [fn(i) for i in range(iters)])
    return replay_us(graph, repeats, iters)


def cell(v, width=9, digits=2) -> str:
    """A table cell: ``v`` right-aligned in ``width`` with ``digits`` decimals, or ``-``."""
    return f"{'-':>{width}}" if v is None else f"{v:>{width}.{digits}f}"


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


def time_graph(fn, replays=7, inner=1):
    """Median time (us) of one replay of a CUDA graph of ``fn`` divided by ``inner``."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up / compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return replay_us(graph, replays, inner)


def copy_bandwidth():
    """Device-to-device copy, bytes read + written per second (TB/s)."""
    import torch

    n = 1 << 28  # 1 GiB of fp32
    a = torch.empty(n, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    graph_us = time_graph(lambda: b.copy_(a), replays=9)
    eager = [event_us(lambda: b.copy_(a)) for _ in range(9)]  # a plain cudaMemcpyAsync
    us = min(graph_us, statistics.median(eager))
    return 2 * 4 * n / (us * 1e-6) / 1e12


def write_json(path, payload):
    """Write ``payload`` to ``path`` whole (a run killed mid-write keeps the last rows)."""
    import json

    partial = f"{path}.partial"
    with open(partial, "w") as handle:
        json.dump(payload, handle, indent=1)
    os.replace(partial, path)
