"""CPU compile-check harness: compile a CuTe DSL kernel for a given arch, no GPU needed.

Kernels join by writing a test that calls ``compile_for(arch, jit_fn, *fake_args)``
with fake tensors from ``fake_tensor``; the test is marked ``compile`` and skips cleanly
when the ``cu13`` extra (nvidia-cutlass-dsl) is not installed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

ARCHS = ("sm_90a", "sm_100a")


def require_dsl():
    """Import and return ``cutlass.cute``, or skip the calling test."""
    pytest.importorskip("cutlass")
    return pytest.importorskip("cutlass.cute")


def fake_tensor(dtype, shape, stride_order=None, align=16):
    """A compile-only compact tensor (global memory, ``align``-byte aligned)."""
    cute = require_dsl()
    order = tuple(stride_order) if stride_order is not None else tuple(range(len(shape)))[::-1]
    return cute.runtime.make_fake_compact_tensor(
        dtype, tuple(shape), stride_order=order, assumed_align=align
    )


def fake_stream():
    cute = require_dsl()
    return cute.runtime.make_fake_stream()


def compile_for(arch: str, fn, *args, **kwargs):
    """``cute.compile(fn, *args)`` for ``arch`` (e.g. ``sm_90a``); returns the compiled object."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}; got {arch!r}")
    cute = require_dsl()
    return cute.compile(fn, *args, options=f"--gpu-arch {arch}", **kwargs)


def ptxas_sm90a(text: str, path) -> str:
    """Assemble PTX ``text`` (written to ``path``) with ptxas for sm_90a; returns ptxas'
    ``-v`` report. Skips without a ptxas, or when this ptxas predates the PTX ISA the
    installed DSL emits (e.g. CUDA 13.0's ptxas and the cu13 libraries' newer ``.version``);
    any other ptxas failure fails the test with its message."""
    exe = shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas"
    if not os.path.exists(exe):
        pytest.skip("no ptxas for the register / spill check")
    with open(path, "w") as f:
        f.write(text)
    p = subprocess.run([exe, "-arch=sm_90a", "-v", str(path), "-o", os.devnull],
                       capture_output=True, text=True)  # fmt: skip
    if p.returncode != 0 and re.search(r"Unsupported \.version", p.stderr):
        version = re.search(r"^\.version (\S+)", text, re.M)
        pytest.skip(f"{exe} cannot assemble PTX ISA {version and version.group(1)}: "
                    f"{p.stderr.strip()[:200]}")  # fmt: skip
    assert p.returncode == 0, f"ptxas failed ({p.returncode}): {p.stderr[-2000:]}"
    return p.stderr
