"""EngineStats (engine/stats.py): the typed snapshot every engine's stats() returns.

Every field is filled, with its annotated type, by a real run of each engine kind (the default model on CPU,
LoRA, the simulated device, pipeline and tensor parallelism in process); the groups an engine does not have
are None and left out of the dict view. The snapshot refuses what the dict allowed: unknown keys, `.get`
with a default, assignment, a source reporting a key that is no field.
"""

from __future__ import annotations

import dataclasses
import pickle
import types
import typing

import pytest

from engine import AsyncLLM, EngineConfig, EngineStats, SamplingParams
from engine.llm_engine import create_engine
from engine.pipeline import LocalStageGroup, PipelineEngine
from engine.sim import SIM_MODELS
from engine.stats import GROUPS
from engine.tp import TensorParallelEngine
from engine.tp.local import LocalTPWorkerGroup

HINTS = typing.get_type_hints(EngineStats)
GROUP_OF = {name: group for group, names in GROUPS.items() for name in names}
PARAMS = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


def make_stats(**values) -> EngineStats:
    """A synthetic snapshot for unit tests: every always-reported field zero ("" for strings), no optional
    group, then `values`."""
    zero = {int: 0, float: 0.0, str: ""}
    base = {f.name: zero[HINTS[f.name]] for f in dataclasses.fields(EngineStats) if f.name not in GROUP_OF}
    return EngineStats(**{**base, **values})


def _base_type(hint):
    """X for `X | None`, else the hint itself."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    return hint


def _has_type(value, hint) -> bool:
    t = _base_type(hint)
    if t is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if t is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if typing.get_origin(t) is tuple:
        (item, _) = typing.get_args(t)
        return isinstance(value, tuple) and all(isinstance(v, item) for v in value)
    return isinstance(value, t)


def check_snapshot(s: EngineStats, groups: set[str]) -> None:
    """Every field of the engine's groups set, with its annotated type; the other groups None and absent."""
    assert isinstance(s, EngineStats)
    for f in dataclasses.fields(EngineStats):
        value = getattr(s, f.name)
        group = GROUP_OF.get(f.name)
        if group is not None and group not in groups:
            assert value is None, f.name
            assert f.name not in s and f.name not in s.keys()
            with pytest.raises(KeyError, match=f"{f.name}.*{group}"):
                s[f.name]
            continue
        assert _has_type(value, HINTS[f.name]), f"{f.name} = {value!r} is not {HINTS[f.name]}"
        assert f.name in s and s[f.name] == value
    assert s.as_dict() == dict(s) == {k: getattr(s, k) for k in s.keys()}
    assert pickle.loads(pickle.dumps(s)) == s  # Serve ships it between processes (replica.stats)


def run(engine, prompts=([5, 6, 7, 8, 9], [11, 12, 13])) -> EngineStats:
    """A few greedy tokens through `engine` (an LLMEngine or subclass); its stats afterwards."""
    for p in prompts:
        engine.add_request(list(p), PARAMS)
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()
    return engine.stats()


# Each engine kind, and the optional groups it reports; together they cover every group.
# (The engine itself, not an LLM around it: an LLM shuts its engine down when it is dropped.)
def _default(_):
    return create_engine(EngineConfig())  # what LLM() builds: the embedded default model


def _lora(_):
    return create_engine(EngineConfig(enable_lora=True, max_loras=2, num_kv_blocks=64))


def _sim(_):
    return create_engine(EngineConfig(model=str(SIM_MODELS / "qwen2.5-0.5b"), device="sim", sim_gpu="h100",
                                      max_model_len=256, max_num_seqs=4))


def _pipeline(factory):
    path, _ = factory("llama", num_hidden_layers=4)
    return PipelineEngine(EngineConfig(model=str(path), block_size=4, pipeline_parallel_size=2), LocalStageGroup)


def _tensor(factory):
    path, _ = factory("llama")
    return TensorParallelEngine(EngineConfig(model=str(path), device="cpu", block_size=4, tensor_parallel_size=2),
                                LocalTPWorkerGroup)


ENGINES = {
    "default": (_default, {"memory-profiled"}),
    "lora": (_lora, {"LoRA"}),
    "sim": (_sim, {"simulated-device", "memory-profiled"}),
    "pipeline": (_pipeline, {"pipeline-parallel"}),
    "tensor": (_tensor, {"tensor-parallel", "memory-profiled"}),
}


def test_the_engine_kinds_below_cover_every_group():
    assert set().union(*(groups for _, groups in ENGINES.values())) == set(GROUPS)


@pytest.mark.parametrize("kind", list(ENGINES))
def test_a_real_run_fills_every_field_with_its_type(kind, tiny_model_factory):
    build, groups = ENGINES[kind]
    engine = build(tiny_model_factory)
    try:
        s = run(engine)
    finally:
        engine.shutdown()
    check_snapshot(s, groups)
    assert s.steps > 0 and s.generation_tokens == 6 and s.requests_finished == 2 and s.prompt_tokens == 8
    assert s.kv_blocks_free == s.kv_blocks_total > 0 and s.num_waiting == s.num_running == 0
    if kind == "sim":  # the simulated device's time and profile
        assert s.sim_gpu == "h100" and s.device_busy_s > 0 and 0 < s.device_busy_fraction <= 1
        assert s["device_busy_fraction"] == s.device_busy_fraction and s.memory_source == "modelled"
    if kind == "lora":
        assert s.lora_resident == () and s.max_loras == 2 and s.lora_loads == 0
    if kind == "pipeline":
        assert s.pipeline_parallel_size == 2 and s.microbatches_in_flight == 0
    if kind == "tensor":
        assert s.tensor_parallel_size == 2 and s.tp_collectives > 0 and s.tp_collective_s > 0


def test_async_llm_hands_out_the_engines_snapshot():
    llm = AsyncLLM(num_kv_blocks=64)
    try:
        s = llm.stats()
        assert isinstance(s, EngineStats) and s.kv_blocks_total == 64
    finally:
        llm.shutdown()


# ---- what the dict allowed and the snapshot refuses -------------------------------------------------------

def test_unknown_key_raises_key_error_naming_it():
    s = make_stats(num_waiting=3)
    assert s["num_waiting"] == s.num_waiting == 3
    with pytest.raises(KeyError, match="num_wating"):
        s["num_wating"]
    with pytest.raises(AttributeError):
        s.num_wating  # noqa: B018
    assert "num_wating" not in s


def test_no_get_so_nothing_defaults_a_missing_key():
    s = make_stats()
    assert not hasattr(EngineStats, "get") and not hasattr(s, "get")
    with pytest.raises(AttributeError):
        s.get("num_waiting", 0)


def test_frozen():
    s = make_stats()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.num_waiting = 5
    with pytest.raises((AttributeError, TypeError)):
        s.extra = 1  # slots: no new attributes either
    with pytest.raises(TypeError):
        s["num_waiting"] = 5


def test_a_source_reporting_a_renamed_or_missing_key_fails_at_construction():
    base = dataclasses.asdict(make_stats())
    with pytest.raises(TypeError, match="num_wating"):
        EngineStats(**{**base, "num_wating": 1})  # a key renamed on the engine side
    del base["num_waiting"]
    with pytest.raises(TypeError, match="num_waiting"):
        EngineStats(**base)  # a key no longer reported
    with pytest.raises(TypeError, match="simulated-device.*device_idle_s"):
        make_stats(device_busy_s=1.0, device_dep_wait_s=0.0, device_busy_fraction=1.0, device_copy_busy_s=0.0,
                   host_launch_s=0.0, host_blocked_s=0.0, sim_gpu="h100")  # a group only partly reported


def test_dict_view_keeps_the_field_order_and_leaves_out_absent_groups():
    s = make_stats()
    names = [f.name for f in dataclasses.fields(EngineStats)]
    assert s.keys() == [n for n in names if n not in GROUP_OF]
    s = dataclasses.replace(s, pipeline_parallel_size=2, microbatches_in_flight=1)
    assert s.keys()[-2:] == ["pipeline_parallel_size", "microbatches_in_flight"]
    assert s.as_dict()["microbatches_in_flight"] == 1
