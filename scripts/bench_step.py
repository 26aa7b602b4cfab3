"""The whole decode-layer step, one process per GPU, beside its peers on the same GPUs.

    torchrun --nproc-per-node N scripts/bench_step.py [--heads 96] [--hidden 7168]
        [--blocks 8] [--requests 1 8 32] [--tokens 1] [--replays 50] [--json PATH]

TP = N. Per requests count, each rank's step (its head shard), every request live:

- ``ours``: the launcher's ``Runner`` on the nvshmem backend (KDA -> producer -> consumer,
  the launcher's defaults), both parity graphs;
- ``nccl``: the shard through fla (``step_peers.fla_kda``: conv, ``fused_recurrent_kda``,
  ``rms_norm_gated``), its partial ``attn @ w_o^T`` with the rank's w_o columns (cuBLAS),
  ``torch.distributed.all_reduce`` (NCCL, bf16), then residual + AttnRes + RMSNorm in
  torch (fp32), one CUDA graph per rank;
- ``symm``: the same with torch symmetric memory's ``one_shot_all_reduce``;
- ``flashinfer``: the same with flashinfer's ``allreduce_fusion`` (AR + residual +
  RMSNorm, what vLLM uses), AttnRes and the output norm in torch after it when nb > 0.

Each is timed as ``Runner.back_to_back``: ``--replays`` steps (one more first, left out)
back to back behind one sleep and one on-stream nvshmem barrier, an event per step; per
step the slowest rank's time, its median and p99. No checks (``launch/decode.py`` checks
ours). A peer that cannot run is a row with the reason; with T > 1 ours runs verify steps
and the peers are skipped (fla's conv update takes one token). Floor per rank: (state
pages read + written + the rank's w_o) / the device-to-device copy bandwidth measured in
the run (the slowest rank's). NVLink multicast stays off (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1, set before CUDA starts).
Table and JSON (``--json``) from rank 0; last line ``BENCH OK`` / ``BENCH FAILED: ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import step_peers as peers  # noqa: E402
import torch  # noqa: E402
from _common import cell  # noqa: E402

from launch import report as rep  # noqa: E402
from launch.checks import exact_gate_weights  # noqa: E402
from launch.layer import OUT_EPS, Config, Model  # noqa: E402
from launch.procs import env_rank, job_processes, nvshmem_installed, nvshmem_job  # noqa: E402
from launch.runner import GATE_CYCLES, Runner, check_rows  # noqa: E402

NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
VARIANTS = {
    "ours": "ours (nvshmem)",
    "nccl": "fla + NCCL all_reduce",
    "symm": "fla + symm one-shot",
    "flashinfer": "fla + flashinfer fusion",
}
ONE_TOKEN = "the fla peer decodes one token per step (T = 1)"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=96, help="KDA heads of the layer (all ranks)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--blocks", type=int, default=8, help="AttnRes blocks (nb)")
    p.add_argument("--requests", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--replays", type=int, default=50, help="steps back to back per variant")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def config(args, tp: int, requests: int) -> Config:
    shape = dict(heads=args.heads, hidden=args.hidden, tokens=args.tokens, blocks=args.blocks)
    run = dict(steps=2, seed=tp * 100 + requests, groups=None, padding=0.0)
    return Config(tp=tp, requests=requests, **shape, **run)


def check_args(args, world: int) -> None:
    """ValueError naming the option unless every requests count gives a layer that
    ``world`` processes (one per GPU) can run."""
    if world < 2:
        raise ValueError(
            f"one process per GPU and at least 2 (torchrun --nproc-per-node N); "
            f"this job has {world}"
        )
    if args.replays < 1:
        raise ValueError(f"--replays must be >= 1; got {args.replays}")
    for requests in args.requests:
        check_rows(requests, args.tokens)  # names the options
        config(args, world, requests).validate()


def rank_floor(cfg: Config, tbps: float) -> tuple[int, float]:
    """(state pages read + written + the rank's w_o) bytes per rank and their time (us) at
    ``tbps`` TB/s (bytes read + written)."""
    kind = "decode" if cfg.tokens == 1 else "verify"
    b = rep.step_bytes(cfg, kind, cfg.tokens)
    nbytes = (b["state"] + b["w_o"]) // cfg.tp
    return nbytes, nbytes / (tbps * 1e6)


def summarize(per_rank) -> dict:
    """Every rank's us per step: per step the slowest rank's, its median / p99 / max / n,
    and the largest of the ranks' own medians."""
    slowest = [max(step) for step in zip(*per_rank, strict=True)]
    out = rep.stats(slowest)
    out["rank_median_max_us"] = max(statistics.median(t) for t in per_rank)
    return out


def format_table(meta: dict, rows: list[dict]) -> list[str]:
    """The report's lines: per requests count the floor, then every variant (median, p99,
    x floor, x ours, how or why skipped)."""
    lines = [
        f"TP {meta['tp']}, {meta['heads']} heads ({meta['heads'] // meta['tp']} per rank), "
        f"HID {meta['hidden']}, nb {meta['blocks']}, T {meta['tokens']}; {meta['replays']} "
        "steps back to back, per step the slowest rank",
        "floor per rank = (state pages read + written + the rank's w_o) / "
        f"{meta['copy_tbps']:.2f} TB/s (copy, measured)",
        f"{'B':>4}  {'variant':<24}{'median us':>10}{'p99 us':>9}{'x floor':>9}{'x ours':>8}  how",
    ]
    for row in rows:
        floor = row["floor_us"]
        lines.append(
            f"{row['requests']:>4}  {'floor':<24}{cell(floor, 10)}{'-':>9}"
            f"{'-':>9}{'-':>8}  {row['rank_bytes'] / 1e6:.1f} MB per rank"
        )
        ours = row["variants"].get("ours", {}).get("median_us")
        for key, label in VARIANTS.items():
            v = row["variants"].get(key, {"skipped": "not run"})
            med = v.get("median_us")
            x_floor = None if med is None else med / floor
            x_ours = None if med is None or ours is None else med / ours
            how = f"skipped: {v['skipped']}" if "skipped" in v else v.get("how", "")
            lines.append(
                f"{'':>4}  {label:<24}{cell(med, 10)}{cell(v.get('p99_us'))}"
                f"{cell(x_floor)}{cell(x_ours, 8)}  {how}"
            )
    return lines


# --- on the GPUs ---------------------------------------------------------------------------


def agree(procs, error):
    """The first rank's error where any rank has one (every rank then skips), else None."""
    return next((e for e in procs.objects(error) if e), None)


def timed(runner, procs, replays, steps: int) -> dict:
    """``Runner.back_to_back``'s timing of ``replays`` (called in turn): ``steps`` + 1 of
    them behind one sleep and one on-stream barrier, the first left out; over ranks."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 2)]
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(GATE_CYCLES)  # the host enqueues every step meanwhile
    runner.stream_barrier()
    events[0].record()
    for i, e in enumerate(events[1:]):
        replays[i % len(replays)]()
        e.record()
    torch.cuda.synchronize(runner.device)
    us = [events[i].elapsed_time(events[i + 1]) * 1e3 for i in range(1, steps + 1)]
    return summarize(procs.objects(us))


def ours(runner, procs, bk, steps: int) -> dict:
    """The launcher's graphs of both parities back to back (``Runner.back_to_back``)."""
    runner.graph(bk, 0)
    runner.graph(bk, 1)
    out = summarize(procs.objects(runner.back_to_back(bk, 0, steps)))
    out["how"] = f"2 graphs (parities), KDA {runner.kda_choice(bk).kernel}"
    out["stages_us"] = procs.objects(bk.stage_us)
    return out


def peer_step(kind, runner, bk, nccl, symm):
    """This rank's peer step of ``kind`` (one CUDA graph's body): fla's KDA of the shard,
    the partial, the all-reduce, the torch epilogue. Raises with the reason otherwise."""
    if bk.tokens != 1:
        raise ValueError(ONE_TOKEN)
    kda = peers.fla_kda(runner.layers[0].clone(), bk.x[0], bk.f_a, bk.beta[0], bk.gate[0], bk.slots)
    w_o, blocks, out_norm = runner.w_o[0], bk.blocks, runner.out_norm
    w = runner.norm.float() * runner.query.float()
    prefix, output = bk.prefix[0].clone(), torch.empty_like(bk.output[0])
    partial = torch.empty_like(prefix)
    if kind == "flashinfer":
        return flashinfer_step(runner, kda, w_o, prefix, blocks, w, output, partial)
    if kind == "nccl":

        def reduce():
            torch.distributed.all_reduce(partial, group=nccl)
            return partial
    else:
        if symm[0] is None:
            raise RuntimeError(symm[1])
        symm_mem, name = symm[0]
        partial = symm_mem.empty(*prefix.shape, dtype=torch.bfloat16, device=runner.device)
        symm_mem.rendezvous(partial, name)

        def reduce():
            return torch.ops.symm_mem.one_shot_all_reduce(partial, "sum", name)

    def step():
        torch.matmul(kda(), w_o.t(), out=partial)
        out, prefix_new = peers.torch_epilogue(reduce(), prefix, blocks, w, out_norm)
        prefix.copy_(prefix_new)
        output.copy_(out)

    return step


def flashinfer_step(runner, kda, w_o, prefix, blocks, w, output, partial):
    """The peer step with flashinfer's ``allreduce_fusion`` (AR + residual + RMSNorm, the
    residual updated in place); ImportError where flashinfer or the fusion is missing."""
    try:
        import flashinfer.comm as fc
    except ImportError as e:
        raise ImportError(f"flashinfer is not installed ({e})") from None
    if not all(hasattr(fc, n) for n in ("allreduce_fusion", "create_allreduce_fusion_workspace")):
        raise ImportError("this flashinfer has no allreduce_fusion")
    rows, hid = prefix.shape
    ws = fc.create_allreduce_fusion_workspace(
        backend="trtllm",
        world_size=runner.cfg.tp,
        rank=runner.ranks[0],
        max_token_num=rows,
        hidden_dim=hid,
        dtype=torch.bfloat16,
    )
    normed, out_norm = torch.empty_like(prefix), runner.out_norm

    def step():
        torch.matmul(kda(), w_o.t(), out=partial)
        fc.allreduce_fusion(
            input=partial,
            workspace=ws,
            pattern=fc.AllReduceFusionPattern.kARResidualRMSNorm,
            launch_with_pdl=True,
            residual_in=prefix,
            residual_out=prefix,
            norm_out=normed,
            rms_gamma=out_norm,
            rms_eps=OUT_EPS,
            use_oneshot=True,
            trigger_completion_at_end=True,
            fp32_acc=True,
        )
        output.copy_(normed if blocks is None else peers.attn_res_norm(prefix, blocks, w, out_norm))

    return step


def peer(kind, runner, procs, bk, nccl, symm, steps: int) -> dict:
    """A peer's row: its step run once (compiles, warms the communicator), captured, timed."""
    error = None
    try:
        step = peer_step(kind, runner, bk, nccl, symm)
        step()
        torch.cuda.synchronize(runner.device)
        side = torch.cuda.Stream(runner.device)
        side.wait_stream(torch.cuda.current_stream(runner.device))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            step()
        torch.cuda.synchronize(runner.device)
    except Exception as e:  # a missing package, an unsupported shape: the row says why
        error = f"{type(e).__name__}: {e}"
    error = agree(procs, error)
    if error:
        return {"skipped": error}
    return dict(timed(runner, procs, [graph.replay], steps), how="1 graph")


def run(args, backend, procs):
    """Every requests count on this process's GPU: (rows, failures, copy TB/s)."""
    from _common import copy_bandwidth

    nccl = torch.distributed.new_group(backend="nccl")
    symm = peers.symm_mem_for(nccl)
    tbps = min(procs.objects(copy_bandwidth()))
    rows, failures = [], []
    for requests in args.requests:
        cfg = config(args, backend.world, requests)
        model = Model(cfg)
        if peers.GRIDS:
            exact_gate_weights(model.kda)
        runner = Runner(cfg, model, backend, procs=procs)
        plan, step, prefix, blocks = peers.first_step(cfg, model)
        bk = runner.bucket(plan.tokens, plan.record)
        runner.fill(bk, plan, step, prefix, blocks)
        nbytes, floor = rank_floor(cfg, tbps)
        row = {"requests": requests, "rank_bytes": nbytes, "floor_us": floor, "variants": {}}
        try:
            row["variants"]["ours"] = ours(runner, procs, bk, args.replays)
        except (RuntimeError, ValueError) as e:
            row["variants"]["ours"] = {"skipped": f"{type(e).__name__}: {e}"}
            failures.append(f"ours at {requests} requests: {e}")
        for kind in ("nccl", "symm", "flashinfer"):
            row["variants"][kind] = peer(kind, runner, procs, bk, nccl, symm, args.replays)
        rows.append(row)
        del runner, bk
        torch.cuda.empty_cache()
    return rows, failures, tbps


def main(argv=None) -> int:
    os.environ.update(NO_MULTICAST)  # before NCCL, NVSHMEM or symmetric memory start
    args = parse_args(argv)
    speak = env_rank() == 0
    try:
        check_args(args, job_processes())
        if not torch.cuda.is_available():
            raise ValueError("needs a CUDA GPU per process")
        if not nvshmem_installed():
            raise ValueError("ours needs nvshmem4py (nvshmem.core; pip install nvshmem4py-cu13)")
    except ValueError as e:
        if speak:
            print(f"BENCH FAILED: {e}", flush=True)
        return 1
    from tpcomm import host

    with nvshmem_job(host.launcher()) as (backend, procs):
        try:
            rows, failures, tbps = run(args, backend, procs)
        except Exception as e:
            print(f"BENCH FAILED: rank {backend.rank}: {type(e).__name__}: {e}", flush=True)
            os._exit(1)  # the other ranks may wait in a collective: torchrun ends them
        if not procs.root:
            return 0 if not failures else 1
        meta = dict(tp=backend.world, heads=args.heads, hidden=args.hidden, blocks=args.blocks)
        meta.update(tokens=args.tokens, replays=args.replays, copy_tbps=tbps)
        meta["device"] = torch.cuda.get_device_name(backend.device)
    print("\n".join(format_table(meta, rows)), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=2)
    print("BENCH OK" if not failures else f"BENCH FAILED: {'; '.join(failures)}", flush=True)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
