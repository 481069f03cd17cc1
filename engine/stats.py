"""EngineStats: what an engine reports about itself, one immutable snapshot per `stats()` call.

The stats were a dict, and routing, autoscaling and the metrics exporter read it with `.get(key, 0)`: a key
renamed on the engine side then made them export 0 (an idle-looking replica, an empty KV cache) forever,
with nothing failing. Here every key is a typed field, so

- building the snapshot fails (TypeError) when a source (the engine's counters, the simulated device, the
  memory plan, LoRA slots, the pipeline or tensor-parallel engine) reports a key that is not a field or
  leaves out one that is;
- reading fails: an attribute that is not a field raises AttributeError, `stats["key"]` raises KeyError
  naming the key, and there is no `.get`, so no consumer can default a missing key to 0.

The key names are a public contract (`llm.stats()["num_preemptions"]`, the docs): `stats["key"]`, `keys()`,
`as_dict()` and `key in stats` keep the dict's view. Groups only some engines have (a simulated device, a
memory profile, LoRA, pipeline or tensor parallelism) are fields that are None on the engines without
them; those keys are left out of that view (as they were left out of the dict), and `stats["key"]` for
one raises KeyError saying which engines report it. A group is all there or all None (checked here).

The snapshot is frozen and holds only immutable values, so it can be shared between threads (AsyncLLM
hands the same object to every reader) and sent between processes (it pickles).
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True, slots=True)
class EngineStats:
    # ---- KV cache: device blocks and the CPU swap pool
    kv_blocks_total: int  # pages of one KV group with sliding-window groups (engine/kv_groups.py)
    kv_blocks_free: int
    cpu_blocks_total: int
    cpu_blocks_free: int
    # K and V bytes one position holds: in the full-attention layers, and in the sliding-window layers while it
    # is in their window (0 without sliding-window groups: every layer counts as full)
    kv_bytes_per_token_full: int
    kv_bytes_per_token_sliding: int
    # Positions the device cache holds: when every one is still in its window (short requests), and when none is
    # (positions past every window hold full-attention pages only). Equal without sliding-window groups.
    kv_capacity_tokens: int
    kv_capacity_tokens_past_window: int
    kv_cache_dtype: str  # what the KV cache is stored in (EngineConfig.kv_cache_dtype resolved)
    # ---- scheduler: preemption, swapping, forks (cumulative)
    num_preemptions: int
    num_offloads: int
    num_swap_ins: int
    num_soft_resets: int
    kv_tokens_discarded: int
    num_forks: int
    num_cow_copies: int
    blocks_swapped_out: int
    blocks_swapped_in: int
    # ---- prefix cache (cumulative tokens)
    prefix_cache_hit_tokens: int
    prefix_cache_queried_tokens: int
    # ---- queues now
    num_waiting: int
    num_running: int
    num_swapped: int
    # ---- configuration as resolved
    device: str
    dtype: str
    pipeline_depth: int
    max_num_batched_tokens: int
    num_compiling: int  # requests waiting for their grammar to compile (now)
    executor: str
    grammar_compiles: int
    attention_backend: str
    cuda_graph_max_batch_size: int  # 0: no CUDA graphs
    # ---- the engine loop's counters (cumulative)
    steps: int
    graph_steps: int  # steps that replayed a CUDA graph (decode or mixed)
    mixed_graph_steps: int  # of those, steps with prompt chunks (engine/cuda_graphs.py)
    prompt_tokens: int
    generation_tokens: int
    requests_finished: int
    zombie_rows: int
    constrained_tokens: int
    # speculative decoding (engine/spec_decode.py): draft tokens verified, those accepted, chunks that verified
    spec_draft_tokens: int
    spec_accepted_tokens: int
    spec_verify_chunks: int
    # ---- host time of the loop by phase (engine.core.HOST_PHASES): seconds, and microseconds per step
    host_schedule_s: float
    host_prepare_s: float
    host_commit_s: float
    host_finalize_s: float
    host_stream_s: float
    host_wait_s: float
    host_schedule_us_per_step: float
    host_prepare_us_per_step: float
    host_commit_us_per_step: float
    host_finalize_us_per_step: float
    host_stream_us_per_step: float
    host_wait_us_per_step: float
    # ---- simulated device (device="sim", engine/sim/device.py); None elsewhere
    device_busy_s: float | None = None
    device_idle_s: float | None = None
    device_dep_wait_s: float | None = None
    device_busy_fraction: float | None = None
    device_copy_busy_s: float | None = None
    host_launch_s: float | None = None
    host_blocked_s: float | None = None
    sim_emulation_s: float | None = None  # the simulator's own host work, taken off the virtual clock
    sim_gpu: str | None = None
    # ---- the memory profiling pass (engine/memory.py MemoryPlan, bytes); None with a fixed num_kv_blocks
    memory_usable: float | None = None
    memory_in_use: float | None = None
    memory_activation_peak: float | None = None
    memory_graph_pool: float | None = None
    memory_source: str | None = None
    memory_kv_bytes: int | None = None
    # ---- LoRA (enable_lora); None without
    lora_resident: tuple[str, ...] | None = None  # adapters in device slots
    lora_loads: int | None = None
    lora_evictions: int | None = None
    max_loras: int | None = None
    # ---- pipeline parallelism (engine/pipeline); None on other engines
    pipeline_parallel_size: int | None = None
    microbatches_in_flight: int | None = None
    # ---- tensor parallelism on real devices (engine/tp: its collectives, seconds); None on other engines
    tensor_parallel_size: int | None = None
    tp_collective_s: float | None = None
    tp_collectives: int | None = None
    tp_all_reduce_s: float | None = None
    tp_broadcast_s: float | None = None
    tp_gather_s: float | None = None

    def __post_init__(self):
        for group, names in GROUPS.items():
            present = [getattr(self, n) is not None for n in names]
            if any(present) and not all(present):
                missing = [n for n, p in zip(names, present) if not p]
                raise TypeError(f"EngineStats: the {group} group is only partly reported (missing {missing})")

    def __getitem__(self, key: str):
        """The field `key`, as the dict used to give it. KeyError (naming the key) for a name that is no
        field, and for a field of a group this engine does not have."""
        if key not in _GROUP_OF and key not in _REQUIRED:
            raise KeyError(f"{key!r} is not an engine stat (EngineStats in engine/stats.py lists them)")
        value = getattr(self, key)
        if value is None:
            raise KeyError(f"{key!r} is not reported by this engine ({_GROUP_OF[key]} engines only)")
        return value

    def __contains__(self, key: object) -> bool:
        return key in _REQUIRED or (key in _GROUP_OF and getattr(self, key) is not None)

    def keys(self) -> list[str]:
        """The reported keys, in field order (no keys of groups this engine does not have)."""
        return [n for n in _NAMES if n not in _GROUP_OF or getattr(self, n) is not None]

    def as_dict(self) -> dict:
        """The reported keys and values as a plain dict (for export: JSON, logs)."""
        return {n: getattr(self, n) for n in self.keys()}


# Fields present only on some engines, by group: each is all None or all set.
GROUPS: dict[str, tuple[str, ...]] = {
    "simulated-device": ("device_busy_s", "device_idle_s", "device_dep_wait_s", "device_busy_fraction",
                         "device_copy_busy_s", "host_launch_s", "host_blocked_s", "sim_emulation_s",
                         "sim_gpu"),
    "memory-profiled": ("memory_usable", "memory_in_use", "memory_activation_peak", "memory_graph_pool",
                        "memory_source", "memory_kv_bytes"),
    "LoRA": ("lora_resident", "lora_loads", "lora_evictions", "max_loras"),
    "pipeline-parallel": ("pipeline_parallel_size", "microbatches_in_flight"),
    "tensor-parallel": ("tensor_parallel_size", "tp_collective_s", "tp_collectives", "tp_all_reduce_s",
                        "tp_broadcast_s", "tp_gather_s"),
}
_NAMES: tuple[str, ...] = tuple(f.name for f in fields(EngineStats))
_GROUP_OF: dict[str, str] = {n: group for group, names in GROUPS.items() for n in names}
_REQUIRED: frozenset[str] = frozenset(_NAMES) - _GROUP_OF.keys()
if set(_GROUP_OF) != {f.name for f in fields(EngineStats) if f.default is None} or \
        sum(map(len, GROUPS.values())) != len(_GROUP_OF):
    raise RuntimeError("engine/stats.py: GROUPS must name every optional EngineStats field exactly once")
