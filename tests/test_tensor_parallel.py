"""Tensor parallelism (engine/models/tp.py, engine/tp, cluster/tensor_parallel.py): TP=2 over gloo gives Hugging
Face's fp32 greedy tokens, token for token.

- Sharding, checked against the checkpoint itself: the ranks' slices put back together are the whole tensors
  (q/k/v and gate/up rows, o/down columns, fused Phi-3 tensors, replicated KV heads, a padded vocabulary).
- In process (ranks as threads, each with its own gloo endpoint, model shard and KV shard) for the families
  whose sharding differs: split and replicated KV heads, q/k/v and o biases, tied and untied heads, q/k norms,
  Gemma's soft-caps and sandwich norms, Phi-3's fused checkpoint tensors; and a mutation (the row-parallel
  all-reduce skipped) that must break the equality, so the comparison can fail.
  Also: the memory profile run in lock step, the blocking loop, an idle group outliving the step timeout, a
  worker that fails to start, refused combinations, and the Serve app's placement bundles.
- Over real processes (Ray actors), through the offline LLM: chunked prefill, KV pressure (preemption and
  recompute), prefix-cache hits, n > 1 forks (copy-on-write blocks broadcast to the workers); a killed worker
  ends every request with an error and marks the engine unhealthy, never hangs.
- TP x PP: two pipeline stages, each sharded over its own TP=2 group, in process and over Ray (a killed stage
  rank fails the requests).
The Serve path is tests/test_tensor_parallel_serve.py.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.models.decoder import ModelSpec
from engine.models.tp import RowParallelLinear, TPShard, check_shardable, local_spec, read_shard
from engine.pipeline import LocalStageGroup, PipelineEngine
from engine.tp import TensorParallelEngine
from engine.tp.local import LocalTPWorkerGroup
from ray_local import local_ray
from test_correctness_hf import MAX_NEW, assert_matches_hf, make_prompts
from test_pipeline_parallel import GREEDY, run_engine

OPTS = dict(device="cpu", block_size=4, max_num_batched_tokens=16, max_num_seqs=8, tensor_parallel_size=2)


def finish_failed(engine, ids: list[str], timeout_s: float = 30) -> None:
    """Step a broken engine until every request in `ids` has ended: each with an error, none hanging."""
    finished, deadline = {}, time.monotonic() + timeout_s
    while engine.has_unfinished() and time.monotonic() < deadline:
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == set(ids), "every in-flight request must end, none may hang"
    assert all(o.finish_reason == "abort" and o.error for o in finished.values())


def local_engine(path, **kw) -> TensorParallelEngine:
    return TensorParallelEngine(EngineConfig(model=str(path), **{**OPTS, "num_kv_blocks": 96, **kw}),
                                LocalTPWorkerGroup)


# ---- sharding against the checkpoint -----------------------------------------------------------------------
class _Slices:
    """safe_open's get_slice over in-memory tensors (a tensor slices the same way)."""

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def get_slice(self, name):
        return self.tensors[name]


def _spec(**kw):
    base = dict(family="llama", vocab_size=10, hidden_size=6, intermediate_size=8, num_layers=1, num_heads=4,
                num_kv_heads=2, head_dim=3, rms_norm_eps=1e-6, qkv_bias=True, o_bias=True, mlp_bias=False,
                qk_norm=False, tie_word_embeddings=False, sliding_window=None, max_position_embeddings=64,
                hidden_act="silu")
    return ModelSpec(**{**base, **kw})


@pytest.mark.parametrize("size,kv_heads,vocab", [(2, 2, 10), (2, 1, 9), (4, 2, 10)])
def test_rank_slices_reassemble_every_checkpoint_tensor(size, kv_heads, vocab):
    spec = _spec(num_kv_heads=kv_heads, vocab_size=vocab)
    h, kv, d, inter = spec.num_heads * 3, kv_heads * 3, 3, spec.intermediate_size
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(*s, generator=g) for n, s in {
        "q": (h, 6), "k": (kv, 6), "v": (kv, 6), "qkv": (h + 2 * kv, 6), "o": (6, h), "o_bias": (6,),
        "gate_up": (2 * inter, 6), "down": (6, inter), "embed": (vocab, 6)}.items()}
    f = _Slices(full)
    ranks = [TPShard(r, size, spec, None) for r in range(size)]
    local = local_spec(spec, size)

    def read(name, pname, shard=0):
        return [read_shard(f, name, pname, shard, tp) for tp in ranks]

    assert torch.equal(torch.cat(read("q", "layers.0.self_attn.qkv_proj.weight", 0)), full["q"])
    k_parts = read("k", "layers.0.self_attn.qkv_proj.weight", 1)
    assert all(p.shape[0] == local.num_kv_heads * d for p in k_parts)
    for r, part in enumerate(k_parts):  # rank r's query heads read KV head (q head // group size)
        first_q_head = r * spec.num_heads // size
        kv_head = first_q_head // (spec.num_heads // kv_heads)
        assert torch.equal(part[:d], full["k"][kv_head * d:(kv_head + 1) * d])
    if kv_heads >= size:
        assert torch.equal(torch.cat(k_parts), full["k"])
    assert torch.equal(torch.cat(read("o", "layers.0.self_attn.o_proj.weight"), dim=1), full["o"])
    assert all(torch.equal(b, full["o_bias"]) for b in read("o_bias", "layers.0.self_attn.o_proj.bias"))
    assert torch.equal(torch.cat(read("down", "layers.0.mlp.down_proj.weight"), dim=1), full["down"])
    # Phi-3's fused tensors: each rank's q, k and v (gate and up) sections, fused again locally.
    fused = read("qkv", "layers.0.self_attn.qkv_proj.weight", -1)
    ql, kvl = local.num_heads * d, local.num_kv_heads * d
    assert torch.equal(torch.cat([p[:ql] for p in fused]), full["qkv"][:h])
    assert all(p.shape[0] == ql + 2 * kvl for p in fused)
    gate_up = read("gate_up", "layers.0.mlp.gate_up_proj.weight", -1)
    il = inter // size
    assert torch.equal(torch.cat([p[:il] for p in gate_up]), full["gate_up"][:inter])
    assert torch.equal(torch.cat([p[il:] for p in gate_up]), full["gate_up"][inter:])
    # Vocabulary shards: equal sizes, zero rows past the real vocabulary.
    emb = read("embed", "embed_tokens.weight")
    assert {p.shape[0] for p in emb} == {local.vocab_size}
    assert torch.equal(torch.cat(emb)[:vocab], full["embed"])
    assert not torch.cat(emb)[vocab:].any()


def test_unshardable_models_and_unsupported_combinations_are_rejected(tiny_model_factory):
    spec = _spec()
    with pytest.raises(ValueError, match="does not divide the model's num_attention_heads 4"):
        check_shardable(spec, 3)
    with pytest.raises(ValueError, match="num_key_value_heads 3 .nor does 4 divide"):
        check_shardable(dataclasses.replace(spec, num_heads=8, num_kv_heads=3, intermediate_size=8), 4)
    path, _ = tiny_model_factory("llama")
    for kw, why in ((dict(num_cpu_blocks=8), "KV offload"), (dict(enable_lora=True), "LoRA")):
        with pytest.raises(ValueError, match=f"tensor_parallel_size=2 is not supported with .*{why}"):
            EngineConfig(model=str(path), tensor_parallel_size=2, **kw)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(model=str(path), tensor_parallel_size=0)
    with pytest.raises(ValueError, match="does not divide the model's num_attention_heads 4"):
        local_engine(path, tensor_parallel_size=3)
    moe_path, _ = tiny_model_factory("qwen2_moe")
    with pytest.raises(ValueError, match="mixture-of-experts models .qwen2_moe. are not sharded yet"):
        local_engine(moe_path, tensor_parallel_size=2)


@pytest.mark.parametrize("pp,tp,bundles,strategy", [(1, 2, 2, "STRICT_PACK"), (1, 4, 4, "STRICT_PACK"),
                                                     (2, 2, 3, "SPREAD")])
def test_the_app_reserves_a_bundle_per_rank_or_per_stage_group(pp, tp, bundles, strategy):
    """The replica (bundle 0), then one bundle per TP worker rank (STRICT_PACK: the group talks over
    loopback), or with PP one bundle per stage sized for its TP group (one node per stage group), placed by
    pp_placement_strategy."""
    from serve_app import build_app

    app = build_app({"device": "cpu", "tensor_parallel_size": tp, "pipeline_parallel_size": pp,
                     "pp_placement_strategy": "SPREAD", "pp_stage_num_cpus": 0.5})
    replica = app._bound_deployment.init_args[0]._bound_deployment._replica_config
    assert len(replica.placement_group_bundles) == bundles
    assert replica.placement_group_strategy == strategy
    if pp > 1:
        assert replica.placement_group_bundles[1:] == [{"CPU": tp * 0.5}] * pp
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the model's num_attention_heads 8"):
        build_app({"device": "cpu", "tensor_parallel_size": 3})


# ---- ranks in process ---------------------------------------------------------------------------------------
# llama: KV heads split (2 over 2 ranks); llama_mqa_rope_scaled: one KV head replicated, q/k/v and o biases;
# qwen2: qkv bias, tied head; qwen3: q/k norms; gemma2/gemma3_text: soft-caps, sandwich norms, scaled and
# tied embeddings; phi3: fused qkv / gate_up checkpoint tensors, partial rotary.
# qwen3's engine sizes its KV cache by the memory profile, whose dummy steps the ranks run in lock step;
# gemma2's runs the blocking loop (pipeline_depth=1), the others the two-slot pipeline.
FAMILIES = ["llama", "llama_mqa_rope_scaled", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3"]
ENGINE_KW = {"qwen3": dict(num_kv_blocks=None, cpu_kv_cache_bytes=64 * 2**20), "gemma2": dict(pipeline_depth=1)}


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_in_process_matches_hf(tiny_model_factory, family):
    path, hf = tiny_model_factory(family)
    prompts = make_prompts(seed=21, lengths=(5, 19, 40))
    engine = local_engine(path, **ENGINE_KW.get(family, {}))
    try:
        assert engine.stats()["tensor_parallel_size"] == 2
        if family == "qwen3":
            assert engine.runner.memory is not None and engine.stats()["kv_blocks_total"] > 24
        for prompt, out in zip(prompts, run_engine(engine, prompts, GREEDY)):
            assert_matches_hf(hf, prompt, out.token_ids)
        assert engine.stats()["tp_collectives"] > 0
    finally:
        engine.shutdown()


def test_a_worker_that_fails_to_start_fails_the_engine_at_once(tiny_model_factory, monkeypatch):
    import engine.tp.local as local

    class Broken:
        def __init__(self, spec):
            raise ValueError("worker rank cannot load its shard")

    monkeypatch.setattr(local, "TPWorker", Broken)
    path, _ = tiny_model_factory("llama")
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="cannot load its shard"):
        local_engine(path)
    assert time.monotonic() - t0 < 10, "the rendezvous must not wait for its timeout"


def test_prompt_logprobs_are_refused_by_name(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    engine = local_engine(path)
    try:
        with pytest.raises(ValueError, match="prompt_logprobs is not supported by this engine .TPModelRunner"):
            engine.add_request([5, 6, 7], SamplingParams(max_tokens=2, prompt_logprobs=1))
    finally:
        engine.shutdown()


def test_an_idle_group_outlives_the_step_timeout(tiny_model_factory):
    """Workers wait for rank 0's next step without a limit (a gloo timeout would close the group for good);
    only a step's own collectives have the step timeout."""
    path, hf = tiny_model_factory("llama")
    prompts = make_prompts(seed=22, lengths=(6,))
    engine = local_engine(path, stall_timeout_s=0.5)
    try:
        assert_matches_hf(hf, prompts[0], run_engine(engine, prompts, GREEDY)[0].token_ids)
        time.sleep(1.5)
        assert engine.health_error() is None
        assert_matches_hf(hf, prompts[0], run_engine(engine, prompts, GREEDY)[0].token_ids)
    finally:
        engine.shutdown()


def test_skipping_the_row_parallel_all_reduce_breaks_equality(tiny_model_factory, monkeypatch):
    """The mutation the HF comparison must catch: each rank keeps only its partial o/down products."""
    path, hf = tiny_model_factory("llama")
    monkeypatch.setattr(RowParallelLinear, "forward", lambda self, x: self.linear(x))
    prompts = make_prompts(seed=21, lengths=(5, 19))
    engine = local_engine(path)
    try:
        outs = run_engine(engine, prompts, GREEDY)
    finally:
        engine.shutdown()
    with pytest.raises(AssertionError):
        for prompt, out in zip(prompts, outs):
            assert_matches_hf(hf, prompt, out.token_ids)


# ---- TP x PP: each pipeline stage's layers sharded over its own TP group ------------------------------------
@pytest.mark.parametrize("family", ["llama", "llama_mqa_rope_scaled"])
def test_tp2_x_pp2_in_process_matches_hf(tiny_model_factory, family):
    path, hf = tiny_model_factory(family, num_hidden_layers=4)
    config = EngineConfig(model=str(path), **{**OPTS, "num_kv_blocks": 96}, pipeline_parallel_size=2)
    engine = PipelineEngine(config, LocalStageGroup)
    try:
        assert "x tensor parallel 2" in engine.stats()["attention_backend"]
        prompts = make_prompts(seed=23, lengths=(5, 19, 40))
        for prompt, out in zip(prompts, run_engine(engine, prompts, GREEDY)):
            assert_matches_hf(hf, prompt, out.token_ids)
    finally:
        engine.shutdown()
    steps = [f.result(timeout=10) for f in engine.runner.stages.followers]  # each stage's rank 1 ran every step
    assert len(steps) == 2 and min(steps) > 0


# ---- worker ranks as Ray actors -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray(4, "tandem-tp-test") as ray:
        yield ray


@pytest.mark.parametrize("family", ["llama", "llama_mqa_rope_scaled"])
def test_ray_tp2_matches_hf_under_chunked_prefill_kv_pressure_and_prefix_hits(ray_cluster, tiny_model_factory,
                                                                                family):
    """24 KV blocks of 4 tokens hold 96 tokens: six prompts of up to 70 tokens (prefilled 16 tokens a step)
    preempt each other; then prompts that extend earlier ones hit the prefix cache."""
    path, hf = tiny_model_factory(family)
    llm = LLM(str(path), **OPTS, num_kv_blocks=24, tp_worker_num_cpus=1.0)
    try:
        assert "tensor parallel x2" in llm.stats()["attention_backend"]
        prompts = make_prompts(seed=5)
        for prompt, out in zip(prompts, llm.generate(prompts, GREEDY)):
            assert_matches_hf(hf, prompt, out.token_ids)
        stats = llm.stats()
        assert stats["num_preemptions"] > 0 and stats["num_soft_resets"] > 0
        # the last prompts: under this KV pressure the first ones' blocks are the LRU's first victims, and whether
        # any survive depends on the step order (none did once pipeline_depth resolved to 1 here)
        extended = [p + [7, 8, 9] for p in prompts[-3:]]
        for prompt, out in zip(extended, llm.generate(extended, GREEDY)):
            assert_matches_hf(hf, prompt, out.token_ids)
        assert llm.stats()["prefix_cache_hit_tokens"] > stats["prefix_cache_hit_tokens"]
        llm.check_integrity()
    finally:
        llm.shutdown()


def test_ray_tp2_forks_copy_shared_blocks_on_every_rank(ray_cluster, tiny_model_factory):
    """n = 3 greedy siblings share the prompt's last, partial block and copy it before writing (copy-on-write
    pairs broadcast to the worker): every sibling still equals HF."""
    path, hf = tiny_model_factory("qwen2")
    llm = LLM(str(path), **OPTS, num_kv_blocks=64)
    try:
        prompt = make_prompts(seed=9, lengths=(10,))[0]
        outs = llm.generate([prompt], SamplingParams(n=3, max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
        assert len(outs) == 3 and llm.stats()["num_cow_copies"] > 0
        for out in outs:
            assert_matches_hf(hf, prompt, out.token_ids)
    finally:
        llm.shutdown()


def test_killed_worker_fails_requests_and_marks_the_engine_unhealthy(ray_cluster, tiny_model_factory):
    ray = ray_cluster
    path, _ = tiny_model_factory("llama")
    llm = LLM(str(path), **OPTS, num_kv_blocks=64)
    engine = llm.engine
    try:
        ids = [engine.add_request(p, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
               for p in make_prompts(seed=6, lengths=(5, 9, 13))]
        for _ in range(6):
            engine.step()
        assert engine.health_error() is None
        ray.kill(engine.runner.workers.actors[0])
        finish_failed(engine, ids)
        assert "tensor-parallel" in engine.health_error()
        engine.check_integrity()  # their blocks were freed
        with pytest.raises(RuntimeError, match="unhealthy"):
            engine.add_request([5, 6, 7], SamplingParams(max_tokens=4))
    finally:
        llm.shutdown()


def test_ray_tp2_x_pp2_matches_hf(ray_cluster, tiny_model_factory):
    """Two stage actors in the compiled graph, each the TP rank 0 of its stage, plus one follower actor each."""
    path, hf = tiny_model_factory("llama", num_hidden_layers=4)
    llm = LLM(str(path), **OPTS, num_kv_blocks=64, pipeline_parallel_size=2, pp_stage_num_cpus=1.0)
    try:
        assert "pipeline x2 x tensor parallel 2 over Ray" in llm.stats()["attention_backend"]
        prompts = make_prompts(seed=24, lengths=(7, 30))
        for prompt, out in zip(prompts, llm.generate(prompts, GREEDY)):
            assert_matches_hf(hf, prompt, out.token_ids)
        assert len(llm.engine.runner.stages.followers) == 2 and llm.engine.health_error() is None
    finally:
        llm.shutdown()


def test_ray_tp2_x_pp2_killed_stage_rank_fails_requests_and_marks_the_engine_unhealthy(ray_cluster,
                                                                                          tiny_model_factory):
    ray = ray_cluster
    path, _ = tiny_model_factory("llama", num_hidden_layers=4)
    llm = LLM(str(path), **OPTS, num_kv_blocks=64, pipeline_parallel_size=2, pp_stage_num_cpus=1.0)
    engine = llm.engine
    try:
        ids = [engine.add_request(p, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
               for p in make_prompts(seed=6, lengths=(5, 9))]
        for _ in range(6):
            engine.step()
        ray.kill(engine.runner.stages.followers[1])  # the last stage's TP rank 1
        finish_failed(engine, ids)
        assert engine.health_error() is not None
    finally:
        llm.shutdown()
