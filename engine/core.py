"""The engine core: launch step t+1, commit step t, finalize (sample) t+1 — Photon's pipelined decoding.

The core runs the scheduler, KV manager, runner and sampler, and nothing of serving: it takes token ids and
gives back, per step, only what is new for each request (CoreOutput: new token ids, their logprobs, the
finish). Text is the frontend's (engine/output_processor.py: detokenization, stop strings, RequestOutput),
in the same thread offline (engine/llm_engine.py) or in the replica while the core runs in a process of its
own (engine/core_proc.py). A stop string the frontend finds ends the request here through finish().

With pipeline_depth=2 the forward of t+1 is queued before the CPU commits t, so commit bookkeeping
(appending tokens, stop checks, outputs) overlaps the forward. Sampling t+1 is queued after
commit t, so everything sampling depends on (penalties, min_tokens, grammar masks) is current: a grammar
matcher advances at commit t and the mask for t+1 is built from it at finalize, with no rollback ever.
pipeline_depth=3 (three slots) launches t+2 before committing t: two steps wait on the device while the loop
works, so a slow tick borrows from fast ones. While a request whose sampling reads its commits on the host runs
(a grammar, allowed_token_ids, min_tokens: engine/scheduler.py sampling_waits_for_commit) it keeps to two.
pipeline_depth=1 runs the same code with the commit right after its own finalize: the blocking baseline.
Requests with a grammar wait outside the scheduler until it is compiled (engine.structured, on a thread pool).
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, replace
from importlib.metadata import entry_points
from typing import Callable

import torch
from transformers import AutoTokenizer, GenerationConfig

from engine.block_manager import BlockManager
from engine.kv_dtype import resolve_kv_dtype
from engine.kv_groups import KVLayout, kv_layout
from engine.config import EngineConfig
from engine.cpu.block_pool import CpuBlockPool
from engine.executor import release_openmp_threads
from engine.kv_offload import KVSwapError
from engine.lora.registry import AdapterRegistry
from engine.lora.request import LoRARequest
from engine.lora.slots import AdapterSlots
from engine.model_runner import ModelRunner
from engine.models import load_hf_config, model_spec
from engine.outputs import CoreOutput, StepRecord
from engine.sampling_params import SamplingParams, sibling_params
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.slot import Step, StepResult
from engine.stats import EngineStats
from engine.step_runner import StepRunner
from engine.structured import StructuredOutputManager

logger = logging.getLogger(__name__)

HOST_PHASES = ("schedule", "prepare", "commit", "finalize", "stream", "wait")
COMPILE_POLL_S = 0.02  # idle wait for a grammar compile when nothing else can run
# Step records kept for the metrics side to drain; older ones are dropped if nobody drains (offline use).
STEP_RECORDS_MAX = 4096


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What a request is checked against before it is queued: read from the core once, so a frontend in
    another process validates without asking it (engine/core_proc.py)."""

    vocab_size: int
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    runner_name: str
    supports_prompt_logprobs: bool
    supports_forks: bool
    # Sliding-window KV groups (engine/kv_groups.py): num_kv_blocks counts pages. A prompt runs in its full pages plus
    # one query's window of pages in each window group: the scheduler counts growth net of the pages the window
    # gives back and shrinks a chunk to what is free, down to one position (whose window is window_blocks).
    window_groups: int = 0
    window_blocks: int = 0

    def check(self, ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming what is wrong with a tokenized request (nothing else is touched)."""
        if not ids:
            raise ValueError("prompt must not be empty")
        vocab = self.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len} "
                             f"(the prompt must leave room for at least one generated token)")
        for name, tids in (("stop_token_ids", params.stop_token_ids),
                           ("allowed_token_ids", params.allowed_token_ids or ()),
                           ("logit_bias", params.logit_bias or {})):
            bad = [t for t in tids if t >= vocab]
            if bad:
                raise ValueError(f"{name} token ids must be in [0, {vocab}); got {bad[:5]}")
        blocks = -(-(len(ids) + 1) // self.block_size)
        if blocks + self.window_groups * min(blocks, self.window_blocks) > self.num_kv_blocks:
            raise ValueError(f"prompt has {len(ids)} tokens, more than the KV cache holds "
                             f"({self.num_kv_blocks} blocks of {self.block_size})")
        if params.prompt_logprobs is not None and not self.supports_prompt_logprobs:
            raise ValueError(f"prompt_logprobs is not supported by this engine ({self.runner_name})")
        if params.n > 1:
            if not self.supports_forks:
                raise ValueError(f"n > 1 is not supported by this engine ({self.runner_name}); send n "
                                 f"separate requests")
            if params.n > self.max_num_seqs:
                raise ValueError(f"n must be <= max_num_seqs ({self.max_num_seqs}): all n samples run "
                                 f"together; got n={params.n}")


RunnerFactory = Callable[["EngineCore", int], StepRunner]


class EngineCore:
    """The engine core, whatever runs its forwards. Not thread-safe: one thread calls add_sequence/abort/finish/
    step (the async engine funnels other threads' calls through its inbox, or runs the core in a process of its
    own).

    Where forwards run is the runner's business, behind one interface (engine/step_runner.py: launch, finalize,
    wait, free_slot, health_error, is_fatal, stats): this device (ModelRunner), a simulated one (SimRunner),
    tensor-parallel ranks (engine/tp: TPModelRunner as rank 0) or pipeline stages (engine/pipeline:
    PipelineRunner). `make_runner(core, num_cpu_blocks)` builds it; None is this device's or the simulated one.
    The loop is the same for all: up to one step in flight per runner slot, oldest committed first."""

    def __init__(self, config: EngineConfig, make_runner: RunnerFactory | None = None):
        if config.max_num_batched_tokens is None:  # auto, resolved once: everything below reads the number
            config = replace(config, max_num_batched_tokens=config.token_budget())
        self.config = config
        self.simulated = config.device == "sim"  # engine/sim: host side real, device time modelled
        self.compute_device = _resolve_device(config.device)  # where forwards run (sim: host tensors)
        self.hf_config = load_hf_config(config.model_dir)
        self.spec = model_spec(self.hf_config)
        self.dtype = _resolve_dtype(config.dtype, self.hf_config,
                                    torch.device("cuda") if self.simulated else self.compute_device)
        self.max_model_len = min(config.max_model_len or self.spec.max_position_embeddings,
                                 self.spec.max_position_embeddings)
        # The core reads the tokenizer's vocabulary (grammars, the simulated device), never decodes with it.
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_dir, local_files_only=True)
        self.eos_token_ids = _eos_ids(config.model_dir, self.tokenizer)
        # Sliding-window layers' KV groups (engine/kv_groups.py): blocks are pages of one group's layers. The
        # runner's cache decides (pipeline stages keep one group); this is what this device's runner will use.
        self.kv_layout = kv_layout(config, self.spec)
        # What the KV cache is stored in (engine/kv_dtype.py), resolved once: the host pool and stats size by it.
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype,
                                         "sim" if self.simulated else self.compute_device, config.attention_backend)
        num_cpu_blocks = self._num_cpu_blocks()
        speculative = config.speculative()
        # A draft model (engine/spec_draft.py) is loaded before the runner profiles memory, which then counts its
        # weights and sizes its KV cache with the target's; it runs on this device's runner only.
        drafting = speculative is not None and speculative.method == "draft_model"
        if drafting and make_runner is not None:
            raise ValueError("speculative_config with a draft model runs on a single device's runner only")
        self.draft = _draft_model(self, speculative) if drafting else None
        self.runner = (make_runner or _local_runner)(self, num_cpu_blocks)
        if self.draft is not None:
            self.draft.allocate(self.runner.num_kv_blocks, self.runner.executor)
        self.kv_layout = self.runner.kv_layout or KVLayout.single(self.spec.num_layers)
        num_blocks = self.runner.num_kv_blocks  # what its memory profiling pass left room for (engine/memory.py)
        # EngineConfig.pipeline_depth, resolved: None is 2 where the forward overlaps the loop, else 1
        self.pipeline_depth = self.config.pipeline_depth or (2 if self.runner.forward_overlaps_loop else 1)
        self.device = self.runner.device  # where sampling runs (the driver's CPU under pipeline parallelism)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                          self.kv_layout.num_window_groups, self.kv_layout.window)
        self.cpu_pool = CpuBlockPool(num_cpu_blocks)
        # Multi-LoRA (engine/lora): adapter names -> host weights, and the device slots' LRU; None when off.
        self.loras = AdapterRegistry(self.spec, config.max_lora_rank, config.lora_modules, config.lora_dir) \
            if config.enable_lora else None
        self.lora_slots = AdapterSlots(config.max_loras) if config.enable_lora else None
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   policy=config.scheduler, admission_margin=config.admission_margin,
                                   cpu_pool=self.cpu_pool, one_step_per_seq=self.runner.one_step_per_seq,
                                   lora_slots=self.lora_slots, caching=config.enable_prefix_caching,
                                   speculative=speculative, propose=self.draft and self.draft.propose,
                                   three_slots=len(self.runner.slots) == 3 and not self.runner.one_step_per_seq)
        self._slots = len(self.runner.slots)
        self.structured = StructuredOutputManager(self.tokenizer, self.spec.vocab_size,
                                                  sorted(self.eos_token_ids))
        self.requests: dict[str | tuple[str, int], Sequence] = {}  # by Sequence.key
        self.compiling: list[tuple[Sequence, Future]] = []  # requests waiting for their grammar
        self.pending: deque[Step] = deque()  # launched, not yet committed: oldest first, one per busy slot
        self.counters = {"steps": 0, "graph_steps": 0, "mixed_graph_steps": 0, "prompt_tokens": 0,
                         "requests_finished": 0}
        self.last_step_timing: dict[str, float] = {}
        # Host time of the loop by phase (seconds, cumulative); "stream" is added by AsyncLLM's delivery,
        # "wait" is the commit blocked on the device (not host work).
        self.host_time = dict.fromkeys(HOST_PHASES, 0.0)
        self._stream_interval = config.stream_interval
        self.step_records: deque[StepRecord] = deque(maxlen=STEP_RECORDS_MAX)
        self._last_commit_time: float | None = None  # None while idle: the next period starts afresh
        self.fault: str | None = None  # set once the device raised an error: the engine serves no more

    def health_error(self) -> str | None:
        """Why the engine cannot serve any more (None while it can); the replica's health check reads it, so
        Serve replaces a replica whose device faulted, or whose TP rank or pipeline stage died, instead of
        letting it fail every request forever."""
        return self.fault or self.runner.health_error()

    def inflight_steps(self) -> list[Step]:
        """Launched steps not yet committed, oldest first."""
        return list(self.pending)

    # ---- requests -----------------------------------------------------------------------------------------
    @functools.cached_property
    def limits(self) -> RequestLimits:
        """What requests are checked against (RequestLimits.check), for a frontend in another process."""
        return RequestLimits(self.spec.vocab_size, self.max_model_len, self.block_manager.num_blocks,
                             self.config.block_size, self.config.max_num_seqs, type(self.runner).__name__,
                             self.runner.supports_prompt_logprobs, self.runner.supports_forks,
                             self.kv_layout.num_window_groups,
                             self.kv_layout.window_blocks(self.config.block_size) if self.kv_layout.window else 0)

    def make_sequence(self, prompt_token_ids: list[int], params: SamplingParams | None, request_id: str,
                      lora_request: LoRARequest | str | None = None, prompt: str | None = None,
                      arrival_time: float | None = None, prompt_hashes: list[int] | None = None) -> Sequence:
        """Validate a tokenized request and build its sequence (and its n > 1 siblings); raises ValueError
        naming the problem. Reads only immutable engine state and the adapter registry (which locks): safe
        from any thread.

        The prompt's block hashes (prefix caching) are made here, where the request is made (the caller's thread,
        or before `LLM.generate`'s loop starts), not on the loop when it is admitted
        (docs/engine.md#host-work-per-step). `prompt_hashes`: the same hashes made by a frontend in another process
        (`prompt_block_hashes`), used as they are for a base-model request when their count fits the prompt."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        ids = list(prompt_token_ids)  # (its type was checked where it was tokenized: llm_engine.tokenize)
        self.limits.check(ids, params)
        adapter = self._adapter(lora_request) if lora_request is not None else None
        seq = self._sequence(request_id, prompt, ids, params, adapter, 0)
        if params.n > 1:  # siblings: own seeds (seed + index), no second prompt scoring
            seq.forks = [self._sequence(request_id, prompt, ids, sibling_params(params, i), adapter, i)
                         for i in range(1, params.n)]
        if arrival_time is not None:
            for s in [seq, *(seq.forks or ())]:
                s.arrival_time = arrival_time
        bm = self.block_manager
        if prompt_hashes is not None and adapter is None and len(prompt_hashes) == (len(ids) - 1) // bm.block_size:
            seq.prompt_hashes = (len(ids), prompt_hashes)
        else:
            bm.prompt_hashes(seq)  # (siblings take sample 0's when they fork off it)
        return seq

    def _sequence(self, request_id: str, text: str | None, ids: list[int], params: SamplingParams, adapter,
                  index: int) -> Sequence:
        seq = Sequence(request_id, text, ids, params, self.eos_token_ids, self.max_model_len,
                       self.spec.vocab_size, self.device, index)
        if adapter is not None:
            seq.lora, seq.hash_root = adapter, adapter.key
        return seq

    def add_sequence(self, seq: Sequence) -> None:
        """Queue a validated sequence. One whose grammar is still compiling waits outside the scheduler
        (nothing else waits for it); a grammar already known not to compile raises ValueError here."""
        if self.fault is not None:
            raise RuntimeError(f"the engine is unhealthy ({self.fault}); no new requests")
        if seq.key in self.requests:
            raise ValueError(f"request_id {seq.request_id!r} is already in use")
        compiled = self.structured.compile_async(seq.params)
        if compiled is not None and compiled.done():
            compiled.result()  # raises the compile error, before anything is queued
        self.requests[seq.key] = seq
        for sibling in seq.forks or ():
            self.requests[sibling.key] = sibling
        self.counters["prompt_tokens"] += len(seq.prompt_token_ids)
        if compiled is None or compiled.done():
            self._admit(seq, compiled)
        else:
            self.compiling.append((seq, compiled))

    def _admit(self, seq: Sequence, compiled: Future | None) -> None:
        for s in [seq, *(seq.forks or ())]:
            s.constraint = self.structured.constraint(s.params, compiled and compiled.result())
        self.scheduler.add(seq)

    def _admit_compiled(self) -> list[CoreOutput]:
        """Move requests whose grammar finished compiling to the scheduler; reject those whose grammar does
        not compile and those still waiting past grammar_compile_timeout_s since they arrived."""
        outputs, waiting = [], []
        timeout = self.config.grammar_compile_timeout_s
        for seq, compiled in self.compiling:
            try:
                if not compiled.done():
                    if time.monotonic() - seq.arrival_time <= timeout:
                        waiting.append((seq, compiled))
                        continue
                    raise self.structured.timed_out(seq.params, compiled, timeout)
                self._admit(seq, compiled)
            except ValueError as exc:
                outputs += self._end(seq, "abort", error=str(exc), rejected=True)
        self.compiling = waiting
        return outputs

    def _adapter(self, lora_request: LoRARequest | str):
        """The loaded adapter a request names; ValueError when LoRA is off or the adapter is unknown or bad."""
        if self.loras is None:
            raise ValueError("lora_request: this engine has no LoRA adapters (set enable_lora, lora_modules "
                             "or lora_dir)")
        return self.loras.resolve(lora_request)

    def abort(self, request_id: str) -> list[CoreOutput]:
        """Stop a request (all its n samples) now; returns their final outputs (none when it is unknown or
        already finished). Blocks are freed at once, or when an in-flight step drains (zombie)."""
        seq = self.requests.get(request_id)
        if seq is None:
            return []
        self.compiling = [(s, f) for s, f in self.compiling if s is not seq]
        n = seq.params.n
        outputs = self.finish([request_id] + [(request_id, i) for i in range(1, n)], "abort")
        self._note_idle()
        return outputs

    def finish(self, keys: list, reason: str) -> list[CoreOutput]:
        """End the given samples (Sequence.key) with `reason`: the frontend's stop strings end requests here
        ("stop"), aborts ("abort"). Unknown or finished keys are ignored."""
        outputs = []
        for key in keys:
            seq = self.requests.get(key)
            if seq is not None and not seq.finalized:
                outputs += self._end(seq, reason)
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self.pending)

    # ---- the loop -----------------------------------------------------------------------------------------
    def step(self) -> list[CoreOutput]:
        """One tick: launch the next step into a free slot, commit the oldest in-flight one once every slot
        is busy (or nothing new could start), finalize (sample) the launched one.

        With the two slots of a single device (or TP group) that is Photon's order: launch t+1 (its forward
        reads t's sampled tokens on the device), commit t, finalize t+1. With p pipeline stages it keeps p
        microbatches in flight, one per stage, and commits each as the next one needs its slot. With three slots
        (pipeline_depth=3) it launches t+2, commits t, finalizes t+2; while a request whose sampling reads its
        commits runs (Scheduler.commit_readers), it keeps to two."""
        outputs = self._admit_compiled() if self.compiling else []
        launched = None
        pending, runner, scheduler = self.pending, self.runner, self.scheduler
        was_idle = not pending  # a commit below may free blocks: only then can nothing run
        limit = self._slots
        if scheduler.three_slots:
            limit = 2 if scheduler.commit_readers else 3
            # The step planned now is finalized before the newest in-flight one commits, except with two slots
            # in use and one step in flight (committed in this tick, before the finalize)
            scheduler.latest_step = pending[-1].id if pending and not (limit == 2 and len(pending) == 1) else -1
        slot = runner.free_slot() if len(pending) < limit else None
        clock, ht = time.perf_counter, self.host_time
        t0 = clock()
        if slot is not None and scheduler.has_work():
            sched = scheduler.schedule()
            t1 = clock()
            ht["schedule"] += t1 - t0
            if sched:
                launched = runner.launch(sched, slot, pending[-1] if pending else None)
                t0 = clock()
                ht["prepare"] += t0 - t1
        if pending and (launched is None or len(pending) + 1 >= limit):
            outputs += self._commit(pending.popleft())
        if launched is not None:
            t1 = clock()
            runner.finalize(launched)
            ht["finalize"] += clock() - t1
            if self.pipeline_depth == 1:
                outputs += self._commit(launched)
            else:
                pending.append(launched)
        elif was_idle and self.scheduler.has_work():
            outputs += self._end_stuck()
        elif not pending and self.compiling and not outputs:
            self._wait_for_compile()
        self._note_idle()
        return outputs

    def _wait_for_compile(self) -> None:
        """Only grammars are left to wait for: sleep until one compiles instead of spinning."""
        wait_futures([f for _, f in self.compiling], timeout=COMPILE_POLL_S, return_when=FIRST_COMPLETED)

    def _note_idle(self) -> None:
        if not self.has_unfinished():
            self._last_commit_time = None  # the time until the next request is idle, not a bubble
            if self.simulated:
                self.runner.note_idle()

    def _end_stuck(self) -> list[CoreOutput]:
        """Nothing could run and nothing is in flight: the running requests hold the whole KV cache and
        still need more. End the oldest (its KV budget is exhausted) so the others can go on."""
        stuck = self.scheduler.stuck()
        if not stuck:
            return []
        seq = stuck[0]
        logger.warning("request %s needs more KV blocks than the cache holds; ending it", seq.request_id)
        return self._end(seq, "length",
                         error="KV cache exhausted: the request needs more blocks than the engine has")

    def _commit(self, step: Step) -> list[CoreOutput]:
        t0 = time.perf_counter()
        try:
            result = self.runner.wait(step)
        except KVSwapError:
            raise  # offloaded KV is lost: fatal for the engine, not just this step
        except Exception as exc:  # a failed forward fails its requests, not the engine...
            if is_device_fault(exc) or self.runner.is_fatal(exc):  # ...unless the device (or TP group) failed
                return self._device_failed(step, exc)
            logger.exception("step %d failed", step.id)
            return self._fail_step(step, exc)
        t1 = time.perf_counter()
        self.host_time["wait"] += t1 - t0
        self._record_timing(step, result, t1 - t0)
        try:
            return self._outputs(self.scheduler.update_from_output(step, result))
        finally:
            self.host_time["commit"] += time.perf_counter() - t1

    def _outputs(self, changed: list[Sequence]) -> list[CoreOutput]:
        """Each changed sequence's delta (new tokens, or its finish; only the finish for a final-only one);
        finished ones leave the engine."""
        outputs, interval, requests = [], self._stream_interval, self.requests
        for seq in changed:
            if requests.get(seq.key) is not seq or seq.finalized:
                continue  # a zombie, or a sample the frontend ended meanwhile
            if seq.finish_reason is not None:
                outputs.append(self._finish(seq, seq.finish_reason))
            elif not seq.final_only:
                emitted = seq.num_emitted_tokens  # (lengths read directly: num_output_tokens is a property call)
                start = len(seq.prompt_token_ids) + emitted
                new = len(seq.token_ids) - start
                if not new or (new < interval and emitted):
                    continue
                if emitted and seq.logprobs is None and (seq.prompt_logprobs is None or seq.prompt_logprobs_sent):
                    # _output's common case inlined (a streamed request's every step): only the new token ids
                    seq.num_emitted_tokens = emitted + new
                    new_ids = seq.token_ids[start:].tolist()  # host memory (an int64 array)
                    outputs.append(CoreOutput(seq.request_id, seq.index, new_ids))
                else:
                    outputs.append(self._output(seq))
        return outputs

    def _finish(self, seq: Sequence, reason: str, error: str | None = None, rejected: bool = False) -> CoreOutput:
        self.scheduler.finish(seq, reason)
        del self.requests[seq.key]
        self.counters["requests_finished"] += seq.index == 0
        out = self._output(seq)
        out.error, out.rejected = error, rejected
        return out

    def _end(self, seq: Sequence, reason: str, error: str | None = None,
             rejected: bool = False) -> list[CoreOutput]:
        """_finish, and the same for siblings not forked yet (n > 1): they only ever run as forks of it."""
        outputs = [self._finish(seq, reason, error, rejected)]  # (the scheduler frees the siblings' seats)
        forks, seq.forks = seq.forks, None
        for sibling in forks or ():
            outputs.append(self._finish(self.requests[sibling.key], reason, error, rejected))
        return outputs

    def _output(self, seq: Sequence) -> CoreOutput:
        """What is new for `seq` since its last output: O(new tokens), whatever the request's length. (_outputs
        builds the common case, a streamed sample's later reports without logprobs, itself: a field added here
        that such a report carries must be added there too.)"""
        first = not seq.num_emitted_tokens
        start = len(seq.prompt_token_ids) + seq.num_emitted_tokens
        new = seq.token_ids[start:].tolist()  # host memory (an int64 array)
        seq.num_emitted_tokens += len(new)
        out = CoreOutput(seq.request_id, seq.index, new, seq.finish_reason, seq.stop_token)
        if first:  # what does not change after the first report is sent once (the frontend keeps it)
            out.num_cached_tokens, out.first_scheduled_time = seq.num_cached, seq.first_scheduled_time
            out.first_token_time = seq.first_token_time
        if seq.logprobs is not None:
            out.new_logprobs, seq.logprobs = seq.logprobs, []
        if seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
            out.prompt_logprobs, seq.prompt_logprobs_sent = list(seq.prompt_logprobs), True
        return out

    def _fail_step(self, step: Step, exc: Exception, error: str | None = None) -> list[CoreOutput]:
        outputs = []
        for c in [*step.chunks, *step.forks]:
            c.seq.inflight_refs -= 1
            if c.samples:
                c.seq.num_pending -= 1
            if self.requests.get(c.seq.key) is c.seq and not c.seq.finalized:
                why = error or f"engine step failed: {type(exc).__name__}"
                outputs += self._end(c.seq, "abort", error=why)
            self.scheduler.release_if_idle(c.seq)
        return outputs

    def _device_failed(self, step: Step, exc: Exception) -> list[CoreOutput]:
        """A CUDA error is sticky (every later call fails too): fail every request now, refuse new ones, and
        report unhealthy so the replica is replaced."""
        logger.error("device fault in step %d: %s: %s; the engine is unhealthy", step.id, type(exc).__name__, exc)
        self.fault = f"device fault: {type(exc).__name__}: {exc}"
        outputs = self._fail_step(step, exc, self.fault)
        for seq in list(self.requests.values()):
            if not seq.finalized:
                outputs.append(self._finish(seq, "abort", error=self.fault))
        self.compiling = []
        return outputs

    def _record_timing(self, step: Step, result: StepResult, wait_s: float) -> None:
        now = time.monotonic()
        period = now - self._last_commit_time if self._last_commit_time is not None else None
        self._last_commit_time = now
        self.counters["steps"] += 1
        self.counters["graph_steps"] += step.graph_size is not None
        self.counters["mixed_graph_steps"] += step.graph_seqs is not None
        # forward/sample/device_period: the device timeline (CUDA events; the worker's clock on CPU);
        # period_s: between commits on the host.
        self.last_step_timing = {"forward_s": result.forward_s, "sample_s": result.sample_s,
                                 "period_s": period or 0.0, "device_period_s": result.period_s,
                                 "num_tokens": step.num_tokens, "num_seqs": len(step.chunks),
                                 "num_samples": len(step.sample_chunks), "graph_size": step.graph_size,
                                 "finalize_s": step.finalize_s, "commit_wait_s": wait_s,
                                 "sample_wait_s": result.sample_wait_s}
        self.step_records.append(StepRecord(len(step.chunks), step.num_tokens, result.forward_s,
                                            result.sample_s, period))

    def drain_step_records(self) -> list[StepRecord]:
        """Take the step records accumulated since the last drain. Safe from another thread: the loop
        only appends, and deque append/popleft are atomic."""
        records = []
        while self.step_records:
            records.append(self.step_records.popleft())
        return records

    # ---- sizing and stats ---------------------------------------------------------------------------------
    def _num_cpu_blocks(self) -> int:
        cfg = self.config
        if not cfg.swap_space_gb:
            return cfg.num_cpu_blocks
        per_block = ModelRunner.kv_bytes_per_block(self.spec, cfg.block_size, self.kv_dtype,
                                                   self.kv_layout.layers_per_page)
        return int(cfg.swap_space_gb * 1024**3) // per_block

    def _kv_capacity(self) -> dict[str, int]:
        """KV bytes per position by group and the cache's capacity in positions (EngineStats)."""
        layout, bm, spec = self.kv_layout, self.block_manager, self.runner.spec
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        per = layout.bytes_per_token(spec.num_kv_heads, spec.head_dim, elem)
        past = bm.num_blocks * bm.block_size
        return {"kv_bytes_per_token_full": int(per["full"]), "kv_bytes_per_token_sliding": int(per.get("sliding", 0)),
                "kv_capacity_tokens": past // layout.pages_per_block, "kv_capacity_tokens_past_window": past,
                "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch.")}

    def stats(self) -> EngineStats:
        """A snapshot of the engine's state and counters (engine/stats.py: typed, immutable; a key that is
        renamed here without renaming its field fails when the snapshot is built, not in a dashboard)."""
        bm, sched = self.block_manager, self.scheduler
        offloader = self.runner.offloader
        return EngineStats(
            kv_blocks_total=bm.num_blocks, kv_blocks_free=bm.num_free, **self._kv_capacity(),
            cpu_blocks_total=self.cpu_pool.num_blocks, cpu_blocks_free=self.cpu_pool.num_free,
            num_preemptions=sched.num_preemptions, num_offloads=sched.num_offloads,
            num_swap_ins=sched.num_swap_ins, num_soft_resets=sched.num_soft_resets,
            kv_tokens_discarded=sched.kv_tokens_discarded,
            num_forks=sched.num_forks, num_cow_copies=sched.num_cow_copies,
            blocks_swapped_out=offloader.blocks_out if offloader else 0,
            blocks_swapped_in=offloader.blocks_in if offloader else 0,
            prefix_cache_hit_tokens=bm.hit_tokens, prefix_cache_queried_tokens=bm.queried_tokens,
            num_waiting=len(sched.waiting), num_running=len(sched.running),
            num_swapped=len(sched.swapped),
            device=str(self.compute_device), dtype=str(self.dtype).removeprefix("torch."),
            pipeline_depth=self.pipeline_depth, max_num_batched_tokens=self.config.max_num_batched_tokens,
            num_compiling=len(self.compiling),
            executor=type(self.runner.executor).__name__,
            grammar_compiles=self.structured.num_compiles, attention_backend=self.runner.backend_name,
            cuda_graph_max_batch_size=self.runner.max_graph_batch_size(),
            **self.counters, **self.scheduler.counters,
            **{f"host_{phase}_s": t for phase, t in self.host_time.items()},
            **{f"host_{phase}_us_per_step": 1e6 * t / max(1, self.counters["steps"])
               for phase, t in self.host_time.items()},
            **(self.runner.device_stats() if self.simulated else {}),
            **(self.runner.memory.stats() if getattr(self.runner, "memory", None) is not None else {}),
            **(self._lora_stats() if self.lora_slots is not None else {}),
            **self.runner.stats(),
        )

    def _lora_stats(self) -> dict:
        slots = self.lora_slots
        return {"lora_resident": tuple(slots.resident()), "lora_loads": slots.num_loads,
                "lora_evictions": slots.num_evictions, "max_loras": slots.max_loras}

    def check_integrity(self) -> None:
        """Assert block accounting; when idle, every block must be free."""
        live = {id(s): s for s in self.requests.values()}
        for step in self.inflight_steps():  # zombies: finished, blocks held until their step drains
            live.update((id(c.seq), c.seq) for c in [*step.chunks, *step.forks])
        live = [s for s in live.values() if not s.released]
        self.block_manager.check_integrity(live)
        self.cpu_pool.check_integrity(c for s in self.scheduler.swapped for c in s.cpu_blocks)
        if self.lora_slots is not None:
            self.lora_slots.check_integrity(live)
        if not self.has_unfinished():
            assert self.block_manager.num_free == self.block_manager.num_blocks, "blocks leaked"
            assert self.cpu_pool.num_free == self.cpu_pool.num_blocks, "cpu blocks leaked"

    def shutdown(self) -> None:
        self.runner.shutdown()
        self.structured.shutdown()


_DEVICE_ERRORS = tuple(e for e in (getattr(torch, "AcceleratorError", None), torch.OutOfMemoryError) if e)


def is_device_fault(exc: BaseException) -> bool:
    """An error the device raised (a CUDA error, or running out of device memory after the KV cache was sized),
    as opposed to one a step's inputs caused. Older torch raises CUDA errors as plain RuntimeErrors."""
    return isinstance(exc, _DEVICE_ERRORS) or (isinstance(exc, RuntimeError) and "CUDA error" in str(exc))


def _local_runner(core: EngineCore, num_cpu_blocks: int) -> StepRunner:
    """This device's runner, or the simulated accelerator's."""
    if core.simulated:
        from engine.sim.runner import SimRunner

        return SimRunner(core.config, core.spec, core.dtype, core.max_model_len, core.tokenizer, num_cpu_blocks)
    return ModelRunner(core.config, core.hf_config, core.spec, core.compute_device, core.dtype,
                       core.max_model_len, num_cpu_blocks,
                       draft_kv_bytes_per_page=core.draft.kv_bytes_per_page if core.draft is not None else 0)


def _draft_model(core: EngineCore, speculative):
    """The draft model of speculative_config (engine/spec_draft.py), on the target's device and dtype."""
    from engine.spec_draft import DraftModel

    return DraftModel(speculative.model, core.config, core.spec, core.compute_device, core.dtype, core.max_model_len)


def _resolve_device(device: str) -> torch.device:
    if device == "sim":
        return torch.device("cpu")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but CUDA is not available")
    return torch.device(device)


def _resolve_dtype(name: str, hf_config, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.float32
    ckpt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return ckpt if ckpt in (torch.bfloat16, torch.float16) else torch.bfloat16


def _eos_ids(model_dir: str, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(model_dir, local_files_only=True).eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except OSError:
        pass
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


ENGINE_PLUGINS = "tandem.engines"  # entry-point group of engines other packages provide


def create_core(config: EngineConfig) -> EngineCore:
    """The engine core `config` asks for: single-device, pipeline-parallel or tensor-parallel.

    The pipeline-parallel engine drives Ray stage actors, so it lives with them in cluster/pipeline.py and is
    found through the `tandem.engines` entry point named "pipeline" (pyproject.toml): this package never
    imports Ray or cluster/. The tensor-parallel engine's Ray workers come through the same entry point; a
    simulated device models tensor parallelism in its cost model instead (engine/sim), so it stays here."""
    if config.pipeline_parallel_size > 1 or (config.tensor_parallel_size > 1 and config.device != "sim"):
        core = engine_plugin("pipeline")(config)
    else:
        core = EngineCore(config)
    release_openmp_threads()  # forwards may run on another thread (AsyncLLM's loop): see there
    return core


def engine_plugin(name: str):
    """The factory(config) -> engine core registered under `name` in the `tandem.engines` entry-point group."""
    found = entry_points(group=ENGINE_PLUGINS, name=name)
    if not found:
        raise ValueError(f"no {name!r} engine is installed (entry point group {ENGINE_PLUGINS!r}); "
                         f"reinstall tandem (pip install -e .) so its cluster package registers it")
    return next(iter(found)).load()
