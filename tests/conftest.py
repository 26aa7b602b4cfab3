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


_failures_out: list = []  # the controller's --gpu-failures-out, if any


def pytest_configure(config):
    out = config.getoption("--gpu-failures-out")
    if out and not hasattr(config, "workerinput"):  # the controller sees every report
        pathlib.Path(out).write_text("")
        _failures_out.append(out)


def pytest_collection_modifyitems(config, items):
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
    if report.when == "call" and report.passed:
        _seconds[report.nodeid] = round(report.duration, 1)
    if report.failed and _failures_out:
        with open(_failures_out[0], "a") as f:
            f.write(f"{report.nodeid} ({report.when})\n")


def pytest_sessionfinish(session):
    out = session.config.getoption("--gpu-durations-out")
    if out and not hasattr(session.config, "workerinput"):  # the controller writes it
        ranked = dict(sorted(_seconds.items(), key=lambda kv: -kv[1]))
        pathlib.Path(out).write_text(json.dumps(ranked, indent=1) + "\n")
