"""The seam between the loop and the strategies: how the gradients of a step become an update.

The loop never asks which strategy runs. Each step it calls one object that follows
:class:`GradSync`, built from ``parallel.sync`` by :mod:`mpitrain.train.build`:

1. ``begin_step()`` before the step's first forward (a parameter-server worker waits for
   its pull here; False ends the loop: the servers have had their updates);
2. the schedule's backward passes (:mod:`mpitrain.train.schedule`), all but the last of
   the step inside ``no_sync()`` (data parallelism then only accumulates);
3. ``finish()`` after the last backward (data parallelism waits for its buckets, averages);
4. once the ranks agree that the loss is finite, ``step(lr, grad_clip)`` (ZeRO-1:
   reduce-scatter, update of this rank's shard, allgather; a worker: push), and
   ``zero_grad()`` in any case.

Around the steps: ``sync_buffers()`` before an evaluation or a checkpoint;
``whole_model()`` around saving and loading a checkpoint (ZeRO-3 gathers the parameters
there; for the others they are whole already);
``check_replicas()`` at the end; ``state_pieces(offsets)`` for checkpoints (the part of
the optimizer state this rank holds, and whether it writes it); ``bytes_sent`` and
``comm_seconds()`` for the time table; ``on_comm`` for the timeline; ``describe()``: a
line for the start of the run, and the names of the calls that wait for other ranks,
which the stall watchdog and the timeline show.

Implementations, in ``mpitrain/parallel/``: ``LocalSync`` (one data-parallel rank),
``DataParallel``, ``Zero1``, ``Zero2``, ``Zero3``, ``ParameterServer`` (a worker's side), and
``PipelineSync`` (a pipeline stage: its replicas' sync, then the tied weights' sum over
the stages that hold them, clipping by the whole model's norm). A ``Protocol``:
the strategy modules import nothing of the trainer; a test checks that each has it all.
"""

from __future__ import annotations

from typing import ContextManager, Protocol, runtime_checkable


@runtime_checkable
class GradSync(Protocol):
    on_comm: object  # None, or set to be called (name, start, end, bytes) for communication in the background

    def begin_step(self) -> bool: ...
    def no_sync(self) -> ContextManager: ...
    def finish(self) -> None: ...
    def step(self, lr: float | None, grad_clip: float) -> None: ...
    def zero_grad(self) -> None: ...
    def sync_buffers(self) -> None: ...
    def whole_model(self) -> ContextManager: ...
    def check_replicas(self) -> str: ...
    def state_pieces(self, offsets) -> tuple | None: ...
    def comm_seconds(self) -> tuple[float, float]: ...
    def describe(self) -> tuple[str, dict[str, str]]: ...
    def close(self) -> None: ...

    @property
    def bytes_sent(self) -> int: ...
