"""Pipeline parallelism (engine/pipeline, cluster/pipeline.py): the layers split over 2 and 3 stages give
the same fp32 greedy tokens as Hugging Face and as the single-device engine.

In process (LocalStageGroup) for every family, then over real Ray stage actors and a compiled graph with
shared-memory channels, through the offline `LLM(pipeline_parallel_size=p)`, with each SiPipe technique
switched off in turn, and with a stage actor killed mid-run.
"""

from __future__ import annotations

import time

import pytest

import tiny_models
from engine import LLM, EngineConfig, SamplingParams
from engine.pipeline import LocalStageGroup, PipelineEngine, split_layers
from ray_local import local_ray
from test_correctness_hf import MAX_NEW, assert_matches_hf, make_prompts

LAYERS = 4  # enough for 3 stages


@pytest.fixture
def deep_models(tiny_model_factory):
    """Tiny checkpoints with LAYERS layers (the shared session factory, so HF references are built once)."""
    return lambda family: tiny_model_factory(family, num_hidden_layers=LAYERS)


def run_engine(engine, prompts, params) -> list:
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    engine.check_integrity()
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], "blocks leaked after all requests finished"
    return [done[i] for i in ids]


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)


def test_split_layers_is_contiguous_and_balanced():
    assert split_layers(4, 2) == [(0, 2), (2, 4)]
    assert split_layers(4, 3) == [(0, 2), (2, 3), (3, 4)]
    assert split_layers(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert split_layers(4, 1) == [(0, 4)]
    with pytest.raises(ValueError, match="pipeline_parallel_size must be in \\[1, 4\\]"):
        split_layers(4, 5)


def test_offload_with_pipeline_parallelism_is_rejected(deep_models):
    path, _ = deep_models("llama")
    with pytest.raises(ValueError, match="not supported with pipeline_parallel_size > 1"):
        EngineConfig(model=str(path), pipeline_parallel_size=2, num_cpu_blocks=8)


@pytest.mark.parametrize("family", list(tiny_models.FAMILIES))
@pytest.mark.parametrize("stages", [2, 3])
def test_local_stages_match_hf_and_single_engine(deep_models, family, stages):
    """Mixed lengths, block_size 4 and a 16-token budget (chunked prefill), tied and untied heads."""
    path, hf = deep_models(family)
    prompts = make_prompts(seed=1)
    single = [o.token_ids for o in LLM(str(path), block_size=4, max_num_batched_tokens=16).generate(prompts, GREEDY)]
    cfg = EngineConfig(model=str(path), block_size=4, max_num_batched_tokens=16, pipeline_parallel_size=stages)
    engine = PipelineEngine(cfg, LocalStageGroup)
    outs = run_engine(engine, prompts, GREEDY)
    for prompt, out, ref in zip(prompts, outs, single):
        assert out.token_ids == ref
        assert_matches_hf(hf, prompt, out.token_ids)
    # Microbatches: every sequence rode in exactly one step at a time, so the steps outnumber a
    # one-big-batch run's (the pipeline splits the running set between in-flight steps).
    assert engine.stats()["steps"] > MAX_NEW


def test_local_stages_under_kv_pressure_soft_reset_and_match_hf(deep_models):
    """Too few KV blocks: running sequences are preempted (soft reset; a victim still in flight gives its
    blocks back when its step commits) and every output still equals HF's."""
    path, hf = deep_models("llama")
    prompts = make_prompts(seed=7, lengths=(6,) * 8)
    cfg = EngineConfig(model=str(path), block_size=4, num_kv_blocks=14, admission_margin=0.0,
                       pipeline_parallel_size=2)
    engine = PipelineEngine(cfg, LocalStageGroup)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = run_engine(engine, prompts, params)
    for prompt, out in zip(prompts, outs):
        assert len(out.token_ids) == 24
        assert_matches_hf(hf, prompt, out.token_ids, n=24)
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["num_soft_resets"] > 0, stats


@pytest.mark.parametrize("cpu_sampling", [True, False], ids=["driver-samples", "last-stage-samples"])
def test_local_stages_structured_output_matches_single_engine(deep_models, cpu_sampling):
    """Grammar masks are built on the driver after the sequence's previous commit and applied where the step is
    sampled (the driver, or the last stage), with the tokens of the single engine."""
    import re

    from engine.sampling_params import StructuredOutputsParams

    path, _ = deep_models("qwen3")
    regex = r"\d{3}-\d{4}"
    params = [SamplingParams(max_tokens=20, temperature=0.8, seed=s,
                             structured_outputs=StructuredOutputsParams(regex=regex)) for s in range(3)]
    params.append(SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))  # unconstrained, same batch
    prompts = make_prompts(seed=8, lengths=(4, 7, 11, 5))
    single = LLM(str(path), block_size=4).generate(prompts, params)
    engine = PipelineEngine(EngineConfig(model=str(path), block_size=4, pipeline_parallel_size=2,
                                         pp_cpu_sampling=cpu_sampling), LocalStageGroup)
    outs = run_engine(engine, prompts, params)
    for out, ref in zip(outs, single):
        assert out.token_ids == ref.token_ids
    for out in outs[:3]:
        assert re.fullmatch(regex, out.text), out.text


@pytest.mark.parametrize("cpu_sampling", [True, False], ids=["driver-samples", "last-stage-samples"])
def test_local_stages_prefix_cache_and_seeded_sampling_match_single_engine(deep_models, cpu_sampling):
    """Every sampling feature gives the single engine's tokens and logprobs whether the driver samples or the last
    stage does (seeded draws are made on the driver, from each request's own generator, and travel with the
    step's parameters)."""
    path, _ = deep_models("qwen3")
    shared = make_prompts(seed=2, lengths=(23,))[0]
    prompts = [shared + tail for tail in make_prompts(seed=3, lengths=(1, 5, 9, 14))]
    extras = [{"repetition_penalty": 1.1}, {"presence_penalty": 0.5, "frequency_penalty": 0.3},
              {"min_tokens": 8, "logit_bias": {7: 3.0, 11: -2.0}}, {"temperature": 0.0, "seed": None}]
    params = [SamplingParams(**{"max_tokens": 12, "temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": s,
                                "logprobs": 2, **extra}) for s, extra in enumerate(extras)]
    single = LLM(str(path), block_size=4).generate(prompts, params)
    engine = PipelineEngine(EngineConfig(model=str(path), block_size=4, pipeline_parallel_size=2,
                                         pp_cpu_sampling=cpu_sampling), LocalStageGroup)
    run_engine(engine, prompts[:1], params[0])  # warms the prefix cache
    outs = run_engine(engine, prompts, params)
    assert engine.stats()["prefix_cache_hit_tokens"] > 0
    for out, ref in zip(outs, single):
        assert out.token_ids == ref.token_ids
        assert [lp.token_id for lp in out.logprobs] == out.token_ids
        for a, b in zip(out.logprobs, ref.logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top] and len(a.top) == 2  # same top ids, in order


# ---- Ray stage actors over a compiled graph ----------------------------------------------------------------

@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray(8, "tandem-pp-test") as ray:
        yield ray


RAY_OPTS = dict(block_size=4, max_num_batched_tokens=16, pp_stage_num_cpus=1.0)


@pytest.mark.parametrize("stages", [2, 3])
def test_ray_stages_match_hf_through_offline_llm(ray_cluster, deep_models, stages):
    path, hf = deep_models("llama")
    prompts = make_prompts(seed=4)
    llm = LLM(str(path), pipeline_parallel_size=stages, **RAY_OPTS)
    try:
        assert "over Ray" in llm.stats()["attention_backend"]
        outs = llm.generate(prompts, GREEDY)
        llm.check_integrity()
        for prompt, out in zip(prompts, outs):
            assert_matches_hf(hf, prompt, out.token_ids)
        busy = llm.engine.runner.stages.busy_seconds()
        assert len(busy) == stages and all(b > 0 for b in busy)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("switch", ["pp_cpu_sampling", "pp_token_safe", "pp_structure_aware"])
def test_each_sipipe_technique_off_gives_the_same_tokens(ray_cluster, deep_models, switch):
    path, hf = deep_models("qwen2")  # tied embeddings: the last stage holds the embedding as its head
    prompts = make_prompts(seed=5, lengths=(3, 17, 40))
    llm = LLM(str(path), pipeline_parallel_size=2, **{switch: False}, **RAY_OPTS)
    try:
        for prompt, out in zip(prompts, llm.generate(prompts, GREEDY)):
            assert_matches_hf(hf, prompt, out.token_ids)
        if switch == "pp_cpu_sampling":  # the step's sampling parameters travel to the last stage actor
            seeded = SamplingParams(max_tokens=8, temperature=0.8, seed=3, logprobs=1, repetition_penalty=1.2)
            ref = LLM(str(path), block_size=4).generate(prompts[:1], seeded)[0]
            out = llm.generate(prompts[:1], seeded)[0]
            assert out.token_ids == ref.token_ids
            assert [lp.token_id for lp in out.logprobs] == out.token_ids
    finally:
        llm.shutdown()


def test_killed_stage_fails_inflight_requests_and_marks_the_engine_unhealthy(ray_cluster, deep_models):
    ray = ray_cluster
    path, _ = deep_models("mistral")
    llm = LLM(str(path), pipeline_parallel_size=2, **RAY_OPTS)
    engine = llm.engine
    try:
        ids = [engine.add_request(p, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
               for p in make_prompts(seed=6, lengths=(5, 9, 13))]
        for _ in range(6):
            engine.step()
        ray.kill(engine.runner.stages.actors[1])
        finished, deadline = {}, time.monotonic() + 30
        while engine.has_unfinished() and time.monotonic() < deadline:
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        assert set(finished) == set(ids), "every in-flight request must end, none may hang"
        assert all(o.finish_reason == "abort" and o.error for o in finished.values())
        assert engine.health_error() is not None
        engine.check_integrity()  # their blocks were freed
        late = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))[0]  # fails at once, never hangs
        assert late.finish_reason == "abort" and late.error
    finally:
        llm.shutdown()
