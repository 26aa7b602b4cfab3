"""One KDA decode step, bracketed for Nsight Compute: ours (``--kernel``), fla's recurrence
(``--kernel fla``) or SGLang's fused kernel (``--kernel sglang``, unpacked as ``kda_peers.py``
says; T 1, H 3 / 6 / 12, on a window-first conv pool, as ours with ``--window-first``),
H / B / T as given, after a warm-up that compiles.

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
from kda_peers import fla_recurrence, sglang_fused, sglang_module, window_first  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--kernel",
        default="stream",
        help="wide, pipe, stream, split, fla, sglang or replay (R steps)",
    )
    p.add_argument("--cluster", type=int, default=None, help="split: CTAs per item")
    p.add_argument("--window-first", action="store_true", help="a window-first conv pool")
    p.add_argument("--ring", type=int, default=8, help="replay: the ring size R")
    p.add_argument("--heads", type=int, default=96)
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--state-dtype", default="fp32", choices=("fp32", "bf16"))
    args = p.parse_args(argv)
    H, B, T = args.heads, args.requests, args.tokens
    dim_first = not (args.window_first or args.kernel == "sglang")
    layer, steps = setup(H, B, T, 1, state_dtype=args.state_dtype, dim_first=dim_first)
    if args.kernel == "sglang":
        conv = window_first(layer.conv_state, layer.conv_dim_first).clone()
        fn = sglang_fused(sglang_module(), layer, steps, layer.state, conv)
    elif args.kernel == "fla":
        fn = fla_recurrence(layer, steps, H, B, T)
    elif args.kernel == "replay":
        fn = replay(layer, steps, replay_setup(layer, args.ring))
    else:
        fn = ours(layer, steps, args.kernel, cluster=args.cluster)
    fn()  # compile and load
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
