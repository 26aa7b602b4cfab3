"""Digest of every kernel's sm_90a PTX as compiled by the CPU compile tests.

A refactor that must not change the kernels compares the digests before and after:

    python scripts/ptx_digest.py before.json        # on the old tree
    python scripts/ptx_digest.py after.json         # on the new tree
    python scripts/ptx_digest.py --compare before.json after.json

The PTX is normalised only where a move cannot change the code: entry names (they spell the
module and class) and the compiler banner. Everything else must match byte for byte. Each
compile's PTX is kept apart (``ptx_dump_plugin.py``) and keyed by its test and its index in
the test, so configurations the DSL dumps under one file name are all compared.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

ENTRY = re.compile(r"\.entry\s+(\w+)\(")


def normalise(text: str) -> str:
    for i, name in enumerate(ENTRY.findall(text)):
        text = text.replace(name, f"KERNEL{i}")
    return "\n".join(line for line in text.splitlines() if not line.startswith("//"))


def digest(out: pathlib.Path, select: str) -> None:
    root = pathlib.Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as dump:
        here = str(pathlib.Path(__file__).resolve().parent)
        path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=dump, PYTHONPATH=path)
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-m",
            "compile",
            "-k",
            select,
            "-p",
            "no:cacheprovider",
            "-p",
            "ptx_dump_plugin",
            str(root / "tests"),
        ]
        subprocess.run(cmd, cwd=root, env=env, check=True)
        table = {}  # "test__index" -> digest
        for path in sorted(pathlib.Path(dump).glob("*/*.ptx")):
            body = normalise(path.read_text())
            # The test and the compile's index name the folder; the file's name spells the
            # jit function's arguments, which a signature refactor changes.
            key = path.parent.name
            if key in table:
                key = f"{key}/{path.name[:120]}"
            table[key] = hashlib.sha256(body.encode()).hexdigest()[:16]
    out.write_text(json.dumps(table, indent=1, sort_keys=True))
    print(f"{len(table)} PTX files, {len(set(table.values()))} distinct -> {out}")


def compare(before: pathlib.Path, after: pathlib.Path) -> int:
    """Per compile (test and index): changed digests, compiles only after, only before.
    Non-zero when any compile of both runs changed or one appears only after."""
    old, new = json.loads(before.read_text()), json.loads(after.read_text())
    changed = sorted(k for k in set(old) & set(new) if old[k] != new[k])
    added, dropped = sorted(set(new) - set(old)), sorted(set(old) - set(new))
    for k in changed:
        print("CHANGED", k)
    for k in added:
        print("only after", k)
    for k in dropped:
        print("only before", k)
    print(
        f"{len(new)} compiles after: {len(changed)} changed, {len(added)} only after, "
        f"{len(dropped)} only before"
    )
    return 1 if changed or added else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=pathlib.Path)
    p.add_argument("--compare", action="store_true")
    p.add_argument("-k", default="sm_90a or not sm_100a", help="pytest -k of the compiles")
    a = p.parse_args()
    if a.compare:
        return compare(*a.files)
    digest(a.files[0], a.k)
    return 0


if __name__ == "__main__":
    sys.exit(main())
