"""The examples run as a user runs them, each ending ``OK``: on the CPU (the host backend:
one process, and ``embed_layer.py`` under torchrun with two ranks: the engine-level script
on the host backend), and their GPU form (``--device cuda``: loopback on one GPU) in the
GPU suite. Each example checks its own outputs (against the unsharded references, or fla's
layer within derived bounds) and fails with a traceback otherwise."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_launch import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script, *args, torchrun=0, timeout=300):
    """``examples/<script>`` as a subprocess (``torchrun``: that many ranks); asserts it
    ends with the line ``OK``; returns its stdout."""
    path = os.path.join(ROOT, "examples", script)
    cmd = [sys.executable, path, *args]
    if torchrun:
        launch = ["-m", "torch.distributed.run", f"--nproc-per-node={torchrun}"]
        launch += ["--master-addr=127.0.0.1", f"--master-port={free_port()}"]
        cmd = [sys.executable, *launch, path, *args]
    # the checkout first, then whatever the caller's path holds (the GPU machine's packages)
    path_env = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path_env, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    lines = p.stdout.splitlines()
    assert p.returncode == 0 and lines and lines[-1] == "OK", p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def _needs_fla():
    pytest.importorskip("einops")
    if importlib.util.find_spec("fla") is None:
        pytest.skip("fla-core 0.6.0 is not installed (pip install '.[fla]')")


def test_embed_layer_cpu():
    assert "TP 1, 4 heads, hidden 1024, host backend: 4 steps checked" in run("embed_layer.py")


@pytest.mark.distributed
def test_embed_layer_host_backend_two_ranks():
    """The engine-level script on the host backend (gloo), a rank per process."""
    assert "TP 2, 4 heads, hidden 1024, host backend" in run("embed_layer.py", torchrun=2)


def test_serving_loop_cpu():
    out = run("serving_loop.py")
    assert "preempted and resumed" in out and "emitted tokens checked" in out


def test_load_fla_layer_cpu():
    _needs_fla()
    assert "the argmax equal on every token" in run("load_fla_layer.py")


@pytest.mark.gpu
@pytest.mark.parametrize("script", ["embed_layer.py", "serving_loop.py", "load_fla_layer.py"])
def test_examples_gpu(script):
    """The GPU forms: the kernels (loopback on this GPU) checked against the references, or
    fla's layer, by the examples themselves."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if script == "load_fla_layer.py":
        _needs_fla()
        pytest.importorskip("triton")
    run(script, "--device", "cuda", timeout=600)


def test_readme_quotes_embed_layer():
    """The README's engine-API snippet is ``examples/embed_layer.py``'s own lines, in order
    (``...`` marks lines left out), so it cannot drift from the example a test runs."""
    readme = Path(ROOT, "README.md").read_text()
    block = readme.split("## The engine API", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    quoted = [line.strip() for line in block.splitlines() if line.strip()]
    source = Path(ROOT, "examples", "embed_layer.py").read_text().splitlines()
    lines = [line.strip() for line in source]
    at = 0
    for line in quoted:
        if line == "...":
            continue
        assert line in lines[at:], f"README quotes a line not in the example (in order): {line}"
        at += lines[at:].index(line) + 1
    assert len([q for q in quoted if q != "..."]) >= 15
