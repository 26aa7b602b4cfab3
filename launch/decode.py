"""Decode steps of one KDA layer, tensor-parallel, end to end, checked and timed.

    torchrun --nproc-per-node N launch/decode.py [options]
    mpirun -np N python launch/decode.py [options]
    python launch/decode.py --backend loopback --tp N [options]

Backends: ``host`` (CPU, gloo, the reference math; ``launch.host``), ``loopback`` (one
process, ``--tp N`` ranks as streams of one GPU) and ``nvshmem`` (one process and rank per
GPU; both ``launch.gpu``). The last line is ``DECODE OK`` or ``DECODE FAILED: ...``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

if __package__ in (None, ""):  # run as a script: make the project importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from engine.layer import DEFAULT_RING, KDA_STATES
from kda.operands import MAX_RING, MIN_RING
from kda.validate import GATE_FORMS
from launch.layer import MAX_ROWS
from launch.liveness import hard_exit
from launch.procs import env_rank, job_processes, nvshmem_installed
from launch.report import check_json_path
from tpcomm.host import launcher
from tpcomm.mailbox import HID_STEP, MAX_HID

HOST_TOKENS = 3  # --tokens default on the host
GPU_TOKENS = 2  # --tokens default on the GPU backends (requests x tokens <= 1024)
HOST_TIMEOUT = 30.0  # --timeout default on the host (a step there takes well under 1 s)
GPU_TIMEOUT = 300.0  # --timeout default on the GPU backends (kernel compiles between waits)
MAX_SEED = 2**63 - 1
MAX_STEPS = 10**6
DEFAULT_TRACE = 20  # --trace without a count: traced steps
MAX_TRACE = 500  # traced steps are enqueued behind one ~20 ms sleep
REFUSAL_TICK_S = 2.0  # refusing ranks of a job exit together on this clock's ticks
# Rank 0 prints the refusal and leaves on its SPEAKER_TICKS-th tick, so that ranks still
# importing reach their own wait (status 2 on SIGTERM) first (a 4-rank refusal on a loaded
# two-core machine lost a rank that way); the others wait up to QUIET_TICKS ticks for it
# (the launcher stops them, status 2, once rank 0 leaves), so a rank 0 that started late is
# not stopped before it speaks (a 4-rank job under load lost its line).
SPEAKER_TICKS = 2
QUIET_TICKS = 4


class Parser(argparse.ArgumentParser):
    """argparse with a one-line refusal: ``DECODE FAILED: ...`` from rank 0, exit 2."""

    def error(self, message):
        if env_rank() == 0:
            print(f"DECODE FAILED: {self.prog}: {message}", flush=True)
        if job_processes() > 1:  # the launcher stops the other ranks once one exits: every
            hard_exit(2, REFUSAL_TICK_S, refusal_ticks())  # rank leaves on a tick, rank 0 first
        sys.exit(2)


class Help(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help, but for options whose default depends on the backend (None):
    their help says it."""

    def _get_help_string(self, action):
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def refusal_ticks() -> int:
    """Ticks a refusing rank waits before it leaves: fewer for rank 0 (which speaks)."""
    return SPEAKER_TICKS if env_rank() == 0 else QUIET_TICKS


def ranged(kind, low, high=None, step=None):
    """An argparse type: ``kind`` (int or float) within ``low .. high``, finite (and, with
    ``step``, a multiple of it)."""

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {kind.__name__}: {text!r}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be finite; got {text!r}")
        if high is None and value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}; got {text}")
        if high is not None and not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in {low} .. {high}; got {text}")
        if step is not None and value % step:
            raise argparse.ArgumentTypeError(f"must be a multiple of {step}; got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


class MarkdownOptions(argparse.Action):
    """``--markdown-options``: print the option table (docs/cli.md's) and exit, as --help."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(options_markdown(parser), end="")
        parser.exit()


def options_markdown(p: argparse.ArgumentParser | None = None) -> str:
    """The options as a Markdown table (option, default, meaning), from the parser itself:
    docs/cli.md holds this text and ``tests/test_docs_cli.py`` checks it."""
    p = p or parser()
    gpu_group = next(g for g in p._action_groups if g.title == "GPU backends")
    lines = ["| option | default | meaning |", "|---|---|---|"]
    for a in p._actions:
        if not a.option_strings or a.help in (None, argparse.SUPPRESS) or a.dest == "help":
            continue
        names = " / ".join(f"`{o}`" for o in a.option_strings)
        if a.nargs == "?":
            names = f"`{a.option_strings[0]} [{a.metavar}]`"
        if a.default in (None, argparse.SUPPRESS):
            default = "-"
        elif isinstance(a.default, bool):
            default = "on" if a.default else "off"
        else:
            default = f"`{a.default}`"
        meaning = ("GPU: " if a in gpu_group._group_actions else "") + a.help
        if a.choices is not None:
            meaning += "; one of " + ", ".join(f"`{c}`" for c in a.choices)
        meaning = meaning.replace("|", "\\|")
        lines.append(f"| {names} | {default} | {meaning} |")
    return "\n".join(lines) + "\n"


def parser() -> Parser:
    """The job's argument parser (``parse_args`` adds the checks across options)."""
    # fmt: off
    p = Parser(description=__doc__.split("\n\n")[0],
               formatter_class=Help)
    add, gpu = p.add_argument, p.add_argument_group("GPU backends").add_argument
    add("--backend", choices=("auto", "host", "loopback", "nvshmem"), default="auto",
        help="auto = loopback with CUDA in one process, nvshmem under torchrun / mpirun "
        "with GPUs and nvshmem4py, host otherwise")
    add("--tp", type=ranged(int, 1, 16), default=None,
        help="TP ranks of the loopback backend (streams of one GPU; default 2); the other "
        "backends take the job's process count")
    add("--heads", type=ranged(int, 1, 4096), default=16,
        help="KDA heads of the whole layer (96 in Kimi-K3); a multiple of the ranks")
    add("--hidden", type=ranged(int, HID_STEP, MAX_HID, HID_STEP), default=1024,
        help=f"hidden width, a multiple of {HID_STEP} up to {MAX_HID} (7168 in Kimi-K3, "
        "2304 in Kimi-Linear)")
    add("--requests", type=ranged(int, 1, MAX_ROWS), default=4,
        help=f"requests per step (B); requests x tokens <= {MAX_ROWS}, and the job's memory "
        "estimate within the host's")
    add("--tokens", type=ranged(int, 1, 8), default=None,
        help=f"tokens per request of the verify steps (T, 1..8; 1 = decode only); default "
        f"{HOST_TOKENS} on the host, {GPU_TOKENS} on the GPU (requests x tokens <= 1024 there)")
    add("--blocks", type=ranged(int, 0, 8), default=3, help="AttnRes block snapshots (nb, 0..8)")
    add("--steps", type=ranged(int, 1, MAX_STEPS), default=6,
        help="steps: one single-token decode step, then verify steps")
    add("--seed", type=ranged(int, 0, MAX_SEED), default=0,
        help="seed of weights, pools and inputs (0 .. 2**63-1)")
    add("--groups", type=ranged(int, 1, 4), default=None,
        help="consumer polling groups (1..4); default 4 on the host, on the GPU the "
        "o-projection plan's, lowered until all ranks' consumers are co-resident")
    add("--padding", type=ranged(float, 0.0, 0.99), default=0.25,
        help="chance that a request is a padding row in a step")
    add("--conv-layout", choices=("dim-first", "window-first"), default="dim-first",
        help="conv cache layout: [S, 3D, W] or [S, W, 3D]")
    add("--kda-state", choices=KDA_STATES, default=KDA_STATES[0],
        help="KDA state: per-step (each step reads and writes the state pages; verify steps "
        "recorded and recovered in turn) or replay (checkpoint pages plus a ring of step "
        "records, folded when full; checked against the replay and the per-step references)")
    add("--state-dtype", choices=("fp32", "bf16"), default="fp32",
        help="KDA state pages: fp32, or bf16 (half the bytes; fp32 arithmetic, each stored "
        "page rounded once; checked against the reference on bf16 pages)")
    add("--gate", choices=GATE_FORMS, default=GATE_FORMS[0],
        help="KDA decay of the raw gate: lower-bound, exp(-5 sigmoid(exp(A_log) (g + dt_bias))) "
        "(Kimi K3), or softplus, exp(-exp(A_log) softplus(g + dt_bias)) (Kimi-Linear, fla's "
        "lower_bound=None); the layer and the references use it")
    add("--ring", type=ranged(int, MIN_RING, MAX_RING), default=DEFAULT_RING,
        help=f"replay: ring entries per state page (R, {MIN_RING}..{MAX_RING}, >= --tokens)")
    add("--check-every", type=ranged(int, 0), default=1,
        help="rank 0 checks every k-th step against the unsharded layer (0: never)")
    add("--json", default=None,
        help="write the report as JSON to this path (its directory checked at the start)")
    add("--timeout", type=ranged(float, 0.1, 3600.0), default=None,
        help=f"seconds a rank may go unheard: the gloo collectives' timeout and the "
        f"heartbeat limit naming a stopped rank; default {HOST_TIMEOUT:g} on the host, "
        f"{GPU_TIMEOUT:g} on the GPU backends")
    add("--domain-size", type=int, default=None,
        help="ranks per load/store (NVLink) domain, a divisor of the TP ranks; peers in other "
        "domains get each partial by put-with-signal (default: what the backend reaches by "
        "load/store; host and loopback: every rank)")
    gpu("--kernel", choices=("auto", "wide", "stream", "split", "pipe"), default="auto",
        help="KDA kernel (auto: kda.dispatch's choice; replay: only auto, the replay "
        "dispatcher's)")
    gpu("--gate-mode", type=int, choices=(0, 1, 3), default=3,
        help="KDA raw-gate reduction (3: mma.sync with an exact recompute where its error "
             "bound leaves the bf16 rounding open, 0/1: the seed's mma.sync orders)")
    gpu("--pdl", action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
        help="programmatic dependent launch of the KDA and recover kernels (and, loopback "
        "with --oproj-launch both, of the consumer behind the producer); default on, off "
        "with --trace")
    gpu("--trace", type=ranged(int, 1, MAX_TRACE), nargs="?", const=DEFAULT_TRACE, default=0,
        metavar="N",
        help=f"after the checked and back-to-back steps, N (default {DEFAULT_TRACE}) steps "
        "back to back with globaltimer stamps between the stages on each rank's stream: per "
        "rank stage times, gaps, skew, the consumer's polling (report['timeline'], "
        "scripts/plot_timeline.py). The whole job then runs without PDL: a stamp between "
        "two PDL kernels would break their overlap")
    gpu("--oproj-launch", choices=("per-rank", "both"), default=None,
        help="loopback: o-projection launches; both (default): one producer and one consumer "
        "launch for all ranks; per-rank: each rank's on its stream")
    gpu("--xmoe", type=ranged(int, 0, 8), default=0,
        help="MoE latent copies of each output row (0..8): the consumer writes them and a "
        "ready hint per CTA; a waiting kernel on another stream (the MoE dispatch's "
        "stand-in) acquires the hints and only then reads the copies; checked bitwise")
    gpu("--multicast", action=argparse.BooleanOptionalAction, default=False,
        help="nvshmem: allow NVLink multicast (NVLS); off sets NVSHMEM_DISABLE_NVLS=1 unless "
        "the environment says otherwise, and publishing goes to each peer")
    add("--fault", choices=("none", "output", "state"), default="none",
        help="test hook: the last rank corrupts its output or a state page in step 1, "
        "which the checks must catch")
    add("--markdown-options", action=MarkdownOptions, help=argparse.SUPPRESS)
    # fmt: on
    return p


def parse_args(argv=None):
    p = parser()
    args = p.parse_args(argv)
    if args.kda_state == "replay" and args.kernel != "auto":
        p.error(
            f"--kernel {args.kernel} is the per-step path's; --kda-state replay takes the "
            "replay dispatcher's kernel (--kernel auto)"
        )
    why = check_json_path(args.json)
    if why is not None:
        p.error(why)
    pdl = getattr(args, "pdl", None)  # None: not given
    if args.trace and pdl:
        p.error(
            "--trace runs without PDL (a stamp between PDL kernels breaks their "
            "overlap): drop --pdl"
        )
    args.pdl = not args.trace if pdl is None else pdl
    return args


def resolve_backend(requested: str) -> str:
    """``auto`` -> loopback (CUDA, one process), nvshmem (CUDA, several), else host."""
    if requested in ("auto", "loopback") and job_processes() == 1:
        # the loopback ranks need one hardware queue each, set before CUDA starts
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    if requested != "auto":
        return requested
    if not torch.cuda.is_available():
        return "host"
    if job_processes() == 1:
        return "loopback"
    # one GPU per process (a smaller node runs host rather than several PEs per GPU)
    if job_processes() <= torch.cuda.device_count() and nvshmem_installed():
        return "nvshmem"
    return "host"


def main(argv=None) -> int:
    args = parse_args(argv)
    backend_name = resolve_backend(args.backend)
    if backend_name == "host":
        if args.xmoe:
            from launch.report import refuse

            return refuse("--xmoe runs on the GPU backends (loopback, nvshmem), not host")
        args.tokens = HOST_TOKENS if args.tokens is None else args.tokens
        args.groups = 4 if args.groups is None else args.groups
        args.timeout = HOST_TIMEOUT if args.timeout is None else args.timeout
        from launch import host

        return host.main(args)
    args.tokens = GPU_TOKENS if args.tokens is None else args.tokens
    args.timeout = GPU_TIMEOUT if args.timeout is None else args.timeout
    from launch import gpu

    return gpu.main(args, backend_name, job_processes(), launcher())


if __name__ == "__main__":
    status = main()
    if status == 2 and job_processes() > 1:  # a refusal: the launcher stops the other ranks
        hard_exit(2, REFUSAL_TICK_S, refusal_ticks())  # once one exits: rank 0 first
    sys.exit(status)
