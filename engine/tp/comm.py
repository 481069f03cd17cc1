"""The collectives of one tensor-parallel group: a torch.distributed process group of its own.

Gloo on CPU (so the test suite runs real multi-process TP on a laptop). The group is a ProcessGroupGloo built
directly on a TCPStore, not `init_process_group`'s global default group: two engines in one process (tests,
or a replica restarted in place) never share or clobber one. Rank 0 (the engine's process) hosts the store on
a port the OS picks (`open_store`); the other ranks are told host and port.

Every call is blocking and counted, in total and per kind (`seconds`, `calls`; `by_kind`: all_reduce,
broadcast, gather): the benchmark's all-reduce cost per step, and the engine's stats. The time includes
waiting for the slowest rank to arrive, not only the transfer.

A peer that dies closes its sockets, and gloo then raises on the next collective (measured: ~immediately,
"Connection closed by peer"); a peer that hangs is cut off by the per-call `timeout_s`. A gloo timeout
closes the connection for good (measured), so the one wait that may legitimately last forever, an idle
worker's wait for rank 0's next step, passes `idle=True` and waits without a limit.

On CUDA the same calls would go to a ProcessGroupNCCL on the compute stream (not wired yet: EngineConfig
refuses device='cuda' with tensor_parallel_size > 1). What Ray's own channels would change:
- ray.util.collective offers the same gloo/NCCL collectives callable inside actors, under a named group
  instead of our TCPStore rendezvous; the forward would be unchanged (its all-reduces are still issued from
  inside each layer), only group setup and teardown would move to Ray.
- Compiled graphs (the pipeline engine's transport, cluster/pipeline.py) could replace the per-step broadcast
  of the step's inputs: the driver writes one channel per step that every worker reads (shared memory on one
  node, NCCL for device tensors), with the graph's failure semantics. Their collective nodes
  (ray.experimental.collective) run between actor method calls, i.e. once per graph step, so they cannot
  stand in for the all-reduces inside a layer; those stay torch.distributed.
"""

from __future__ import annotations

import datetime
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable

import torch
import torch.distributed as dist

START_TIMEOUT_S = 300.0  # ranks joining the group at start (a worker actor may be importing torch, loading)
IDLE_TIMEOUT = datetime.timedelta(days=365)  # gloo has no "no limit"; an idle replica may wait this long


def open_store(host: str, size: int) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free port (store.port) of `host`."""
    return dist.TCPStore(host, 0, size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=START_TIMEOUT_S))


class GroupComm:
    """Blocking collectives over one gloo process group (root = rank 0)."""

    def __init__(self, store: dist.Store, rank: int, size: int, host: str, timeout_s: float):
        """host: the address this rank's gloo device binds and announces (127.0.0.1 on one node); timeout_s:
        the limit of every collective of a step (START_TIMEOUT_S while the ranks start; idle waits: none)."""
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        opts._timeout = self.timeout = datetime.timedelta(seconds=START_TIMEOUT_S)  # until `started()`
        self._step_timeout = datetime.timedelta(seconds=timeout_s)
        self.store = store  # kept alive with the group
        self.pg = dist.ProcessGroupGloo(store, rank, size, opts)  # returns once every rank has joined
        self.rank, self.size = rank, size
        self.seconds, self.calls = 0.0, 0
        self.by_kind = {kind: 0.0 for kind in ("all_reduce", "broadcast", "gather")}  # seconds

    @classmethod
    def join(cls, host: str, port: int, rank: int, size: int, bind_host: str, timeout_s: float) -> GroupComm:
        """A rank other than 0: connect to rank 0's store and join the group."""
        store = dist.TCPStore(host, port, size, is_master=False,
                              timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
        return cls(store, rank, size, bind_host, timeout_s)

    @classmethod
    def host_watching(cls, store: dist.Store, size: int, host: str, timeout_s: float,
                      failed: Callable[[], None]) -> GroupComm:
        """Join as rank 0 on a thread while polling `failed()`, which raises when a worker has died before
        joining: a worker that fails to start ends the wait with its error, not the rendezvous timeout."""
        fut: Future = Future()

        def join():
            try:
                fut.set_result(cls(store, 0, size, host, timeout_s))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                fut.set_exception(exc)

        threading.Thread(target=join, name="tp-join", daemon=True).start()
        while True:
            try:
                return fut.result(timeout=0.2)
            except FutureTimeout:
                failed()

    def started(self) -> None:
        """The ranks are built (they load and profile at their own pace until then): steps get `timeout_s`."""
        self.timeout = self._step_timeout

    def _wait(self, work, kind: str) -> None:
        t0 = time.perf_counter()
        work.wait()
        dt = time.perf_counter() - t0
        self.seconds += dt
        self.by_kind[kind] += dt
        self.calls += 1

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        """Reduce `t` over the ranks (a sum by default), in place."""
        opts = dist.AllreduceOptions()
        opts.reduceOp, opts.timeout = op, self.timeout
        self._wait(self.pg.allreduce([t], opts), "all_reduce")

    def all_reduce_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.long)
        self.all_reduce(t, dist.ReduceOp.MIN)
        return int(t[0])

    def broadcast(self, t: torch.Tensor, idle: bool = False) -> None:
        """Rank 0's `t` into every rank's `t` (same shape and dtype everywhere); `idle`: no time limit."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.timeout = 0, IDLE_TIMEOUT if idle else self.timeout
        self._wait(self.pg.broadcast([t], opts), "broadcast")

    def gather_to_root(self, t: torch.Tensor, out: list[torch.Tensor] | None) -> None:
        """Every rank's `t` into rank 0's `out` (one tensor per rank, in rank order); `out` is None elsewhere."""
        opts = dist.GatherOptions()
        opts.rootRank, opts.timeout = 0, self.timeout
        self._wait(self.pg.gather([out] if self.rank == 0 else [], [t], opts), "gather")

    def stats(self) -> dict:
        return {"tp_collective_s": self.seconds, "tp_collectives": self.calls,
                **{f"tp_{kind}_s": t for kind, t in self.by_kind.items()}}
