"""``RowChunks``: a step's rows as chunks that per-rank launches on one GPU can hold.

Per-rank launches of every rank on one GPU (loopback) spin side by side, so every rank's
consumer CTAs (``HID / 1024`` per row) must be resident together; above that (TP 8, HID
7168: about 16 rows) per-rank runs, twoshot's included, take the step's rows in chunks.
Each chunk is an ``OprojAllReduce`` of its own rows (its own mailbox, or receive views
and gather rows: the chunks' bytes add up to one bucket's), run on the current stream one
after another: chunk ``c + 1`` forks only after every rank of chunk ``c`` joined. A row's
math is the unchunked one (rank-order sum, one rounding; twoshot's gather), bitwise.
"""

from __future__ import annotations

from tpcomm.checks import is_int
from tpcomm.oproj.api import OprojAllReduce
from tpcomm.oproj.plan import MAX_ROWS, choose


class RowChunks:
    """``rows`` rows on ``backend`` as chunks of at most ``chunk`` rows (default: the
    largest power-of-two share whose per-rank consumers can all be resident, or all rows);
    ``twoshot`` defaults to the plan of the whole ``rows``; other keywords go to every
    chunk's ``OprojAllReduce`` (no ``xmoe_reps``: a chunk of the copies is not contiguous)."""

    def __init__(self, backend, rows, hid, nb, *, chunk=None, twoshot=None, **kw):
        if not is_int(rows) or not 1 <= rows <= MAX_ROWS:
            raise ValueError(f"rows must be an int in 1..{MAX_ROWS}; got {rows!r}")
        if chunk is not None and (not is_int(chunk) or not 1 <= chunk <= rows):
            raise ValueError(f"chunk must be an int in 1..rows = {rows}; got {chunk!r}")
        if kw.get("xmoe_reps") or kw.get("one_launch"):
            raise ValueError("RowChunks runs per-rank launches without xmoe copies")
        self.plan = choose(backend.world, rows, hid)
        twoshot = self.plan.twoshot if twoshot is None else bool(twoshot)
        self.rows, self.twoshot = rows, twoshot
        kw = dict(kw, twoshot=twoshot)
        n = rows if chunk is None else chunk
        first = None
        while first is None:
            try:
                first = OprojAllReduce(backend, n, hid, nb, **kw)
            except ValueError as e:  # refused before allocating: halve while it cannot fit
                if chunk is not None or "resident" not in str(e) or n == 1:
                    raise
                n = -(-n // 2)
        self.chunk = n
        self.parts = [(0, n, first)]
        for a in range(n, rows, n):
            b = min(rows, a + n)
            self.parts.append((a, b, OprojAllReduce(backend, b - a, hid, nb, **kw)))
        self.groups = first.groups
        self.bytes = sum(c.bytes for _, _, c in self.parts)

    def run_ranks(self, inputs, prefixes, blocks, norm, query, out_norm, outputs, step, *,
                  w_os=None, ranks=None, publishers=None):  # fmt: skip
        """``OprojAllReduce.run_ranks`` (per-rank mode) chunk by chunk: ``inputs`` [TP,
        rows, HID] partials (or [TP, rows, D_local] ``attn_out`` with ``w_os``),
        ``prefixes``/``outputs`` [TP, rows, HID], ``blocks`` [rows, nb, HID] or None."""
        for name, t in (("inputs", inputs), ("prefixes", prefixes), ("outputs", outputs)):
            if t is not None and (t.dim() != 3 or t.shape[1] != self.rows):
                raise ValueError(f"{name} must be [TP, rows = {self.rows}, ...]")
        for a, b, comm in self.parts:
            comm.run_ranks(
                None if inputs is None else inputs[:, a:b], prefixes[:, a:b],
                None if blocks is None else blocks[a:b], norm, query, out_norm,
                outputs[:, a:b], step, w_os=w_os, ranks=ranks, publishers=publishers,
            )  # fmt: skip

    def error_masks(self) -> list[int]:
        """Per hosted rank, the OR of its error words over the chunks (0: none)."""
        ranks = self.parts[0][2].backend.ranks
        masks = [0] * len(ranks)
        for _, _, comm in self.parts:
            for i, r in enumerate(ranks):
                masks[i] |= int(comm.error(r).item())
        return masks

    def armed(self) -> bool:
        return all(comm.armed() for _, _, comm in self.parts)

    def reset(self) -> None:
        for _, _, comm in self.parts:
            comm.reset()
