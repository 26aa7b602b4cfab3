"""Time per phase of a KDA kernel from Nsight Compute's source view: each SASS instruction
(by address) is assigned to the last phase method of ``kda/`` seen in address order (the
helpers of ``kda/kernels/device.py`` and ``tpcomm/cuteutil.py`` inherit it), and each phase's warp
state samples give its share of the time, beside its warp instructions per item.

    CUTE_DSL_LINEINFO=1 ncu --clock-control none --profile-from-start off --launch-count 1 \\
        --section SourceCounters --import-source yes -o replay \\
        python3 scripts/profile_kda.py --kernel replay --ring 4 --heads 96 --requests 32
    ncu --import replay.ncu-rep --page source --csv --print-source cuda,sass > replay.csv
    python3 scripts/ncu_phases.py replay.csv --items 3072 [--json phases.json]

(``CUTE_DSL_LINEINFO=1`` makes the DSL emit line info, so the CSV names the Python lines;
the phases are read from the files those lines name, so run this on the tree profiled.)
"""

from __future__ import annotations

import argparse
import ast
import collections
import csv
import json

# KdaReplay's and KdaWide's phase methods -> phase
PHASES = {
    "copy_entries": "inputs",
    "conv_operands": "inputs",
    "gate_operands": "inputs",
    "read_inputs": "inputs",
    "load_beta": "inputs",
    "load_activations": "inputs",
    "load_gate_weights": "inputs",
    "conv_phase": "conv",
    "conv_phase_unrecorded": "conv",
    "write_conv": "conv",
    "write_k_record": "conv",
    "gate_phase": "gate",
    "stage_entries": "ring decode",
    "normalize_qk": "normalize",
    "suffix_phase": "suffix products",
    "suffix_chain": "suffix products",
    "fold_page": "fold",
    "replay_rows": "page products + ring terms",
    "page_chunk": "page products + ring terms",
    "norm_sums": "output",
    "write_output": "output",
    # KdaPipe (and KdaStream's staging): the prep group's phases, then the state group's
    "prep": "prep loop",
    "stage_head": "head cache",
    "next_head": "head cache",
    "advance": "input loads",
    "stage_rows": "input loads",
    "stage_conv": "input loads",
    "stage_inputs": "input loads",
    "gate_weights": "gate",
    "gate_batch": "gate",
    "gate_decays": "gate",
    "take_output": "output",
    "finish_output": "output",
    "state_loop": "state loop",
    "load_history": "page loads",
    "stage_state": "page loads",
    "recurrence": "recurrence",
}
PHASE_FILES = (
    "kda/kernels/replay.py",
    "kda/kernels/wide.py",
    "kda/kernels/pipe.py",
    "kda/kernels/pipe_prep.py",
    "kda/kernels/stream.py",
)
SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def function_at(source: str, line: int) -> str:
    """The innermost function of ``source`` (Python text) that holds ``line`` ("?" if none)."""
    best = None
    for node in ast.walk(ast.parse(source)):
        inside = isinstance(node, ast.FunctionDef) and node.lineno <= line <= node.end_lineno
        if inside and (best is None or node.lineno > best.lineno):
            best = node
    return best.name if best else "?"


def sass_rows(lines):
    """(address, file, line, samples, executed, {stall: samples}) per SASS instruction of
    ncu's ``--print-source cuda,sass`` CSV (``lines``: its text lines)."""
    path = header = line = None
    for row in csv.reader(lines):
        if not row:
            continue
        if row[0] == "File Path":
            path = row[1]
        elif row[0] == "Line No":
            header = row
        elif header is None or row[0] == "Function Name":
            continue
        elif row[0]:
            line = int(row[0])
        elif row[2].startswith("0x"):
            h = dict(zip(header, row, strict=False))
            stalls = {
                k[6:]: int(v)
                for k, v in h.items()
                if k.startswith("stall_") and "(Not" not in k and v not in ("", "-")
            }
            yield int(row[2], 16), path, line, int(h[SAMPLES]), int(h[EXECUTED]), stalls


def read_text(path: str) -> str:
    with open(path) as f:
        return f.read()


def phases(rows, read=read_text) -> dict:
    """{phase: (samples, executed, Counter of stalls)} from ``sass_rows``, in address order;
    instructions before the first phase method count as "setup"."""
    sources, functions = {}, {}
    out = collections.defaultdict(lambda: [0, 0, collections.Counter()])
    current = "setup"
    for _, path, line, samples, executed, stalls in sorted(rows):
        if path.endswith(PHASE_FILES):
            if path not in sources:
                sources[path] = read(path)
            key = (path, line)
            if key not in functions:
                functions[key] = function_at(sources[path], line)
            current = PHASES.get(functions[key], current)
        entry = out[current]
        entry[0] += samples
        entry[1] += executed
        entry[2].update(stalls)
    return dict(out)


def summary(table: dict, items: int) -> dict:
    """Per phase: share of the samples (%), warp instructions per item, top three stalls (%
    of the phase's samples), largest share first."""
    total = sum(v[0] for v in table.values()) or 1
    result = {}
    for name, (samples, executed, stalls) in sorted(table.items(), key=lambda kv: -kv[1][0]):
        top = {k: round(100 * c / samples, 1) for k, c in stalls.most_common(3)} if samples else {}
        result[name] = dict(
            samples_pct=round(100 * samples / total, 1),
            warp_instructions_per_item=round(executed / items),
            top_stalls_pct=top,
        )
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csv", help="ncu --page source --csv --print-source cuda,sass output")
    p.add_argument("--items", type=int, required=True, help="the launch's (request, head) items")
    p.add_argument("--json", help="write the summary here")
    args = p.parse_args(argv)
    with open(args.csv) as f:
        result = summary(phases(list(sass_rows(f))), args.items)
    for name, row in result.items():
        print(
            f"{row['samples_pct']:5.1f}% {row['warp_instructions_per_item']:6d} warp "
            f"instructions / item  {name:28s} {row['top_stalls_pct']}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
