"""The o-projection all-reduce + residual + AttnRes + RMSNorm across GPUs, against peers.

    torchrun --nproc-per-node 8 scripts/bench_allreduce.py [--json out.json]

One process per GPU. For every tokens x nb (default tokens 1, 2, 4, 8, 32 and nb 0, 8;
HID 7168, D_local = 96 heads / TP x 128), each variant's step, timed per iteration by
events behind an on-stream nvshmem barrier (all GPUs start together), CUDA graphs where
they capture:

- ``ours: producer + consumer``: ``OprojAllReduce.produce`` (bf16(attn @ w_o^T) published
  into every rank's mailbox) then ``consume`` (rank-order sum, residual, AttnRes, RMSNorm)
  on the nvshmem backend, per-peer stores (no multicast); two launches in one graph;
- ``ours: fused producer + consumer``: the same in one ``OprojFused`` launch per rank
  (``produce_consume``), first checked bitwise equal to the unfused pair;
- ``ours: consumer alone``: the partials published first (untimed), then the consumer;
- ``nccl: all_reduce``, ``nccl: all_reduce + torch ops`` and ``nccl: gemm + all_reduce +
  torch ops``: ``torch.distributed.all_reduce`` (NCCL) of the bf16 partial, followed by the
  same residual + AttnRes + RMSNorm in plain torch ops (fp32);
- ``symm one-shot``/``symm two-shot`` (+ torch ops): torch symmetric memory's
  ``one_shot_all_reduce`` / ``two_shot_all_reduce_`` when ``torch.distributed.
  _symmetric_memory`` has them (unfused).

Above 8 tokens the producer is cuBLAS then the publisher; the fused kernel (mma.sync, 1..8
tokens) refuses them with the reason (the peers still run). Latency: per iteration the
slowest rank's time; median and p99 of that over the iterations, and the largest per-rank
median. Ours is checked once against the torch math on an fp32 rank-order sum of the same
partials (loose: a wrong result, not an ulp). NVLink multicast stays off:
NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 are set
here before CUDA starts. The table, the JSON (``--json``) and last ``BENCH OK`` / ``BENCH
FAILED: ...`` come from rank 0.
"""

from __future__ import annotations

import os

for _var, _value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ[_var] = _value  # before torch, NCCL or NVSHMEM touch CUDA

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from step_peers import symm_mem_for, torch_epilogue  # noqa: E402

from launch import report as rep  # noqa: E402

EPS = OUT_EPS = 1e-6
BUDGET_NS = 2_000_000_000  # generous poll budget: a timeout here is a bug, not a race
CHECK_LIMIT = 0.1  # ours vs the torch math: worst |diff| / rms(ref) per rank


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1,2,4,8,32", help="comma-separated token counts")
    p.add_argument("--blocks", default="0,8", help="comma-separated AttnRes block counts")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--heads", type=int, default=96, help="KDA heads of the layer (D_local)")
    p.add_argument("--groups", type=int, default=None, help="consumer groups (plan's)")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


class Bench:
    def __init__(self, args):
        import nvshmem.core as nv
        import torch.distributed as dist

        from tpcomm import host
        from tpcomm.backends import make_backend
        from tpcomm.backends.nvshmem import TorchStream

        self.args, self.dist, self.host = args, dist, host
        self.info = host.init_distributed()  # gloo: the uid broadcast and the gathers
        self.rank, self.world = self.info.rank, self.info.world
        index = self.info.local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        self.device = torch.device("cuda", index)
        self.backend = make_backend("nvshmem", device=index, launcher="torchrun")
        self.nccl = dist.new_group(backend="nccl")
        self._nv, self._stream = nv, TorchStream
        if args.heads % self.world:
            raise ValueError(f"--heads {args.heads} must be a multiple of TP {self.world}")
        self.d_local = args.heads // self.world * 128
        self.symm = self._symm_mem()
        self.rows: list[dict] = []
        self.failures: list[str] = []

    # --- helpers ---------------------------------------------------------------------
    def _symm_mem(self):
        """torch symmetric memory (module, group name) or None, with the reason said once."""
        symm, why = symm_mem_for(self.nccl, self.say)
        if symm is None:
            self.say(f"note: {why}")
        return symm

    def say(self, text):
        if self.rank == 0:
            print(text, flush=True)

    def barrier(self):
        """Every GPU's current stream meets the others' (nvshmem, on stream)."""
        self._nv.barrier_all(self._stream(torch.cuda.current_stream(self.device)))

    def capture(self, fn):
        """``fn`` as a CUDA graph's replay, or ``fn`` itself where capture fails (said)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g, stream=side):
                fn()
        except Exception as e:
            torch.cuda.synchronize(self.device)
            return fn, f"eager ({type(e).__name__})"
        torch.cuda.synchronize(self.device)
        return g.replay, "graph"

    def measure(self, timed, pre=None):
        """Per iteration: ``pre[i & 1]`` (untimed), an on-stream barrier, ``timed[i & 1]``
        between events. Returns this rank's times (us) after the warm-up."""
        a = self.args
        times = []
        for i in range(a.warmup + a.iters):
            if pre is not None:
                pre[i & 1]()
            self.barrier()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            timed[i & 1]()
            end.record()
            end.synchronize()
            if i >= a.warmup:
                times.append(start.elapsed_time(end) * 1e3)
        return times

    def record(self, variant, tokens, nb, times=None, how="", refused=None, **extra):
        """Gather every rank's times; rank 0 keeps the row (slowest rank per iteration)."""
        row = {"variant": variant, "tokens": tokens, "nb": nb, "how": how, **extra}
        everyone = [None] * self.world
        self.dist.all_gather_object(everyone, times)
        if refused is not None:
            row["refused"] = refused
        elif all(t for t in everyone):
            slowest = [max(v) for v in zip(*everyone, strict=True)]
            row.update(
                median_us=statistics.median(slowest),
                p99_us=rep.percentile(slowest, 0.99),
                rank_median_max_us=max(statistics.median(t) for t in everyone),
            )
        if self.rank == 0:
            self.rows.append(row)

    # --- one shape ---------------------------------------------------------------------
    def inputs(self, tokens, nb):
        a, dev = self.args, self.device
        g = torch.Generator(device="cpu").manual_seed(a.seed * 1009 + tokens * 31 + nb)
        H, D = a.hidden, self.d_local

        def rnd(*shape, scale=1.0):  # on the CPU: every rank draws the same numbers
            return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

        attns = [rnd(tokens, D) for _ in range(self.world)]
        w_os = [rnd(H, D, scale=D**-0.5) for _ in range(self.world)]
        x = {
            "attn": attns[self.rank].to(dev),
            "w_o": w_os[self.rank].to(dev),
            "prefix": rnd(tokens, H).to(dev),
            "blocks": rnd(tokens, nb, H).to(dev) if nb else None,
            "norm": (1 + 0.1 * torch.randn(H, generator=g)).to(torch.bfloat16).to(dev),
            "query": (0.2 * torch.randn(H, generator=g)).to(torch.bfloat16).to(dev),
            "out_norm": (1 + 0.1 * torch.randn(H, generator=g)).to(torch.bfloat16).to(dev),
        }
        x["w"] = x["norm"].float() * x["query"].float()
        x["partial"] = (x["attn"] @ x["w_o"].t()).contiguous()  # bf16, fp32 accumulate
        return x

    def shape(self, tokens, nb):
        x = self.inputs(tokens, nb)
        self.ours(tokens, nb, x)
        self.nccl_variants(tokens, nb, x)
        self.symm_variants(tokens, nb, x)

    def ours(self, tokens, nb, x):
        from tpcomm.oproj import launcher
        from tpcomm.oproj.allreduce import OprojAllReduce

        a = self.args
        names = (
            "ours: producer + consumer",
            "ours: consumer alone",
            "ours: fused producer + consumer",
        )
        try:
            options = dict(groups=a.groups, eps=EPS, out_eps=OUT_EPS, budget_ns=BUDGET_NS)
            comm = OprojAllReduce(self.backend, tokens, a.hidden, nb, **options)
        except ValueError as e:
            why = f"the o-projection producer/consumer cannot take {tokens} tokens: {e}"
            for name in names:
                self.record(name, tokens, nb, refused=why)
            return
        # compile before anyone polls (a peer's compile must not eat the poll budget)
        comm.functions()
        launcher.producer(comm, self.d_local)
        prefix = x["prefix"].clone()
        self._prefix0 = x["prefix"]
        output = torch.empty_like(prefix)
        args = (x["blocks"], x["norm"], x["query"], x["out_norm"], output)

        def step(parity):
            comm.produce(x["attn"], x["w_o"], parity)
            comm.consume(prefix, *args, parity)

        # once eagerly, checked against the torch math on the fp32 rank-order sum
        prefix0 = prefix.clone()
        comm.produce(x["attn"], x["w_o"], 0)  # compiles on first use if not cached above
        self.backend.barrier()  # every partial published before any consumer polls
        comm.consume(prefix, *args, 0)
        torch.cuda.synchronize(self.device)
        everyone = [torch.empty_like(x["partial"]) for _ in range(self.world)]
        self.dist.all_gather(everyone, x["partial"], group=self.nccl)
        total = everyone[0].float()
        for p in everyone[1:]:
            total = total + p.float()
        want, want_prefix = torch_epilogue(
            total.to(torch.bfloat16), prefix0, x["blocks"], x["w"], x["out_norm"]
        )
        rms = want.float().pow(2).mean().sqrt().clamp_min(1e-30)
        err = float(((output.float() - want.float()).abs().max() / rms).item())
        prefix_err = float(
            ((prefix.float() - want_prefix.float()).abs().max() / rms.clamp_min(1)).item()
        )
        worst = max(self.host_max(err), 0.0)
        self.backend.barrier()

        graphs, how = [], "graph"
        for parity in (0, 1):
            fn, how = self.capture(lambda parity=parity: step(parity))
            graphs.append(fn)
        times = self.measure(graphs)
        errors = self.host_max(float(comm.errors[:, 0].abs().sum().item()))
        checks = dict(check=worst, prefix_check=self.host_max(prefix_err), timeouts=errors)
        self.record(names[0], tokens, nb, times, how, **checks)
        if worst > CHECK_LIMIT:
            self.failures.append(f"ours at {tokens} tokens, nb {nb}: |diff|/rms {worst:.3g}")
        if errors:
            self.failures.append(f"ours at {tokens} tokens, nb {nb}: consumer timeouts")
            comm.reset()

        self.backend.barrier()
        self.fused(comm, tokens, nb, x, prefix, args)

        self.backend.barrier()
        pubs, cons = [], []
        for parity in (0, 1):
            fn, _ = self.capture(lambda parity=parity: comm.publish(x["partial"], parity))
            pubs.append(fn)
            fn, how = self.capture(lambda parity=parity: comm.consume(prefix, *args, parity))
            cons.append(fn)
        times = self.measure(cons, pre=pubs)
        errors = self.host_max(float(comm.errors[:, 0].abs().sum().item()))
        self.record(names[1], tokens, nb, times, how, timeouts=errors)
        if errors:
            self.failures.append(f"ours (consumer alone) at {tokens} tokens: timeouts")
            comm.reset()
        self.backend.barrier()

    def fused(self, comm, tokens, nb, x, prefix, args):
        """``ours: fused producer + consumer``: ``produce_consume`` (one ``OprojFused``
        launch per rank), checked bitwise against the unfused pair's step first."""
        name = "ours: fused producer + consumer"
        try:
            comm.fused_function(self.d_local)  # plan (may refuse) + compile before polls
        except ValueError as e:
            self.record(name, tokens, nb, refused=str(e))
            return
        output = args[-1]
        want_prefix, want_out = prefix.clone(), output.clone()
        prefix.copy_(self._prefix0)
        self.backend.barrier()
        comm.produce(x["attn"], x["w_o"], 0)
        self.backend.barrier()
        comm.consume(prefix, *args, 0)
        torch.cuda.synchronize(self.device)
        want_prefix.copy_(prefix)
        want_out.copy_(output)
        prefix.copy_(self._prefix0)
        self.backend.barrier()
        comm.produce_consume(x["attn"], x["w_o"], prefix, *args, 1)
        torch.cuda.synchronize(self.device)
        same = torch.equal(prefix.view(torch.int16), want_prefix.view(torch.int16)) and (
            torch.equal(output.view(torch.int16), want_out.view(torch.int16))
        )
        differ = self.host_max(0.0 if same else 1.0)
        self.backend.barrier()
        graphs, how = [], "graph"
        for parity in (0, 1):
            fn, how = self.capture(
                lambda parity=parity: comm.produce_consume(
                    x["attn"], x["w_o"], prefix, *args, parity, checked=True
                )
            )
            graphs.append(fn)
        times = self.measure(graphs)
        errors = self.host_max(float(comm.errors[:, 0].abs().sum().item()))
        how += "" if differ == 0 else "; NOT BITWISE"
        self.record(name, tokens, nb, times, how, timeouts=errors, bitwise_vs_unfused=differ == 0)
        if differ:
            self.failures.append(f"fused at {tokens} tokens, nb {nb}: differs from unfused")
        if errors:
            self.failures.append(f"fused at {tokens} tokens, nb {nb}: consumer timeouts")
            comm.reset()

    def host_max(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t.item())

    def nccl_variants(self, tokens, nb, x):
        dist, group = self.dist, self.nccl
        buf = torch.empty_like(x["partial"])
        prefix = x["prefix"]
        tail = (x["blocks"], x["w"], x["out_norm"])

        def ar():
            buf.copy_(x["partial"])
            dist.all_reduce(buf, group=group)

        def ar_ops():
            ar()
            torch_epilogue(buf, prefix, *tail)

        def gemm_ar_ops():
            torch.matmul(x["attn"], x["w_o"].t(), out=buf)
            dist.all_reduce(buf, group=group)
            torch_epilogue(buf, prefix, *tail)

        for name, fn in (
            ("nccl: all_reduce", ar),
            ("nccl: all_reduce + torch ops", ar_ops),
            ("nccl: gemm + all_reduce + torch ops", gemm_ar_ops),
        ):
            fn()  # warm-up: communicator, kernels, allocator
            torch.cuda.synchronize(self.device)
            replay, how = self.capture(fn)
            self.record(name, tokens, nb, self.measure([replay, replay]), how)

    def symm_variants(self, tokens, nb, x):
        if self.symm is None:
            return
        symm_mem, name = self.symm
        ops = torch.ops.symm_mem
        prefix = x["prefix"]
        tail = (x["blocks"], x["w"], x["out_norm"])
        try:
            buf = symm_mem.empty(*x["partial"].shape, dtype=torch.bfloat16, device=self.device)
            symm_mem.rendezvous(buf, name)
        except Exception as e:
            for v in ("symm one-shot", "symm two-shot"):
                self.record(v, tokens, nb, refused=f"symmetric memory: {e}")
            return

        def one():
            buf.copy_(x["partial"])
            return ops.one_shot_all_reduce(buf, "sum", name)

        def two():
            buf.copy_(x["partial"])
            ops.two_shot_all_reduce_(buf, "sum", name)
            return buf

        variants = [("symm one-shot", one)]
        if hasattr(ops, "two_shot_all_reduce_"):
            variants.append(("symm two-shot", two))
        for label, fn in variants:
            for suffix, body in (
                ("", fn),
                (" + torch ops", lambda fn=fn: torch_epilogue(fn(), prefix, *tail)),
            ):
                error = None
                try:
                    body()
                    torch.cuda.synchronize(self.device)
                except Exception as e:  # e.g. a size the kernel does not take
                    error = f"{type(e).__name__}: {e}"
                errors = [None] * self.world
                self.dist.all_gather_object(errors, error)
                bad = next((e for e in errors if e), None)
                if bad:
                    self.record(label + suffix, tokens, nb, refused=bad[:200])
                    continue
                replay, how = self.capture(body)
                self.record(label + suffix, tokens, nb, self.measure([replay, replay]), how)

    # --- the run -----------------------------------------------------------------------
    def run(self):
        a = self.args
        for tokens in [int(t) for t in a.tokens.split(",") if t]:
            for nb in [int(b) for b in a.blocks.split(",") if b]:
                self.shape(tokens, nb)
        ok = self.host_max(float(len(self.failures))) == 0
        if self.rank == 0:
            self.report(ok)
        return 0 if ok else 1

    def report(self, ok):
        a = self.args
        props = torch.cuda.get_device_properties(self.device)
        config = dict(tp=self.world, hidden=a.hidden, heads=a.heads, d_local=self.d_local)
        config.update(iters=a.iters, warmup=a.warmup, device=props.name, torch=torch.__version__)
        config["multicast"] = "off"
        print(
            f"all-reduce + residual + AttnRes + RMSNorm, TP {self.world} on {props.name}, "
            f"HID {a.hidden}, D_local {self.d_local}; slowest rank per iteration, "
            f"{a.iters} iterations"
        )
        print(
            f"{'variant':<40}{'tokens':>7}{'nb':>4}{'median us':>11}{'p99 us':>9}"
            f"{'rank med':>10}  how"
        )
        for r in self.rows:
            if "refused" in r:
                print(f"{r['variant']:<40}{r['tokens']:>7}{r['nb']:>4}  refused: {r['refused']}")
                continue
            if "median_us" not in r:
                continue
            note = r["how"]
            if "check" in r:
                note += f"; vs torch math |diff|/rms {r['check']:.2e}"
            print(
                f"{r['variant']:<40}{r['tokens']:>7}{r['nb']:>4}{r['median_us']:>11.2f}"
                f"{r['p99_us']:>9.2f}{r['rank_median_max_us']:>10.2f}  {note}"
            )
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"config": config, "rows": self.rows, "ok": ok}, f, indent=2)
        if ok:
            print("BENCH OK", flush=True)
        else:
            print("BENCH FAILED: " + "; ".join(self.failures or ["on another rank"]), flush=True)

    def close(self):
        torch.cuda.synchronize(self.device)
        try:
            self.backend.teardown()  # frees every nvshmem tensor, then finalize
        finally:
            self.host.finalize()  # the process groups last


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print("BENCH FAILED: run under torchrun --nproc-per-node N (one process per GPU)")
        return 2
    if not torch.cuda.is_available():
        print("BENCH FAILED: needs CUDA GPUs")
        return 2
    bench = Bench(args)
    try:
        return bench.run()
    finally:
        bench.close()


if __name__ == "__main__":
    sys.exit(main())
