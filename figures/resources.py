"""The memory a container (or a systemd unit, or a cgroup) must grant a dctms process: the pool's
M_max split into named terms, rounded up to whole MiB (paper §5.3: a deployment scheduler that
knows M_max in advance). Pure functions over a ``Pool``; ``dctms.views.resources`` renders them.

The request equals the limit: M_max is an upper bound proven before the process starts, so there is
nothing to burst into, and a request equal to the limit gives Kubernetes' "Guaranteed" class (the
last to be evicted under node pressure).
"""

from __future__ import annotations

from dataclasses import dataclass

from dctms.figures.pool import Pool
from dctms.figures.units import MIB


@dataclass(frozen=True)
class Term:
    name: str
    bytes: int
    why: str


@dataclass(frozen=True)
class Resources:
    terms: tuple[Term, ...]
    plans: tuple[str, ...]
    serving: bool  # a `dctms serve` process (its HTTP stack counted) or a `dctms run` one

    @property
    def total(self) -> int:
        """The pool's M_max: every term added up, in bytes."""
        return sum(t.bytes for t in self.terms)

    @property
    def limit_mib(self) -> int:
        """The limit in whole MiB, rounded up (orchestrators take binary units: ``Mi``)."""
        return -(-self.total // MIB)

    @property
    def limit(self) -> int:
        return self.limit_mib * MIB


def resources_of(pool: Pool, serving: bool) -> Resources:
    """The pool's envelope as the terms a container limit is made of, each named with its source."""
    terms = [
        Term("weights", sum(m.weights for m in pool.members), "the plans' weights arenas"),
        Term("kv", sum(m.kv for m in pool.members), "KV caches at plan capacity"),
        Term("persistent", sum(m.persistent for m in pool.members),
             "constants and per-call inputs"),
        Term("intermediate", pool.intermediate,
             "the packed arena of intermediates (" + ("summed: concurrent calls)"
                                                      if pool.concurrent else
                                                      "the largest: one call at a time)")),
        Term("buffer_cache", pool.cache, "MLX's buffer-cache limit the runner sets"),
        Term("process_baseline", pool.baseline,
             "interpreter, MLX, tokenizers and chat templates outside MLX's count (measured)"),
        Term("recorded_graphs", sum(m.recorded for m in pool.members),
             "the graphs the runner records for every length point it may run at, outside "
             "MLX's count and M_max (1 KiB per op and point, measured 815 B)"),
    ]
    terms += [Term("server_stack" if i == 0 else f"server_stack_{i}", size, what)
              for i, (what, size) in enumerate(pool.extras)]
    return Resources(tuple(terms), tuple(m.name for m in pool.members), serving)
