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

**Communicator**: a ``Dup`` of the one given (all ``S + W`` ranks); point-to-point while
training; at the end ``Bcast`` of each server's parameters, an ``Allreduce`` of the
workers' batch-norm statistics and an allgather of the staleness counts.

**The calls and when**, per worker step, for each server ``s`` (tags from
:class:`mpitrain.comm.Tag`):

* *push*: ``Isend`` of a header ``(step, version)`` (16 bytes: the step, and the version
  of ``s``'s parameters the gradient was computed on) and of the gradient of ``s``'s
  parameters; then ``Irecv`` of the reply;
* the server, blocked in ``Waitany`` on one header receive per worker, takes the
  header, ``Recv``s the gradient that follows it and:

  - *synchronous* (``staleness=0``): keeps it in that worker's slot; when all ``W``
    gradients of the step are in, applies their mean (summed in worker order: equal to
    one process with batch ``B``), then replies to every worker;
  - *asynchronous* (``staleness=k > 0``, or ``-1`` for unbounded): applies it at
    once (Downpour), records its staleness (the server's version minus the version it
    was computed on), and replies to each waiting worker as soon as the bound allows:
    a worker may start step ``t`` only when every worker has finished step
    ``t - 1 - k``, i.e. it runs at most ``k`` steps ahead of the slowest (Stale
    Synchronous Parallel, Ho et al., NIPS 2013; ``k = 0`` would be lockstep); servers
    know every worker's progress because every worker pushes to every server;

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
parameters of ``s`` bytes, ``S`` servers): two copies of the parameters per step, plus
headers. Each server sends and receives ``W x N_server x s`` per step.

**Mean.** Each worker's loss is the mean over its ``B/W`` samples; in synchronous mode
the server divides the sum of the ``W`` gradients by ``W``; asynchronously every
gradient is applied as it arrives, as its own update (``W`` updates per global step).

**Launch**: ``mpiexec -n 4 mpitrain train jobs/mnist_lenet.toml --set parallel.strategy=ps
--set parallel.servers=1 --set parallel.staleness=-1`` (1 server, 3 workers).
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np

from mpitrain.comm import Tag

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


class ParameterServer:
    """Both roles of the parameter-server strategy; every rank of ``comm`` builds one.

    Servers call :meth:`serve` (returns when every worker has stopped). Workers::

        while ps.pull_wait():       # parameters of the newest allowed version (False: done)
            loss = loss_fn(model, x, y); loss.backward()
            ps.push(step)           # gradients out, replies requested; zeroes .grad
        ps.stop()                   # take the replies still due, say goodbye
    """

    def __init__(self, model, optimizer, comm, servers: int = 1, staleness: int = 0, lr_at=None,
                 max_updates: int | None = None):
        if not 1 <= servers < comm.size:
            raise ValueError(f"need 1 <= servers < ranks ({comm.size}), got {servers}")
        if staleness < UNBOUNDED:
            raise ValueError(f"staleness must be >= 0, or -1 for unbounded, got {staleness}")
        self.comm = comm.dup()
        self.S, self.W = servers, comm.size - servers
        self.staleness = staleness
        self.lr_at = lr_at
        self.max_updates = max_updates  # asynchronous: stop the workers after this many applied gradients
        self.is_server = self.comm.rank < servers
        self.worker = self.comm.rank - servers  # this worker's index (negative on servers)
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"parameters of one dtype are kept flat, got {sorted(map(str, dtypes))}")
        dtype = dtypes.pop()
        self.owner = partition([p.size for p in self.params], servers)
        self.flat_params, self.flat_grads = [], []  # per server: (n_s,) arrays the parameters are views of
        for s in range(servers):
            mine = [p for p, o in zip(self.params, self.owner) if o == s]
            values = np.zeros(sum(p.size for p in mine), dtype=dtype)  # (n_s,)
            grads = np.zeros_like(values)  # (n_s,)
            offset = 0
            for p in mine:
                values[offset : offset + p.size] = p.data.reshape(-1)
                p.data = values[offset : offset + p.size].reshape(p.shape)
                p.grad = grads[offset : offset + p.size].reshape(p.shape)
                offset += p.size
            self.flat_params.append(values)
            self.flat_grads.append(grads)
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

    def stop(self) -> None:
        """After the last step: take the replies still due, then tell every server goodbye."""
        if self._pending:
            self.pull_wait()
        bye = [np.array([-1, -1], dtype=np.int64) for _ in range(self.S)]
        self.comm.waitall([self.comm.isend(bye[s], s, Tag.PS_HEADER) for s in range(self.S)])

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
        while listening:
            order = list(listening)
            tick = time.perf_counter()
            w = order[self.comm.waitany([listening[k] for k in order])]
            if trace is not None:
                trace("waiting for pushes", "communication", tick, time.perf_counter())
            step, version = (int(v) for v in header[w])
            if step < 0:  # goodbye: this worker is done
                del listening[w]
                continue
            self.comm.recv(slots[w], self.S + w, Tag.PS_GRAD)
            listening[w] = self.comm.irecv(header[w], self.S + w, Tag.PS_HEADER)
            done[w] += 1
            if self.staleness == 0:
                arrived[w] = True
                if arrived.all():
                    tick = time.perf_counter()
                    self._apply(slots.sum(axis=0) / W)  # (n,) the mean, summed in worker order
                    if trace is not None:
                        trace(f"apply the mean of {W} gradients", "optimizer", tick, time.perf_counter())
                    arrived[:] = False
                    for k in range(W):
                        self._reply(k)
            elif self.max_updates is not None and self.version >= self.max_updates:
                self._reply(w, stop=True)  # the run has had its gradients: this one is dropped
            else:
                self.staleness_seen[self.version - version] += 1
                tick = time.perf_counter()
                self._apply(slots[w])
                if trace is not None:
                    trace(f"apply worker {w}'s gradient (staleness {self.version - 1 - version})", "optimizer",
                          tick, time.perf_counter())
                waiting.append(w)
                if self.max_updates is not None and self.version >= self.max_updates:
                    for k in waiting:  # the run has had its updates: nobody waits for the bound
                        self._reply(k, stop=True)
                    waiting = []
                    continue
                slowest = int(done.min())
                # worker k starts step done[k] once every worker has finished step done[k] - 1 - staleness
                ready = [k for k in waiting if self.staleness == UNBOUNDED or slowest >= done[k] - self.staleness]
                for k in ready:
                    waiting.remove(k)
                    self._reply(k)
        self.comm.waitall(self._sends)

    def _apply(self, grad: np.ndarray) -> None:
        """One optimizer step of this server's parameters with ``grad`` (n,)."""
        self.comm.waitall(self._sends)  # replies in flight read the parameters: let them go first
        self._sends, self._keep = [], []
        mine = self.flat_grads[self.comm.rank]
        mine[...] = grad
        if self.lr_at is not None:
            self.optimizer.set_lr(self.lr_at(self.version))
        self.optimizer.step()
        self.version += 1

    def _reply(self, w: int, stop: bool = False) -> None:
        version = np.array([-1 if stop else self.version], dtype=np.int64)
        self._keep.append(version)  # alive until the send completes
        self._sends += [self.comm.isend(version, self.S + w, Tag.PS_VERSION),
                        self.comm.isend(self.flat_params[self.comm.rank], self.S + w, Tag.PS_PARAMS)]

    # ------------------------------------------------------------ afterwards
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

    def bytes_per_worker_step(self) -> tuple[int, int]:
        """(sent, received) by a worker per step: the formula."""
        n = sum(f.nbytes for f in self.flat_params)
        return n + 16 * self.S, n + 8 * self.S

    def state_pieces(self, offsets):
        """For checkpoints: a server's optimizer and its parameters' (index, lo, hi) in
        the flat layout of the optimizer's order (``offsets``); None on workers."""
        if not self.is_server:
            return None
        mine = [i for i, o in enumerate(self.owner) if o == self.comm.rank]
        return self.optimizer, [(i, int(offsets[i]), int(offsets[i + 1])) for i in mine]

    def unreceived(self) -> bool:
        """Whether a message to this rank is still waiting (after a run: never)."""
        return self.comm.poll()

    @property
    def bytes_sent(self) -> int:
        return self.comm.stats.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.comm.stats.bytes_received

    def close(self) -> None:
        self.comm.free()
