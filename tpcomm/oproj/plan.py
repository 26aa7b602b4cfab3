"""Plain-Python plans and checks of the o-projection kernels (CPU-tested, no CuTe DSL).

Geometry (``slicing``): a hidden width is whole warps of 16-byte groups (a multiple of
``HID_STEP`` = 256). A token's consumer cluster of ``n`` <= 8 CTAs splits it into ``HID / n``
column slices, ``HID / n / 8`` threads a group, one 16-byte group (8 bf16) per thread;
``groups`` groups poll disjoint rank slots. A producer tile is 16 output features computed
by four warps. ``choose`` picks the consumer plan, ``plan_fused`` the fused launch (refused
when its CTAs cannot all be resident).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from tpcomm.checks import is_int
from tpcomm.mailbox import (
    CTA_THREADS,
    DEFAULT_BUDGET_NS,
    GROUP_ELEMS,
    HID_STEP,
    MAX_ROWS,
    MAX_TOKENS,
    MAX_TP,
    POLL_CHUNK,
    MailboxLayout,
    TwoshotLayout,
    check_tp_hid,
)
from tpcomm.mailbox import MAX_HID as MAX_HIDDEN

__all__ = [
    "HID_STEP",
    "slicing",
    "MAX_HIDDEN",
    "MAX_TOKENS",
    "MAX_ROWS",
    "MAX_TP",
    "POLL_CHUNK",
    "DEFAULT_BUDGET_NS",
    "choose",
    "plan_fused",
]

MAX_BLOCKS = 8  # AttnRes block snapshots
GROUP_THREADS = CTA_THREADS  # a group of a 1024-column slice: one 16-byte group a thread
SLICE_COLUMNS = GROUP_THREADS * GROUP_ELEMS  # the widest slice ``slicing`` prefers: 1024
MAX_GROUPS = 4
MAX_CLUSTER = 8  # the portable cluster size
MAX_CTA_THREADS = 1024
REGISTER_THREADS = 1024  # threads per SM the launch bound keeps resident (64 registers each)
WORD_ROW_BYTES = 16  # a rank's row of error words / hint counters: int32 [4]

THREADS = CTA_THREADS  # a producer tile: four warps
FEATURES = 16  # output features per producer tile (the MMA's M)
K_CHUNK = 32  # k per warp iteration (two m16n8k16)
WARPS = 4
TILE_SMEM_BYTES = WARPS * 32 * 4 * 4  # fp32 fragments of one tile, summed in warp order

RESERVED_SMEM = 1024  # bytes the hardware reserves per CTA (sm_80+)
SMS_PER_GPC_AT_LEAST = 16  # assumed: Hopper / Blackwell data-center GPCs hold 16+ SMs

PRODUCERS = ("mma", "cublas", "wgmma")
# OprojGemmProducer's CTA tile (rows x features) by rows: the fastest of a tile sweep
# at 8-32, 128, 256 and 1024 rows (H200, TP 8 / 16, one-shot and twoshot, 2026-12-02;
# docs/oproj.md). Small tiles keep more CTAs streaming w_o at few rows; larger ones re-read
# w_o fewer times per row.
GEMM_TILES = ((64, (64, 64)), (128, (64, 128)), (256, (128, 128)), (None, (128, 256)))

TWOSHOT_MIN_TP = 8  # the expected crossover (``twoshot_available``) where none is measured
TWOSHOT_MIN_TOKENS = 4
CROSSOVERS = Path(__file__).with_name("crossovers.json")


# --- checks -----------------------------------------------------------------------------


def check_hidden(hidden, name="hidden"):
    if not is_int(hidden) or hidden % HID_STEP != 0 or not HID_STEP <= hidden <= MAX_HIDDEN:
        raise ValueError(
            f"{name} ({hidden}) must be a multiple of {HID_STEP} in {HID_STEP}..{MAX_HIDDEN}"
        )


# --- the consumer's slices ----------------------------------------------------------------


@dataclass(frozen=True)
class Slicing:
    """A token's consumer cluster: ``ctas`` CTAs of ``columns`` hidden columns each."""

    ctas: int
    columns: int

    @property
    def threads(self) -> int:
        """Threads of one group (one 16-byte group of the slice each): whole warps."""
        return self.columns // GROUP_ELEMS

    @property
    def warps(self) -> int:
        return self.threads // 32

    @property
    def max_groups(self) -> int:
        """Groups a CTA can hold (at most ``MAX_CTA_THREADS`` threads)."""
        return max(1, min(MAX_GROUPS, MAX_CTA_THREADS // self.threads))


def slicing(hid: int) -> Slicing:
    """The consumer cluster for ``hid``: the fewest CTAs (n <= ``MAX_CLUSTER``, dividing
    ``hid / 256``) whose slices are at most ``SLICE_COLUMNS`` (1024) columns; where no n
    gives one that narrow, the most CTAs (the narrowest slices). Multiples of 1024 get
    ``hid / 1024`` CTAs of 1024 columns; 2304 = 3 x 768; 1280 = 5 x 256; 2816 = 1 x 2816."""
    check_hidden(hid, "hid")  # before the cache: 1024.0 hashes as 1024
    return _slicing(hid)


@functools.cache
def _slicing(hid: int) -> Slicing:
    units = hid // HID_STEP
    ctas = [n for n in range(1, MAX_CLUSTER + 1) if units % n == 0]
    narrow = [n for n in ctas if hid // n <= SLICE_COLUMNS]
    n = min(narrow) if narrow else max(ctas)
    return Slicing(n, hid // n)


def check_groups(hid, groups, name="groups"):
    """``groups`` 1..4 and its threads within a CTA's 1024 for ``hid``'s slices."""
    top = slicing(hid).max_groups
    if not is_int(groups) or not 1 <= groups <= top:
        why = "" if top == MAX_GROUPS else f" (hid {hid}: {slicing(hid).threads}-thread groups)"
        raise ValueError(f"{name} must be an int in 1..{top}{why}; got {groups!r}")


def check_domain(tp, domain, twoshot=False, ranks=1) -> int:
    """The consumer's ``domain`` (ranks per load/store domain): ValueError unless it divides
    ``tp``, and, below ``tp``, the one-shot mailbox with one rank per launch."""
    if not is_int(domain) or domain < 1 or tp % domain:
        raise ValueError(f"domain must be an int dividing tp={tp}; got {domain!r}")
    if domain < tp and (twoshot or ranks > 1):
        raise ValueError("domain < tp needs the one-shot mailbox and one rank per launch")
    return domain


def check_ranks(tp: int, ranks: int, twoshot: bool = False) -> None:
    """``ranks``: consecutive ranks one launch serves (1; or all ``tp`` on one GPU)."""
    if not is_int(ranks) or ranks not in (1, tp):
        raise ValueError(f"ranks must be 1 or tp = {tp} (every rank in one launch); got {ranks!r}")
    if ranks > 1 and twoshot:
        raise ValueError("ranks > 1 (every rank in one launch) is one-shot only: twoshot=False")


def check_config(tp, hid, nb, groups, xmoe_reps, twoshot=False):
    """The consumer's compile-time configuration."""
    check_tp_hid(tp, hid)
    if not is_int(nb) or not 0 <= nb <= MAX_BLOCKS:
        raise ValueError(f"nb must be an int in 0..{MAX_BLOCKS}; got {nb!r}")
    check_groups(hid, groups)
    if not is_int(xmoe_reps) or not 0 <= xmoe_reps <= 8:
        raise ValueError(f"xmoe_reps must be an int in 0..8; got {xmoe_reps!r}")
    _check_twoshot(tp, hid, twoshot)


def check_producer(tp, hid, d_local=None, *, twoshot=False, ranks=1):
    """The publisher's (``d_local`` None) or the producer's compile-time configuration."""
    check_ranks(tp, ranks, twoshot)
    check_tp_hid(tp, hid)
    if d_local is not None and (not is_int(d_local) or d_local <= 0 or d_local % (K_CHUNK * WARPS)):
        raise ValueError(f"d_local must be a positive multiple of 128; got {d_local!r}")
    _check_twoshot(tp, hid, twoshot)


def _check_twoshot(tp, hid, twoshot):
    if twoshot and hid % (8 * tp):
        raise ValueError(f"twoshot needs hid ({hid}) divisible by 8 * tp ({8 * tp})")


# --- the consumer plan ------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    groups: int
    twoshot: bool
    reason: str
    # "mma": OprojProducer (rows <= 8); "wgmma": OprojGemmProducer (sm_90, more rows);
    # "cublas": cuBLAS GEMM + publisher (more rows elsewhere)
    producer: str = "mma"
    bytes: int = 0  # symmetric memory per rank: mailbox, or receive view + gather row


@functools.cache
def load_crossovers(path: str | None = None) -> dict:
    """The measured crossovers ``choose`` reads (``crossovers.json`` beside this module):
    ``twoshot_from_rows[tp]`` the first rows count where twoshot beat one-shot (None: never
    measured or never faster), ``expected_from_rows`` the unmeasured rule, ``source``."""
    data = json.loads(Path(path or CROSSOVERS).read_text())
    for key in ("twoshot_from_rows", "expected_from_rows"):
        table = data.get(key)
        if not isinstance(table, dict) or not all(
            k.isdigit() and (v is None or (is_int(v) and v >= 1)) for k, v in table.items()
        ):
            raise ValueError(f"{path or CROSSOVERS}: {key} must map TP to a rows count or null")
    return data


def crossover(table: dict, tp: int) -> int | None:
    """The entry for the largest TP key <= ``tp`` (None when there is none)."""
    keys = [int(k) for k in table if int(k) <= tp]
    return table[str(max(keys))] if keys else None


def hint_quota(hid: int, rows: int) -> int:
    """Release increments of one rank's consumer per step (``xmoe``): one per CTA (after
    a lead-group barrier), ``slicing(hid).ctas`` CTAs per row."""
    return slicing(hid).ctas * rows


def buffer_bytes(tp: int, rows: int, hid: int, twoshot: bool) -> int:
    """Symmetric memory one rank allocates for a rows bucket: the one-shot mailbox
    ``[2, TP, rows, HID]`` bf16, or twoshot's receive view and gather row."""
    layout = TwoshotLayout(tp, rows, hid) if twoshot else MailboxLayout(tp, rows, hid)
    return layout.nbytes


def choose(
    tp: int,
    rows: int,
    hid: int,
    *,
    twoshot_available: bool = False,
    crossovers: dict | None = None,
    one_launch: bool = False,
    twoshot: bool | None = None,
    wgmma: bool = False,
):
    """The o-projection plan for a TP group size, rows (tokens) per step and hidden width.

    Every group polls at most ``POLL_CHUNK`` slots (one round of four 16-byte loads per
    thread in flight): ``groups = ceil(TP / 4)``, at most what a CTA of ``hid``'s slices
    holds (``Slicing.max_groups``; fewer groups poll more slots each). Producer:
    ``OprojProducer`` (mma.sync, N = 8 rows) up to ``MAX_TOKENS`` rows; above, a real GEMM
    (M = rows): with ``wgmma`` (the caller's GPU is sm_90) ``OprojGemmProducer``,
    publishing from its epilogue (against cuBLAS + publisher at 32-1024 rows, TP 8 / 16:
    1.11-1.27x faster twoshot, 1.01-1.16x one-shot but for TP 16 at 128 rows, 0.91x;
    docs/oproj.md);
    otherwise cuBLAS into a staging partial, then ``PartialPublisher``.

    One-shot or twoshot (about ``2 / TP`` of one-shot's bytes into each rank plus a second
    hop), by launch structure:

    - per-rank launches (one producer / consumer launch per rank: every multi-GPU backend,
      and ``RowChunks`` on one GPU), the default: twoshot from ``rows`` = the crossover
      measured for this TP (``crossovers.json``'s ``twoshot_from_rows``, measured between
      one-shot and twoshot both run as per-rank launches in row chunks); where none is
      measured, only with ``twoshot_available`` and the expected rule;
    - ``one_launch=True`` (every rank of a one-GPU backend in one producer and one consumer
      launch: the loopback launcher's path): one-shot at every rows count, the crossovers do
      not apply. One launch exists one-shot only, and in the sweep that measured the
      crossovers it beat both chunked variants, twoshot included, at every measured row
      (``crossovers.json``'s ``one_launch``);
    - ``twoshot`` True / False: the caller's path (a one-shot all-reduce on one GPU outside
      ``RowChunks``, a split domain, the launcher's checks, or asked); the plan, its groups
      and bytes are that path's, and the reason says when the crossover would differ.
    """
    check_tp_hid(tp, hid)
    if not is_int(rows) or not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"rows must be an int in 1..{MAX_ROWS} (requests x tokens); got {rows!r}")
    if twoshot is not None and not isinstance(twoshot, bool):
        raise ValueError(f"twoshot must be None, True or False; got {twoshot!r}")
    if one_launch and twoshot:
        raise ValueError("one launch for every rank is one-shot only: twoshot=False")
    data = load_crossovers() if crossovers is None else crossovers
    groups = min(MAX_GROUPS, -(-tp // POLL_CHUNK), slicing(hid).max_groups)
    if rows <= MAX_TOKENS:
        producer, why = "mma", f"mma.sync producer (rows {rows} <= {MAX_TOKENS})"
    elif wgmma:
        tile = "x".join(map(str, gemm_tile(rows)))
        producer, why = "wgmma", f"wgmma GEMM M = {rows}, tile {tile}, publishing (sm_90)"
    else:
        producer, why = "cublas", f"cuBLAS GEMM M = {rows} + publisher (mma.sync takes <= 8)"
    start = crossover(data["twoshot_from_rows"], tp)
    source = "measured"
    if start is None and twoshot_available and tp >= TWOSHOT_MIN_TP:
        start = crossover(data["expected_from_rows"], tp) or TWOSHOT_MIN_TOKENS
        source = "expected (not measured)"
    per_rank = start is not None and rows >= start and hid % (8 * tp) == 0
    if twoshot:
        _check_twoshot(tp, hid, True)
        size = buffer_bytes(tp, rows, hid, True)
        how = f"TP {tp} x {rows} rows >= {start} ({source} crossover)" if per_rank else "asked"
        return Plan(
            1, True, f"twoshot: {how}; one gather slot; {why}; {size} B per rank", producer, size
        )
    if twoshot is None and not one_launch and per_rank:
        size = buffer_bytes(tp, rows, hid, True)
        return Plan(
            1,
            True,
            f"twoshot: TP {tp} x {rows} rows >= {start} ({source} crossover "
            f"of per-rank launches); one gather slot; {why}; {size} B per rank",
            producer,
            size,
        )
    size = buffer_bytes(tp, rows, hid, False)
    reason = f"{groups} group(s) of <= {POLL_CHUNK} slots for TP {tp}; {why}; {size} B per rank"
    if one_launch:
        reason += (
            "; one launch for every rank: one-shot (it beat chunked one-shot and "
            "twoshot at every measured row; the crossovers are per-rank ones)"
        )
    elif per_rank:
        reason += (
            f"; one-shot on this path (twoshot from {start} rows, the {source} crossover of "
            "per-rank launches, not applied)"
        )
    elif start is None:
        reason += "; no measured twoshot crossover for this TP: one-shot"
    elif rows < start:
        reason += f"; one-shot below the {source} twoshot crossover ({start} rows)"
    else:
        reason += f"; twoshot needs hid divisible by 8 * TP ({8 * tp}): one-shot"
    return Plan(groups, False, reason, producer, size)


def per_group(tp: int, groups: int) -> int:
    """``S``: rank slots each group polls."""
    return -(-tp // groups)


def group_ranks(tp: int, groups: int, g: int) -> tuple[int, int]:
    """(first rank, count) polled by group ``g``; count 0 for an empty group."""
    s = per_group(tp, groups)
    first = g * s
    return first, max(0, min(s, tp - first))


def min_blocks_per_sm(groups: int, group_threads: int = GROUP_THREADS) -> int:
    """Launch bound: CTAs per SM the compiled kernel guarantees (64 registers a thread;
    ``8 // groups`` for 128-thread groups)."""
    return max(1, REGISTER_THREADS // (group_threads * groups))


def pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def smem_layout(hid: int, nb: int, groups: int) -> list[tuple[int, int]]:
    """(bytes, alignment) of each shared allocation of the consumer, in its order."""
    s = slicing(hid)
    ctas, threads, warps = s.ctas, s.threads, s.warps
    kpre, kpost = max(1, pow2_at_least(2 * nb) if nb else 0), 4 if nb else 1
    helpers = [((groups - 1) * threads * 8 * 4, 16)] if groups > 1 else []
    return [
        (2 * 8, 8),  # the two exchange mbarriers
        ((4 + nb) * threads * 16, 16),  # prefetch rows
        *helpers,  # the helper groups' sums (none with one group)
        (warps * kpre * 4, 16),
        (warps * kpost * 4, 16),
        (ctas * kpre * 4, 16),
        (ctas * kpost * 4, 16),
        (kpre * 4, 16),
        (kpost * 4, 16),
        (4 * 4, 16),  # error flag
    ]


def pack_smem(allocations) -> int:
    """Bytes a sequence of (bytes, alignment) allocations takes (a bump allocator)."""
    offset = 0
    for size, align in allocations:
        offset = -(-offset // align) * align + size
    return offset


def smem_bytes(hid: int, nb: int, groups: int) -> int:
    """Dynamic shared memory of one consumer CTA (what the DSL passes at launch)."""
    return pack_smem(smem_layout(hid, nb, groups))


# --- the fused plan ---------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceLimits:
    """What bounds residency on one GPU (defaults: sm_90 / sm_100)."""

    sms: int
    max_threads_per_sm: int = 2048
    smem_per_sm: int = 233472  # 228 KiB
    max_ctas_per_sm: int = 32
    gpcs: int | None = None  # None: at most ceil(sms / SMS_PER_GPC_AT_LEAST)

    @property
    def gpc_bound(self) -> int:
        return self.gpcs if self.gpcs is not None else -(-self.sms // SMS_PER_GPC_AT_LEAST)

    @classmethod
    def of(cls, device) -> DeviceLimits:
        """The limits of a CUDA device (torch's properties)."""
        import torch

        props = torch.cuda.get_device_properties(device)
        return cls(
            sms=props.multi_processor_count,
            max_threads_per_sm=props.max_threads_per_multi_processor,
            smem_per_sm=getattr(props, "shared_memory_per_multiprocessor", 233472),
            max_ctas_per_sm=32 if props.major >= 9 else 16,
        )


def tile_count(hid: int) -> int:
    """16-feature producer tiles: ``HID / 16``."""
    return hid // FEATURES


def gemm_tile(rows: int) -> tuple[int, int]:
    """``OprojGemmProducer``'s (tile_m, tile_n) for ``rows`` (``GEMM_TILES``; every tile
    width, 64 to 256, divides every valid hid, a multiple of 256)."""
    if not is_int(rows) or not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"rows must be an int in 1..{MAX_ROWS}; got {rows!r}")
    return next(t for limit, t in GEMM_TILES if limit is None or rows <= limit)


def producer_teams(hid: int, groups: int) -> int:
    """128-thread producer teams of a fused CTA (``groups`` consumer groups of ``hid``'s
    slices; the groups themselves at 1024-column slices): ValueError naming ``groups``
    unless the CTA's threads split into whole teams."""
    threads = slicing(hid).threads * groups
    if threads % THREADS:
        raise ValueError(
            f"groups ({groups}) x {slicing(hid).threads} threads (hid {hid}) = {threads} is "
            f"not a multiple of the fused producer's {THREADS}-thread tile: use groups with "
            "whole 128-thread teams, or the unfused producer + consumer"
        )
    return threads // THREADS


def producer_rows(hid: int, groups: int, tiles: int) -> int:
    """``P``: cluster rows of producer CTAs (``teams * tiles`` tiles per CTA)."""
    per_cta = producer_teams(hid, groups) * tiles
    return -(-tile_count(hid) // (slicing(hid).ctas * per_cta))


def tile_index(row, cta, team, t, ctas: int, teams: int, tiles: int):
    """Tile of team ``team``'s ``t``-th turn in producer CTA (``row``, ``cta``): plain
    arithmetic, also traced in the kernel. Tiles ``>= HID / 16`` are idle turns."""
    return ((row * ctas + cta) * teams + team) * tiles + t


def fused_smem_bytes(hid: int, nb: int, groups: int) -> int:
    """Dynamic shared memory of one fused CTA: the consumer's, then the producer teams'
    fragment areas (what the DSL passes at launch)."""
    teams = producer_teams(hid, groups)
    return pack_smem(smem_layout(hid, nb, groups) + [(teams * TILE_SMEM_BYTES, 16)])


def ctas_per_sm(threads: int, smem: int, launch_bound: int, limits: DeviceLimits):
    """(CTAs per SM guaranteed, the resource that limits it)."""
    bounds = {
        "launch bound (registers)": launch_bound,
        "threads": limits.max_threads_per_sm // threads,
        "shared memory": limits.smem_per_sm // (smem + RESERVED_SMEM),
        "CTA slots": limits.max_ctas_per_sm,
    }
    name = min(bounds, key=bounds.get)
    return bounds[name], name


def resident_ctas(per_sm: int, cluster: int, limits: DeviceLimits) -> int:
    """CTAs of ``cluster``-CTA clusters that can all be resident. A cluster never spans
    GPCs, so a GPC of ``s`` SMs holds ``floor(s * per_sm / cluster)`` clusters, at least
    ``(s * per_sm - (cluster - 1)) / cluster``; summed over at most ``gpc_bound`` GPCs."""
    slots = limits.sms * per_sm - limits.gpc_bound * (cluster - 1)
    return max(0, -(-slots // cluster)) * cluster


@dataclass(frozen=True)
class FusedPlan:
    tiles: int  # T: tiles per producer group
    rows: int  # P: producer cluster rows
    grid: tuple[int, int, int]
    ctas: int  # CTAs of one launch
    threads: int
    smem: int  # dynamic shared memory per CTA
    launch_bound: int
    per_sm: int
    limit: str  # the resource that bounds per_sm
    launches: int  # launches sharing the GPU (loopback: every rank)
    capacity: int  # CTAs that can be resident together
    reason: str


def tiles_candidates(hid: int, groups: int) -> list[int]:
    """T = 1, 2, 4, ... up to one producer row (``HID / 16`` tiles over ``C`` CTAs)."""
    teams, per_cta = producer_teams(hid, groups), slicing(hid).columns // FEATURES
    out, t = [], 1
    while True:
        out.append(t)
        if teams * t >= per_cta:
            return out
        t *= 2


def plan_fused(
    tp, tokens, hid, nb, groups, limits: DeviceLimits, *, launches=1, tiles=None, xmoe_reps=0
):
    """The fused launch for this shape on ``limits`` with ``launches`` launches sharing
    the GPU: the smallest T (most producer CTAs) whose CTAs can all be resident; a
    ``ValueError`` saying why when none can (a consumer CTA spinning in the slot a
    producer CTA needs would wait until its poll budget ran out)."""
    check_config(tp, hid, nb, groups, xmoe_reps)
    if not is_int(tokens) or not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(
            f"tokens must be an int in 1..{MAX_TOKENS} for the fused kernel (its mma.sync "
            f"producer takes N = 8 rows); got {tokens!r}: above, produce then consume"
        )
    if not is_int(launches) or launches < 1:
        raise ValueError(f"launches must be a positive int; got {launches!r}")
    if tiles is not None and (not is_int(tiles) or tiles < 1):
        raise ValueError(f"tiles must be a positive int; got {tiles!r}")
    ctas_x, group_threads = slicing(hid).ctas, slicing(hid).threads
    threads = group_threads * groups
    smem = fused_smem_bytes(hid, nb, groups)
    bound = min_blocks_per_sm(groups, group_threads)
    per_sm, limit = ctas_per_sm(threads, smem, bound, limits)
    capacity = resident_ctas(per_sm, ctas_x, limits)
    need = None
    for t in [tiles] if tiles is not None else tiles_candidates(hid, groups):
        rows = producer_rows(hid, groups, t)
        ctas = ctas_x * (rows + tokens)
        need = ctas * launches
        if need <= capacity:
            reason = (
                f"T={t}: {rows} producer + {tokens} consumer cluster rows of {ctas_x} CTAs; "
                f"{launches} x {ctas} CTAs <= {capacity} resident ({limits.sms} SMs x {per_sm} "
                f"CTAs/SM, limited by {limit})"
            )
            return FusedPlan(
                t,
                rows,
                (ctas_x, rows + tokens, 1),
                ctas,
                threads,
                smem,
                bound,
                per_sm,
                limit,
                launches,
                capacity,
                reason,
            )
    fewest = ctas_x * (producer_rows(hid, groups, t) + tokens)
    raise ValueError(
        f"fused o-projection cannot be co-resident: {launches} launch(es) x {fewest} CTAs "
        f"(at least {ctas_x} x ({producer_rows(hid, groups, t)} producer + {tokens} consumer "
        f"rows), {threads} threads, {smem} B shared each) = {need} CTAs > {capacity} that fit "
        f"({limits.sms} SMs x {per_sm} CTAs/SM, limited by {limit}, less cluster packing); "
        "consumer CTAs could starve the producers. Use fewer tokens, ranks or groups, or the "
        "unfused producer + consumer"
    )
