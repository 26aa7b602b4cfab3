"""Digest of every kernel's sm_90a PTX as compiled by the CPU compile tests.

A refactor that must not change the kernels compares the digests before and after:

    python scripts/ptx_digest.py before.json        # on the old tree
    python scripts/ptx_digest.py after.json         # on the new tree
    python scripts/ptx_digest.py --compare before.json after.json

The PTX is normalised only where a move cannot change the code: entry names (they spell the
module and class) and the compiler banner. Everything else must match byte for byte.
"""

from __future__ import annotations

import argparse
import collections
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
        env = dict(os.environ, CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=dump)
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
            str(root / "tests"),
        ]
        subprocess.run(cmd, cwd=root, env=env, check=True)
        table = collections.defaultdict(list)
        for path in sorted(pathlib.Path(dump).glob("*.ptx")):
            body = normalise(path.read_text())
            table[hashlib.sha256(body.encode()).hexdigest()[:16]].append(path.name[:120])
    out.write_text(json.dumps(table, indent=1, sort_keys=True))
    print(f"{sum(map(len, table.values()))} PTX files, {len(table)} distinct -> {out}")


def compare(before: pathlib.Path, after: pathlib.Path) -> int:
    old, new = json.loads(before.read_text()), json.loads(after.read_text())
    changed = sorted(set(new) - set(old))
    dropped = sorted(set(old) - set(new))
    for h in changed:
        print("NEW/CHANGED", h, new[h][0])
    for h in dropped:
        print("not compiled any more", h, old[h][0])
    print(f"{len(new)} kernels after, {len(changed)} not in before, {len(dropped)} dropped")
    return 1 if changed else 0


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
