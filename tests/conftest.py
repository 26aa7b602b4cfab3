import json
import os
import pathlib
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

if hasattr(os, "geteuid") and os.geteuid() == 0:  # Open MPI refuses root without these (the
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")  # GPU machine runs the suite as
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")  # root); mpirun tests inherit


def _has_cuda():
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


# Seconds per test of the last GPU suite (``--gpu-durations-out`` rewrites it).
DURATIONS = pathlib.Path(__file__).with_name("gpu_durations.json")


def pytest_addoption(parser):
    what = "write each GPU test's call duration (seconds) to PATH as JSON"
    parser.addoption("--gpu-durations-out", default=None, metavar="PATH", help=what)
    what = (
        "append each failing test's id to PATH as soon as it is reported (kept when the "
        "run is cut off before pytest's summary)"
    )
    parser.addoption("--gpu-failures-out", default=None, metavar="PATH", help=what)
    what = (
        "run part K of N (K/N, e.g. 1/2) of the collected tests, split by the recorded GPU "
        "durations so that the parts take about as long (a suite in several device calls)"
    )
    parser.addoption("--gpu-shard", default=None, metavar="K/N", help=what)


_failures_out: list = []  # the controller's --gpu-failures-out, if any


def pytest_configure(config):
    # ``-n N``: loadgroup instead of load, so the tests marked ``xdist_group`` (fla's, whose
    # Triton compiles and autotuning take minutes) share one worker and its caches; each
    # other test is its own unit, handed out in the order below as under load
    if getattr(config.option, "dist", "no") == "load" and not hasattr(config, "workerinput"):
        config.option.dist = "loadgroup"
    if getattr(config, "workerinput", {}).get("loadgroup"):  # a worker parses the command
        config.option.loadgroup = True  # line again (dist "load"): told by the controller
    out = config.getoption("--gpu-failures-out")
    if out and not hasattr(config, "workerinput"):  # the controller sees every report
        pathlib.Path(out).write_text("")
        _failures_out.append(out)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: on the controller, per worker
def pytest_configure_node(node):
    node.workerinput["loadgroup"] = node.config.option.dist == "loadgroup"


def shard_of(nodeids, known, count):
    """Part (0-based) of each node id when ``count`` parts share them: longest first (no
    recorded time: the longest recorded), each to the part with the least total so far."""
    default = max(known.values(), default=1.0)
    order = sorted(nodeids, key=lambda n: (-known.get(n, default), n))
    totals, part = [0.0] * count, {}
    for nodeid in order:
        k = min(range(count), key=lambda i: (totals[i], i))
        part[nodeid] = k
        totals[k] += known.get(nodeid, default)
    return part


def _parse_shard(text):
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--gpu-shard must be K/N; got {text!r}") from None
    if not 1 <= k <= n:
        raise pytest.UsageError(f"--gpu-shard must be K/N with 1 <= K <= N; got {text!r}")
    return k, n


@pytest.hookimpl(tryfirst=True)  # before xdist suffixes grouped node ids with "@group"
def pytest_collection_modifyitems(config, items):
    shard = config.getoption("--gpu-shard")
    if shard:
        k, n = _parse_shard(shard)
        known = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
        part = shard_of([item.nodeid for item in items], known, n)
        keep = [item for item in items if part[item.nodeid] == k - 1]
        config.hook.pytest_deselected(items=[i for i in items if part[i.nodeid] != k - 1])
        items[:] = keep
    if _has_cuda():
        # Slowest first: pytest-xdist hands out the first items first, so the long tests
        # (launcher subprocesses, fla's Triton compiles) start at once instead of last;
        # tests with no recorded time first of all (new ones: seen even in a run cut short).
        known = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
        items.sort(key=lambda item: -known.get(item.nodeid, float("inf")))
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_seconds: dict = {}


def pytest_runtest_logreport(report):
    if report.when == "call" and report.passed:  # loadgroup's "@group" suffix left out
        _seconds[report.nodeid.split("@")[0]] = round(report.duration, 1)
    if report.failed and _failures_out:
        with open(_failures_out[0], "a") as f:
            f.write(f"{report.nodeid} ({report.when})\n")


def pytest_sessionfinish(session):
    out = session.config.getoption("--gpu-durations-out")
    if out and not hasattr(session.config, "workerinput"):  # the controller writes it
        ranked = dict(sorted(_seconds.items(), key=lambda kv: -kv[1]))
        pathlib.Path(out).write_text(json.dumps(ranked, indent=1) + "\n")
