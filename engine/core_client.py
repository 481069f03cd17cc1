"""The frontend's handle on an engine core process (engine/core_proc.py): start it, talk to it, watch it die.

One PUSH socket carries requests to the core, one PULL socket brings its per-tick messages back; both bound
here on ipc:// paths in a private temporary directory, so only this process and its child can reach them.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import tempfile

import msgspec
import zmq

from engine.config import EngineConfig
from engine.core_proc import DEAD, FAILED, READY

START_TIMEOUT_S = 600.0  # loading and profiling a model may take minutes on a slow disk


class CoreProcessError(RuntimeError):
    """The engine core process could not start, died, or was lost."""


class CoreProcess:
    """A child process running the engine core. `send` from any thread (serialized by a lock in AsyncLLM's
    frontend); `recv` from one thread only (the frontend's output thread)."""

    def __init__(self, config: EngineConfig):
        self._dir = tempfile.mkdtemp(prefix="tandem-core-")
        self._ctx = zmq.Context()
        self._in = self._ctx.socket(zmq.PUSH)   # frontend -> core
        self._out = self._ctx.socket(zmq.PULL)  # core -> frontend
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.setsockopt(zmq.SNDHWM, 0)  # no message limit: a send never blocks or drops while the core runs
        self._out.setsockopt(zmq.LINGER, 0)
        in_addr, out_addr = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._in.bind(in_addr)
        self._out.bind(out_addr)
        self._decoder = msgspec.msgpack.Decoder()
        self.proc = subprocess.Popen([sys.executable, "-m", "engine.core_proc", in_addr, out_addr, str(os.getpid())],
                                     stdin=subprocess.DEVNULL, env=_child_env())
        try:
            self._in.send(pickle.dumps(config))
            self.limits, self.eos_token_ids, self.stats_blob = self._handshake()
        except BaseException:
            self.close(timeout_s=0)
            raise

    def _handshake(self):
        poller = zmq.Poller()
        poller.register(self._out, zmq.POLLIN)
        waited = 0.0
        while not poller.poll(500):
            waited += 0.5
            code = self.proc.poll()
            if code is not None:
                raise CoreProcessError(f"the engine core process exited with code {code} while starting")
            if waited > START_TIMEOUT_S:
                raise CoreProcessError(f"the engine core process did not start in {START_TIMEOUT_S:.0f} s")
        msg = self._decoder.decode(self._out.recv())
        if msg[0] == FAILED:
            exc = pickle.loads(msg[1])
            raise exc  # the core's own error (a bad model dir, a bad config value: ValueError naming it)
        if msg[0] != READY:
            raise CoreProcessError(f"unexpected first message from the engine core: {msg[0]!r}")
        return pickle.loads(msg[1]), frozenset(msg[2]), msg[3]

    def send(self, kind: str, arg) -> bool:
        """Queue a message for the core; False when it cannot be delivered (the core process is gone: with no
        message limit, only a missing peer makes a non-blocking send fail)."""
        try:
            self._in.send(pickle.dumps((kind, arg)), zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def recv(self, timeout_ms: int):
        """The next message, decoded (a list), or None after timeout_ms with nothing."""
        if not self._out.poll(timeout_ms):
            return None
        return self._decoder.decode(self._out.recv(copy=False).buffer)

    def exitcode(self) -> int | None:
        return self.proc.poll()

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask the core to stop, wait for it, kill it if it does not; free the sockets. Idempotent."""
        if self.proc.poll() is None:
            try:
                self.send("shutdown", None)
                self.proc.wait(timeout=timeout_s)
            except (zmq.ZMQError, subprocess.TimeoutExpired):
                pass
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=30)
        if not self._ctx.closed:
            self._in.close(0)
            self._out.close(0)
            self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)


class CpuReservation:
    """Keeps this process's threads off one CPU, which the engine core process then has to itself among them.

    On a host with few CPUs the frontend's threads (the callers' event loop, the output thread, ZeroMQ's and
    Ray's) woke on whichever CPU the core was running on and preempted it: the core's host work per step grew
    and the device idled (docs/serving.md#the-engine-core-process has the figures). The frontend is
    bound by its GIL to about one CPU's work anyway, so it loses little. The CPU left out is the highest-numbered
    one this process may use; the core process, started before, keeps every CPU. Threads started later inherit
    their creator's CPUs, so they stay off it too. Linux only (elsewhere, and with a single CPU, it does
    nothing). `release()` gives the threads living then every CPU of the original set back."""

    def __init__(self):
        self.allowed: set[int] | None = None  # the CPUs to give back; None: nothing was moved
        if not hasattr(os, "sched_setaffinity"):
            return
        allowed = os.sched_getaffinity(0)
        if len(allowed) < 2:
            return
        self.allowed = allowed
        self._set_all(allowed - {max(allowed)})

    def release(self) -> None:
        if self.allowed is not None:
            self._set_all(self.allowed)
            self.allowed = None

    @staticmethod
    def _set_all(cpus: set[int]) -> None:
        try:
            tids = [int(t) for t in os.listdir("/proc/self/task")]
        except OSError:
            tids = [0]
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError:  # the thread ended meanwhile
                pass


def _child_env() -> dict[str, str]:
    """The replica's environment, with this checkout importable (the child runs `python -m engine.core_proc`
    from wherever the replica runs)."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


__all__ = ["CoreProcess", "CoreProcessError", "CpuReservation", "DEAD"]
