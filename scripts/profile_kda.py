"""One KDA decode step, bracketed for Nsight Compute: ours (``--kernel``) or fla's
recurrence (``--kernel fla``), H / B / T as given, after a warm-up that compiles.

    ncu --clock-control none --profile-from-start off --launch-count 2 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python scripts/profile_kda.py --kernel stream --heads 96 --requests 128
"""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import torch  # noqa: E402
from bench_kda import ours, replay, replay_setup, setup  # noqa: E402
from kda_peers import fla_recurrence  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--kernel", default="stream", help="wide, pipe, stream, split, fla or replay (R steps)"
    )
    p.add_argument("--ring", type=int, default=8, help="replay: the ring size R")
    p.add_argument("--heads", type=int, default=96)
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--state-dtype", default="fp32", choices=("fp32", "bf16"))
    args = p.parse_args(argv)
    H, B, T = args.heads, args.requests, args.tokens
    layer, steps = setup(H, B, T, rotations=1, state_dtype=args.state_dtype)
    if args.kernel == "fla":
        fn = fla_recurrence(layer, steps, H, B, T)
    elif args.kernel == "replay":
        fn = replay(layer, steps, replay_setup(layer, args.ring))
    else:
        fn = ours(layer, steps, args.kernel)
    fn()  # compile and load
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
