"""The host side works without the CuTe DSL: a subprocess whose import system refuses
``cutlass`` (a meta-path blocker) imports kda, tpcomm and launch, runs the references and
the host job's math, and gets ValueErrors (not ImportErrors) from the GPU entries."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import sys


class NoDsl:
    def find_spec(self, name, path=None, target=None):
        if name == "cutlass" or name.startswith("cutlass."):
            raise ImportError(f"DSL hidden: {name}")


sys.meta_path.insert(0, NoDsl())
import torch

import kda
import kda.dispatch
import kda.reference
from kda import synthetic as kt
from tpcomm import mailbox
from tpcomm.backends.loopback import LoopbackBackend
from tpcomm.oproj import allreduce as api, reference

try:
    import cutlass  # noqa: F401
except ImportError:
    pass
else:
    raise AssertionError("the blocker let cutlass in")

layer = kt.make_layer(2, 8, seed=1)
step = kt.make_step(2, 2, 2, pages=8, seed=2)
out = kt.run_reference(layer.clone(), step)
assert out.shape == (4, 256) and not torch.isnan(out.float()).any()
try:
    kda.decode(step.x, layer.conv_weight, layer.conv_bias, layer.conv_state, step.f_a,
               step.beta, layer.a_log, layer.dt_bias, step.slots, layer.state, step.gate,
               layer.norm_weight, layer.f_b, lower_bound=-5.0, scale=0.1, eps=1e-6,
               accepted=step.accepted)
except ValueError as e:
    assert "CUDA" in str(e), e
else:
    raise AssertionError("kda.decode ran on the CPU")
print(kda.dispatch.choose(1, 6, 1, sms=132).kernel)
partials = torch.randn(4, 2, 1024).to(torch.bfloat16)
prefix = torch.randn(2, 1024).to(torch.bfloat16)
gamma = torch.ones(1024, dtype=torch.bfloat16)
o, p = reference.consume(partials, prefix, None, gamma, gamma, gamma, eps=1e-6, out_eps=1e-6)
assert torch.equal(p, (prefix.float() + mailbox.rank_order_sum(partials).float()).bfloat16())
comm = api.OprojAllReduce(LoopbackBackend(4, device="cpu"), 2, 1024, 0, eps=1e-6,
                          out_eps=1e-6)
assert comm.armed()
print(api.choose(16, 1, 7168).groups)
assert not any(m == "cutlass" or m.startswith("cutlass.") for m in sys.modules)
print("NO_DSL_OK")
"""


def test_host_side_runs_with_the_dsl_hidden():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert p.stdout.split() == ["split", "4", "NO_DSL_OK"], p.stdout


def test_the_blocker_blocks():
    """The same blocker makes a DSL kernel module fail to import (so the test above would
    see a module that needs the DSL)."""
    code = SCRIPT.split("import torch")[0] + "import kda.kernels.wide\n"
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert p.returncode != 0 and "DSL hidden: cutlass" in p.stderr, p.stderr[-2000:]
