"""Benchmark the fused KDA decode step against fla's kernels on one GPU.

For H in {6, 12, 96}, B in {1, 8, 32, 128}, T in {1, 4}: our kernel (``kda.decode``,
the dispatcher's choice, and each kernel forced) under CUDA graphs, and in the same run
the peers: fla's ``fused_recurrent_kda`` (recurrence only: in-kernel gate with lower
bound, V-first state, continuous batching / spec decoding slot indices) and the composed
stock path (fla ``causal_conv1d_update`` with SiLU, the gate projection as a torch matmul,
``fused_recurrent_kda``, fla ``rms_norm_gated`` with a sigmoid gate; T = 1 only: the
stock conv update takes one token per sequence). Each graph holds ``R`` launches on
disjoint slot tables (>= 256 MB of state per graph, so L2 is rotated); the time per step
is the median over replays divided by R. State traffic counts (1 + T) x 64 KB per
(request, head) (one read, T writes); % of copy is against a device-to-device copy
measured in the same run (bytes read + written).

``--small``: the small-batch table of issue 5 (H in {6, 12}, B in {1, 2, 4, 8}, T in
{1, 4}) with KdaSplit (each cluster size) beside Wide, Stream and the peers; plot it with
``scripts/plot_kda.py``.

``--verify``: verify steps (H in {12, 96}, B in {32, 128}, T in {2, 4, 8}), Wide beside
Stream, for ``STREAM_MAX_TOKENS`` in ``kda/dispatch.py`` (docs/kda_dispatch.md).

Usage: python scripts/bench_kda.py [--json out.json] [--quick | --small | --verify] [--diag]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import torch

from kda import synthetic as kt

PAGE = 128 * 128 * 4
ROTATE_BYTES = 256 << 20


def time_graph(fn, replays=7, inner=1):
    """Median time (us) of one replay of a CUDA graph of ``fn`` divided by ``inner``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up / compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / inner)
    return statistics.median(times)


def copy_bandwidth():
    """Device-to-device copy, bytes read + written per second (TB/s)."""
    n = 1 << 28  # 1 GiB of fp32
    a = torch.empty(n, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    graph_us = time_graph(lambda: b.copy_(a), replays=9)
    eager = []
    for _ in range(9):  # a plain cudaMemcpyAsync, outside a graph
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        eager.append(start.elapsed_time(end) * 1e3)
    us = min(graph_us, statistics.median(eager))
    return 2 * 4 * n / (us * 1e-6) / 1e12


def setup(H, B, T, rotations, seed=0):
    pages = 1 + rotations * B * T
    layer = kt.make_layer(H, pages, window=T + 2, bias=True, seed=seed, device="cuda")
    steps = []
    for r in range(rotations):
        table = 1 + r * B * T + torch.arange(B * T, dtype=torch.int32).view(B, T)
        steps.append(kt.make_step(B, T, H, pages=pages, slot_table=table, seed=seed + r,
                                  device="cuda"))  # fmt: skip
    return layer, steps


def ours(layer, steps, kernel, gate_mode=3, cluster=None):
    import kda

    out = torch.empty_like(steps[0].gate)
    extra = {} if cluster is None else {"cluster": cluster}

    def fn():
        for s in steps:
            kda.decode(
                s.x, layer.conv_weight, layer.conv_bias, layer.conv_state, s.f_a, s.beta,
                layer.a_log, layer.dt_bias, s.slots, layer.state, s.gate, layer.norm_weight,
                layer.f_b, lower_bound=kt.LOWER_BOUND, scale=kt.SCALE, eps=kt.EPS,
                accepted=s.accepted, kernel=kernel, out=out, gate_mode=gate_mode, **extra,
            )  # fmt: skip

    return fn


def fla_recurrence(layer, steps, H, B, T):
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    prepared = []
    for s in steps:
        qkv = s.x.view(B * T, 3, H, 128)
        q, k, v = (qkv[:, i].contiguous().view(1, B * T, H, 128) for i in range(3))
        g = (s.f_a @ layer.f_b.T).view(1, B * T, H, 128)
        beta = s.beta.view(1, B * T, H).contiguous()
        extra = {}
        if T > 1:
            extra = dict(
                cu_seqlens=torch.arange(0, B * T + 1, T, device="cuda", dtype=torch.long),
                ssm_state_indices=s.slots,
                num_accepted_tokens=s.accepted,
            )
        else:
            extra = dict(ssm_state_indices=s.slots)
            q, k, v = (t.view(B, 1, H, 128) for t in (q, k, v))
            g, beta = g.view(B, 1, H, 128), beta.view(B, 1, H)
        out = torch.empty_like(v)
        prepared.append((q, k, v, g, beta, out, extra))

    def fn():
        for q, k, v, g, beta, out, extra in prepared:
            fused_recurrent_kda_fwd(
                q, k, v, g, beta, A_log=layer.a_log, dt_bias=layer.dt_bias,
                initial_state=layer.state, scale=kt.SCALE, inplace_final_state=True,
                state_v_first=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True, lower_bound=kt.LOWER_BOUND, out=out, **extra,
            )  # fmt: skip

    return fn


def fla_composed(layer, steps, H, B):
    """T = 1: conv update + SiLU, gate matmul, recurrence, gated RMSNorm (sigmoid)."""
    from fla.modules.causal_conv1d.ops import causal_conv1d_update
    from fla.modules.norm.fused_norm_gate import rms_norm_gated
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    D = H * 128
    weight = layer.conv_weight.permute(0, 2, 1).reshape(3 * D, 4).contiguous()  # [3D, 4]
    caches = [torch.randn(B, 3 * D, 4, device="cuda").to(torch.bfloat16) for _ in steps]
    outs = [torch.empty(B, 1, H, 128, device="cuda", dtype=torch.bfloat16) for _ in steps]
    activation = "sigmoid"

    def fn():
        for s, cache, out in zip(steps, caches, outs, strict=True):
            y, _ = causal_conv1d_update(s.x, cache, weight=weight, bias=layer.conv_bias,
                                        activation="silu")  # fmt: skip
            qkv = y.view(B, 1, 3, H, 128)
            g = (s.f_a @ layer.f_b.T).view(B, 1, H, 128)
            fused_recurrent_kda_fwd(
                qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], g, s.beta.view(B, 1, H),
                A_log=layer.a_log, dt_bias=layer.dt_bias, initial_state=layer.state,
                scale=kt.SCALE, inplace_final_state=True, state_v_first=True,
                ssm_state_indices=s.slots, use_qk_l2norm_in_kernel=True,
                use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                lower_bound=kt.LOWER_BOUND, out=out,
            )  # fmt: skip
            rms_norm_gated(out.view(B * H, 128), s.gate.view(B * H, 128), layer.norm_weight,
                           None, activation=activation, eps=kt.EPS)  # fmt: skip

    return fn


def diagnose():
    """Where the kernels' bf16 intermediates differ from the reference (record mode)."""
    import kda

    H, B, T = 96, 130, 4
    pages = 1 + B * T
    for kernel in ("wide", "stream"):
        for gate_mode in (3, 0):
            layer = kt.make_layer(H, pages, window=T + 2, seed=1, device="cuda")
            step = kt.make_step(B, T, H, pages=pages, seed=2, device="cuda")
            ref_layer = layer.clone()
            rec = [(torch.zeros(B, H, T, 128, device="cuda"),
                    torch.zeros(B, H, T, 256, dtype=torch.bfloat16, device="cuda"))
                   for _ in range(2)]  # fmt: skip
            ref = kt.run_reference(ref_layer, step, records=rec[0])
            out = kda.decode(
                step.x, layer.conv_weight, layer.conv_bias, layer.conv_state, step.f_a,
                step.beta, layer.a_log, layer.dt_bias, step.slots, layer.state, step.gate,
                layer.norm_weight, layer.f_b, lower_bound=kt.LOWER_BOUND, scale=kt.SCALE,
                eps=kt.EPS, accepted=step.accepted, records=rec[1], kernel=kernel,
                gate_mode=gate_mode,
            )  # fmt: skip
            torch.cuda.synchronize()
            rk, gk = rec[0][1], rec[1][1]
            k_bad = (rk[..., :128] != gk[..., :128]).any(-1).any(-1)
            g_bad = (rk[..., 128:] != gk[..., 128:]).any(-1).any(-1)
            d = (out.float() - ref.float()).abs().view(B, T, H, 128)
            ulp = torch.exp2(torch.floor(torch.log2(ref.float().abs().clamp_min(1e-30))) - 7)
            bad = (d > ulp.view(B, T, H, 128)).any(-1).any(1)
            print(
                f"{kernel} gate_mode {gate_mode}: k mismatches "
                f"{int((rk[..., :128] != gk[..., :128]).sum())}, raw_g mismatches "
                f"{int((rk[..., 128:] != gk[..., 128:]).sum())} of {B * H * T * 128}; "
                f"heads with an output > 1 ulp {int(bad.sum())} (with raw_g diff "
                f"{int((bad & g_bad).sum())}, with k diff {int((bad & k_bad).sum())}, "
                f"neither {int((bad & ~g_bad & ~k_bad).sum())}); exact outputs "
                f"{(out == ref).float().mean().item():.5f}"
            )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    parser.add_argument(
        "--small", action="store_true", help="small batches: H 6, 12; B 1..8; split included"
    )
    parser.add_argument(
        "--verify", action="store_true", help="verify steps: H 12, 96; B 32, 128; T 2, 4, 8"
    )
    parser.add_argument(
        "--splits", action="store_true", help="also time KdaSplit (cluster 2, 4, 8) on every row"
    )
    parser.add_argument("--diag", action="store_true", help="numerics diagnosis, no timing")
    parser.add_argument("--gate-mode", type=int, default=3, choices=(0, 1, 3))
    args = parser.parse_args()
    if args.diag:
        diagnose()
        return
    copy_tbs = copy_bandwidth()
    print(f"device copy bandwidth (read + write): {copy_tbs:.2f} TB/s")
    shapes = [(H, B, T) for T in (1, 4) for H in (6, 12, 96) for B in (1, 8, 32, 128)]
    if args.quick:
        shapes = [(6, 1, 1), (12, 128, 1), (96, 128, 1), (96, 128, 4), (12, 128, 4)]
    if args.small:
        shapes = [(H, B, T) for T in (1, 4) for H in (6, 12) for B in (1, 2, 4, 8)]
    if args.verify:
        shapes = [(H, B, T) for T in (2, 4, 8) for H in (12, 96) for B in (32, 128)]
    rows = []
    header = (f"{'H':>3} {'B':>4} {'T':>2} {'kernel':>7} {'us':>8} {'TB/s':>6} {'%copy':>6} "
              f"{'wide':>8} {'stream':>8} {'fla rec':>8} {'x rec':>6} {'fla comp':>9} "
              f"{'x comp':>6}")  # fmt: skip
    print(header)
    for H, B, T in shapes:
        per_launch = B * H * (1 + T) * PAGE
        rotations = max(1, min(64, math.ceil(ROTATE_BYTES / per_launch)))
        layer, steps = setup(H, B, T, rotations)
        from kda.ops import plan

        choice = plan(B, H, T, "cuda")
        result = dict(H=H, B=B, T=T, kernel=choice.kernel, reason=choice.reason,
                      rotations=rotations, state_bytes=per_launch)  # fmt: skip
        for name in ("auto", "wide", "stream"):
            fn = ours(layer, steps, name, args.gate_mode)
            result[f"{name}_us"] = time_graph(fn, inner=rotations)
        if args.small or args.splits:
            for cluster in (2, 4, 8):
                try:
                    fn = ours(layer, steps, "split", args.gate_mode, cluster=cluster)
                    result[f"split{cluster}_us"] = time_graph(fn, inner=rotations)
                except Exception as error:  # report, keep going
                    result[f"split{cluster}_us"] = None
                    result[f"split{cluster}_error"] = repr(error)[:200]
        kernels = {k[:-3]: v for k, v in result.items() if k.endswith("_us") and v
                   and k[:-3] in ("wide", "stream", "split2", "split4", "split8")}  # fmt: skip
        best = min(kernels, key=kernels.get)
        result["best"], result["auto_vs_best"] = best, result["auto_us"] / kernels[best]
        try:
            result["fla_us"] = time_graph(fla_recurrence(layer, steps, H, B, T), inner=rotations)
        except Exception as error:  # the peer is optional: report, keep going
            result["fla_us"], result["fla_error"] = None, repr(error)[:200]
        result["composed_us"] = None
        if T == 1:
            try:
                fn = fla_composed(layer, steps, H, B)
                result["composed_us"] = time_graph(fn, inner=rotations)
            except Exception as error:
                result["composed_error"] = repr(error)[:200]
        us = result["auto_us"]
        result["state_tbs"] = per_launch / (us * 1e-6) / 1e12
        result["pct_copy"] = 100 * result["state_tbs"] / copy_tbs
        fla, comp = result["fla_us"], result["composed_us"]
        result["speedup_fla"] = fla / us if fla else None
        result["speedup_composed"] = comp / us if comp else None
        rows.append(result)

        def f(v, w=8, p=1):
            return f"{v:>{w}.{p}f}" if v is not None else f"{'-':>{w}}"

        line = (
            f"{H:>3} {B:>4} {T:>2} {choice.kernel:>7} {f(us)} {f(result['state_tbs'], 6, 2)} "
            f"{f(result['pct_copy'], 6)} {f(result['wide_us'])} {f(result['stream_us'])} "
            f"{f(fla)} {f(result['speedup_fla'], 6, 2)} {f(comp, 9)} "
            f"{f(result['speedup_composed'], 6, 2)}"
        )
        print(line)
        if args.small or args.splits:
            splits = " ".join(f"split{c} {f(result[f'split{c}_us'])}" for c in (2, 4, 8))
            print(f"    {splits}; best {result['best']}, auto / best {result['auto_vs_best']:.3f}")
        for key in ("fla_error", "composed_error", "split2_error", "split4_error", "split8_error"):
            if key in result:
                print(f"    {key}: {result[key]}")
        del layer, steps
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(dict(copy_tbs=copy_tbs, rows=rows), handle, indent=1)


if __name__ == "__main__":
    main()
