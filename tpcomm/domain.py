"""Domain map: which TP ranks reach each other by load/store (one NVLink domain).

Ranks are split into ``world / size`` domains of ``size`` consecutive ranks. Inside a
domain the mailbox protocol runs as ever (stores with the flag in the data); a partial for
a rank of another domain travels by put-with-signal and the consumer waits on the signal
word of slot ``[parity, source]`` before it reads the slot (flag-in-data is not guaranteed
across a network). Plain Python (CPU-safe).
"""

from __future__ import annotations

from dataclasses import dataclass

from tpcomm.checks import is_int

SIGNAL_BYTES = 8  # one uint64 signal word per (parity, source rank): NVSHMEM's signal type


def check_domain_size(size, world, name: str = "--domain-size") -> int:
    """``size`` as an int; ValueError naming ``name`` unless 1 <= size and size divides
    ``world``."""
    if not is_int(size) or size < 1:
        raise ValueError(f"{name} must be an int >= 1; got {size!r}")
    if world % size:
        raise ValueError(f"{name} {size} must divide the TP ranks ({world})")
    return int(size)


@dataclass(frozen=True)
class DomainMap:
    """``world`` ranks in domains of ``size`` consecutive ranks."""

    world: int
    size: int

    def __post_init__(self):
        if not is_int(self.world) or self.world < 1:
            raise ValueError(f"world must be an int >= 1; got {self.world!r}")
        check_domain_size(self.size, self.world, "domain_size")

    @property
    def split(self) -> bool:
        """True when some ranks are outside each other's domain."""
        return self.size < self.world

    def domain(self, rank: int) -> int:
        return rank // self.size

    def members(self, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s domain (itself included), in rank order."""
        first = self.domain(rank) * self.size
        return tuple(range(first, first + self.size))

    def remote(self, rank: int) -> tuple[int, ...]:
        """The ranks outside ``rank``'s domain, in rank order."""
        mine = self.domain(rank)
        return tuple(r for r in range(self.world) if self.domain(r) != mine)

    def remote_mask(self, rank: int) -> int:
        """Bit r set for every rank r outside ``rank``'s domain (the error word's numbering)."""
        return sum(1 << r for r in self.remote(rank))

    def groups(self) -> tuple[tuple[int, ...], ...]:
        """Every domain's ranks, in domain order."""
        return tuple(self.members(d * self.size) for d in range(self.world // self.size))


def domain_of_reachable(world: int, rank: int, reachable) -> int:
    """The domain size implied by ``reachable`` (the ranks ``rank`` can load/store, itself
    included): they must be an aligned block of consecutive ranks whose size divides
    ``world``; RuntimeError otherwise (a layout this map cannot describe)."""
    ranks = sorted(set(reachable) | {rank})
    size = len(ranks)
    first = (rank // size) * size
    if world % size or ranks != list(range(first, first + size)):
        raise RuntimeError(
            f"rank {rank} reaches ranks {ranks} by load/store: not an aligned block of "
            f"consecutive ranks dividing {world}; pass --domain-size explicitly"
        )
    return size


def missing_message(rank: int, mask: int, budget_s: float) -> str:
    """The error of a signal wait that ran out: names every missing rank (bit r: rank r)."""
    ranks = [r for r in range(mask.bit_length()) if mask >> r & 1]
    return (
        f"rank {rank}: no signal from rank(s) {ranks} within {budget_s:g} s (error word {mask:#x})"
    )
