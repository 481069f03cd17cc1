"""Speculative decoding with a draft model (engine/spec_draft.py).

Oracles: for the output, the same engine without speculation (itself checked against transformers in
test_correctness_hf.py): greedy output must be identical token for token. For the proposals, transformers running
the draft checkpoint: every draft the engine proposed must be the draft model's own greedy continuation of the
sequence's committed tokens. The verification would hide a proposer that read stale draft KV (after a rejection,
a preemption, a copy-on-write) behind identical output and a lower acceptance; this second oracle does not.
Each test also checks that drafts were proposed, so that it really compares speculative steps.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import tiny_models
from test_spec_decode import async_tokens
from engine import LLM, EngineConfig, SamplingParams

K = 4
ORACLE_CHECKS = 120  # proposals checked against transformers per test (spread over the run)


def _noisy_copy(src, dst, scale: float):
    """The checkpoint at `src` with every matrix perturbed by `scale` of its standard deviation: a draft that
    agrees with the target often but not always (rejections at every draft position)."""
    shutil.copytree(src, dst)
    weights = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    noisy = {k: v + scale * v.std() * torch.randn(v.shape, generator=g) if v.dim() == 2 else v
             for k, v in weights.items()}
    save_file(noisy, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst, AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def drafts(tiny_model_factory, tmp_path_factory):
    """family -> (target dir, {kind: (draft dir, transformers draft model)}): "smaller", a random one-layer model
    of another family (same vocabulary), and "noisy", the target perturbed."""
    root = tmp_path_factory.mktemp("drafts")
    out = {}
    for family in ("llama", "gemma3_text"):
        target, _ = tiny_model_factory(family)
        out[family] = target, {
            "smaller": tiny_models.build("qwen2", root / f"smaller-{family}", seed=1, num_hidden_layers=1),
            "noisy": _noisy_copy(target, root / f"noisy-{family}", 0.02)}
    return out


def _config(draft_dir, k: int = K) -> dict:
    return {"model": str(draft_dir), "num_speculative_tokens": k}


def _record(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """Every (committed tokens, draft) the engine's proposer returns from now on. Each call also checks what the
    proposer is promised: every position the draft writes (up to len(token_ids) + room - 2) lies in a block the
    sequence holds, and its draft KV is valid for fewer positions than it has committed tokens."""
    scheduler, bs = llm.engine.core.scheduler, llm.config.block_size
    propose, seen = scheduler.propose, []

    def recording(seqs, rooms):
        for s, room in zip(seqs, rooms):
            assert 1 <= room <= K and len(s.block_table) * bs >= len(s.token_ids) + room - 1, (s, room)
            assert s.num_draft_computed < len(s.token_ids), s
        proposed = propose(seqs, rooms)
        seen.extend((list(s.token_ids), d) for s, d in zip(seqs, proposed))
        return proposed

    scheduler.propose = recording
    return seen


@torch.inference_mode()
def _check_proposals(seen, hf) -> None:
    """Each draft is the draft model's greedy continuation of its committed tokens: in one transformers forward
    over the tokens and the draft, the argmax after each position up to the last draft's is the next draft."""
    assert seen, "nothing was proposed"
    for ids, draft in seen[::max(1, len(seen) // ORACLE_CHECKS)]:
        logits = hf(torch.tensor([ids + draft[:-1]])).logits[0, len(ids) - 1:]
        assert logits.argmax(-1).tolist() == draft, (len(ids), draft)


def _prompts(seed: int, count: int, longest: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(3, longest))] for _ in range(count)]


# ---- configuration --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, match", [
    ({"method": "draft_model"}, "needs model"),
    ({"model": "/no/such/draft"}, "is not a directory"),
    ({"model": "/some/draft.gguf"}, "is not a directory"),
    ({"method": "ngram", "model": "/some/draft"}, "model is the draft_model method's"),
    ({"model": "DIR", "prompt_lookup_max": 3}, "prompt_lookup_max are the ngram method's"),
    ({"model": "DIR", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer"),
    ({"model": "DIR", "draft_tensor_parallel_size": 1}, "unknown field"),
])
def test_bad_draft_configs_are_refused_by_name(tiny_model_factory, bad, match):
    path, _ = tiny_model_factory("llama")
    bad = {k: str(path) if v == "DIR" else v for k, v in bad.items()}
    with pytest.raises(ValueError, match=match):
        EngineConfig(model=str(path), speculative_config=bad)


def test_unsupported_combinations_are_refused_by_name(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    with pytest.raises(ValueError, match="not supported on the simulated device"):
        EngineConfig(model=str(path), device="sim", speculative_config=_config(path))
    with pytest.raises(ValueError, match="speculative_config is not supported with tensor_parallel_size"):
        EngineConfig(model=str(path), tensor_parallel_size=2, speculative_config=_config(path))
    assert EngineConfig(model=str(path), speculative_config=_config(path)).speculative().method == "draft_model"


def test_a_draft_of_another_vocabulary_or_family_is_refused(tiny_model_factory, tmp_path):
    path, _ = tiny_model_factory("llama")
    small_vocab, _ = tiny_models.build("llama", tmp_path / "vocab", vocab_size=256)
    with pytest.raises(ValueError, match=r"the draft's vocab_size \(256\) differs from the target's \(512\)"):
        LLM(str(path), speculative_config=_config(small_vocab))
    unknown = tmp_path / "family"
    shutil.copytree(path, unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        LLM(str(path), speculative_config=_config(unknown))


# ---- output and proposals -------------------------------------------------------------------------------------
def test_the_target_as_its_own_draft_is_always_accepted(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    prompts = _prompts(1, 6)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    ref = LLM(str(path), block_size=4).generate(prompts, params)
    spec = LLM(str(path), block_size=4, speculative_config=_config(path))
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    s = spec.stats()
    assert s.spec_draft_tokens > 100 and s.spec_accepted_tokens >= 0.98 * s.spec_draft_tokens, \
        (s.spec_draft_tokens, s.spec_accepted_tokens)
    assert s.spec_verify_chunks < 0.4 * sum(len(o.token_ids) for o in outs)  # ~K + 1 tokens a step
    spec.check_integrity()


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@pytest.mark.parametrize("kind", ["smaller", "noisy"])
def test_greedy_output_and_proposals_with_chunked_prefill_and_prefix_hits(drafts, family, kind):
    """A budget of 32 tokens chunks the prompts, and the draft's catch-up too (a sequence's first proposal catches
    up on its whole prompt); Gemma 3's sliding layers put the target's KV in groups (the draft reads group 0)."""
    target, by_kind = drafts[family]
    draft, hf = by_kind[kind]
    kw = dict(block_size=4, max_num_batched_tokens=32)
    prompts = _prompts(2, 10, longest=70)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=2)
    ref = LLM(str(target), **kw).generate(prompts, params)
    spec = LLM(str(target), speculative_config=_config(draft), **kw)
    spec.generate(prompts[:3], params)  # warms the prefix cache: the run below hits it
    seen = _record(spec)
    outs = spec.generate(prompts, params)
    for a, b in zip(ref, outs):
        assert b.token_ids == a.token_ids
        assert [lp.token_id for lp in b.logprobs] == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert y.logprob == pytest.approx(x.logprob, abs=1e-4)
    s = spec.stats()
    assert s.spec_draft_tokens > 0 and s.prefix_cache_hit_tokens > 0
    if kind == "noisy":
        assert 0 < s.spec_accepted_tokens < s.spec_draft_tokens  # accepted and rejected drafts both
    _check_proposals(seen, hf)
    spec.check_integrity()


@pytest.mark.parametrize("cpu_blocks", [0, 64], ids=["soft-reset", "offload"])
def test_greedy_output_and_proposals_under_preemption(drafts, cpu_blocks):
    target, by_kind = drafts["llama"]
    draft, hf = by_kind["noisy"]
    kw = dict(block_size=4, num_kv_blocks=48, num_cpu_blocks=cpu_blocks, max_num_batched_tokens=64)
    prompts = _prompts(3, 8)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    ref = LLM(str(target), **kw).generate(prompts, params)
    spec = LLM(str(target), speculative_config=_config(draft), **kw)
    seen = _record(spec)
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    s = spec.stats()
    assert s.num_preemptions > 0 and s.spec_accepted_tokens > 0
    assert (s.num_offloads > 0) == bool(cpu_blocks)
    _check_proposals(seen, hf)
    spec.check_integrity()


def test_n_stop_strings_and_eos_keep_their_meaning(drafts):
    """n > 1 samples speculate each (greedy siblings share the prompt's last block until copy-on-write: the draft's
    KV there is recomputed, which the proposals' oracle checks); a stop string, EOS and max_tokens end where they
    would without drafts."""
    target, by_kind = drafts["llama"]
    draft, hf = by_kind["noisy"]
    base = LLM(str(target), block_size=4)
    spec = LLM(str(target), block_size=4, speculative_config=_config(draft))
    prompts = _prompts(4, 6)
    text = base.generate(prompts[:1], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]  # a string that occurs in the greedy text
    seen = _record(spec)
    cases = [SamplingParams(max_tokens=30, temperature=0, n=2, ignore_eos=True),
             SamplingParams(max_tokens=30, temperature=0.7, seed=5, n=3, ignore_eos=True),
             SamplingParams(max_tokens=30, temperature=0, stop=[stop] if stop.strip() else None),
             SamplingParams(max_tokens=30, temperature=0)]  # EOS ends it (EOS_ID is in the vocabulary)
    for params in cases:
        ref = base.generate(prompts, params)
        outs = spec.generate(prompts, params)
        if params.temperature == 0:
            assert [(o.index, o.token_ids, o.text, o.finish_reason) for o in outs] == \
                   [(o.index, o.token_ids, o.text, o.finish_reason) for o in ref], params
        else:  # seeded sampling: each sample is a draw of the target; same lengths, same ends
            assert [len(o.token_ids) for o in outs] == [len(o.token_ids) for o in ref]
    assert spec.stats().spec_accepted_tokens > 0
    _check_proposals(seen, hf)
    spec.check_integrity()


def test_app_arg_and_async_engine(drafts):
    """`serve run ... speculative_config='{"model": ...}'` reaches the engine config; AsyncLLM speculates like LLM."""
    from serve_app.builder import AppConfig

    target, by_kind = drafts["llama"]
    draft, _ = by_kind["noisy"]
    app = AppConfig(speculative_config=json.dumps({"model": str(draft), "num_speculative_tokens": 3}))
    config = EngineConfig(model=str(target), **app.engine)
    spec = config.speculative()
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("draft_model", str(draft), 3)
    with pytest.raises(ValueError, match="is not a directory"):
        EngineConfig(**AppConfig(speculative_config='{"model": "/no/such/draft"}').engine)
    prompt = _prompts(5, 1)[0]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    ref = LLM(str(target)).generate([prompt], params)[0].token_ids
    tokens, stats = async_tokens(config, prompt, params)
    assert tokens == ref and stats.spec_draft_tokens > 0
