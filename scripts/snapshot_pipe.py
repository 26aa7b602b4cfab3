"""KdaPipe of another git revision beside this tree's, for ``probe_pipe.py --baseline``.

``python3 scripts/snapshot_pipe.py REF NAME`` writes the package ``kda/kernels/snap_NAME/``
holding REF's ``kda/kernels/pipe*.py`` (its own pipe_prep, pipe_index, ... where REF has
them), their imports of the shared kernel modules (``device``, ``stream``, ``wide``) pointed
one level up, so ``probe_pipe.py --baseline kda.kernels.snap_NAME.pipe`` times REF's
KdaPipe on this tree's launcher, same graphs, same run. Snapshots are not part of the
tree: ``--clean`` removes every ``snap_*`` package (``.gitignore`` keeps them out of
commits; the device tool carries them when named in ``carry``).

    python3 scripts/snapshot_pipe.py main main
    python3 scripts/probe_pipe.py --baseline kda.kernels.snap_main.pipe --json ab.json
    python3 scripts/snapshot_pipe.py --clean
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = os.path.join(ROOT, "kda", "kernels")


def pipe_files(ref):
    """REF's ``kda/kernels/pipe*.py`` file names."""
    out = subprocess.run(
        ["git", "ls-tree", "--name-only", ref, "kda/kernels/"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    return [os.path.basename(p) for p in out if re.fullmatch(r"kda/kernels/pipe\w*\.py", p)]


def rewrite(text, local):
    """Relative imports of modules outside ``local`` (the snapshot's own) one level up."""

    def up(match):
        name = match.group(1)
        return match.group(0) if name in local else f"from ..{name} import"

    text = re.sub(r"^from \. import", "from .. import", text, flags=re.M)
    return re.sub(r"^from \.(\w+) import", up, text, flags=re.M)


def snapshot(ref, name):
    files = pipe_files(ref)
    if "pipe.py" not in files:
        raise SystemExit(f"{ref} has no kda/kernels/pipe.py")
    target = os.path.join(KERNELS, f"snap_{name}")
    shutil.rmtree(target, ignore_errors=True)
    os.makedirs(target)
    local = {f[:-3] for f in files}
    for f in files:
        text = subprocess.run(
            ["git", "show", f"{ref}:kda/kernels/{f}"],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        with open(os.path.join(target, f), "w") as out:
            out.write(rewrite(text, local))
    with open(os.path.join(target, "__init__.py"), "w") as out:
        out.write(f'"""KdaPipe of {ref} (scripts/snapshot_pipe.py)."""\n')
    return target


def clean():
    for entry in os.listdir(KERNELS):
        if entry.startswith("snap_"):
            shutil.rmtree(os.path.join(KERNELS, entry))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ref", nargs="?")
    p.add_argument("name", nargs="?")
    p.add_argument("--clean", action="store_true")
    a = p.parse_args(argv)
    if a.clean:
        clean()
        return
    if not (a.ref and a.name and re.fullmatch(r"\w+", a.name)):
        p.error("give REF NAME (NAME: letters, digits, _) or --clean")
    print(snapshot(a.ref, a.name))


if __name__ == "__main__":
    sys.exit(main())
