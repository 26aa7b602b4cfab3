"""What bounds KdaPipe: timing probes on one GPU (docs/kda.md, "What bounds KdaPipe").

``--ablate``: KdaPipe beside variants with one group's math removed (timing only: their
outputs are garbage): ``no_state`` (the recurrence, its math and page stores; the page
loads stay), ``no_prep`` (conv, gate and conv write-back), ``no_gate``, ``no_conv`` and
``neither``; ``copy_only`` (the pages read and written back unchanged, no recurrence math)
and ``copy_no_prep`` (that without the prep group's math: the state bytes alone, in this
kernel's pattern). The full kernel against ``no_prep`` / ``no_state`` says which group
bounds; ``copy_no_prep`` against the copy bandwidth what the pattern itself reaches.

``--baseline MODULE`` (repeatable): other KdaPipes beside this tree's, same graphs, each
``--repeats`` times alternately (e.g. another revision's, by ``scripts/snapshot_pipe.py REF
NAME`` and ``--baseline kda.kernels.snap_NAME.pipe``).

Each row is timed as ``bench_kda.py`` times a forced kernel (CUDA graphs, slot tables
rotated past L2); % of copy counts (1 + T) pages per item against a copy measured in the
run, also for variants that store no pages.

    python3 scripts/probe_pipe.py --ablate [--json out.json]
    python3 scripts/probe_pipe.py --baseline kda.kernels.snap_main.pipe [--json out.json]
    python3 scripts/probe_pipe.py --ablate --of kda.kernels.pipe_rows:KdaPipeRows
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402

import kda.kernels.pipe as pipe  # noqa: E402

KdaPipe = pipe.KdaPipe
ROWS = [
    (96, 128, 1, "fp32"),
    (96, 128, 1, "bf16"),
    (12, 128, 1, "fp32"),
    (12, 128, 1, "bf16"),
    (12, 32, 1, "fp32"),
    (6, 128, 1, "fp32"),
    (12, 128, 2, "fp32"),
    (12, 128, 4, "fp32"),
    (12, 128, 4, "bf16"),
    (12, 32, 4, "fp32"),
    (96, 128, 4, "fp32"),
]


class NoState(KdaPipe):
    @cute.jit
    def recurrence(self, op, history, shared, s_beta, s_o, slot, request, head):
        pass


class CopyOnly(KdaPipe):
    """The recurrence's page traffic without its math: each token's page written back as
    loaded (KdaStream's chunk writer). Against ``full`` it says how far the state bytes
    alone, read and written in this kernel's pattern, are from the copy bandwidth."""

    @cute.jit
    def recurrence(self, op, history, shared, s_beta, s_o, slot, request, head):
        target = self.state_target(op.slots, slot, request)
        state0 = cutlass.Int64(op.state.iterator.toint())
        for t in cutlass.range_constexpr(self.tokens):
            write = self.chunk_writer(state0, target(t), head)
            for i in cutlass.range_constexpr(len(history)):
                for c in cutlass.range_constexpr(len(history[0])):
                    write(i, c, history[i][c])


class NoGate(KdaPipe):
    @cute.jit
    def gate_phase(self, op, weights, activations, a, dt, s_decay, request, head, rows=None):
        pass

    @cute.jit
    def gate_batch(self, op, batch, caches, n, count, request, requests):
        pass

    @cute.jit
    def gate_decays(self, op, weights, activations, a, dt, dt_row, s_decay, rows):
        pass


class NoConv(KdaPipe):
    @cute.jit
    def conv_phase(self, taps, coeff, bias, inputs, shared, sums, kg_records, request, head):
        pass

    @cute.jit
    def write_conv(self, conv_state, conv_slot, head, taps, inputs):
        pass


class NoPrep(NoGate, NoConv):
    pass


class Neither(NoPrep, NoState):
    pass


class CopyNoPrep(NoPrep, CopyOnly):
    """``copy_only`` with the prep group's math removed too: the state bytes alone."""


ABLATIONS = dict(
    full=KdaPipe,
    no_state=NoState,
    no_prep=NoPrep,
    no_gate=NoGate,
    no_conv=NoConv,
    neither=Neither,
    copy_only=CopyOnly,
    copy_no_prep=CopyNoPrep,
)


def time_rows(variants, rows, repeats, json_path=None):
    """Each row's variants timed in turn, ``repeats`` rounds; returns the rows' dicts."""
    import torch
    from bench_kda import PAGE, copy_bandwidth, ours, rotations_for, setup, time_graph

    from tpcomm import cuteutil

    tbps = copy_bandwidth()
    out = []
    for H, B, T, dtype in rows:
        rot, per = rotations_for(H, B, T, PAGE // 2 if dtype == "bf16" else PAGE)
        layer, steps = setup(H, B, T, rot, state_dtype=dtype)
        for rep in range(repeats):
            for name, cls in variants.items():
                pipe.KdaPipe = cls  # the launcher imports it per build
                cuteutil._COMPILED.clear()
                us = time_graph(ours(layer, steps, "pipe"), inner=rot)
                pct = 100 * per / (us * 1e-6) / 1e12 / tbps
                out.append(dict(H=H, B=B, T=T, dtype=dtype, variant=name, rep=rep, us=us))
                out[-1]["pct_copy"] = pct
                print(f"{name:9s} H {H:3d} B {B:4d} T {T} {dtype}: {us:8.1f} us {pct:5.1f}%")
        pipe.KdaPipe = KdaPipe
        del layer, steps
        torch.cuda.empty_cache()
        if json_path:
            with open(json_path, "w") as f:
                json.dump(dict(copy_tbps=tbps, rows=out), f, indent=1)
    return out


def variant_name(module):
    """A baseline's name in the rows: the module's last part, its package's for a
    ``snapshot_pipe.py`` snapshot (``kda.kernels.snap_main.pipe`` -> ``snap_main``), the
    class's for ``module:Class``."""
    if ":" in module:
        return module.split(":")[1]
    parts = module.split(".")
    return parts[-2] if parts[-1] == "pipe" and len(parts) > 1 else parts[-1]


def baseline_class(spec):
    """The class ``module`` (its KdaPipe) or ``module:Class`` names."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name or "KdaPipe")


def ablations_of(base):
    """The ablation variants on ``base`` (KdaPipe or a subclass of it, e.g. KdaPipeRows):
    each variant's overrides ahead of ``base``'s in the method order."""
    if base is KdaPipe:
        return dict(ABLATIONS)
    return {
        name: cls if cls is KdaPipe else type(f"{cls.__name__}_{base.__name__}", (cls, base), {})
        for name, cls in ABLATIONS.items()
    } | {"full": base}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ablate", action="store_true")
    p.add_argument(
        "--baseline",
        action="append",
        default=[],
        help="a module holding a KdaPipe, or module:Class of another one (repeatable)",
    )
    p.add_argument(
        "--of", default=None, help="--ablate: module:Class of another KdaPipe (default this tree's)"
    )
    p.add_argument("--repeats", type=int, default=None, help="rounds (ablate 1, baseline 2)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.ablate == bool(a.baseline):
        p.error("give --ablate or --baseline MODULE")
    if a.ablate:
        variants = ablations_of(baseline_class(a.of) if a.of else KdaPipe)
    else:
        variants = {variant_name(m): baseline_class(m) for m in a.baseline}
        variants["tree"] = KdaPipe
    repeats = a.repeats or (1 if a.ablate else 2)
    time_rows(variants, ROWS, repeats, a.json)


if __name__ == "__main__":
    main()
