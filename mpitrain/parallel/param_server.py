"""Parameter servers: server ranks own the parameters, worker ranks push gradients and pull weights.

**What is split.** The ranks of ``comm`` take one of two roles: ranks ``0 .. S-1`` are
*servers*, ranks ``S .. S+W-1`` are *workers*. Every rank builds the same model from the
seed; the parameters are then partitioned over the servers by size, largest first to
the least loaded server (so their loads balance), and each server keeps its
parameters, flat, with the optimizer state for them (the user's optimizer, restricted
to those parameters). Each worker holds a full copy of the model and trains on its
``B/W`` samples of each global batch (Dean et al., "Large Scale Distributed Deep
Networks" (DistBelief, Downpour SGD), NIPS 2012; Li et al., "Scaling Distributed
Machine Learning with the Parameter Server" (ps-lite), OSDI 2014).

**Communicators**: one of its own over all ``S + W`` ranks of the one given,
point-to-point while training; at the end (:meth:`ParameterServer.end`) ``Bcast`` of each
server's parameters and an ``Allreduce`` of the workers' batch-norm statistics, then an
allgather of the staleness counts (:meth:`ParameterServer.summary`). And ``workers``: the
workers alone, for what they do together while the servers serve (averaging their
batch-norm statistics before an evaluation, the training loop's agreement on each step).

**The calls and when**, per worker step, for each server ``s`` (tags from
:class:`mpitrain.comm.Tag`):

* *push*: ``Isend`` of a header ``(step, version)`` (16 bytes: the step, and the version
  of ``s``'s parameters the gradient was computed on) and of the gradient of ``s``'s
  parameters; then ``Irecv`` of the reply;
* the server, blocked in ``Waitany`` on one header receive per worker, takes the
  header, ``Recv``s the gradient that follows it and:

  - *synchronous* (``staleness=0``): keeps it in that worker's slot; when all ``W``
    gradients of the step are in, applies their mean (summed in worker order: equal to
    one process with batch ``B``) at the learning rate of the header's step, then
    replies to every worker;
  - *asynchronous* (``staleness=k > 0``, or ``-1`` for unbounded): applies it at
    once (Downpour) at the learning rate of its version, records its staleness (the
    server's version minus the version it was computed on), and replies to each
    waiting worker as soon as the bound allows: a worker may start step ``t`` only
    when every worker has finished step ``t - 1 - k``, i.e. it runs at most ``k`` steps
    ahead of the slowest (Stale Synchronous Parallel, Ho et al., NIPS 2013; ``k = 0``
    would be lockstep); servers know every worker's progress because every worker
    pushes to every server (a worker that has said goodbye holds back nobody);

* *pull*: the reply is ``Isend`` of the version (8 bytes) and of the parameters; the
  worker ``wait``s for all servers' replies before its next forward. At the start every
  server sends version 0 to every worker; after its last step a worker sends the header
  ``(-1, -1)`` to each server, which stops listening to it. A server returns when all
  workers have stopped, with every message received.
* *the end, asynchronously*: with ``max_updates`` a server applies that many gradients
  and then answers with version ``-1``, "stop" (a push that arrives later is received
  and dropped), so the run processes the same number of samples however the workers'
  speeds differ: fast workers take more steps than a straggler.

Pushes to all servers go out before any reply is awaited, so a push to one server
overlaps the pull from another. Servers block in ``Waitany``/``Recv``: no polling loop.

**Bytes per worker per step**: push ``N x s + 16 S``, pull ``N x s + 8 S`` (``N``
parameters of ``s`` bytes, ``S`` servers; :func:`mpitrain.cost.parameter_server_bytes`):
two copies of the parameters per step, plus headers. Each server sends and receives
``W x N_server x s`` per step.

**Mean.** Each worker's loss is the mean over its ``B/W`` samples; in synchronous mode
the server divides the sum of the ``W`` gradients by ``W``; asynchronously every
gradient is applied as it arrives, as its own update (``W`` updates per global step).

**In the trainer** servers run :meth:`serve`; workers run the ordinary loop with this
object as its :class:`~mpitrain.parallel.GradSync`: :meth:`begin_step` waits for the pull,
:meth:`step` pushes (once the workers agree the loss is finite), :meth:`leave` says
goodbye; then every rank calls :meth:`end`.

**Launch**: ``mpiexec -n 4 mpitrain train jobs/mnist_lenet.toml --set parallel.sync=ps
--set parallel.servers=1 --set parallel.staleness=-1`` (1 server, 3 workers).
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np

from mpitrain import flat
from mpitrain.comm import Tag, replicas
from mpitrain.parallel import GradSync

UNBOUNDED = -1


def partition(sizes: list[int], servers: int) -> list[int]:
    """The server of each parameter: largest first, to the least loaded server (ties:
    the lower index); the same on every rank."""
    load = [0] * servers
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        s = min(range(servers), key=lambda s: (load[s], s))
        owner[i] = s
        load[s] += sizes[i]
    return owner


class ParameterServer(GradSync):
    """Both roles of the parameter-server strategy; every rank of ``comm`` builds one.

    Servers call :meth:`serve` (returns when every worker has stopped). Workers::

        while ps.pull_wait():       # parameters of the newest allowed version (False: done)
            loss = loss_fn(model, x, y); loss.backward()
            ps.push(step)           # gradients out, replies requested; zeroes .grad
        ps.leave()                  # take the replies still due, say goodbye

    (In the trainer: ``begin_step``, ``step`` and ``leave`` make these calls.) Then every
    rank calls :meth:`end` to receive the final parameters.
    """

    waits = {"begin": "pull", "step": "push"}

    def __init__(self, model, optimizer, comm, servers: int = 1, staleness: int = 0, lr_at=None,
                 max_updates: int | None = None, slow: float = 1.0):
        if not 1 <= servers < comm.size:
            raise ValueError(f"need 1 <= servers < ranks ({comm.size}), got {servers}")
        if staleness < UNBOUNDED:
            raise ValueError(f"staleness must be >= 0, or -1 for unbounded, got {staleness}")
        super().__init__(model, optimizer, comm.dup())  # its own counter, as the workers' below
        self.S, self.W = servers, comm.size - servers
        self.staleness, self.lockstep = staleness, staleness == 0
        self.lr_at = lr_at  # learning rate at a step (synchronous) or at a version (asynchronous)
        self.slow = slow  # on a worker: > 1 makes it a straggler (experiments), see step()
        self.max_updates = max_updates  # asynchronous: stop the workers after this many applied gradients
        self.is_server = self.comm.rank < servers
        self.worker = self.comm.rank - servers  # this worker's index (negative on servers)
        self.workers = comm.split(0 if self.is_server else 1, self.comm.rank)
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        dtype = flat.one_dtype(self.params, "a parameter server")
        self.owner = partition([p.size for p in self.params], servers)
        flats = [flat.Flat([p for p, o in zip(self.params, self.owner) if o == s], data=True, dtype=dtype)
                 for s in range(servers)]
        self.flat_params = [f.data for f in flats]  # per server: (n_s,) the parameters are views of
        self.flat_grads = [f.grad for f in flats]  # (n_s,)
        self.begun = 0  # on a worker: steps begun (a step whose loss was not finite pushes nothing)
        self.said_goodbye = False
        self._zeroed = False  # the gradients are zero since the last push
        self.version = 0  # on a server: the updates it has applied
        self.staleness_seen: Counter = Counter()
        if self.is_server:
            self.optimizer = self._own_optimizer(optimizer)
            self._greet()
        else:
            self.versions = np.zeros(servers, dtype=np.int64)  # of the parameters this worker holds
            self._version_bufs = [np.zeros(1, dtype=np.int64) for _ in range(servers)]
            self._headers = [np.zeros(2, dtype=np.int64) for _ in range(servers)]
            self._pending: list = []
            self._post_pulls()

    # ------------------------------------------------------------ set-up
    def _own_optimizer(self, full):
        """The user's optimizer over this server's parameters only (a copy: its state
        is this server's, its hyperparameters the user's)."""
        mine = {id(p) for p, o in zip(self.params, self.owner) if o == self.comm.rank}
        return full.over(lambda p: (p.data, p.grad) if id(p) in mine else None)  # views into the flat arrays

    def _greet(self) -> None:
        """Version 0 to every worker: the first pull."""
        self._sends, self._keep = [], []
        for w in range(self.W):
            self._reply(w)

    # ------------------------------------------------------------- worker
    def _post_pulls(self) -> None:
        for s in range(self.S):
            self._pending += [self.comm.irecv(self._version_bufs[s], s, Tag.PS_VERSION),
                              self.comm.irecv(self.flat_params[s], s, Tag.PS_PARAMS)]

    def pull_wait(self) -> bool:
        """Wait for every server's reply: the parameters for the next step. False when
        a server says the run has had its updates (``max_updates``): stop then."""
        self.comm.waitall(self._pending)
        self._pending = []
        self.versions[:] = [int(v[0]) for v in self._version_bufs]
        return bool((self.versions >= 0).all())

    def push(self, step: int) -> None:
        """Send this step's gradients to their servers and ask for the next parameters;
        the gradients are zeroed once sent (call after backward, before the next
        :meth:`pull_wait`)."""
        sends = []
        for s in range(self.S):
            self._headers[s][:] = (step, self.versions[s])
            sends += [self.comm.isend(self._headers[s], s, Tag.PS_HEADER),
                      self.comm.isend(self.flat_grads[s], s, Tag.PS_GRAD)]
        self._post_pulls()
        self.comm.waitall(sends)  # the buffers are reused next step
        for g in self.flat_grads:
            g.fill(0)
        self._zeroed = True

    def leave(self) -> None:
        """A worker, after its last step (or a failed one): take the replies still due,
        then tell every server goodbye (once; later calls, and calls on a server, do
        nothing)."""
        if self.is_server or self.said_goodbye:
            return
        self.said_goodbye = True
        if self._pending:
            self.pull_wait()
        bye = [np.array([-1, -1], dtype=np.int64) for _ in range(self.S)]
        self.comm.waitall([self.comm.isend(bye[s], s, Tag.PS_HEADER) for s in range(self.S)])

    # ----------------------------------------- a worker's side of the trainer's step
    def begin_step(self) -> bool:
        """Before a step's forward: wait for the pull (see :meth:`pull_wait`)."""
        go = self.pull_wait()
        self.begun += 1
        self._zeroed = False
        self._began = time.perf_counter()
        return go

    def step(self, lr: float | None = None, grad_clip: float = 0.0) -> None:
        """Push this step's gradients (the servers own the update and its learning rate,
        ``lr_at``; global-norm clipping would need every server's part of the norm)."""
        if grad_clip > 0:
            raise ValueError("parameter servers see only their shard of the gradient: no global-norm clipping")
        if self.slow > 1:  # a straggler: this worker computes slow times as long
            time.sleep((self.slow - 1) * (time.perf_counter() - self._began))
        self.push(self.begun - 1)  # the step, which sets a synchronous server's learning rate

    def zero_grad(self) -> None:
        """Zero the gradients, unless a push has since :meth:`begin_step` (it zeroes them)."""
        if not self._zeroed:
            for g in self.flat_grads:
                g.fill(0)

    def sync_buffers(self) -> None:
        """Before an evaluation between synchronous steps: take the pull in flight (its
        receives write the parameters; the next :meth:`begin_step` finds it done), then
        average the workers' floating buffers over the workers (collective on ``workers``)."""
        self.pull_wait()
        replicas.average(self.workers, [b for _, b in self.model.named_buffers()])


    # ------------------------------------------------------------- server
    def serve(self, trace=None) -> None:
        """Apply pushes until every worker has stopped; every message is received.
        ``trace(name, category, start, end)``, if given, hears of each wait and update."""
        W, n = self.W, self.flat_params[self.comm.rank].size
        header = [np.zeros(2, dtype=np.int64) for _ in range(W)]
        listening = {w: self.comm.irecv(header[w], self.S + w, Tag.PS_HEADER) for w in range(W)}
        slots = np.zeros((W, n), dtype=self.flat_params[self.comm.rank].dtype)  # (W, n) one gradient per worker
        arrived = np.zeros(W, dtype=bool)
        done = np.zeros(W, dtype=np.int64)  # steps each worker has pushed
        waiting: list[int] = []  # workers owed a reply
        trace = trace or (lambda *args: None)
        while listening:
            order = list(listening)
            tick = time.perf_counter()
            w = order[self.comm.waitany([listening[k] for k in order])]
            trace("waiting for pushes", "communication", tick, time.perf_counter())
            step, version = (int(v) for v in header[w])
            if step < 0:  # goodbye: this worker is done, and holds back nobody any more
                del listening[w]
                done[w] = np.iinfo(np.int64).max
                self._release(waiting, done)
                continue
            self.comm.recv(slots[w], self.S + w, Tag.PS_GRAD)
            listening[w] = self.comm.irecv(header[w], self.S + w, Tag.PS_HEADER)
            done[w] += 1
            if self.staleness == 0:
                arrived[w] = True
                if arrived.all():
                    tick = time.perf_counter()
                    self._apply(slots.sum(axis=0) / W, at=step)  # (n,) the mean, summed in worker order
                    trace(f"apply the mean of {W} gradients", "optimizer", tick, time.perf_counter())
                    arrived[:] = False
                    for k in range(W):
                        self._reply(k)
            elif self.max_updates is not None and self.version >= self.max_updates:
                self._reply(w, stop=True)  # the run has had its gradients: this one is dropped
            else:
                self._apply_async(w, version, slots[w], trace)
                waiting.append(w)
                self._release(waiting, done)
        self.comm.waitall(self._sends)

    def _apply_async(self, w: int, version: int, grad: np.ndarray, trace) -> None:
        """Apply worker ``w``'s gradient, computed on ``version``, at once (Downpour)."""
        self.staleness_seen[self.version - version] += 1
        tick = time.perf_counter()
        self._apply(grad, at=self.version)
        trace(f"apply worker {w}'s gradient (staleness {self.version - 1 - version})", "optimizer",
              tick, time.perf_counter())

    def _release(self, waiting: list[int], done: np.ndarray) -> None:
        """Reply to the waiting workers the staleness bound lets go on (``waiting`` is
        updated); once the run has had its updates (``max_updates``), to all with stop."""
        if self.max_updates is not None and self.version >= self.max_updates:
            for k in waiting:  # nobody waits for the bound any more
                self._reply(k, stop=True)
            waiting.clear()
            return
        slowest = int(done.min())
        # worker k starts step done[k] once every worker has finished step done[k] - 1 - staleness
        for k in [k for k in waiting if self.staleness == UNBOUNDED or slowest >= done[k] - self.staleness]:
            waiting.remove(k)
            self._reply(k)

    def _apply(self, grad: np.ndarray, at: int) -> None:
        """One optimizer step of this server's parameters with ``grad`` (n,), at the
        learning rate ``lr_at(at)``."""
        self.comm.waitall(self._sends)  # replies in flight read the parameters: let them go first
        self._sends, self._keep = [], []
        mine = self.flat_grads[self.comm.rank]
        mine[...] = grad
        if self.lr_at is not None:
            self.optimizer.set_lr(self.lr_at(at))
        self.optimizer.step()
        self.version += 1

    def _reply(self, w: int, stop: bool = False) -> None:
        version = np.array([-1 if stop else self.version], dtype=np.int64)
        self._keep.append(version)  # alive until the send completes
        self._sends += [self.comm.isend(version, self.S + w, Tag.PS_VERSION),
                        self.comm.isend(self.flat_params[self.comm.rank], self.S + w, Tag.PS_PARAMS)]

    # ------------------------------------------------------------ afterwards
    def end(self) -> int | None:
        """After the loop (workers) or :meth:`serve` (servers), on every rank
        (collective): a worker takes the replies still due and says goodbye; then every
        rank receives the final parameters and the workers' batch-norm statistics.
        Asynchronously, returns the global steps the applied gradients amount to (over
        ``W``, on every rank); synchronously None: every worker took the loop's steps."""
        self.leave()  # unless the trainer's loop has said goodbye already
        self.gather_parameters()
        self.gather_buffers(self.model)
        return None if self.staleness == 0 else self.comm.bcast(self.version // self.W, root=0)

    def summary(self) -> tuple[list[str], dict[int, int]]:
        """After :meth:`end` (collective): a line on the staleness of the applied
        gradients (asynchronous runs), and the histogram, on every rank."""
        histogram = self.staleness_histogram()
        return (["staleness of the applied gradients (server version - version computed on): "
                 + ", ".join(f"{k}: {v}" for k, v in histogram.items())] if histogram else []), histogram

    def gather_parameters(self) -> None:
        """Every rank gets every server's final parameters (collective)."""
        for s in range(self.S):
            self.comm.bcast_array(self.flat_params[s], root=s)

    def gather_buffers(self, model) -> None:
        """Every rank gets the workers' batch-norm statistics (collective): floating
        buffers are averaged over the workers (servers never run a forward pass),
        others (counters) are taken from worker 0."""
        for _, b in model.named_buffers():
            if b.dtype.kind == "f":
                if self.is_server:
                    b[...] = 0
                self.comm.allreduce(b)
                b /= self.W
            else:
                self.comm.bcast_array(b, root=self.S)

    def staleness_histogram(self) -> dict[int, int]:
        """Applied gradients by staleness, summed over servers (collective; on every rank)."""
        total: Counter = Counter()
        for seen in self.comm.allgather(dict(self.staleness_seen)):
            total.update(seen)
        return dict(sorted(total.items()))

    def state_pieces(self, offsets):
        """For checkpoints: a server's optimizer, its parameters' (index, lo, hi) in the
        flat layout of the optimizer's order (``offsets``), and True: each server writes
        its own; None on workers, which hold no optimizer state."""
        if not self.is_server:
            return None
        mine = [i for i, o in enumerate(self.owner) if o == self.comm.rank]
        return self.optimizer, flat.pieces(offsets, mine), True

    def unreceived(self) -> bool:
        """Whether a message to this rank is still waiting (after a run: never)."""
        return self.comm.poll()

    def close(self) -> None:
        self.workers.free()
        self.comm.free()
