"""Multi-LoRA in the engine: fp32 greedy under PEFT adapters equals Hugging Face + PEFT token for token.

Adapters are random PEFT LoRAs built here (init_lora_weights=False, so B is non-zero) on the tiny random
checkpoints, of different ranks, targets and scales, saved with save_pretrained. The oracle is PEFT's own
model (PeftModel over a copy of the HF checkpoint) generating greedily: never values from the engine.
"""

from __future__ import annotations

import copy
import json
import shutil
import time

import pytest
import torch
from peft import LoraConfig, get_peft_model

from engine import LLM, SamplingParams
from engine.lora import LoRARequest
from engine.attention import triton_paged
from engine.lora.layers import LoRALinear
from test_correctness_hf import MAX_NEW, assert_matches_hf, hf_greedy, make_prompts

# name -> LoraConfig kwargs: rank 8 on attention with alpha != r, rank 64 on everything, rsLoRA on the MLP only
ADAPTERS = {
    "attn8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "all64": dict(r=64, lora_alpha=64, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                       "up_proj", "down_proj"]),
    "mlp16": dict(r=16, lora_alpha=8, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"]),
}


def build_adapter(hf_model, out_dir, seed: int, **lora_kwargs):
    """Save a random PEFT LoRA for `hf_model` under out_dir; return the PEFT model (the oracle)."""
    torch.manual_seed(seed)
    config = LoraConfig(init_lora_weights=False, lora_dropout=0.0, **lora_kwargs)
    peft_model = get_peft_model(copy.deepcopy(hf_model), config).eval()
    with torch.no_grad():  # PEFT's default init of B is small: scale it up so every adapter changes the output
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    peft_model.save_pretrained(str(out_dir))
    return peft_model


@pytest.fixture(scope="module")
def adapters(tiny_model_factory, tmp_path_factory):
    """family -> (checkpoint dir, HF model, {name: (adapter dir, PEFT model)}), built once per module."""
    root, cache = tmp_path_factory.mktemp("loras"), {}

    def get(family: str):
        if family not in cache:
            path, hf = tiny_model_factory(family)
            built = {name: (root / family / name, build_adapter(hf, root / family / name, seed=i + 1, **kw))
                     for i, (name, kw) in enumerate(ADAPTERS.items())}
            cache[family] = (path, hf, built)
        return cache[family]

    return get


def lora_llm(path, built, **kw) -> LLM:
    return LLM(str(path), lora_modules={n: str(d) for n, (d, _) in built.items()}, max_lora_rank=64,
               block_size=4, max_num_batched_tokens=16, **kw)


def greedy(llm: LLM, prompts, loras) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True),
                        lora_request=loras)
    llm.check_integrity()
    return [o.token_ids for o in outs]


def oracle(hf, built, lora: str | None):
    return hf if lora is None else built[lora][1]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_mixed_adapter_batch_matches_peft(adapters, family, depth):
    """One batch: the base model and three adapters, chunked prefills interleaved with decodes."""
    path, hf, built = adapters(family)
    llm = lora_llm(path, built, pipeline_depth=depth, max_loras=3)
    prompts = make_prompts(seed=3, lengths=(3, 9, 17, 33, 40, 70, 12, 25))
    loras = [None, "attn8", "all64", "mlp16", "mlp16", "attn8", None, "all64"]
    outs = greedy(llm, prompts, loras)
    for prompt, lora, ours in zip(prompts, loras, outs):
        assert_matches_hf(oracle(hf, built, lora), prompt, ours)
    for name in ADAPTERS:  # every adapter really changes the output (else the comparison proves little)
        assert hf_greedy(built[name][1], prompts[0])[0] != hf_greedy(hf, prompts[0])[0], name
    stats = llm.stats()
    assert stats["lora_loads"] == 3 and stats["lora_evictions"] == 0
    assert sorted(stats["lora_resident"]) == sorted(ADAPTERS)


def test_one_slot_two_adapters_in_flight(adapters):
    """max_loras=1: requests for two adapters (and the base model) queue for the one slot, run in turns, and
    all match PEFT; the slot is reloaded (LRU eviction of the idle adapter)."""
    path, hf, built = adapters("llama")
    llm = lora_llm(path, built, max_loras=1)
    prompts = make_prompts(seed=4, lengths=(6, 14, 9, 21, 5))
    loras = ["attn8", "all64", None, "attn8", "all64"]
    for prompt, lora, ours in zip(prompts, loras, greedy(llm, prompts, loras)):
        assert_matches_hf(oracle(hf, built, lora), prompt, ours)
    stats = llm.stats()
    assert stats["lora_evictions"] >= 1 and stats["lora_loads"] >= 2
    assert len(stats["lora_resident"]) == 1


def test_lora_request_objects_and_names_are_the_same_adapter(adapters):
    path, hf, built = adapters("qwen2")
    llm = lora_llm(path, built, max_loras=2)
    prompt = make_prompts(seed=5, lengths=(11,))
    by_name = greedy(llm, prompt, "mlp16")
    by_request = greedy(llm, prompt, LoRARequest("mlp16", str(built["mlp16"][0])))
    assert by_name == by_request
    assert_matches_hf(built["mlp16"][1], prompt[0], by_name[0])


def test_prefix_cache_never_crosses_adapters(adapters):
    """Same prompt under two adapters: no prefix-cache hit across them; a repeat under the same one hits."""
    path, hf, built = adapters("llama")
    llm = lora_llm(path, built, max_loras=2)
    prompt = make_prompts(seed=6, lengths=(40,))
    runs = []
    for lora in ("attn8", "all64", None):
        runs.append(greedy(llm, prompt, lora)[0])
        assert llm.stats()["prefix_cache_hit_tokens"] == 0, lora
    assert_matches_hf(built["all64"][1], prompt[0], runs[1])
    assert greedy(llm, prompt, "all64")[0] == runs[1]
    hits = llm.stats()["prefix_cache_hit_tokens"]
    assert hits >= 36  # all full blocks but the last token's
    assert greedy(llm, prompt, None)[0] == runs[2]
    assert llm.stats()["prefix_cache_hit_tokens"] >= 2 * hits  # the base model's blocks are cached too


# ---- bad adapters and bad requests ------------------------------------------------------------------------------
def _broken(src, dst, **config_changes):
    shutil.copytree(src, dst)
    cfg_path = dst / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(config_changes)
    cfg_path.write_text(json.dumps(cfg))
    return dst


def test_bad_adapters_fail_their_request_with_a_clear_error(adapters, tmp_path, tiny_model_factory):
    path, hf, built = adapters("llama")
    src = built["attn8"][0]
    head = build_adapter(hf, tmp_path / "head", seed=9, r=4, lora_alpha=4, target_modules=["lm_head"])
    cases = {
        "missing": (tmp_path / "nowhere", "is not a directory"),
        "dora": (_broken(src, tmp_path / "dora", use_dora=True), "DoRA"),
        "saves": (_broken(src, tmp_path / "saves", modules_to_save=["lm_head"]), "modules_to_save"),
        "bias": (_broken(src, tmp_path / "bias", bias="all"), "bias='all'"),
        "norank": (_broken(src, tmp_path / "norank", r=0), "r must be a positive integer"),
        "head": (head and tmp_path / "head", "lm_head"),
    }
    wide = build_adapter(hf, tmp_path / "wide", seed=10, r=32, lora_alpha=32, target_modules=["q_proj"])
    assert wide is not None
    cases["wide"] = (tmp_path / "wide", "rank 32 exceeds max_lora_rank=16")
    llm = LLM(str(path), lora_modules={n: str(d) for n, (d, _) in cases.items()}, max_lora_rank=16)
    params = SamplingParams(max_tokens=2, temperature=0)
    for name, (_, message) in cases.items():
        with pytest.raises(ValueError, match=f"LoRA adapter '{name}'.*") as err:
            llm.generate([[5, 6, 7]], params, lora_request=name)
        assert message in str(err.value), (name, str(err.value))
    with pytest.raises(ValueError, match="'nope' is not known"):
        llm.generate([[5, 6, 7]], params, lora_request="nope")
    assert not llm.engine.has_unfinished()
    llm.check_integrity()


def test_config_and_disabled_engine(tiny_model_factory, tmp_path):
    path, _ = tiny_model_factory("llama")
    with pytest.raises(ValueError, match="max_lora_rank must be <= 64"):
        LLM(str(path), enable_lora=True, max_lora_rank=128)
    with pytest.raises(ValueError, match="max_loras must be a positive integer"):
        LLM(str(path), enable_lora=True, max_loras=0)
    with pytest.raises(ValueError, match="lora_dir must be a directory"):
        LLM(str(path), lora_dir=str(tmp_path / "none"))
    with pytest.raises(ValueError, match="not supported with pipeline_parallel_size > 1"):
        LLM(str(path), enable_lora=True, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="not supported on device='sim'"):
        LLM(str(path), enable_lora=True, device="sim")
    llm = LLM(str(path))  # LoRA off: nothing of it in the model, the step buffers or the stats
    assert llm.engine.runner.lora is None and llm.engine.lora_slots is None
    assert "lora_slots" not in llm.engine.runner.slots[0].inputs.np
    assert not any(isinstance(m, LoRALinear) for m in llm.engine.runner.model.modules())
    assert "lora_loads" not in llm.stats()
    with pytest.raises(ValueError, match="no LoRA adapters"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), lora_request="attn8")


def test_lora_dir_finds_adapters_by_subdirectory(adapters, tmp_path):
    path, hf, built = adapters("llama")
    shutil.copytree(built["attn8"][0], tmp_path / "mine")
    llm = LLM(str(path), lora_dir=str(tmp_path), max_lora_rank=8)
    prompt = make_prompts(seed=7, lengths=(13,))
    assert_matches_hf(built["attn8"][1], prompt[0], greedy(llm, prompt, "mine")[0])
    for bad in ("../mine", "other", "."):
        with pytest.raises(ValueError, match="is not known"):
            llm.generate(prompt, SamplingParams(max_tokens=2), lora_request=bad)


@pytest.mark.parametrize("cpu_blocks", [64, 0], ids=["offload", "soft_reset"])
def test_preemption_under_adapters_matches_peft(adapters, cpu_blocks):
    """KV pressure with two adapter slots for three adapters: preempted sequences give up their slot and get
    one back (maybe another) when they resume; outputs are unchanged. The shared prefix under two adapters
    must not be shared in the device cache or the host pool."""
    path, hf, built = adapters("llama")
    llm = lora_llm(path, built, max_loras=2, num_kv_blocks=16, num_cpu_blocks=cpu_blocks, admission_margin=0.0)
    shared = make_prompts(seed=11, lengths=(12,))[0]
    prompts = make_prompts(seed=12, lengths=(9, 14, 11)) + [shared + t for t in make_prompts(13, (2, 5, 3))]
    loras = ["attn8", "all64", None, "mlp16", "attn8", "mlp16"]
    for prompt, lora, ours in zip(prompts, loras, greedy(llm, prompts, loras)):
        assert_matches_hf(oracle(hf, built, lora), prompt, ours)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert (stats["num_offloads"] > 0) == bool(cpu_blocks)


@pytest.mark.skipif(not triton_paged.usable_on(torch.device("cpu")), reason="triton (interpreter) not available")
def test_decode_graph_replay_reads_the_token_slots(adapters):
    """Decode steps replayed as (emulated) graphs take each row's adapter from the step buffers."""
    path, hf, built = adapters("llama")
    llm = lora_llm(path, built, max_loras=3, attention_backend="triton", max_num_seqs=8, num_kv_blocks=96)
    llm.engine.runner.capture_graphs(max_batch_size=4, emulate=True)
    prompts = make_prompts(seed=14, lengths=(4, 10, 7))
    loras = ["all64", None, "attn8"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), lora_request=loras)
    for prompt, lora, out in zip(prompts, loras, outs):
        assert_matches_hf(oracle(hf, built, lora), prompt, out.token_ids, 6)
    assert llm.stats()["graph_steps"] > 0


# ---- the slot LRU on its own (pure Python: exact slots and eviction order) ----------------------------------
def _seq(adapter):
    from engine.sequence import Sequence

    seq = Sequence(f"r{id(adapter)}", None, [1, 2], SamplingParams(), frozenset(), 64, 512)
    seq.lora = adapter
    return seq


def test_adapter_slots_lru_never_evicts_a_held_adapter():
    from types import SimpleNamespace

    from engine.lora.slots import AdapterSlots

    a, b, c = (SimpleNamespace(key=k, name=n) for k, n in ((11, "a"), (22, "b"), (33, "c")))
    slots = AdapterSlots(2)
    sa, sb, sc, sa2 = _seq(a), _seq(b), _seq(c), _seq(a)
    assert slots.acquire(sa) and slots.acquire(sb) and (sa.lora_slot, sb.lora_slot) == (1, 2)
    assert [(op.slot, op.adapter.name) for op in slots.take_loads()] == [(1, "a"), (2, "b")]
    assert not slots.acquire(sc) and sc.lora_slot == 0  # both held: c waits
    assert slots.acquire(sa2) and sa2.lora_slot == 1 and not slots.take_loads()  # resident: no load
    slots.release(sb)
    slots.release(sa)
    slots.release(sa2)
    slots.release(sa2)  # idempotent
    assert list(slots.idle) == [2, 1]  # b went idle first: least recently used
    assert slots.acquire(sc) and sc.lora_slot == 2 and slots.num_evictions == 1
    assert [(op.slot, op.adapter.name) for op in slots.take_loads()] == [(2, "c")]
    assert sorted(slots.resident()) == ["a", "c"]
    slots.check_integrity([sc])
    with pytest.raises(AssertionError):
        slots.check_integrity([])


def test_adapters_in_the_engine_core_process_match_peft(adapters):
    """The core in a process of its own builds a request under an adapter off its loop (the adapter's first use
    reads it from disk) and queues it when loaded: the tokens are PEFT's; a request aborted while its adapter
    loads is never queued; an unknown adapter is refused."""
    import asyncio

    from engine.async_engine import AsyncLLM
    from engine.config import EngineConfig

    path, hf, built = adapters("llama")
    prompts = make_prompts(seed=11, lengths=(5, 9, 13))
    loras = ["attn8", None, "mlp16"]
    llm = AsyncLLM(EngineConfig(model=str(path), lora_modules={n: str(d) for n, (d, _) in built.items()},
                                max_lora_rank=64, block_size=4, max_num_batched_tokens=16), core_process=True)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)

    async def run(prompt, lora, params=params):
        final = None
        async for out in llm.generate(prompt, params, lora_request=lora):
            final = out
        return final.token_ids

    async def abandon(prompt, lora):  # long enough to still run at the end, had it been queued after all
        task = asyncio.create_task(run(prompt, lora, SamplingParams(max_tokens=1500, ignore_eos=True)))
        await asyncio.sleep(0)  # submitted, its adapter still loading
        task.cancel()

    async def main():
        await abandon(prompts[0], "all64")
        return await asyncio.gather(*(run(p, lora) for p, lora in zip(prompts, loras)))

    try:
        for prompt, lora, ids in zip(prompts, loras, asyncio.run(main())):
            assert_matches_hf(oracle(hf, built, lora), prompt, ids)
        with pytest.raises(ValueError, match="nope"):
            asyncio.run(run(prompts[0], "nope"))
        deadline = time.monotonic() + 1.0  # the core's stats reach the frontend every 50 ms
        while time.monotonic() < deadline and llm.stats().num_running:
            time.sleep(0.05)
        s = llm.stats()
        assert (s.num_running, s.num_waiting, s.kv_blocks_free) == (0, 0, s.kv_blocks_total)
    finally:
        llm.shutdown()


def test_speculative_decoding_under_adapters_matches_peft(adapters):
    """n-gram drafts verified under each request's adapter, in a batch mixing two adapters and the base model
    (prompts repeating their first tokens, so drafts are proposed; these random models rarely continue the pattern,
    so most are rejected, which verifies them on every row all the same): the tokens equal PEFT's greedy ones and
    those of the same engine without speculation."""
    path, hf, built = adapters("llama")
    prompts = [(p * 5)[:36] for p in make_prompts(seed=12, lengths=(5, 6, 7))]
    loras = ["attn8", "all64", None]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    runs = {}
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3}):
        llm = lora_llm(path, built, enable_lora=True, max_loras=2, speculative_config=spec)
        runs[spec is not None] = [o.token_ids for o in llm.generate(prompts, params, lora_request=loras)]
        llm.check_integrity()
    assert runs[True] == runs[False]
    for prompt, lora, ours in zip(prompts, loras, runs[True]):
        assert_matches_hf(oracle(hf, built, lora), prompt, ours[:MAX_NEW])
    assert llm.stats().spec_draft_tokens >= 3
