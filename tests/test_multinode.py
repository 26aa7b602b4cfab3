"""docs/multinode.md's recipe on the CPU (issue 36, part 3): the mpirun command line of two
8-GPU nodes, shrunk to 4 ranks on two "nodes" of 2 declared by a hostfile and
``--domain-size 2``, run on the host backend; the placement its flags give lines up with
the domains; every ``launch/decode.py`` command in the doc parses.

Two "nodes" on one machine need MPICH's Hydra (the ``mpich`` pip package of the ``mpi``
extra): its ``-launcher fork`` starts every rank here whatever the hostfile names, and
``-ppn`` places them by node as ``--map-by ppr:N:node`` does under Open MPI. Under Open MPI
the decode job runs without a hostfile (the domains still declared) and the placement
test is skipped: it would ssh to the second name.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "launch", "decode.py")
DOC = os.path.join(ROOT, "docs", "multinode.md")
NODES, PER_NODE = 2, 2
# what the recipe sets on every rank (PYTHONPATH through the environment, as the tests do)
GENV = {"NVSHMEM_BOOTSTRAP": "MPI", "NVSHMEM_DISABLE_NVLS": "1", "NVSHMEM_SYMMETRIC_SIZE": "2g"}
SMALL = [
    "--heads",
    "8",
    "--hidden",
    "1024",
    "--requests",
    "2",
    "--tokens",
    "2",
    "--blocks",
    "2",
    "--steps",
    "3",
]
# Probe: where the recipe's flags put each rank; one file per rank (no interleaved output).
PROBE = (
    "import json, os, sys; "
    "e = os.environ; "
    "r = int(e['PMI_RANK']); "
    "json.dump({'rank': r, 'node': e.get('PMI_HOSTNAME'), 'local': int(e['MPI_LOCALRANKID']), "
    "'genv': e.get('NVSHMEM_SYMMETRIC_SIZE')}, open(os.path.join(sys.argv[1], str(r)), 'w'))"
)


def mpi_flavour():
    """("hydra" | "openmpi" | None, the mpirun path)."""
    exe = shutil.which("mpirun") or shutil.which("mpiexec")
    if exe is None:
        return None, None
    text = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    out = text.stdout + text.stderr
    if "HYDRA" in out:
        return "hydra", exe
    return ("openmpi" if "Open MPI" in out or "OpenRTE" in out else None), exe


def launcher_args(tmp_path, ranks):
    """The recipe's mpirun options for ``ranks`` processes on two "nodes" of this machine."""
    flavour, exe = mpi_flavour()
    if flavour is None:
        pytest.skip("no mpirun of a known flavour (pip install '.[mpi]')")
    if flavour == "openmpi":
        env = [a for k, v in GENV.items() for a in ("-x", f"{k}={v}")]
        return flavour, [exe, "-np", str(ranks), "--oversubscribe", *env]
    hosts = tmp_path / "hosts"
    hosts.write_text("".join(f"node{i}:{PER_NODE}\n" for i in range(NODES)))
    env = [a for k, v in GENV.items() for a in ("-genv", k, v)]
    return flavour, [
        exe,
        "-np",
        str(ranks),
        "-f",
        str(hosts),
        "-ppn",
        str(PER_NODE),
        "-launcher",
        "fork",
        *env,
    ]


def run(cmd, timeout=600):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    return p, [line for line in p.stdout.splitlines() if line.strip()]


@pytest.mark.distributed
def test_mpirun_two_nodes_declared(tmp_path):
    """4 ranks, domains of 2 (one per "node"): every check passes, the partials of the other
    domain through the store's put-with-signal, and the report says the split."""
    pytest.importorskip("mpi4py")
    _, mpirun = launcher_args(tmp_path, NODES * PER_NODE)
    out = tmp_path / "report.json"
    p, lines = run(
        [
            *mpirun,
            sys.executable,
            SCRIPT,
            "--backend",
            "host",
            "--domain-size",
            str(PER_NODE),
            *SMALL,
            "--json",
            str(out),
        ]
    )
    assert p.returncode == 0 and lines[-1] == "DECODE OK", p.stdout[-3000:] + p.stderr[-3000:]
    assert f"(mpirun), TP {NODES * PER_NODE}" in p.stdout
    assert f"domain {PER_NODE}," in p.stdout
    assert "ok   output, prefix == TP reference (bitwise): 3/3 steps" in p.stdout
    report = json.loads(out.read_text())
    assert report["config"]["domain_size"] == PER_NODE
    assert report["config"]["launcher"] == "mpirun" and report["config"]["tp"] == 4
    assert all(v["passed"] == v["of"] == 3 for v in report["checks"].values())


@pytest.mark.distributed
def test_recipe_places_domains_on_nodes(tmp_path):
    """The recipe's flags put ranks 0..1 on the first "node" and 2..3 on the second, each
    with node-local ranks 0..1 (its GPUs): exactly ``DomainMap(4, 2)``'s domains."""
    from tpcomm.domain import DomainMap

    flavour, mpirun = launcher_args(tmp_path, NODES * PER_NODE)
    if flavour != "hydra":
        pytest.skip("two nodes on one machine need Hydra's fork launcher")
    where = tmp_path / "where"
    where.mkdir()
    p, _ = run([*mpirun, sys.executable, "-c", PROBE, str(where)], timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    ranks = [json.loads((where / str(r)).read_text()) for r in range(NODES * PER_NODE)]
    nodes: dict = {}
    for r in ranks:
        nodes.setdefault(r["node"], []).append(r["rank"])
        assert r["genv"] == GENV["NVSHMEM_SYMMETRIC_SIZE"]
    assert sorted(tuple(v) for v in nodes.values()) == list(DomainMap(4, PER_NODE).groups())
    assert [r["local"] for r in ranks] == [0, 1, 0, 1]


def doc_commands():
    """Every mpirun command of docs/multinode.md's indented blocks, continuations joined."""
    with open(DOC) as f:
        text = f.read().replace("\\\n", " ")
    return [
        line.strip()
        for line in text.splitlines()
        if line.startswith("    mpirun") and "launch/decode.py" in line
    ]


def test_recipes_in_this_doc_parse():
    """The doc's decode options are the CLI's, ``--domain-size`` the ranks per node and
    every rank started (``-np``) a whole number of nodes."""
    from launch.decode import parse_args

    commands = doc_commands()
    assert len(commands) >= 3  # Open MPI, MPICH, the two-GPU check
    for command in commands:
        words = shlex.split(command.replace("$PWD", ROOT))
        opts = words[words.index("launch/decode.py") + 1 :]
        args = parse_args(opts)
        assert args.backend == "nvshmem" and args.domain_size is not None, command
        np_ = int(words[words.index("-np") + 1])
        per_node = re.search(r"ppr:(\d+):node|-ppn (\d+)", command)
        if per_node:
            assert int(per_node.group(1) or per_node.group(2)) == args.domain_size, command
            assert np_ % args.domain_size == 0 and np_ // args.domain_size == 2, command
