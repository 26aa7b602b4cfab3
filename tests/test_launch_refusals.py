"""Every refusal of ``launch/decode.py`` reached by its own options, in process (CPU, no
launcher): exit status 2 and the last line ``DECODE FAILED: <the refusal>``. Values the
option parser already refuses (ranges) reach the job's own checks as ``{name: value}``
set after parsing, as a program building the options itself would pass them."""

import pytest
import torch

from launch import decode
from launch import gpu as gpu_job
from launch import host as host_job

GPU_REFUSALS = [  # options, backend, processes, message
    ([], "host", 1, "launch/gpu.py runs loopback or nvshmem, not host"),
    ([], "loopback", 2, "--backend loopback runs every rank in one process; this job has 2"),
    (["--tp", "4"], "nvshmem", 2, "--tp 4 is for the loopback backend; the nvshmem backend"),
    (["--tp", "4", "--heads", "6"], "loopback", 1, "heads (6) must be a positive multiple"),
    ({"tokens": 9}, "loopback", 1, "tokens must be in 1..8; got 9"),
    ({"blocks": 9}, "loopback", 1, "blocks must be in 0..8; got 9"),
    ({"requests": 0}, "loopback", 1, "requests and steps must be >= 1"),
    ({"steps": 0}, "loopback", 1, "requests and steps must be >= 1"),
    ({"padding": 1.0}, "loopback", 1, "padding must be a fraction in [0, 1)"),
    ({"groups": 5}, "loopback", 1, "groups must be in 1..4; got 5"),
    (["--requests", "129", "--tokens", "8"], "loopback", 1, "1032 rows per step; the o-"),
    (
        ["--kda-state", "replay", "--ring", "2", "--tokens", "3"],
        "loopback",
        1,
        "--ring 2 must be >= --tokens 3",
    ),
    ({"kda_state": "paged"}, "loopback", 1, "kda_state must be one of ('per-step', 'replay')"),
    ({"ring": 17}, "loopback", 1, "ring_size must be an int in 2..16; got 17"),
]


def _parse(argv):
    """Options from ``argv`` (a list) or defaults overridden by ``argv`` (a dict)."""
    if isinstance(argv, dict):
        args = decode.parse_args([])
        for name, value in argv.items():
            setattr(args, name, value)
        return args
    return decode.parse_args(argv)


def _gpu_main(argv, backend, processes, capsys):
    args = _parse(argv)
    args.tokens = decode.GPU_TOKENS if args.tokens is None else args.tokens
    status = gpu_job.main(args, backend, processes, "single")
    return status, capsys.readouterr().out.strip().splitlines()[-1]


@pytest.mark.parametrize("argv,backend,processes,message", GPU_REFUSALS,
                         ids=[str(i) for i in range(len(GPU_REFUSALS))])  # fmt: skip
def test_gpu_job_refusals(argv, backend, processes, message, capsys):
    status, last = _gpu_main(argv, backend, processes, capsys)
    assert status == 2 and last.startswith("DECODE FAILED: ") and message in last, last


def test_gpu_job_needs_cuda_and_nvshmem(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    status, last = _gpu_main([], "loopback", 1, capsys)
    assert status == 2 and "--backend loopback needs a CUDA GPU" in last, last
    status, last = _gpu_main([], "nvshmem", 2, capsys)
    assert status == 2 and "--backend nvshmem needs a CUDA GPU per process" in last, last
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_job, "nvshmem_installed", lambda: False)
    status, last = _gpu_main([], "nvshmem", 2, capsys)
    assert status == 2 and "--backend nvshmem needs nvshmem4py" in last, last


HOST_REFUSALS = [  # options, world, message
    (["--tp", "3"], 2, "--tp 3 is for the loopback backend; the host backend runs one rank"),
    (["--heads", "6"], 4, "heads (6) must be a positive multiple of TP (4)"),
    ({"tokens": 0}, 1, "tokens must be in 1..8; got 0"),
    ({"groups": 0}, 1, "groups must be in 1..4; got 0"),
    (["--kda-state", "replay", "--ring", "2"], 1, "--ring 2 must be >= --tokens 3"),
]


@pytest.mark.parametrize("argv,world,message", HOST_REFUSALS,
                         ids=[str(i) for i in range(len(HOST_REFUSALS))])  # fmt: skip
def test_host_job_refusals(argv, world, message, capsys, monkeypatch):
    args = _parse(argv)
    args.tokens = decode.HOST_TOKENS if args.tokens is None else args.tokens
    args.groups = 4 if args.groups is None else args.groups
    args.timeout = decode.HOST_TIMEOUT
    monkeypatch.setattr(host_job, "job_processes", lambda: world)
    status = host_job.main(args)  # refused before any process group or backend exists
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert status == 2 and last.startswith("DECODE FAILED: ") and message in last, last


def test_argument_parser_refusals(capsys):
    for argv in (["--kernel", "fast"], ["--gate-mode", "4"], ["--gate-mode", "2"],
                 ["--conv-layout", "x"], ["--backend", "mpi"],
                 ["--oproj-launch", "all"]):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            decode.parse_args(argv)
        assert e.value.code == 2
        last = capsys.readouterr().out.strip().splitlines()[-1]
        assert last.startswith("DECODE FAILED: ") and "invalid choice" in last, last
    for argv, message in ((["--ring", "1"], "must be in 2 .. 16; got 1"),
                          (["--kda-state", "replay", "--kernel", "wide"],
                           "--kda-state replay takes the replay dispatcher's kernel")):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            decode.parse_args(argv)
        assert e.value.code == 2
        last = capsys.readouterr().out.strip().splitlines()[-1]
        assert last.startswith("DECODE FAILED: ") and message in last, last


def test_refusing_ranks_wait_for_rank_0(monkeypatch):
    """Rank 0 prints the refusal and leaves on its SPEAKER_TICKS-th tick (ranks still
    importing reach their wait first); the others wait QUIET_TICKS ticks, more than rank 0
    (the launcher stops them once rank 0 leaves), so a late rank 0 still speaks."""
    for var in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert decode.refusal_ticks() == decode.SPEAKER_TICKS > 1
    monkeypatch.setenv("RANK", "3")
    assert decode.refusal_ticks() == decode.QUIET_TICKS > decode.SPEAKER_TICKS
