"""Domain map and the cross-domain path on the CPU: the map, the store put-with-signal
(bounded wait naming a dead rank), ``--domain-size`` refusals, the host job split into
domains (bitwise the TP reference), and the consumer's signal-wait compile."""

import os
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from tpcomm.backends.host import StoreChannel
from tpcomm.domain import DomainMap, check_domain_size, domain_of_reachable, missing_message
from tpcomm.mailbox import rank_order_sum

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "launch", "decode.py")


def test_domain_map():
    d = DomainMap(8, 4)
    assert d.split and d.members(5) == (4, 5, 6, 7) and d.remote(5) == (0, 1, 2, 3)
    assert d.remote_mask(1) == 0xF0 and d.groups() == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert not DomainMap(8, 8).split and DomainMap(8, 8).remote(3) == ()
    assert DomainMap(4, 1).remote(2) == (0, 1, 3)


@pytest.mark.parametrize("size, world", [(0, 4), (-1, 4), (3, 4), (8, 4), (2.0, 4), ("2", 4)])
def test_bad_domain_size_is_refused(size, world):
    with pytest.raises(ValueError, match="--domain-size"):
        check_domain_size(size, world)


def test_reachable_block():
    assert domain_of_reachable(16, 9, range(8, 16)) == 8
    assert domain_of_reachable(2, 1, []) == 1
    with pytest.raises(RuntimeError, match="aligned block"):
        domain_of_reachable(8, 1, [1, 2])  # not aligned
    with pytest.raises(RuntimeError, match="aligned block"):
        domain_of_reachable(6, 0, [0, 1, 2, 3])  # 4 does not divide 6


def exchange_all(partials, size, dead=()):
    """Every rank's view of the partials with domains of ``size`` over one in-process store:
    own domain copied (the load/store stand-in), others through StoreChannel."""
    world = partials.shape[0]
    domain, store = DomainMap(world, size), dist.HashStore()
    channels = [StoreChannel(store, r, domain) for r in range(world)]
    for r in range(world):
        if r not in dead:
            channels[r].put(partials[r], step=5)
    views = []
    for r in range(world):
        rows = {m: partials[m].clone() for m in domain.members(r)}
        rows.update(channels[r].take(5, partials[r], budget_s=0.5))
        views.append(torch.stack([rows[m] for m in range(world)]))
    return views


@pytest.mark.parametrize("size", [1, 2, 4])
def test_store_put_with_signal_is_bitwise(size):
    g = torch.Generator().manual_seed(7)
    partials = (torch.randn(4, 3, 1024, generator=g) * 100).to(torch.bfloat16)
    partials.view(torch.int32)[2, 1, 5] = -1  # a sentinel word travels unchanged
    want = rank_order_sum(partials)
    for view in exchange_all(partials, size):
        assert torch.equal(view.view(torch.int16), partials.view(torch.int16))
        got = rank_order_sum(view)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_dead_remote_rank_is_named_within_the_budget():
    partials = torch.ones(4, 1, 1024, dtype=torch.bfloat16)
    domain, store = DomainMap(4, 2), dist.HashStore()
    channels = [StoreChannel(store, r, domain) for r in range(4)]
    channels[2].put(partials[2], step=0)  # rank 3 never puts
    start = time.monotonic()
    with pytest.raises(TimeoutError) as e:
        channels[0].take(0, partials[0], budget_s=0.3)
    assert 0.3 <= time.monotonic() - start < 2.0
    assert e.value.args[0] == 1 << 3
    assert "rank(s) [3]" in missing_message(0, e.value.args[0], 0.3)
    assert "0x8" in missing_message(0, e.value.args[0], 0.3)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(*args, n=None, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    if n is None:
        cmd = [sys.executable, SCRIPT, *args]
    else:
        port = f"--master-port={free_port()}"
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}",
               "--master-addr=127.0.0.1", port, SCRIPT, *args]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    return p, [line for line in p.stdout.splitlines() if line.strip()]


@pytest.mark.parametrize(
    "args",
    [
        ("--backend", "host", "--domain-size", "3"),  # one process: 3 does not divide 1
        ("--backend", "host", "--domain-size", "0"),
        ("--backend", "loopback", "--tp", "4", "--domain-size", "3"),  # before any CUDA use
        ("--backend", "loopback", "--tp", "4", "--domain-size", "-2"),
    ],
)
def test_decode_refuses_a_bad_domain_size(args):
    p, lines = run(*args, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert lines[-1].startswith("DECODE FAILED") and "--domain-size" in lines[-1], lines


@pytest.mark.distributed
@pytest.mark.parametrize("size", [1, 2])
def test_host_job_split_into_domains(size):
    """4 ranks in domains of ``size``: every check passes, among them the output and prefix
    bitwise the TP reference (the all-in-domain math)."""
    p, lines = run("--backend", "host", "--heads", "8", "--hidden", "1024", "--requests", "2",
                   "--tokens", "2", "--blocks", "2", "--steps", "3", "--domain-size", str(size),
                   n=4)  # fmt: skip
    assert p.returncode == 0 and lines[-1] == "DECODE OK", p.stdout[-3000:] + p.stderr[-3000:]
    assert f"domain {size}" in p.stdout
    assert "ok   output, prefix == TP reference (bitwise): 3/3 steps" in p.stdout


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("tp, domain, groups", [(2, 1, 4), (16, 8, 4), (4, 2, 1)])
def test_signal_consumer_compiles(arch, tp, domain, groups):
    from compile_harness import require_dsl

    require_dsl()
    from tpcomm.oproj.kernels.consumer import compiled

    assert compiled(tp, 1024, 3, True, groups, 0, False, arch, domain=domain) is not None


@pytest.mark.compile
def test_signal_wait_only_in_the_split_configuration(tmp_path):
    from compile_harness import require_dsl

    cute = require_dsl()
    from tpcomm.oproj.kernels.consumer import OprojConsumerKernel, fake_arguments

    texts = {}
    for domain in (4, 2):
        kernel = OprojConsumerKernel(4, 1024, 2, groups=2, domain=domain)
        dump = tmp_path / str(domain)
        dump.mkdir()  # a missing dump dir leaves __ptx__ reading another compile's file
        options = f"--gpu-arch sm_90a --keep-ptx --dump-dir {dump}"
        texts[domain] = cute.compile(kernel, *fake_arguments(4, 1024, 2), options=options).__ptx__
    assert "ld.acquire.sys.global.b32" not in texts[4]
    assert texts[2].count("ld.acquire.sys.global.b32") >= 2  # first look and the spin
    with pytest.raises(ValueError, match="domain"):
        OprojConsumerKernel(4, 1024, 2, domain=3)
    with pytest.raises(ValueError, match="one-shot"):
        OprojConsumerKernel(4, 1024, 2, groups=1, twoshot=True, domain=2)


def test_hazards_script_names_missing_ranks(monkeypatch):
    """``tests/nvshmem_hazards.py`` (a GPU torchrun script) imports on the CPU, and
    its failure lines read a consumer's error word as ranks (bit r: nothing from rank r)."""
    for var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        monkeypatch.setenv(var, os.environ.get(var, "unset"))  # the import sets them; undone
    import nvshmem_hazards as script

    assert script.error_text(0x1).startswith("error word 0x1 (nothing from rank(s) [0]")
    assert "rank(s) [1, 3]" in script.error_text(0xA)
