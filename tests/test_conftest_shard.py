"""CPU: ``--gpu-shard K/N`` splits the suite into parts of about equal recorded time,
every test in exactly one part, the same split on every worker."""

import os
import subprocess
import sys

import pytest
from conftest import _parse_shard, shard_of


def test_parts_cover_once_and_balance():
    known = {f"t{i}": float(s) for i, s in enumerate([100, 60, 50, 40, 30, 20, 10, 5, 5])}
    nodeids = [*known, "new_a", "new_b"]  # no recorded time: counted as the longest
    part = shard_of(nodeids, known, 2)
    assert sorted(part) == sorted(nodeids) and set(part.values()) == {0, 1}
    totals = [sum(known.get(n, 100.0) for n in part if part[n] == k) for k in (0, 1)]
    assert abs(totals[0] - totals[1]) <= 100.0  # within the longest test
    assert part == shard_of(list(reversed(nodeids)), known, 2)  # order-independent
    assert set(shard_of(nodeids, known, 1).values()) == {0}


@pytest.mark.parametrize("bad", ["2", "0/2", "3/2", "a/b"])
def test_bad_shard_is_a_usage_error(bad):
    with pytest.raises(pytest.UsageError, match="--gpu-shard"):
        _parse_shard(bad)


def test_two_shards_partition_a_file(tmp_path):
    """Both parts of this very file, collected by pytest: disjoint, together the whole."""

    def ids(extra):
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
             __file__, *extra], capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        return {line for line in out.splitlines() if "::" in line}

    whole, one, two = ids([]), ids(["--gpu-shard", "1/2"]), ids(["--gpu-shard", "2/2"])
    assert one and two and not one & two and one | two == whole


GROUPED = """
import os

import pytest


@pytest.mark.xdist_group("fla")
@pytest.mark.parametrize("i", range(3))
def test_grouped(i):
    with open(os.path.join(os.path.dirname(__file__), "workers"), "a") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"] + " ")


@pytest.mark.parametrize("i", range(6))
def test_other(i):
    pass
"""


def test_xdist_runs_a_group_on_one_worker(tmp_path):
    """Under ``-n`` (dist load) the conftest switches to loadgroup: the tests marked
    ``xdist_group("fla")`` all run on one worker (skipped without pytest-xdist)."""
    pytest.importorskip("xdist")
    here = os.path.dirname(os.path.abspath(__file__))
    (tmp_path / "conftest.py").write_text(  # this suite's hooks, under another name
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('suite', {here!r} + '/conftest.py')\n"
        "suite = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(suite)\n"
        "pytest_addoption = suite.pytest_addoption\n"
        "pytest_configure = suite.pytest_configure\n"
        "pytest_configure_node = suite.pytest_configure_node\n"
        "pytest_collection_modifyitems = suite.pytest_collection_modifyitems\n"
    )
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    workers = (tmp_path / "workers").read_text().split()
    assert "9 passed" in p.stdout and len(workers) == 3, p.stdout + p.stderr
    assert len(set(workers)) == 1, workers
