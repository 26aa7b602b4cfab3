"""GPU tests of the cross-domain path (marker gpu).

One H200, loopback: domains of 1 and 2 ranks (other domains' partials by the emulated
put-with-signal: a copy on the stream, then the signal store; consumers wait on the
signal) give bitwise the outputs and prefixes of the all-in-domain path; a dead remote rank
errors within the budget naming it; the decode job with ``--domain-size`` 1 and 2 passes.
Two GPUs, nvshmem: ``torchrun --nproc-per-node 2 launch/decode.py --backend nvshmem
--domain-size 1`` (every peer through ``nvshmem.core.put_signal``) passes every check.
"""

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
from shared_gpu import poll_budget_ns
from test_oproj_consumer_gpu import random_inputs

from tpcomm.backends.loopback import LoopbackBackend
from tpcomm.oproj.all_ranks import AllRanks
from tpcomm.oproj.allreduce import OprojAllReduce

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "launch", "decode.py")
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}  # fmt: skip


def run_steps(domain, tp=4, tokens=2, hid=2048, nb=3, steps=4, publishers=None, budget=None):
    backend = LoopbackBackend(tp, domain_size=domain)
    kw = {} if budget is None else {"budget_ns": budget}
    comm = OprojAllReduce(backend, tokens, hid, nb, groups=2, **kw)
    a = random_inputs(tp, tokens, hid, nb, seed=11)
    bf = dict(dtype=torch.bfloat16, device="cuda")
    prefixes = a["prefix"][None].repeat(tp, 1, 1)
    outputs = torch.empty(tp, tokens, hid, **bf)
    seen = []
    for step in range(steps):
        outputs.view(torch.int16).fill_(0x7F81)
        AllRanks(comm).run_ranks(a["partials"], prefixes, a["blocks"], a["norm"], a["query"],
                       a["out_norm"], outputs, step,
                       publishers=publishers if step == steps - 1 else None)  # fmt: skip
        torch.cuda.synchronize()
        seen.append((outputs.clone(), prefixes.clone(), comm.errors[:, 0].tolist()))
    armed = comm.armed()
    signals = None if comm.remote is None else backend.local(comm.remote.signals, 0).clone()
    backend.teardown()
    return seen, armed, signals


@pytest.mark.parametrize("domain", [1, 2])
def test_loopback_split_is_bitwise_the_load_store_path(domain):
    want, _, _ = run_steps(4)
    got, armed, signals = run_steps(domain)
    assert armed and int(signals.abs().sum()) == 0  # slots re-armed, signals zeroed
    for (o, p, e), (wo, wp, _) in zip(got, want, strict=True):
        assert e == [0, 0, 0, 0]
        assert torch.equal(o.view(torch.int16), wo.view(torch.int16))
        assert torch.equal(p.view(torch.int16), wp.view(torch.int16))


def test_loopback_dead_remote_rank_is_named():
    budget, dead = poll_budget_ns(20_000_000), 3
    start = time.perf_counter()
    seen, _, _ = run_steps(2, steps=2, publishers=(0, 1, 2), budget=budget)
    outputs, _, errors = seen[-1]
    assert errors == [1 << dead] * 4, errors  # ranks 0, 1: signal wait; 2: flag in data
    assert (outputs.view(torch.int16) == 0x7F81).all(), "an erroring consumer wrote output"
    assert time.perf_counter() - start < 60  # compile + two steps, no hang


def _decode(cmd, tmp_path, name):
    out = tmp_path / f"{name}.json"
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", **NO_MULTICAST)
    p = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True,
                       timeout=1200, env=env, cwd=ROOT)  # fmt: skip
    lines = [line for line in p.stdout.splitlines() if line.strip()]
    assert p.returncode == 0 and lines[-1] == "DECODE OK", p.stdout[-4000:] + p.stderr[-4000:]
    report = json.loads(out.read_text())
    for check, v in report["checks"].items():
        assert v["passed"] == v["of"], (check, v)
    return report


@pytest.mark.parametrize("domain", [1, 2])
def test_loopback_decode_with_domains(tmp_path, domain):
    report = _decode([sys.executable, SCRIPT, "--backend", "loopback", "--tp", "4",
                      "--heads", "8", "--hidden", "2048", "--requests", "2", "--tokens", "3",
                      "--steps", "5", "--domain-size", str(domain)], tmp_path, "loop")  # fmt: skip
    assert report["config"]["domain_size"] == domain
    assert report["checks"]["no consumer timeout"]["of"] == 5


def test_nvshmem_two_gpus_every_peer_by_put(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    report = _decode([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                      "--master-addr=127.0.0.1", f"--master-port={port}", SCRIPT,
                      "--backend", "nvshmem", "--heads", "4", "--hidden", "2048",
                      "--requests", "2", "--tokens", "3", "--steps", "5",
                      "--domain-size", "1"], tmp_path, "nvshmem")  # fmt: skip
    assert report["config"]["backend"] == "nvshmem" and report["config"]["domain_size"] == 1
    assert report["checks"]["outputs identical on all ranks"]["of"] == 5
