"""The mutants of ``scripts/mutants.py`` cannot rot: each one still applies to the tree (its
find-text occurs exactly ``count`` times, so the guard it stands for is still there), names
tests that exist, and every kernel module has mutants of its own."""

from __future__ import annotations

import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import mutants  # noqa: E402

# Kernel modules (one CuTe class each) whose claims a mutant must guard.
KERNEL_DIRS = ("kda/kernels", "tpcomm/oproj/kernels")
NOT_KERNELS = {"__init__.py", "launch.py", "device.py"}  # launchers, shared device math


def _ids(m):
    return m.name


@pytest.mark.parametrize("m", mutants.MUTANTS, ids=_ids)
def test_mutant_still_applies(m):
    path = ROOT / m.path
    assert path.is_file(), f"{m.name}: {m.path} is gone"
    found = path.read_text().count(m.find)
    assert found == m.count, f"{m.name}: find-text occurs {found} times, not {m.count}"
    assert m.find != m.replace


@pytest.mark.parametrize("m", mutants.MUTANTS, ids=_ids)
def test_mutant_names_existing_tests(m):
    assert m.tests, f"{m.name}: no tests"
    for node in m.tests:
        file, _, rest = node.partition("::")
        path = ROOT / file
        assert path.is_file(), f"{m.name}: {file} does not exist"
        if rest:
            function = re.sub(r"\[.*\]$", "", rest)
            assert re.search(rf"^def {re.escape(function)}\(", path.read_text(), re.M), (
                f"{m.name}: no test {function} in {file}"
            )


def test_mutant_names_unique():
    names = [m.name for m in mutants.MUTANTS]
    assert len(names) == len(set(names))


def test_every_kernel_module_has_mutants():
    guarded = {m.path for m in mutants.MUTANTS}
    kernels = [
        f"{d}/{p.name}"
        for d in KERNEL_DIRS
        if (ROOT / d).is_dir()
        for p in sorted((ROOT / d).glob("*.py"))
        if p.name not in NOT_KERNELS
    ]
    assert kernels, "no kernel modules found"
    missing = [k for k in kernels if k not in guarded]
    assert not missing, f"kernel modules without a mutant: {missing}"


def test_apply_refuses_a_stale_mutant(tmp_path):
    """``scripts/mutants.py`` reports STALE (not a survivor) when the text is gone."""
    (tmp_path / "a.py").write_text("x = 1\n")
    stale = mutants.M("stale", "a.py", "x = 2", "x = 3", "tests/test_mutants.py")
    with pytest.raises(ValueError, match="occurs 0 times"):
        mutants.apply(stale, tmp_path)
