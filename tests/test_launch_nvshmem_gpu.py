"""launch/decode.py on the nvshmem backend: one process per GPU (torchrun, mpirun).

Needs at least two GPUs and nvshmem4py (``nvshmem.core``); N = min(GPUs, 8) processes.
The jobs run as subprocesses with NVLink multicast off (the per-peer path: NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1) and write JSON reports: every
check passed on every step (bitwise identical outputs on all ranks, rank 0 against the
unsharded layer), graph replay bitwise equal to the eager run, latency max over ranks.
``scripts/bench_allreduce.py`` and ``scripts/bench_step.py`` run once at small shapes.
Nothing here imports nvshmem, cutlass or cuda in the pytest process. The CPU cases cover
``--backend auto``'s choice and the runner's cross-rank latency reduction.
"""

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from test_launch_trace import check_timeline

from launch import decode, report
from launch.procs import Procs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "launch", "decode.py")
BENCH = os.path.join(ROOT, "scripts", "bench_allreduce.py")
BENCH_STEP = os.path.join(ROOT, "scripts", "bench_step.py")
HAZARDS = os.path.join(ROOT, "tests", "nvshmem_hazards.py")
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def _nvshmem_imports() -> bool:
    p = subprocess.run([sys.executable, "-c", "import nvshmem.core"], capture_output=True)
    return p.returncode == 0


@pytest.fixture(scope="module")
def nproc():
    count = torch.cuda.device_count()
    if count < 2:
        pytest.skip(f"needs >= 2 GPUs (has {count})")
    if not _nvshmem_imports():
        pytest.skip("nvshmem4py (nvshmem.core) does not import")
    return min(count, 8)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", **NO_MULTICAST)
    if os.geteuid() == 0:  # Open MPI's mpirun refuses root without these
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def _run(cmd, timeout):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT)
    lines = [line for line in p.stdout.splitlines() if line.strip()]
    return p, lines


def torchrun(n, script, *args, timeout=1200):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", script, *args]  # fmt: skip
    return _run(cmd, timeout)


def assert_ok(p, lines, report_path, n):
    tail = p.stdout[-4000:] + p.stderr[-4000:]
    assert p.returncode == 0, tail
    assert "DECODE OK" in lines and not any(x.startswith("DECODE FAILED") for x in lines), tail
    report = json.loads(report_path.read_text())
    assert report["ok"]
    c = report["config"]
    assert c["backend"] == "nvshmem" and c["tp"] == n and c["processes"] == n
    assert c["publish"] == "per peer"  # multicast is off on these machines
    for name, v in report["checks"].items():
        assert v["passed"] == v["of"], (name, v)
    for name in ("outputs identical on all ranks", "graph replay == eager (bitwise)",
                 "stage pass == eager (bitwise)", "no consumer timeout"):  # fmt: skip
        assert report["checks"][name]["of"] >= 1, name
    assert len(report["per_rank"]) == n
    steady = [v for k, v in report["latency"].items() if k.endswith("back to back")]
    assert all(v["n"] == 50 and v["median_us"] > 0 for v in steady), report["latency"]
    return report


@pytest.mark.gpu
def test_torchrun_decode_verify(nproc, tmp_path):
    out = tmp_path / "nvshmem.json"
    p, lines = torchrun(
        nproc, SCRIPT, "--backend", "nvshmem", "--heads", str(2 * nproc), "--hidden", "2048",
        "--requests", "2", "--tokens", "3", "--blocks", "3", "--steps", "7",
        "--json", str(out),
    )  # fmt: skip
    report = assert_ok(p, lines, out, nproc)
    assert report["steps"]["decode"] == 1 and report["steps"]["verify+record+recover"] == 3
    assert report["checks"]["kda outputs vs unsharded (1 ulp + o's flip)"]["of"] == 7
    assert report["checks"]["partials identical in every rank's mailbox"]["of"] == 7
    print(p.stdout)


@pytest.mark.gpu
def test_torchrun_large_rows_and_xmoe(nproc, tmp_path):
    """Issue 13: 64 requests x 4 tokens (256 rows per verify step: the wgmma producer on
    sm_90, cuBLAS + publisher elsewhere, per-rank consumers of any rows), the MoE copies and
    hint waiters, every check passing."""
    out = tmp_path / "rows.json"
    p, lines = torchrun(
        nproc, SCRIPT, "--backend", "nvshmem", "--heads", str(2 * nproc), "--hidden", "7168",
        "--requests", "64", "--tokens", "4", "--blocks", "8", "--steps", "5", "--xmoe", "1",
        "--json", str(out),
    )  # fmt: skip
    report = assert_ok(p, lines, out, nproc)
    sm90 = torch.cuda.get_device_capability() == (9, 0)
    assert report["config"]["oproj_plan"]["256"]["producer"] == ("wgmma" if sm90 else "cublas")
    assert report["checks"]["MoE copies read after their hints == output (bitwise)"]["of"] == 5
    print(p.stdout)


@pytest.mark.gpu
def test_torchrun_auto_picks_nvshmem(nproc, tmp_path):
    out = tmp_path / "auto.json"
    p, lines = torchrun(
        nproc, SCRIPT, "--heads", str(nproc), "--hidden", "1024", "--requests", "4",
        "--tokens", "2", "--blocks", "0", "--steps", "4", "--conv-layout", "window-first",
        "--json", str(out),
    )  # fmt: skip
    assert_ok(p, lines, out, nproc)


@pytest.mark.gpu
def test_torchrun_kimi_shapes(nproc, tmp_path):
    """Issue 8's latency shape: 96 heads (12 per rank at TP 8), HID 7168, 8 requests,
    T = 1, nb = 8."""
    out = tmp_path / "kimi.json"
    p, lines = torchrun(
        nproc, SCRIPT, "--backend", "nvshmem", "--heads", "96", "--hidden", "7168",
        "--requests", "8", "--tokens", "1", "--blocks", "8", "--steps", "40",
        "--check-every", "10", "--padding", "0", "--json", str(out),
    )  # fmt: skip
    report = assert_ok(p, lines, out, nproc)
    assert report["steps"] == {"total": 40, "decode": 40}
    print(p.stdout)


@pytest.mark.gpu
def test_torchrun_trace(nproc, tmp_path):
    """``--trace`` across processes: every rank's stamps around every stage of the decode
    step (after the back-to-back steps), gathered on process 0 into one timeline."""
    out = tmp_path / "trace.json"
    p, lines = torchrun(
        nproc, SCRIPT, "--backend", "nvshmem", "--heads", str(2 * nproc), "--hidden", "2048",
        "--requests", "4", "--tokens", "1", "--blocks", "3", "--steps", "6", "--trace", "10",
        "--json", str(out),
    )  # fmt: skip
    report = assert_ok(p, lines, out, nproc)
    assert report["config"]["pdl"] is False
    check_timeline(report["timeline"], nproc, 10, ("kda", "produce", "consume"))
    assert "globaltimer per GPU" in p.stdout
    print(p.stdout)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "fault,check",
    [("output", "outputs identical on all ranks"), ("state", "state pages")],
)
def test_checks_catch_a_corrupted_rank(nproc, fault, check):
    p, lines = torchrun(
        nproc, SCRIPT, "--backend", "nvshmem", "--heads", str(nproc), "--requests", "2",
        "--tokens", "2", "--steps", "3", "--fault", fault, timeout=900,
    )  # fmt: skip
    assert p.returncode != 0, p.stdout[-3000:] + p.stderr[-3000:]
    failed = [x for x in lines if x.startswith("DECODE FAILED")]
    assert failed and check in failed[0], p.stdout[-3000:]


@pytest.mark.gpu
def test_tp_flag_is_refused(nproc):
    p, lines = torchrun(nproc, SCRIPT, "--backend", "nvshmem", "--tp", str(nproc + 1))
    assert p.returncode != 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert any("is for the loopback backend" in x for x in lines), (
        p.stdout[-2000:] + p.stderr[-2000:]
    )


@pytest.mark.gpu
def test_mpirun_decode(nproc, tmp_path):
    exe = shutil.which("mpirun") or shutil.which("mpiexec")
    if exe is None:
        pytest.skip("no mpirun (pip install '.[mpi]')")
    pytest.importorskip("mpi4py")
    out = tmp_path / "mpi.json"
    p, lines = _run(
        [exe, "-np", str(nproc), sys.executable, SCRIPT, "--backend", "nvshmem",
         "--heads", str(2 * nproc), "--hidden", "2048", "--requests", "2", "--tokens", "2",
         "--blocks", "2", "--steps", "5", "--json", str(out)],
        timeout=1200,
    )  # fmt: skip
    report = assert_ok(p, lines, out, nproc)
    assert report["config"]["launcher"] == "mpirun"


@pytest.mark.gpu
def test_bench_allreduce_runs(nproc, tmp_path):
    out = tmp_path / "bench.json"
    p, lines = torchrun(nproc, BENCH, "--iters", "30", "--warmup", "5", "--tokens", "1,8,32",
                        "--blocks", "0,8", "--json", str(out))  # fmt: skip
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert lines and lines[-1] == "BENCH OK", p.stdout[-4000:]
    rows = json.loads(out.read_text())["rows"]
    ours = [r for r in rows if r["variant"] == "ours: producer + consumer"]
    assert {r["tokens"] for r in ours} == {1, 8, 32}
    assert all(r["median_us"] > 0 and not r.get("refused") for r in ours)  # 32: cuBLAS producer
    fused = [r for r in rows if r["variant"] == "ours: fused producer + consumer"]
    assert {r["tokens"] for r in fused} == {1, 8, 32}
    assert all(r.get("refused") for r in fused if r["tokens"] == 32)  # mma.sync: <= 8 rows
    assert all(r["bitwise_vs_unfused"] and r["median_us"] > 0 for r in fused if r["tokens"] < 32)
    print(p.stdout)


@pytest.mark.gpu
def test_bench_step_runs(nproc, tmp_path):
    """Issue 14 part 3: the whole step, ours beside the NCCL peer (fla) on the same GPUs,
    both with positive medians; symm and flashinfer rows present (timed or skipped)."""
    out = tmp_path / "step.json"
    heads = 4 if 4 % nproc == 0 else 2 * nproc
    p, lines = torchrun(nproc, BENCH_STEP, "--heads", str(heads), "--hidden", "2048",
                        "--requests", "2", "--replays", "5", "--json", str(out))  # fmt: skip
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert lines and lines[-1] == "BENCH OK", p.stdout[-4000:] + p.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["tp"] == nproc and [r["requests"] for r in report["rows"]] == [2]
    row = report["rows"][0]
    assert row["floor_us"] > 0 and set(row["variants"]) == {"ours", "nccl", "symm", "flashinfer"}
    for name in ("ours", "nccl"):
        v = row["variants"][name]
        assert "skipped" not in v and v["median_us"] > 0 and v["n"] == 5, (name, v)
    print(p.stdout)


@pytest.mark.gpu
def test_hazards_across_gpus(nproc):
    """The o-projection all-reduce's hazards on real GPUs, every rank in one domain (per-peer
    stores): 1000 graph replays, a delayed rank, a dead rank named within the budget, reset."""
    p, lines = torchrun(nproc, HAZARDS, str(nproc), timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert lines and lines[-1] == "HAZARDS OK", p.stdout[-4000:] + p.stderr[-4000:]
    print(p.stdout)


@pytest.mark.gpu
def test_hazards_across_domains(nproc):
    """The same hazards with every peer in another domain (put with
    signal, the consumer waiting on signal words): 1000 replays, a delayed rank, a dead
    rank named within the budget, reset, signal words zero."""
    p, lines = torchrun(nproc, HAZARDS, "1", timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert lines and lines[-1] == "HAZARDS OK", p.stdout[-4000:] + p.stderr[-4000:]
    print(p.stdout)


# --- CPU: the plain-Python parts ---------------------------------------------------------------


def test_auto_picks_nvshmem_with_a_gpu_per_process(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # restored after the test
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(decode, "nvshmem_installed", lambda: True)
    assert decode.resolve_backend("auto") == "nvshmem"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # two PEs per GPU: no
    assert decode.resolve_backend("auto") == "host"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(decode, "nvshmem_installed", lambda: False)
    assert decode.resolve_backend("auto") == "host"
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert decode.resolve_backend("auto") == "loopback"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert decode.resolve_backend("auto") == "host"


def test_slowest_rank_per_step():
    per_process = [
        [("decode", 5.0), ("verify", 9.0), ("verify", 7.0)],
        [("decode", 6.0), ("verify", 8.0), ("verify", 7.5)],
    ]
    assert report.slowest_per_step(per_process) == {"decode": [6.0], "verify": [9.0, 7.5]}
    assert report.slowest_per_step([[]]) == {}


def test_one_process_gathers_itself():
    procs = Procs()
    x = torch.arange(6, dtype=torch.float32).view(2, 3).to(torch.bfloat16)
    assert procs.root and procs.objects(3) == [3] and procs.all_true(True)
    assert torch.equal(procs.gather(x), x)
