"""Worker ranks as threads of the engine's own process: the reference WorkerGroup, no Ray.

Every rank still has its own gloo process group endpoint, model shard and KV shard, and the ranks talk over
loopback sockets exactly as separate processes do; only the process boundary is missing (torch releases the
GIL inside its ops, so the ranks' forwards overlap). For tests (the whole family sweep runs without starting
a process per rank) and for checking the sharding itself; cluster/tensor_parallel.py runs the same TPWorker
as Ray actors, one per device.
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future

from engine.tp.comm import GroupComm, open_store
from engine.tp.worker import TPWorker, TPWorkerSpec

LOCAL = "127.0.0.1"


class LocalTPWorkerGroup:
    def __init__(self, template: TPWorkerSpec):
        store = open_store(LOCAL, template.size)
        self.description = f"tensor parallel x{template.size} in process"
        self.results: list[Future] = []
        for rank in range(1, template.size):
            spec = dataclasses.replace(template, rank=rank, store_host=LOCAL, store_port=store.port,
                                       bind_host=LOCAL, num_threads=None)
            fut: Future = Future()
            threading.Thread(target=_run, args=(spec, fut), name=f"tp-rank{rank}", daemon=True).start()
            self.results.append(fut)
        self.comm = GroupComm.host_watching(store, template.size, LOCAL, template.config.stall_timeout_s,
                                            self._raise_if_exited)

    def _raise_if_exited(self) -> None:
        for fut in self.results:
            if fut.done():
                fut.result()  # raises the worker's start error
                raise RuntimeError("a tensor-parallel worker exited before joining the group")

    def error(self) -> str | None:
        for fut in self.results:
            if fut.done():
                exc = fut.exception()
                return f"{type(exc).__name__}: {exc}" if exc else "a worker rank stopped following the group"
        return None

    def shutdown(self) -> None:
        """After rank 0's STOP the threads return; one still blocked (a broken group) is a daemon."""
        for fut in self.results:
            try:
                fut.result(timeout=5.0)
            except Exception:  # noqa: BLE001 - its error was reported through error()
                pass


def _run(spec: TPWorkerSpec, fut: Future) -> None:
    try:
        fut.set_result(TPWorker(spec).follow(exit_on_error=False))
    except BaseException as exc:  # noqa: BLE001 - handed to the group
        fut.set_exception(exc)

