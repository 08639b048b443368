"""The few collectives context parallelism uses, over torch.distributed or inside one process.

    Comm(group)      torch.distributed (NCCL, gloo, ...): the ring is batch_isend_irecv
    ThreadGroup(W)   W ranks as threads of one process, exchanging tensors through memory: the
                     per-rank code runs on one device without a process group (tests, GPU checks).
                     One rank runs at a time (a baton passed at each exchange), so the ranks'
                     computations run one after another, as they would on W devices.
"""
from __future__ import annotations

import threading
import weakref

import torch


class _Done:
    """A finished exchange."""

    def __init__(self, tensors):
        self.tensors = tensors

    def wait(self):
        return self.tensors


class _Pending:
    """A ring exchange in flight: wait() gives the received tensors."""

    def __init__(self, reqs, received, keep):
        self.reqs, self.received, self.keep = reqs, received, keep

    def wait(self):
        for r in self.reqs:
            r.wait()
        self.keep = None
        return self.received


class _Rows:
    """gather_ints in flight: wait() gives the rows as lists."""

    def __init__(self, pending):
        self.pending = pending

    def wait(self):
        return torch.stack(self.pending.wait()).tolist()


# process group -> {backend: weak reference to a group of its ranks over that backend, or _NONE where
# none could be made} (Comm._side_group). Weak both ways: torch holds the groups until
# destroy_process_group, and a group still held here when the interpreter shuts down aborted the
# process at exit about one time in five (gloo, "terminate called without an active exception")
_SIDE_GROUPS = weakref.WeakKeyDictionary()
_NONE = object()


class Comm:
    """torch.distributed over ``group`` (None: the default group)."""

    def __init__(self, group=None):
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_initialized():
            from ..errors import AttnccError
            raise AttnccError("context parallelism needs torch.distributed initialised "
                              "(torch.distributed.init_process_group, e.g. under torchrun), or an "
                              "attncc.distributed.ThreadGroup rank")
        self.dist, self.group = dist, group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))

    def _global(self, r: int) -> int:
        return r if self.group is None else self.dist.get_global_rank(self.group, r)

    def gather_objects(self, obj) -> list:
        out = [None] * self.world
        self.dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather_ints(self, values, wait: bool = True):
        """Every rank's ``values`` (ints, as many on each rank): one small all-gather on the host,
        over the group's CPU backend or, for a NCCL-only group, a gloo group of the same ranks
        (made once, by these ranks only): through NCCL the host would wait for the all-gather and so
        for every kernel queued before it, and the GPU for the host after it. ``wait=False``: a
        handle whose wait() gives them, the all-gather in flight meanwhile (on the host)."""
        group = self._host_group()
        t = torch.tensor(values, dtype=torch.int64)
        if group is None:  # no gloo here: through the device
            t = t.to(f"cuda:{torch.cuda.current_device()}") if "nccl" in self.backend else t
            table = torch.stack(self.all_gather(t)).tolist()
            return table if wait else _Done(table)
        out = [torch.empty_like(t) for _ in range(self.world)]
        rows = _Rows(_Pending([self.dist.all_gather(out, t, group=group, async_op=True)], out, None))
        return rows.wait() if wait else rows

    def _host_group(self):
        """A process group of these ranks that runs collectives on CPU tensors, or None."""
        if "nccl" not in self.backend or "cpu:" in self.backend:
            return self.group
        return self._side_group("gloo", None)

    def _ring_group(self):
        """The group the ring's sends and receives go through: for NCCL, one of these ranks whose
        streams have high priority, so that a transfer's kernel takes SMs as soon as a program of
        the attention kernel before it retires. On the group's own (normal-priority) stream the
        block scheduler kept handing SMs to the attention kernel's programs instead: the transfers
        started in the kernels' last wave and 8 of 120 ms waited for them (128k, 4 H200s)."""
        if "nccl" not in self.backend:
            return self.group

        def high_priority():
            opts = self.dist.ProcessGroupNCCL.Options()
            opts.is_high_priority_stream = True
            return dict(pg_options=opts)
        return self._side_group("nccl", self.group, high_priority)

    def _side_group(self, backend, fallback, options=dict):
        """A group of these ranks over ``backend`` (made once, by these ranks only), else fallback."""
        made = _SIDE_GROUPS.setdefault(self.group if self.group is not None else self.dist.group.WORLD, {})
        entry = made.get(backend)
        if entry is _NONE:
            return fallback
        group = entry() if entry is not None else None
        if group is None:
            try:
                ranks = [self._global(r) for r in range(self.world)]
                group = self.dist.new_group(ranks, backend=backend, use_local_synchronization=True, **options())
            except Exception:  # noqa: BLE001 - a build without it: the fallback
                made[backend] = _NONE
                return fallback
            made[backend] = weakref.ref(group)
        return group

    def ring_start(self, tensors, shift: int = 1):
        """Send ``tensors`` to rank + shift and receive their like from rank - shift, asynchronously."""
        if shift % self.world == 0:
            return _Done(list(tensors))
        dist = self.dist
        send = [t.contiguous() for t in tensors]
        recv = [torch.empty_like(t) for t in send]
        nxt = self._global((self.rank + shift) % self.world)
        prv = self._global((self.rank - shift) % self.world)
        group = self._ring_group()
        ops = [dist.P2POp(dist.isend, t, nxt, group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, prv, group) for t in recv]
        return _Pending(dist.batch_isend_irecv(ops), recv, send)

    def all_gather(self, t: torch.Tensor) -> list:
        out = [torch.empty_like(t) for _ in range(self.world)]
        self.dist.all_gather(out, t.contiguous(), group=self.group)
        return out

    def all_gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's rows (a contiguous 2-D ``t``) one after another, in rank order."""
        out = t.new_empty(self.world * t.shape[0], *t.shape[1:])
        self.dist.all_gather_into_tensor(out, t, group=self.group)
        return out

    def reduce_scatter_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Rank r's block of rows (the r-th of ``world``) summed over every rank's ``t``."""
        out = t.new_empty(t.shape[0] // self.world, *t.shape[1:])
        self.dist.reduce_scatter_tensor(out, t.contiguous(), group=self.group)
        return out

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place."""
        self.dist.all_reduce(t, group=self.group)
        return t

    def reduce_scatter(self, blocks: list) -> torch.Tensor:
        """blocks[r] of every rank summed, on rank r (blocks: one tensor per rank, alike in shape)."""
        out = torch.empty_like(blocks[self.rank])
        self.dist.reduce_scatter(out, [b.contiguous() for b in blocks], group=self.group)
        return out


class ThreadGroup:
    """``world`` ranks as threads of this process: ``group.rank(r)`` is rank r's communicator,
    to pass as ``group=`` from the thread that runs rank r (``run(fn)`` starts them)."""

    def __init__(self, world: int):
        self.world = world
        self._barrier = threading.Barrier(world)
        self._slots = [None] * world
        self._turn = threading.Lock()  # held by the rank that computes

    def rank(self, r: int) -> "_ThreadComm":
        return _ThreadComm(self, r)

    def run(self, fn):
        """[fn(comm of rank r) for each r], each in its own thread; the first exception is raised."""
        results, errors = [None] * self.world, [None] * self.world

        def body(r):
            self._turn.acquire()
            try:
                results[r] = fn(self.rank(r))
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors[r] = e
                self._barrier.abort()
            finally:
                self._turn.release()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)),
                     next((e for e in errors if e is not None), None))
        if first is not None:
            raise first
        return results


class _ThreadComm:
    def __init__(self, group: ThreadGroup, rank: int):
        self.g, self.rank, self.world, self.backend = group, rank, group.world, "threads"

    def _exchange(self, value) -> list:
        g = self.g
        g._turn.release()  # another rank computes while this one waits
        try:
            g._barrier.wait()  # everyone has read the previous exchange
            g._slots[self.rank] = value
            g._barrier.wait()
            return list(g._slots)
        finally:
            g._turn.acquire()

    def gather_objects(self, obj) -> list:
        return self._exchange(obj)

    def gather_ints(self, values, wait: bool = True):
        table = self._exchange(list(values))
        return table if wait else _Done(table)

    def ring_start(self, tensors, shift: int = 1):
        slots = self._exchange([t.clone() for t in tensors])
        return _Done(slots[(self.rank - shift) % self.world])

    def all_gather(self, t):
        return [x.clone() for x in self._exchange(t.clone())]

    def all_gather_rows(self, t):
        return torch.cat(self._exchange(t.clone()))

    def reduce_scatter_rows(self, t):
        rows = t.shape[0] // self.world
        parts = self._exchange(t.clone())
        total = parts[0][self.rank * rows:(self.rank + 1) * rows].clone()
        for p in parts[1:]:
            total += p[self.rank * rows:(self.rank + 1) * rows]
        return total

    def all_reduce(self, t):
        parts = self._exchange(t.clone())
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        return t.copy_(total)

    def reduce_scatter(self, blocks):
        parts = self._exchange([b.clone() for b in blocks])
        total = parts[0][self.rank].clone()
        for p in parts[1:]:
            total += p[self.rank]
        return total


def as_comm(group):
    """A communicator for ``group``: a ThreadGroup rank as is, else torch.distributed's."""
    if isinstance(group, (Comm, _ThreadComm)):
        return group
    return Comm(group)
