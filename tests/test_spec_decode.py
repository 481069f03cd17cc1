"""Speculative decoding with the n-gram proposer (engine/spec_decode.py).

Oracles: a brute-force search for the proposer; for the engine, the same engine without speculation (itself
checked against transformers in test_correctness_hf.py): greedy output must be identical token for token, and
sampled output must have the same distribution (a two-sample chi-square test at every position). Each test also
checks that drafts were proposed and accepted, so that it really compares speculative steps.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections import Counter

import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.spec_decode import SpeculativeConfig, propose_ngram

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def _brute_force(ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if n >= len(ids):
            continue
        tail = ids[-n:]
        for start in range(len(ids) - n - 1, -1, -1):  # most recent earlier occurrence first
            if ids[start:start + n] == tail:
                return ids[start + n:start + n + k]
    return []


def test_ngram_proposer_matches_a_brute_force_search():
    rng = random.Random(0)
    for _ in range(2000):
        ids = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]  # a small alphabet: many matches
        k, lo = rng.randrange(1, 6), rng.randrange(1, 4)
        hi = lo + rng.randrange(0, 3)
        assert propose_ngram(ids, k, lo, hi) == _brute_force(ids, k, lo, hi), (ids, k, lo, hi)
    assert propose_ngram([1, 2, 3, 9, 1, 2], 3, 1, 3) == [3, 9, 1]  # the longest n wins
    assert propose_ngram([5, 6, 7], 2, 1, 2) == []


@pytest.mark.parametrize("bad, match", [
    ({"method": "eagle"}, "method must be one of ngram"),
    ({"model": "/some/draft"}, "draft model"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"lookahead": 3}, "unknown field"),
    ({"disable_by_batch_size": -1}, "disable_by_batch_size"),
])
def test_bad_speculative_configs_are_refused_by_name(bad, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(speculative_config=bad)


def test_unsupported_combinations_are_refused_by_name():
    with pytest.raises(ValueError, match="speculative_config is not supported with pipeline_parallel_size"):
        EngineConfig(speculative_config=NGRAM, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="sim_spec_acceptance must be a number in"):
        EngineConfig(speculative_config=NGRAM, device="sim", sim_spec_acceptance=1.5)
    assert SpeculativeConfig.from_dict({}).num_speculative_tokens == 4


def _repetitive_prompts(seed: int, count: int) -> list[list[int]]:
    """Prompts that repeat a phrase, so n-gram drafts exist from the first decode on."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        phrase = [rng.randrange(3, 512) for _ in range(rng.randrange(3, 9))]
        prompts.append([rng.randrange(3, 512) for _ in range(rng.randrange(0, 5))] + phrase * rng.randrange(2, 5)
                       + phrase[:rng.randrange(1, len(phrase))])
    return prompts


def _pair(path, spec_depth: int | None = None, **kw) -> tuple[LLM, LLM]:
    """The engine without drafts (the reference, default depth) and with; spec_depth: the latter's pipeline_depth
    (3: a step finalized while the one before it is uncommitted, engine/step_runner.py)."""
    depth = {} if spec_depth is None else {"pipeline_depth": spec_depth}
    return LLM(str(path), **kw), LLM(str(path), speculative_config=NGRAM, **depth, **kw)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text", "mistral"])
def test_greedy_output_is_identical_with_chunked_prefill_and_prefix_hits(tiny_model_factory, family):
    path, _ = tiny_model_factory(family)
    base, spec = _pair(path, block_size=4, max_num_batched_tokens=32)
    prompts = _repetitive_prompts(1, 12)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2)
    ref = base.generate(prompts, params)
    spec.generate(prompts[:2], params)  # warms the prefix cache: the run below hits it
    outs = spec.generate(prompts, params)
    for a, b in zip(ref, outs):
        assert b.token_ids == a.token_ids
        assert [lp.token_id for lp in b.logprobs] == b.token_ids  # the accepted tokens' own logprobs
        for x, y in zip(a.logprobs, b.logprobs):
            assert y.logprob == pytest.approx(x.logprob, abs=1e-4)
            assert [t for t, _ in y.top] == [t for t, _ in x.top]
    s = spec.stats()
    assert s.spec_draft_tokens > 0 and s.spec_accepted_tokens > 0, "nothing was speculated"
    assert s.prefix_cache_hit_tokens > 0
    spec.check_integrity()


@pytest.mark.parametrize("depth", [None, 3], ids=["depth-default", "depth-3"])
@pytest.mark.parametrize("cpu_blocks", [0, 64], ids=["soft-reset", "offload"])
def test_greedy_output_is_identical_under_preemption(tiny_model_factory, cpu_blocks, depth):
    path, _ = tiny_model_factory("llama")
    kw = dict(block_size=4, num_kv_blocks=48, num_cpu_blocks=cpu_blocks, max_num_batched_tokens=64)
    base, spec = _pair(path, depth, **kw)
    prompts = _repetitive_prompts(2, 8)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    ref = base.generate(prompts, params)
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    s = spec.stats()
    assert s.num_preemptions > 0 and s.spec_accepted_tokens > 0
    assert (s.num_offloads > 0) == bool(cpu_blocks)
    spec.check_integrity()


def test_n_stop_strings_penalties_and_eos_keep_their_meaning(tiny_model_factory):
    """n > 1 samples speculate each; a stop string, EOS and max_tokens end where they would without drafts;
    penalties speculate (test_penalized_greedy_output_is_identical_and_speculates) and requests with min_tokens
    do not; all are unchanged."""
    path, _ = tiny_model_factory("qwen2")
    base, spec = _pair(path, block_size=4)
    prompts = _repetitive_prompts(3, 6)
    text = base.generate(prompts[:1], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]  # a string that occurs in the greedy text
    cases = [SamplingParams(max_tokens=30, temperature=0.7, seed=5, n=3, ignore_eos=True),
             SamplingParams(max_tokens=30, temperature=0, stop=[stop] if stop.strip() else None),
             SamplingParams(max_tokens=30, temperature=0),  # EOS ends it (EOS_ID is in the vocabulary)
             SamplingParams(max_tokens=30, temperature=0, repetition_penalty=1.3, ignore_eos=True),
             SamplingParams(max_tokens=30, temperature=0, min_tokens=20)]
    for params in cases:
        ref = base.generate(prompts, params)
        outs = spec.generate(prompts, params)
        if params.n == 1 or params.seed is None:
            assert [(o.token_ids, o.text, o.finish_reason) for o in outs] == \
                   [(o.token_ids, o.text, o.finish_reason) for o in ref], params
        else:  # seeded sampling: each sample is a draw of the target; same lengths, same ends
            assert [len(o.token_ids) for o in outs] == [len(o.token_ids) for o in ref]
    assert spec.stats().spec_accepted_tokens > 0
    spec.check_integrity()


X, Y = 17, 230  # the tokens the logit-biased cases favour


@pytest.mark.parametrize("penalties", [
    {"repetition_penalty": 1.05},  # Qwen2.5-Instruct's generation_config default
    {"frequency_penalty": -2.0},  # < 0: each repeat in the output is favoured more, so drafts are accepted
    {"repetition_penalty": 0.7, "frequency_penalty": -0.5},
    {"frequency_penalty": 2.0, "logit_bias": {X: 10.0}},  # X until its count outweighs the bias
    {"presence_penalty": 1.5, "frequency_penalty": 1.0, "logit_bias": {X: 8.0, Y: 8.0}},
], ids=["qwen-default", "frequency<0", "repetition<1+frequency<0", "frequency+bias", "presence+frequency+bias"])
@pytest.mark.parametrize("depth", [None, 3], ids=["depth-default", "depth-3"])
def test_penalized_greedy_output_is_identical_and_speculates(tiny_model_factory, penalties, depth):
    """Penalized requests speculate, and each row is penalized as if the drafts before it were committed: greedy
    output equals the engine's without drafts token for token (that engine's penalties are checked against
    transformers' logits processors in test_sampling.py). A row that ignored the drafts before it would see a
    draft token's count short by the drafts before it; drafts counted into the sequence's pool row would stay
    counted after a rejection. Either changes the output of these cases but the first (checked by mutation):
    the favoured repeats are what the n-gram drafts propose. Each case runs as one batch of the same parameters
    (the sampler's path for a model's default penalty: every row at once), then mixed with an unpenalized
    request and one with another penalty (the penalized rows a subset of the batch's). At depth 3 a verify row's
    inputs (its committed token and the drafts) must not also count as uncommitted input tokens (they did, until
    2026-12-01)."""
    path, _ = tiny_model_factory("qwen2")
    base, spec = _pair(path, depth, block_size=4, max_num_batched_tokens=64)
    prompts = _repetitive_prompts(7, 8) + [[5, 6] + [X] * 8, [9, 10, 11] + [X, Y] * 5,
                                           [3] + [X] * 3 + [Y] * 3 + [X] * 3]
    same = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, **penalties)
    mixed = [same] * len(prompts)
    mixed[3] = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    mixed[5] = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, repetition_penalty=1.2)
    unpenalized = base.generate(prompts, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    for params in (same, mixed):
        ref = base.generate(prompts, params)
        assert sum(a.token_ids != b.token_ids for a, b in zip(ref, unpenalized)) >= 3, "the penalties change nothing"
        before = spec.stats()
        outs = spec.generate(prompts, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
        s = spec.stats()
        assert s.spec_draft_tokens > before.spec_draft_tokens, "nothing was speculated"
        assert s.spec_accepted_tokens > before.spec_accepted_tokens, "no draft was accepted"
    spec.check_integrity()


@pytest.mark.parametrize("depth", [None, 3], ids=["depth-default", "depth-3"])
def test_penalized_forks_ride_in_steps_that_verify_drafts(tiny_model_factory, depth):
    """n = 2 requests arrive while penalized sequences decode with drafts, so some steps hold both verify rows and
    the rows of forked siblings (counted here: the test needs such steps). The siblings ask for logprobs, so the
    batch takes the sampler's row-by-row path, where each penalized row's drafts are looked up by its row, fork
    rows after the drafted ones. Greedy output equals the engine's without drafts."""
    import engine.step_runner as step_runner

    path, _ = tiny_model_factory("qwen2")
    base, spec = _pair(path, depth, block_size=4)
    mixed_steps = []
    new_step = step_runner.StepRunner._new_step

    def counting(self, sched, slot):
        step = new_step(self, sched, slot)
        mixed_steps.append(bool(step.forks) and step.drafts is not None)
        return step

    def run(llm) -> dict:
        eng, outs, steps = llm.engine, {}, 0
        for i, p in enumerate(_repetitive_prompts(7, 6)):
            eng.add_request(p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, frequency_penalty=-2.0),
                            request_id=f"a{i}")
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    outs[(o.request_id, o.index)] = o.token_ids
            steps += 1
            if 2 <= steps <= 12:  # short prompts: each is computed in one step, which forks its sibling
                eng.add_request(_repetitive_prompts(8 + steps, 1)[0][:3 + steps % 4],
                                SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, n=2, logprobs=1,
                                               frequency_penalty=-1.0, repetition_penalty=1.1), request_id=f"b{steps}")
        return outs

    ref = run(base)
    step_runner.StepRunner._new_step = counting
    try:
        outs = run(spec)
    finally:
        step_runner.StepRunner._new_step = new_step
    assert any(mixed_steps), "no step verified drafts beside forks"
    assert outs == ref and len(outs) == 6 + 2 * 11
    assert spec.stats().spec_accepted_tokens > 0
    spec.check_integrity()


def test_n_siblings_fork_off_a_prompt_whose_last_token_runs_alone(tiny_model_factory):
    """A prefix hit leaves a repeated prompt's last token to a chunk of its own, which looks like a decode; it must
    not carry drafts: the n > 1 siblings sample their first tokens from its one row."""
    path, _ = tiny_model_factory("llama")
    base, spec = _pair(path, block_size=4)
    prompts = [p for p in _repetitive_prompts(6, 8) if len(p) % 4][:4]  # a partial last block: never cached
    params = SamplingParams(max_tokens=12, temperature=0, n=2, ignore_eos=True)
    ref = base.generate(prompts, params)
    for _ in range(2):  # the second run hits the prefix cache up to the last token
        outs = spec.generate(prompts, params)
        assert [(o.index, o.token_ids) for o in outs] == [(o.index, o.token_ids) for o in ref]
    s = spec.stats()
    assert s.prefix_cache_hit_tokens > 0 and s.spec_draft_tokens > 0
    spec.check_integrity()


def test_no_speculation_above_disable_by_batch_size(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    llm = LLM(str(path), speculative_config={**NGRAM, "disable_by_batch_size": 2})
    llm.generate(_repetitive_prompts(4, 6), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    busy = llm.stats().spec_draft_tokens  # six at once: the first steps have more than two running
    llm.generate(_repetitive_prompts(4, 1), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert llm.stats().spec_draft_tokens > busy  # one running: it speculates


def _chi_square_threshold(df: int, z: float = 4.0) -> float:
    """The chi-square quantile at ~3e-5 upper tail (z standard deviations), by Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampled_output_keeps_the_target_distribution(tiny_model_factory):
    """Temperature 1 with a bias toward the prompt's phrase, so drafts are often accepted and often rejected:
    at every position the token frequencies with speculation match those without (two-sample chi-square,
    categories under 5 expected pooled). A verification that accepted drafts unchecked, or resampled a rejected
    row without removing the draft, shifts these frequencies far past the threshold."""
    path, _ = tiny_model_factory("llama")
    phrase = [17, 230, 41, 99]
    prompt = [5, 6] + phrase * 3 + phrase[:2]
    params = SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True,
                            logit_bias={t: 8.0 for t in phrase})
    n = 1200
    base, spec = _pair(path, max_num_seqs=256)
    counts = []
    for llm in (base, spec):
        outs = []
        for _ in range(n // 30):  # 30 at a time: under disable_by_batch_size's default (32), every decode drafts
            outs += llm.generate([prompt] * 30, params)
        counts.append([Counter(o.token_ids[i] for o in outs) for i in range(5)])
    s = spec.stats()
    assert s.spec_accepted_tokens > n and s.spec_draft_tokens - s.spec_accepted_tokens > n // 4
    for pos in range(1, 5):  # position 0 comes from the prompt's step, which never speculates
        a, b = counts[0][pos], counts[1][pos]
        keys = sorted(set(a) | set(b), key=lambda t: -(a[t] + b[t]))
        big = [t for t in keys if (a[t] + b[t]) / 2 >= 5]
        cats = [(a[t], b[t]) for t in big] + [(sum(a[t] for t in keys if t not in big),
                                               sum(b[t] for t in keys if t not in big))]
        cats = [c for c in cats if sum(c)]
        stat = sum((x - y) ** 2 / (x + y) for x, y in cats)  # equal sample sizes
        assert stat < _chi_square_threshold(len(cats) - 1), (pos, stat, cats[:8])


def test_real_model_greedy_is_identical_and_drafts_are_accepted():
    """SmolLM2-135M (the registry package's GGUF, converted), fp32: asked to repeat a function, its greedy output
    with drafts equals its output without, and most drafts are accepted."""
    import inspect
    import json

    from engine.models.from_gguf import smollm2_dir

    model = str(smollm2_dir())
    source = inspect.getsource(json.dumps)[:600]
    prompt = f"Here is a Python function:\n```python\n{source}\n```\nRepeat it exactly:\n```python\n"
    params = SamplingParams(max_tokens=48, temperature=0)
    ref = LLM(model, max_model_len=1024).generate([prompt], params)[0]
    spec = LLM(model, max_model_len=1024, speculative_config=NGRAM)
    out = spec.generate([prompt], params)[0]
    assert out.token_ids == ref.token_ids and out.text == ref.text
    s = spec.stats()
    assert s.spec_accepted_tokens > s.spec_draft_tokens / 3, (s.spec_draft_tokens, s.spec_accepted_tokens)


def test_app_arg_and_async_engine(tiny_model_factory):
    """`serve run ... speculative_config='{...}'` reaches the engine config; AsyncLLM speculates like LLM."""
    from serve_app.builder import AppConfig

    app = AppConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    path, _ = tiny_model_factory("llama")
    config = EngineConfig(model=str(path), **app.engine)
    assert config.speculative().num_speculative_tokens == 3
    with pytest.raises(ValueError, match="method must be one of ngram"):
        EngineConfig(**AppConfig(speculative_config='{"method": "medusa"}').engine)
    prompt = _repetitive_prompts(5, 1)[0]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    ref = LLM(str(path)).generate([prompt], params)[0].token_ids
    tokens, stats = async_tokens(config, prompt, params)
    assert tokens == ref and stats.spec_draft_tokens > 0


def async_tokens(config, prompt, params):
    """One request through AsyncLLM (the core in its own thread or process, as Serve runs it): its tokens and the
    engine's stats after it."""
    from engine.async_engine import AsyncLLM

    llm = AsyncLLM(config)

    async def run():
        final = None
        async for out in llm.generate(prompt, params):
            final = out
        return final.token_ids

    try:
        return asyncio.run(run()), llm.stats()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("rate", [0.0, 0.6, 1.0])
def test_simulated_device_accepts_drafts_at_the_modelled_rate(rate):
    """On the simulated device each draft is accepted with probability sim_spec_acceptance (up to the first
    rejection): the accepted share follows it, and so does the device time a token costs (a verification step of
    1 + K tokens is priced as one forward over them)."""
    from engine.sim import SIM_MODELS

    prompt = list(range(1, 4096))  # every token the simulated device emits occurs in it: a draft every step
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    kw = dict(device="sim", max_model_len=8192, max_num_seqs=8)
    model = str(SIM_MODELS / "qwen2.5-0.5b")
    base = LLM(model, **kw)
    base.generate([prompt], params)
    spec = LLM(model, speculative_config=NGRAM, sim_spec_acceptance=rate, **kw)
    out = spec.generate([prompt], params)[0]
    assert len(out.token_ids) == 200
    s, b = spec.stats(), base.stats()
    assert s.spec_verify_chunks > 0
    share = s.spec_accepted_tokens / s.spec_draft_tokens
    k = NGRAM["num_speculative_tokens"]
    expected = sum(rate ** i for i in range(1, k + 1)) / k  # drafts are accepted up to the first rejection
    assert abs(share - expected) < 0.1, (share, expected)
    tokens_per_s = 200 / s.device_busy_s, 200 / b.device_busy_s  # simulated device time, not wall time
    if rate == 1.0:
        assert tokens_per_s[0] > 2.5 * tokens_per_s[1]  # ~4 accepted drafts a step at the cost of ~one step
    if rate == 0.0:
        assert tokens_per_s[0] < tokens_per_s[1]  # every step verifies drafts for nothing
