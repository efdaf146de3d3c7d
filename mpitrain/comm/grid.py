"""The process grid: which ranks replicate, pipeline or slice the model together.

``P = pp x dp x tp`` world ranks are laid out with the tensor-parallel index changing
fastest (ranks that slice one layer are neighbours, usually on one node, since they talk
inside every layer), then data parallel, then pipeline stage::

    world rank = (pp_rank * dp + dp_rank) * tp + tp_rank

``dp_comm`` joins the ranks that differ only in ``dp_rank`` (they hold the same part of
the model and average its gradients); ``pp_comm`` those that differ only in ``pp_rank``
(consecutive stages); ``tp_comm`` those that differ only in ``tp_rank``. Each is split
from the world communicator and then duplicated, so that every subsystem has a message
space of its own and tags cannot collide. Creating a grid is collective: every
rank of ``world`` calls it with the same sizes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GridShape:
    dp: int = 1
    pp: int = 1
    tp: int = 1

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def whole_model(self) -> bool:
        """Every rank holds the whole model (no stages, no slices)."""
        return self.pp == self.tp == 1

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of a world rank."""
        rest, tp_rank = divmod(rank, self.tp)
        pp_rank, dp_rank = divmod(rest, self.dp)
        return pp_rank, dp_rank, tp_rank


class ProcessGrid:
    """Sub-communicators of ``world`` for a ``pp x dp x tp`` grid; ``dp=None`` takes
    every rank the other two leave (``world.size // (pp * tp)``)."""

    def __init__(self, world, dp: int | None = None, pp: int = 1, tp: int = 1):
        if pp < 1 or tp < 1 or world.size % (pp * tp):
            raise ValueError(f"{world.size} ranks cannot form a grid with pp={pp}, tp={tp}")
        dp = world.size // (pp * tp) if dp is None else dp
        self.shape = GridShape(dp, pp, tp)
        if self.shape.size != world.size:
            raise ValueError(f"grid pp={pp} x dp={dp} x tp={tp} = {self.shape.size} ranks, "
                             f"but the job has {world.size}")
        self.world = world
        self.pp_rank, self.dp_rank, self.tp_rank = self.shape.coords(world.rank)
        self.dp_size, self.pp_size, self.tp_size = dp, pp, tp
        self.dp_comm = self._sub(color=self.pp_rank * tp + self.tp_rank, key=self.dp_rank)
        self.pp_comm = self._sub(color=self.dp_rank * tp + self.tp_rank, key=self.pp_rank)
        self.tp_comm = self._sub(color=self.pp_rank * dp + self.dp_rank, key=self.tp_rank)

    def _sub(self, color: int, key: int):
        if self.world.size == 1:
            return self.world.dup()
        part = self.world.split(color, key)
        comm = part.dup()
        part.free()
        return comm

    def free(self) -> None:
        for c in (self.dp_comm, self.pp_comm, self.tp_comm):
            c.free()
