"""``scripts/snapshot_pipe.py``: another revision's KdaPipe as a package beside this tree's
(``probe_pipe.py --baseline``): HEAD's snapshot imports, its KdaPipe is its own class on
this tree's shared modules, and ``--clean`` removes it. Skipped without git (the GPU
machine's copy of the tree has no history)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))


def _git_head():
    try:
        subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("no git history here")


def test_rewrite_points_shared_modules_up():
    import snapshot_pipe

    text = "from . import device as dev\nfrom .device import X\nfrom .pipe_prep import P\n"
    assert snapshot_pipe.rewrite(text, {"pipe", "pipe_prep"}) == (
        "from .. import device as dev\nfrom ..device import X\nfrom .pipe_prep import P\n"
    )


def test_snapshot_of_head_imports_and_cleans(tmp_path):
    _git_head()
    pytest.importorskip("cutlass")
    import snapshot_pipe

    name = f"t{os.getpid()}"
    target = snapshot_pipe.snapshot("HEAD", name)
    try:
        assert os.path.isfile(os.path.join(target, "pipe.py"))
        snap = importlib.import_module(f"kda.kernels.snap_{name}.pipe")
        from kda.kernels import pipe

        assert snap.KdaPipe is not pipe.KdaPipe and snap.KdaPipe.__name__ == "KdaPipe"
        assert snap.dev is pipe.dev  # the shared device module, not a copy
        import probe_pipe

        assert probe_pipe.variant_name(f"kda.kernels.snap_{name}.pipe") == f"snap_{name}"
        # another class, by name (e.g. a snapshot's or a branch's KdaPipe subclass)
        spec = f"kda.kernels.snap_{name}.pipe:KdaPipe"
        assert probe_pipe.variant_name(spec) == "KdaPipe"
        assert probe_pipe.baseline_class(spec) is snap.KdaPipe
        assert probe_pipe.baseline_class(f"kda.kernels.snap_{name}.pipe") is snap.KdaPipe

        class Other(pipe.KdaPipe):  # the ablations of another KdaPipe: theirs ahead of its
            pass

        variants = probe_pipe.ablations_of(Other)
        assert variants["full"] is Other and set(variants) == set(probe_pipe.ABLATIONS)
        assert variants["no_state"].recurrence is probe_pipe.NoState.recurrence
        assert issubclass(variants["copy_no_prep"], Other)
    finally:
        snapshot_pipe.main(["--clean"])
    assert not os.path.exists(target)
