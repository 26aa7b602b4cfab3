"""Mutation check of the test suite: each mutant is a small source change a test must catch.

Every mutant is applied to its own scratch copy of the tree (tracked and untracked files,
as they are in the working tree); the tests it names run there, and it is *killed* when one
of them fails. Survivors are bugs the suite cannot see.

    python scripts/mutants.py                 # the CPU mutants (a CPU machine, ~minutes)
    python scripts/mutants.py --gpu           # the GPU mutants (needs a CUDA GPU)
    python scripts/mutants.py --list          # what is checked, no run
    python scripts/mutants.py -k eps -j 4     # a subset, 4 at a time

The mutants are listed in ``scripts/mutants_table.py`` and ``scripts/mutants_kda.py``. Exit
status 0 only when every selected mutant is killed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

from mutants_kda import KDA_MUTANTS
from mutants_oproj import OPROJ_MUTANTS
from mutants_table import MUTANTS as TABLE
from mutants_table import M, Mutant

MUTANTS = TABLE + KDA_MUTANTS + OPROJ_MUTANTS

__all__ = ["MUTANTS", "M", "Mutant", "apply", "main", "run"]  # M, Mutant: the table's

ROOT = pathlib.Path(__file__).resolve().parent.parent


def scratch_copy(dest: pathlib.Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for name in filter(None, files):
        src = ROOT / name.decode()
        if src.is_file():
            (dest / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name.decode())
    if (ROOT / ".dev").is_dir():  # the GPU machine's packages (.dev/site.tar.xz)
        (dest / ".dev").symlink_to(ROOT / ".dev")


def apply(m: Mutant, tree: pathlib.Path) -> None:
    path = tree / m.path
    text = path.read_text()
    found = text.count(m.find)
    if found != m.count:
        raise ValueError(f"{m.name}: {m.find!r} occurs {found} times in {m.path}, not {m.count}")
    path.write_text(text.replace(m.find, m.replace))


SUMMARY = re.compile(r"(\d+) (failed|passed|error|errors|skipped)")


def run(m: Mutant, timeout: float) -> tuple[str, str, float]:
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mutant-") as tmp:
        tree = pathlib.Path(tmp)
        scratch_copy(tree)
        try:
            apply(m, tree)
        except ValueError as e:
            return "STALE", str(e), time.monotonic() - start
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *m.tests]
        if m.select:
            cmd += ["-k", m.select]
        try:
            out = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return "KILLED", "timed out (a hang is a failure)", time.monotonic() - start
    text = out.stdout + out.stderr
    counts = {k: int(n) for n, k in SUMMARY.findall(text.splitlines()[-1] if text else "")}
    failed = [line.split()[1] for line in text.splitlines() if line.startswith(("FAILED", "ERROR"))]
    if out.returncode != 0 and (failed or counts.get("failed") or counts.get("error")):
        return "KILLED", ", ".join(failed[:2]) or "collection error", time.monotonic() - start
    if not counts.get("passed"):
        return "NOT RUN", text.splitlines()[-1] if text else "no output", time.monotonic() - start
    return "SURVIVED", f"{counts.get('passed')} passed", time.monotonic() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", action="store_true", help="the GPU mutants instead of the CPU ones")
    p.add_argument("--list", action="store_true")
    p.add_argument("-k", default="", help="only mutants whose name contains this")
    p.add_argument("-j", type=int, default=2, help="mutants at a time")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant")
    a = p.parse_args()
    chosen = [m for m in MUTANTS if m.gpu == a.gpu and a.k in m.name]
    if a.list:
        for m in chosen:
            print(f"{m.name:32s} {m.path}: {' '.join(m.tests)}")
        return 0
    bad = 0
    with concurrent.futures.ThreadPoolExecutor(a.j) as pool:
        futures = {pool.submit(run, m, a.timeout): m for m in chosen}
        for f in concurrent.futures.as_completed(futures):
            verdict, why, secs = f.result()
            bad += verdict != "KILLED"
            print(f"{verdict:9s} {futures[f].name:32s} {secs:6.1f} s  {why}", flush=True)
    print(f"{len(chosen) - bad}/{len(chosen)} mutants killed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
