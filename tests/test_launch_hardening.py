"""The host job under torchrun when things go wrong, and what it reports.

A rank stopped (SIGSTOP) or killed (SIGKILL) mid-run: every survivor's last line is
``DECODE FAILED: rank N ...`` naming it, within ``--timeout`` + 10 s (stopped) or 10 s
(killed); the test finds the victim's pid and the job's progress in torchrun's rendezvous
store (``launch.liveness``). A refused option: one line, exit status 2 on every rank, no
traceback from a rank. The JSON report holds every rank's peak RSS."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
from test_launch import HOST, ROOT, SCRIPT, free_port, torchrun

WORLD, VICTIM, TIMEOUT = 3, 1, 5
SMALL = ["--heads", "3", "--hidden", "1024", "--requests", "2", "--tokens", "2", "--blocks", "1"]


def lines_of(stream, out):
    """Collect (time, line) of ``stream`` until it closes."""
    for line in stream:
        out.append((time.monotonic(), line.rstrip("\n")))


@pytest.mark.distributed
@pytest.mark.parametrize("sig,bound", [("SIGSTOP", TIMEOUT + 10), ("SIGKILL", 10)])
def test_a_lost_rank_is_named_by_every_survivor(sig, bound):
    import torch.distributed as dist

    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={WORLD}",
           "--master-addr=127.0.0.1", f"--master-port={port}", "--tee=3", SCRIPT, *HOST,
           *SMALL, "--steps", "5000", "--timeout", str(TIMEOUT)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=env, cwd=ROOT)  # fmt: skip
    out = []
    reader = threading.Thread(target=lines_of, args=(job.stdout, out), daemon=True)
    reader.start()
    victim = None
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        store.wait([f"decode/live/at/5/{r}" for r in range(WORLD)])  # all ranks stepping
        victim = int(store.get(f"decode/live/proc/{VICTIM}").decode().split()[0])
        t0 = time.monotonic()
        os.kill(victim, getattr(signal, sig))
        survivors = [r for r in range(WORLD) if r != VICTIM]
        last = {}
        deadline = t0 + bound + 5
        while time.monotonic() < deadline and len(last) < len(survivors):
            for t, line in list(out):
                for r in survivors:
                    if line.startswith(f"[default{r}]:DECODE FAILED"):
                        last.setdefault(r, (t, line))
            time.sleep(0.1)
        if sig == "SIGSTOP":
            os.kill(victim, signal.SIGKILL)  # torchrun's SIGTERM would wait 30 s for it
        job.wait(60)
        reader.join(10)
        text = "\n".join(line for _, line in out)
        for r in survivors:
            assert r in last, f"rank {r} did not report in {bound + 5} s:\n{text[-4000:]}"
            t, line = last[r]
            assert f"DECODE FAILED: rank {VICTIM} " in line, line
            assert t - t0 <= bound, f"rank {r} took {t - t0:.1f} s: {line}"
            mine = [ln for _, ln in out if ln.startswith(f"[default{r}]:")]
            assert mine[-1] == line, mine[-5:]  # the survivor's last line
            assert not any("Traceback" in ln for ln in mine), mine[-20:]
            print(f"rank {r} after {t - t0:.1f} s: {line}")
    finally:
        if job.poll() is None:
            if victim is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, signal.SIGKILL)
            job.kill()
            job.wait(30)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "argv, refusal",
    [
        (["--seed", str(2**70)], "DECODE FAILED: decode.py: argument --seed"),  # an option
        (["--heads", "3"], "DECODE FAILED: heads (3) must be a positive multiple of TP (2)"),
    ],
)
def test_refusal_is_one_line_and_status_2_on_every_rank(argv, refusal):
    """An option or a configuration refused under torchrun: one line on stdout, every rank
    exits 2, nothing of the project's on stderr; torchrun adds what README's Errors section
    says: its ChildFailedError report naming each rank's exit code 2, and status 1."""
    p, lines = torchrun(2, *argv, timeout=300)
    assert lines == [lines[-1]] and lines[-1].startswith(refusal), p.stdout
    assert p.stderr.count("exitcode  : 2") == 2, p.stderr[-3000:]  # torchrun's summary
    assert p.returncode == 1 and p.stderr.count("errors.ChildFailedError:") == 1, p.stderr[-3000:]
    ours = [line for line in p.stderr.splitlines() if "[rank" in line or 'decode.py", line' in line]
    assert "Traceback" not in p.stdout and not ours, p.stderr[-3000:]


def test_help_prints_no_none_default_and_progress_is_rate_limited(capsys, monkeypatch):
    """``--help`` names no ``(default: None)`` (``--oproj-launch`` and the backend-dependent
    defaults say theirs in words); ``Progress``: the configuration line first, then one
    progress line per ``every_s``, and the report does not print that line again."""
    from launch import decode
    from launch import report as rep
    from launch.layer import Config

    with pytest.raises(SystemExit):
        decode.parse_args(["--help"])
    text = capsys.readouterr().out
    assert "--oproj-launch" in text and "default: None" not in text
    cfg = Config(tp=2, heads=4, hidden=1024, requests=3, tokens=3, blocks=2, steps=5)
    block = rep.config(cfg, "host", "torchrun", domain_size=2)
    clock = iter([0.0, 1.0, 6.0, 7.0, 13.0, 14.0])
    monkeypatch.setattr(rep, "clock", lambda: next(clock))
    progress = rep.Progress(True, block, cfg.steps, every_s=5.0)
    for done in (1, 2, 3, 4):
        progress(done)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [rep.config_line(block), "progress step 2/5, 6 s", "progress step 4/5, 13 s"]
    rep.print_config({"config": block, "steps": {"total": 5, "decode": 5}})
    assert capsys.readouterr().out.splitlines() == ["steps    5 (5 decode)"]
    rep.Progress(False, block, 5)  # the other ranks stay quiet
    assert capsys.readouterr().out == ""


@pytest.mark.distributed
def test_report_holds_peak_rss(tmp_path):
    out = tmp_path / "report.json"
    p, lines = torchrun(2, "--heads", "2", "--requests", "2", "--tokens", "2", "--blocks", "1",
                        "--steps", "2", "--json", str(out), timeout=300)  # fmt: skip
    assert p.returncode == 0 and lines[-1] == "DECODE OK", p.stdout[-3000:] + p.stderr[-3000:]
    rss = json.loads(out.read_text())["peak_rss_bytes"]
    assert len(rss["per_rank"]) == 2 and all(v > 2**20 for v in rss["per_rank"])
    assert rss["total"] == sum(rss["per_rank"])
    assert any(line.startswith("memory   peak RSS") for line in lines)
