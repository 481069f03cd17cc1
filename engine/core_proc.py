"""The engine core in a process of its own: a loop that runs the core and nothing of serving.

Started by engine/core_client.py (`python -m engine.core_proc IN OUT`) as a child of the replica process, on
the same host and the same device (it inherits the replica's CUDA_VISIBLE_DEVICES and CPU affinity). Why a
child process and not a Ray actor: the replica's Ray actor already holds the GPU and the CPU reservation
Serve placed it with; a child shares both with no second placement, starts without a round trip through the
Ray scheduler, and dies with its replica (PR_SET_PDEATHSIG) so none outlives it.

Transport: two ZeroMQ sockets over ipc:// (PUSH/PULL each way). Requests in are pickled (they carry
SamplingParams and LoRA requests, a few per step at most); each tick's outputs go out as one message, the
CoreOutputs in it msgspec Structs encoded as msgpack arrays and decoded straight back into Structs
(docs/engine.md#the-engine-core-process says what was measured).

Messages in: ("add", (request_id, prompt_token_ids, params, lora_request, arrival_time, prompt_hashes)), ("abort",
request_id), ("finish", [keys]) for stop strings the frontend found, ("shutdown", None).
Messages out (msgpack): [OUT, outputs_or_none (encode_outputs' bytes), stats_or_none, step_records,
prefix_hashes_or_none, health_error], where `stats` is a pickled EngineStats and health_error the core's (None
while it can serve); [READY, limits(pickled), eos ids, stats]; [FAILED, pickled exception, text]; [DEAD, text]
when the loop died.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import pickle
import signal
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec
import zmq

from engine.core import create_core
from engine.outputs import CoreOutput, StepRecord

logger = logging.getLogger("tandem.core")

READY, FAILED, OUT, DEAD = 0, 1, 2, 3
STATS_PERIOD_S = 0.05  # while busy, the stats snapshot goes out at most this often (always when idle)
SUMMARY_PERIOD_S = 0.5
SUMMARY_MAX_HASHES = 4096
IDLE_POLL_MS = 500  # while idle: how often the loop checks that its parent is alive
LOADING_POLL_MS = 5  # while only adapter loads are pending: how often the loop looks for a finished one
HEARTBEAT_S = 0.25  # a busy core whose step produced nothing still reports this often (progress, stats)


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(list[CoreOutput])


def encode_outputs(outputs: list[CoreOutput]) -> bytes:
    """A step's outputs as one msgpack array of arrays (CoreOutput is an array-like msgspec Struct)."""
    return _ENCODER.encode(outputs)


def decode_outputs(data: bytes) -> list[CoreOutput]:
    return _DECODER.decode(data)


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the process that started it exits, however it exits."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # elsewhere the idle loop's parent check still ends it


class CoreLoop:
    def __init__(self, core, inp: zmq.Socket, out: zmq.Socket, parent: int):
        self.core, self.inp, self.out, self.parent = core, inp, out, parent
        self.encoder = msgspec.msgpack.Encoder()
        self._stats_time = self._summary_time = self._sent_time = 0.0
        # Requests under a LoRA adapter are built on this thread (an adapter's first use reads it from disk,
        # which must not stall the loop's steps): request id -> (the Future of its sequence, its params).
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-lora-load")
        self._loading: dict[str, tuple[Future, object]] = {}

    def run(self) -> None:
        core, poller = self.core, zmq.Poller()
        poller.register(self.inp, zmq.POLLIN)
        while True:
            busy = core.has_unfinished()
            if not busy and self._loading:  # only adapter loads pending: look again soon, not at the idle poll
                poller.poll(LOADING_POLL_MS)
                busy = True
            if not busy:
                self._send([], force=True)
                if not poller.poll(IDLE_POLL_MS):
                    if os.getppid() != self.parent:
                        return  # orphaned (no PDEATHSIG here): nobody will read our outputs
                    continue
            outputs = []
            if not self._drain_inbox(outputs):
                return
            if self._loading:
                outputs += self._add_loaded()
            if core.has_unfinished():
                outputs += core.step()
            self._send(outputs)

    def _drain_inbox(self, outputs: list) -> bool:
        core = self.core
        while True:
            try:
                kind, arg = pickle.loads(self.inp.recv(zmq.NOBLOCK))
            except zmq.Again:
                return True
            if kind == "add":
                outputs += self._add(*arg)
            elif kind == "abort":
                loading = self._loading.pop(arg, None)
                if loading is not None:  # never queued: nothing to free, and its caller is gone
                    loading[0].cancel()
                outputs += core.abort(arg)
            elif kind == "finish":
                core.finish([tuple(k) if isinstance(k, list) else k for k in arg], "stop")
            elif kind == "shutdown":
                self._loader.shutdown(wait=False, cancel_futures=True)
                return False

    def _add(self, request_id, ids, params, lora_request, arrival_time, prompt_hashes) -> list[CoreOutput]:
        """Queue a request; one the core refuses comes back as a rejected output (the frontend raises it).
        One under an adapter is built on the loader thread and queued when it is ready (_add_loaded). The
        frontend hashed a base-model prompt's blocks (prompt_hashes; None without prefix caching): that work
        stays off this loop."""
        if lora_request is not None:
            self._loading[request_id] = (self._loader.submit(
                self.core.make_sequence, ids, params, request_id, lora_request, arrival_time=arrival_time), params)
            return []
        return self._queue(request_id, params, lambda: self.core.make_sequence(
            ids, params, request_id, None, arrival_time=arrival_time, prompt_hashes=prompt_hashes))

    def _add_loaded(self) -> list[CoreOutput]:
        """Queue the requests whose adapters are loaded, in arrival order among themselves."""
        outputs = []
        for request_id, (fut, params) in list(self._loading.items()):
            if not fut.done():
                break
            del self._loading[request_id]
            outputs += self._queue(request_id, params, fut.result)
        return outputs

    def _queue(self, request_id: str, params, make) -> list[CoreOutput]:
        try:
            seq = make()
            self.core.add_sequence(seq)
        except (ValueError, RuntimeError) as exc:
            n = getattr(params, "n", 1)
            return [CoreOutput(request_id, i, [], "abort", error=str(exc), rejected=True) for i in range(n)]
        return []

    def _send(self, outputs: list[CoreOutput], force: bool = False) -> None:
        now = time.monotonic()
        core = self.core
        stats = summary = health = None
        if force or now - self._stats_time > STATS_PERIOD_S:
            stats, self._stats_time = pickle.dumps(core.stats()), now
            health = core.health_error()
        if force or now - self._summary_time > SUMMARY_PERIOD_S:
            summary, self._summary_time = core.block_manager.recent_hashes(SUMMARY_MAX_HASHES), now
        records = core.drain_step_records()
        if not (outputs or stats or summary or records) and now - self._sent_time < HEARTBEAT_S:
            return
        self._sent_time = now
        msg = (OUT, encode_outputs(outputs) if outputs else None, stats,
               [(r.num_seqs, r.num_tokens, r.forward_s, r.sample_s, r.period_s) for r in records], summary, health)
        self.out.send(self.encoder.encode(msg), copy=False)


def decode_records(rows: list) -> list[StepRecord]:
    return [StepRecord(*r) for r in rows]


def main(argv: list[str]) -> int:
    in_addr, out_addr, parent = argv[0], argv[1], int(argv[2])
    _die_with_parent()
    if os.getppid() != parent:
        return 1  # the parent died before PDEATHSIG was set
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s core: %(message)s")
    ctx = zmq.Context()
    inp, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inp.connect(in_addr)
    out.connect(out_addr)
    out.setsockopt(zmq.LINGER, 2000)
    encoder = msgspec.msgpack.Encoder()
    config = pickle.loads(inp.recv())
    try:
        core = create_core(config)
    except BaseException as exc:  # noqa: BLE001 - reported to the frontend, which raises it
        try:
            payload = pickle.dumps(exc)
        except Exception:  # noqa: BLE001
            payload = pickle.dumps(RuntimeError(repr(exc)))
        out.send(encoder.encode((FAILED, payload, f"{type(exc).__name__}: {exc}")))
        return 1
    # What lives now (model, tokenizer, libraries) lives as long as the core: out of the cyclic GC's full
    # collections, which would otherwise scan it every few thousand steps and stall the loop.
    gc.collect()
    gc.freeze()
    out.send(encoder.encode((READY, pickle.dumps(core.limits), sorted(core.eos_token_ids), pickle.dumps(core.stats()))))
    try:
        CoreLoop(core, inp, out, parent).run()
    except BaseException as exc:  # noqa: BLE001 - the frontend fails every request and reports unhealthy
        logger.exception("engine core loop died")
        out.send(encoder.encode((DEAD, f"engine core loop died: {type(exc).__name__}: {exc}")))
        return 1
    finally:
        try:
            core.shutdown()
        except Exception:  # noqa: BLE001
            logger.exception("engine core shutdown failed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
