"""Sampling and stop conditions, checked against Hugging Face transformers on the same fp32 weights.

Greedy-style checks are teacher-forced: HF is run on the engine's own prompt + output, and every engine token
must be the argmax of HF's (adjusted) logits at its position. A token that is not the exact argmax is
accepted only where it is within TIE_GAP of the maximum (a near-tie a correct kernel may flip); that is
asserted, not assumed. Sampled tokens are checked for membership in the support HF's logits allow
(top-p nucleus, top-k, min-p), and seeded sampling for invariance to batching and pipelining.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampler import (TOP_P_CANDIDATES, PenaltyPool, Sampler, SamplingBatch, _top_p, _top_p_sorted, argmax,
                            penalize_entries, penalize_rows)
from engine.sequence import Sequence
from tiny_models import EOS_ID, tokenizer

TIE_GAP = 1e-3
LP_TOL = 1e-4
PROMPTS = ["The quick brown fox", "Paged attention keeps", "Continuous batching admits new",
           "emoji and accents", "The lazy dog", "KV blocks in a pool"]
SEEDS = (0, 1, 2, 3)


# ---- fixtures ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def llm2(llama):
    return LLM(str(llama[0]), device="cpu", pipeline_depth=2, block_size=4, num_kv_blocks=256)


@pytest.fixture(scope="module")
def llm1(llama):
    return LLM(str(llama[0]), device="cpu", pipeline_depth=1, block_size=4, num_kv_blocks=256)


@pytest.fixture(scope="module")
def llm_chunked(llama):
    """Small token budget (chunked prefill interleaved with decodes) and a different engine seed."""
    return LLM(str(llama[0]), device="cpu", pipeline_depth=2, block_size=4, num_kv_blocks=256,
               max_num_batched_tokens=8, seed=1234)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def fam(request, tiny_model_factory):
    """(LLM, HF model) for the HF-oracle tests, on two families (untied and tied embeddings)."""
    path, hf = tiny_model_factory(request.param)
    return LLM(str(path), device="cpu", block_size=4, num_kv_blocks=256), hf


# ---- helpers ----------------------------------------------------------------------------------------------
def prefix_logits(hf, prompt: list[int], out: list[int]) -> torch.Tensor:
    """HF's raw logits that predict out[i] from prompt + out[:i], for every i ([len(out), vocab])."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out])).logits[0].float()
    return logits[len(prompt) - 1: len(prompt) - 1 + len(out)]


def assert_greedy_path(hf, prompt, tokens, adjust=None) -> torch.Tensor:
    """Every token is the argmax (within TIE_GAP) of HF's logits for the engine's own prefix, after
    `adjust(i, logits_row)` (penalties, bans). Returns the raw logits."""
    logits = prefix_logits(hf, prompt, tokens)
    for i, t in enumerate(tokens):
        row = logits[i].clone()
        if adjust is not None:
            row = adjust(i, row)
        best = int(row.argmax())
        assert row[t] >= row[best] - TIE_GAP, (
            f"token {i}: engine chose {t} (score {row[t]:.5f}) but the oracle's argmax is {best} "
            f"(score {row[best]:.5f})")
    return logits


def ban(ids: list[int], before: int):
    def adjust(i, row):
        if i < before:
            row[ids] = float("-inf")
        return row
    return adjust


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


def seeded(seed: int, **kw) -> SamplingParams:
    kw = {"temperature": 0.8, "top_p": 0.9, "max_tokens": 16, **kw}
    return SamplingParams(seed=seed, **kw)


def decode(ids: list[int]) -> str:
    return tokenizer().decode(ids, skip_special_tokens=True)


def find_eos_prompt(hf) -> list[int]:
    """A one-token prompt after which HF's greedy choice is EOS, by a clear margin."""
    with torch.no_grad():
        logits = hf(torch.arange(3, 512)[:, None]).logits[:, -1]
    top = logits.topk(2, dim=-1)
    ok = (top.indices[:, 0] == EOS_ID) & (top.values[:, 0] - top.values[:, 1] > 10 * TIE_GAP)
    hits = ok.nonzero().flatten().tolist()
    assert hits, "no one-token prompt makes EOS the greedy choice on this model"
    return [hits[0] + 3]


def run_engine(llm: LLM, late: list[tuple[int, str | list[int], SamplingParams]]) -> list[list[int]]:
    """Drive the engine directly: add each (step_index, prompt, params) when that many steps have run."""
    eng, ids, done, steps = llm.engine, {}, {}, 0
    late = sorted(late, key=lambda x: x[0])
    while late or eng.has_unfinished():
        while late and late[0][0] <= steps:
            _, prompt, params = late.pop(0)
            ids[eng.add_request(prompt, params)] = len(ids)
        for out in eng.step():
            if out.finished:
                done[ids[out.request_id]] = out.token_ids
        steps += 1
    return [done[i] for i in range(len(ids))]


def assert_idle_and_clean(llm: LLM) -> None:
    llm.check_integrity()
    s = llm.stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"]


# ---- seeded sampling ----------------------------------------------------------------------------------------
def test_seeded_sampling_is_invariant_to_batch_and_pipeline(llm1, llm2, llm_chunked):
    prompt = PROMPTS[0]
    alone = {s: llm2.generate([prompt], seeded(s))[0].token_ids for s in SEEDS}
    assert all(len(t) == 16 or t[-1] == EOS_ID for t in alone.values())
    others = [(PROMPTS[1], greedy(max_tokens=5)),
              (PROMPTS[2], SamplingParams(temperature=1.3, top_k=20, max_tokens=20)),
              ([7, 8, 9, 10, 11, 12, 13], seeded(99, top_p=0.5, max_tokens=3, repetition_penalty=1.2))]
    for llm in (llm2, llm1, llm_chunked):
        assert llm.generate([prompt], seeded(SEEDS[0]))[0].token_ids == alone[SEEDS[0]]
        for s in SEEDS:
            batch = [others[0], (prompt, seeded(s)), others[1], others[2], (prompt, seeded(s))]
            outs = llm.generate([p for p, _ in batch], [sp for _, sp in batch])
            assert outs[1].token_ids == alone[s], f"seed {s} changed when batched ({llm.config})"
            assert outs[4].token_ids == alone[s], "two requests with one seed must not share a generator"
        assert_idle_and_clean(llm)


def test_seeded_sampling_is_invariant_to_arrival_time(llm1, llm2):
    prompt, s = PROMPTS[0], SEEDS[2]
    alone = llm2.generate([prompt], seeded(s))[0].token_ids
    for llm in (llm2, llm1):
        outs = run_engine(llm, [(0, PROMPTS[3], SamplingParams(temperature=1.0, max_tokens=30)),
                                (0, PROMPTS[4], seeded(s + 100, max_tokens=25)),
                                (3, prompt, seeded(s)),
                                (5, PROMPTS[5], greedy(max_tokens=4))])
        assert outs[2] == alone
        assert_idle_and_clean(llm)


def test_seeded_sampling_survives_preemption(llama, llm2):
    """14 blocks of 4 cannot hold four 30-token requests: some are preempted (soft reset) and recomputed,
    and their seeded, penalized, min_tokens-constrained outputs must not change."""
    params = [seeded(s, max_tokens=24, ignore_eos=True, frequency_penalty=0.5, min_tokens=3) for s in SEEDS]
    prompts = PROMPTS[:len(SEEDS)]
    ref = [o.token_ids for o in llm2.generate(prompts, params)]
    for depth in (1, 2, 3):
        small = LLM(str(llama[0]), device="cpu", block_size=4, num_kv_blocks=14, pipeline_depth=depth)
        outs = small.generate(prompts, params)
        assert [(o.finish_reason, o.error) for o in outs] == [("length", None)] * len(outs), (
            f"pipeline_depth={depth}: a request that fits the cache (8 of 14 blocks) was ended early")
        assert [o.token_ids for o in outs] == ref
        assert small.stats()["num_preemptions"] > 0
        assert_idle_and_clean(small)


def test_different_seeds_give_different_outputs(llm2):
    outs = llm2.generate([PROMPTS[0]] * len(SEEDS), [seeded(s) for s in SEEDS])
    assert len({tuple(o.token_ids) for o in outs}) == len(SEEDS)
    again = llm2.generate([PROMPTS[0]] * len(SEEDS), [seeded(s) for s in SEEDS])
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]


def _sampled_runs(llm, hf, **params):
    outs = llm.generate(PROMPTS[:3] * 2, [seeded(s, max_tokens=12, **params) for s in range(6)])
    assert len({tuple(o.token_ids) for o in outs}) > 3, "sampling produced no variety: test is vacuous"
    for o in outs:
        yield o.token_ids, prefix_logits(hf, o.prompt_token_ids, o.token_ids)


def test_sampled_tokens_lie_in_hf_top_p_nucleus(llm2, llama):
    top_p, excluded = 0.5, []
    for tokens, logits in _sampled_runs(llm2, llama[1], temperature=0.8, top_p=top_p):
        probs = torch.softmax(logits / 0.8, dim=-1)
        for i, t in enumerate(tokens):
            mass_above = probs[i][probs[i] > probs[i][t]].sum().item()
            assert mass_above < top_p + LP_TOL, f"token {i} ({t}) lies outside the top-p={top_p} nucleus"
            sorted_p = probs[i].sort(descending=True).values
            excluded.append(sorted_p[(sorted_p.cumsum(0) - sorted_p) >= top_p].sum().item())
    assert sum(excluded) / len(excluded) > 0.2  # ignoring top_p would very likely have been caught


def test_sampled_tokens_lie_in_hf_top_k(llm2, llama):
    for tokens, logits in _sampled_runs(llm2, llama[1], temperature=1.5, top_p=1.0, top_k=3):
        kth = logits.topk(3, dim=-1).values[:, -1]
        for i, t in enumerate(tokens):
            assert logits[i][t] >= kth[i] - LP_TOL, f"token {i} ({t}) is not among HF's top 3"


def test_top_k_applies_per_row_and_leaves_rows_without_it_alone():
    """One batch, three rows: top_k 2, no top_k, top_k 5 (the topk is sized by the largest, 5)."""
    torch.manual_seed(0)
    logits = torch.randn(3, 64)
    seqs = [Sequence(f"r{i}", None, [1, 2], SamplingParams(temperature=1.0, top_k=k), frozenset(), 32, 64)
            for i, k in enumerate((2, -1, 5))]
    batch = SamplingBatch.build(seqs, torch.device("cpu"))
    assert batch.top_k_max == 5
    sampler = Sampler(0, torch.device("cpu"))
    seen = [set() for _ in seqs]
    for _ in range(400):
        for i, t in enumerate(sampler(logits.clone(), batch).tokens.tolist()):
            seen[i].add(t)
    ranks = logits.argsort(dim=-1, descending=True)
    assert seen[0] == set(ranks[0, :2].tolist())
    assert seen[2] <= set(ranks[2, :5].tolist()) and len(seen[2]) == 5
    assert len(seen[1] - set(ranks[1, :5].tolist())) > 5  # the row without top_k samples the whole vocabulary


def test_greedy_rows_beside_sampled_rows_take_the_argmax():
    """A batch mixing greedy and sampled rows (greedy rows take the argmax, sampled rows draw), one of only
    sampled rows (no argmax computed) and one of only greedy rows: each row gets what it asks for."""
    torch.manual_seed(1)
    logits = torch.randn(4, 64)
    sampler = Sampler(0, torch.device("cpu"))
    for temps in ((0.0, 1.0, 0.0, 1.0), (1.0, 1.0, 1.0, 1.0), (0.0, 0.0, 0.0, 0.0)):
        seqs = [Sequence(f"r{i}", None, [1], SamplingParams(temperature=t), frozenset(), 32, 64)
                for i, t in enumerate(temps)]
        batch = SamplingBatch.build(seqs, torch.device("cpu"))
        assert (batch.all_greedy, batch.any_greedy) == (all(t == 0 for t in temps), any(t == 0 for t in temps))
        draws = [sampler(logits.clone(), batch).tokens.tolist() for _ in range(200)]
        for i, t in enumerate(temps):
            seen = {d[i] for d in draws}
            assert seen == {int(logits[i].argmax())} if t == 0 else len(seen) > 10, (temps, i, seen)


def _reference_probs(logits: torch.Tensor, temperature: float, top_p: float, min_p: float) -> list[float]:
    """The distribution a row should be drawn from, computed apart from the sampler: float64 softmax of
    logits / temperature, the top-p nucleus by a Python walk down the sorted tokens, then min-p, renormalized."""
    probs = torch.softmax(logits.double() / temperature, dim=-1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = set(), 0.0
    for i in order:
        if mass >= top_p:
            break
        kept.add(i)
        mass += probs[i]
    floor = min_p * max(probs)
    out = [p if i in kept and p >= floor else 0.0 for i, p in enumerate(probs)]
    return [p / sum(out) for p in out]


@pytest.mark.parametrize("top_p,min_p,spread", [(1.0, 0.0, 2.0), (0.9, 0.0, 2.0), (0.95, 0.0, 0.3),
                                                (1.0, 0.05, 2.0)])
def test_random_draws_follow_the_distribution(top_p, min_p, spread):
    """Draw counts against the reference distribution (one row repeated 6,000 times in one batch, fixed
    seed): every token within 5 standard deviations of its expected count, no token outside the support,
    and the chi-square statistic over tokens expected 5+ times under df + 6 sqrt(2 df). spread 0.3 makes a
    flat row whose nucleus is wider than the CPU top-p's candidates (engine.sampler.TOP_P_CANDIDATES), so
    the fallback sort is drawn from too."""
    vocab, rows, temperature = 1000, 6000, 0.8
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(7)) * spread
    want = _reference_probs(logits, temperature, top_p, min_p)
    params = SamplingParams(temperature=temperature, top_p=top_p, min_p=min_p)
    seqs = [Sequence(f"r{i}", None, [1], params, frozenset(), 32, vocab) for i in range(rows)]
    batch = SamplingBatch.build(seqs, torch.device("cpu"))
    tokens = Sampler(0, torch.device("cpu"))(logits.expand(rows, vocab).contiguous(), batch).tokens
    counts = torch.bincount(tokens, minlength=vocab).tolist()
    support = sum(p > 0 for p in want)
    if spread < 1:
        assert support > 300, "the flat row must reach past the top-p candidates"
    chi2, df = 0.0, -1
    for t, (c, p) in enumerate(zip(counts, want)):
        expected = rows * p
        if p == 0:
            assert c == 0, f"token {t} drawn {c} times outside the support"
            continue
        assert abs(c - expected) <= 5 * (expected * (1 - p)) ** 0.5 + 1, \
            f"token {t}: {c} draws, {expected:.1f} expected"
        if expected >= 5:
            chi2 += (c - expected) ** 2 / expected
            df += 1
    assert df > 0 and chi2 < df + 6 * (2 * df) ** 0.5, f"chi-square {chi2:.1f} over {df} degrees of freedom"


def test_cpu_top_p_keeps_exactly_what_a_full_sort_keeps():
    """The CPU top-p searches a row's nucleus among its k + 1 most likely tokens for growing k before sorting
    the row: rows whose nucleus ends in each tier (and past the last one) in one batch, a SmolLM2-sized
    vocabulary; the kept probabilities are bit-identical to a sort of every row."""
    gen = torch.Generator().manual_seed(3)
    spreads = (6.0, 3.0, 1.5, 1.0, 0.2)
    probs = torch.cat([(torch.randn(2, 49152, generator=gen) * s).softmax(-1) for s in spreads])
    top_p = torch.tensor([0.9, 0.5, 0.9, 0.99, 0.9, 0.95, 0.5, 0.8, 0.9, 0.3])
    want = _top_p_sorted(probs, top_p)
    sizes = (want > 0).sum(-1).tolist()
    tiers = [sum(n > k for k in TOP_P_CANDIDATES) for n in sizes]
    assert set(tiers) == set(range(len(TOP_P_CANDIDATES) + 1)), f"nucleus sizes {sizes} miss a tier"
    assert torch.equal(_top_p(probs, top_p), want)


def test_sampled_tokens_respect_hf_min_p(llm2, llama):
    for tokens, logits in _sampled_runs(llm2, llama[1], temperature=1.0, top_p=1.0, min_p=0.3):
        probs = torch.softmax(logits, dim=-1)
        for i, t in enumerate(tokens):
            assert probs[i][t] >= 0.3 * probs[i].max() - 1e-6, f"token {i} ({t}) is below min_p"


def test_top_k_1_equals_greedy(llm2, llama):
    g = llm2.generate(PROMPTS, greedy(max_tokens=16, ignore_eos=True))
    k1 = llm2.generate(PROMPTS, SamplingParams(temperature=1.0, top_k=1, max_tokens=16, ignore_eos=True))
    k1s = llm2.generate(PROMPTS, [SamplingParams(temperature=1.0, top_k=1, max_tokens=16, ignore_eos=True,
                                                 seed=s) for s in range(len(PROMPTS))])
    for a, b, c in zip(g, k1, k1s):
        assert a.token_ids == b.token_ids == c.token_ids
        assert_greedy_path(llama[1], a.prompt_token_ids, a.token_ids)


# ---- penalties ----------------------------------------------------------------------------------------------
def test_repetition_penalty_matches_hf_generate(fam):
    llm, hf = fam
    n, penalty = 24, 1.3
    outs = llm.generate(PROMPTS, greedy(max_tokens=n, ignore_eos=True, repetition_penalty=penalty))
    plain = llm.generate(PROMPTS, greedy(max_tokens=n, ignore_eos=True))
    assert any(o.token_ids != p.token_ids for o, p in zip(outs, plain)), "the penalty changed nothing"
    for o in outs:
        prompt = torch.tensor([o.prompt_token_ids])
        with torch.no_grad():
            ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                              repetition_penalty=penalty, max_new_tokens=n, min_new_tokens=n,
                              eos_token_id=None, pad_token_id=0, output_scores=True,
                              return_dict_in_generate=True)
        ref_tokens = ref.sequences[0, prompt.shape[1]:].tolist()
        assert len(o.token_ids) == len(ref_tokens) == n
        for i, (a, b) in enumerate(zip(o.token_ids, ref_tokens)):
            if a != b:
                top2 = ref.scores[i][0].topk(2).values
                gap = (top2[0] - top2[1]).item()
                assert gap < TIE_GAP, f"token {i}: engine {a} vs HF {b}; HF top-2 gap {gap:.2e} is no tie"
                break


def test_sampled_tokens_follow_hf_repetition_penalty(llm2, llama):
    """Sampling draws from HF's penalized scores. A large penalty over a prompt holding half the vocabulary
    sends seen tokens with negative logits to ~zero probability (they are multiplied by the penalty); a
    sign slip (dividing them) would make them as likely as seen positive ones. Every draw must be plausible
    under HF's RepetitionPenaltyLogitsProcessor."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
    penalty, floor = 50.0, -25.0
    proc = RepetitionPenaltyLogitsProcessor(penalty)
    prompt = list(range(4, 512, 2))
    outs = llm2.generate([prompt] * 8, [SamplingParams(temperature=1.0, seed=s, max_tokens=24, ignore_eos=True,
                                                       repetition_penalty=penalty) for s in range(8)])
    slip_mass = []
    for o in outs:
        logits = prefix_logits(llama[1], prompt, o.token_ids)
        for i, t in enumerate(o.token_ids):
            ids = torch.tensor([prompt + o.token_ids[:i]])
            lp = torch.log_softmax(proc(ids, logits[i:i + 1].clone())[0], dim=-1)
            assert lp[t] > floor, f"token {i} ({t}) has log-probability {lp[t]:.1f} under HF's penalized scores"
            seen = ids[0].unique()
            slipped = logits[i].clone()
            slipped[seen] = slipped[seen] / penalty
            slip_mass.append(torch.softmax(slipped, -1)[lp <= floor].sum().item())
    assert sum(slip_mass) > 4  # draws a sign slip would be expected to produce: it would have been caught


@pytest.mark.parametrize("presence,frequency", [(1.5, 0.0), (0.0, 1.0), (0.7, 0.6), (-1.0, 0.0)])
def test_presence_frequency_penalties_match_reimplementation(fam, presence, frequency):
    llm, hf = fam
    params = greedy(max_tokens=24, ignore_eos=True, presence_penalty=presence, frequency_penalty=frequency)
    outs = llm.generate(PROMPTS, params)
    plain = llm.generate(PROMPTS, greedy(max_tokens=24, ignore_eos=True))
    assert any(o.token_ids != p.token_ids for o, p in zip(outs, plain)), "the penalties changed nothing"
    for o in outs:
        def adjust(i, row, out=o.token_ids):
            counts = torch.bincount(torch.tensor(out[:i], dtype=torch.long), minlength=row.shape[0]).float()
            return row - frequency * counts - presence * (counts > 0).float()
        assert_greedy_path(hf, o.prompt_token_ids, o.token_ids, adjust)


def test_penalty_rows_are_reused_clean_by_later_requests(llama):
    """Each penalized request keeps its penalty inputs in a row of the runner's pool from step to step; with 2
    seats the pool stops at 4 rows, so six requests reuse the rows of finished ones (a row carried over would
    penalize tokens its new request never produced). Every output follows HF's logits along its own path with
    repetition over prompt + output, then frequency over output, reimplemented here."""
    rep, freq = 1.3, 0.5
    small = LLM(str(llama[0]), device="cpu", max_num_seqs=2, block_size=4, num_kv_blocks=64)
    try:
        outs = small.generate(PROMPTS, greedy(max_tokens=20, ignore_eos=True, repetition_penalty=rep,
                                              frequency_penalty=freq))
        assert small.engine.core.runner.penalty_pool.capacity == 4  # 6 requests, 4 rows: rows were reused
    finally:
        small.shutdown()
    for o in outs:
        def adjust(i, row, prompt=o.prompt_token_ids, out=o.token_ids):
            seen = torch.tensor(sorted(set(prompt + out[:i])))
            vals = row[seen]
            row[seen] = torch.where(vals < 0, vals * rep, vals / rep)
            return row - freq * torch.bincount(torch.tensor(out[:i], dtype=torch.long), minlength=row.shape[0])
        assert_greedy_path(llama[1], o.prompt_token_ids, o.token_ids, adjust)


def test_penalty_pool_over_steps_matches_hf_and_openai_formulas_on_whole_rows_and_on_entries():
    """A pool kept over steps (new tokens each step, a sequence that joins late, one that commits several at once)
    gives, at every step, HF's RepetitionPenaltyLogitsProcessor over prompt + output followed by OpenAI's
    presence / frequency over the output, computed here from the token ids; the whole-row form (CUDA's) and the
    entries-only form (CPU's) agree bit for bit. Rows with one kind of penalty only, and -inf logits, included."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(0)
    vocab = 300
    kinds = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.7, presence_penalty=-0.4),
             dict(repetition_penalty=0.8, presence_penalty=1.1), dict(repetition_penalty=1.5, frequency_penalty=0.2)]

    def seq(i, kw):
        prompt = torch.randint(vocab, (5 + i,), generator=gen).tolist()
        return Sequence(f"r{i}", None, prompt, SamplingParams(temperature=0, **kw), frozenset(), 4096, vocab)
    seqs = [seq(i, kw) for i, kw in enumerate(kinds)]
    for s in seqs:
        s.block_table = [1]
    pool = PenaltyPool(8, vocab, torch.device("cpu"))
    for step in range(12):
        live = seqs if step >= 3 else seqs[:2]  # the last two join at step 3, with output already committed
        for s in seqs if step else ():
            for _ in range(3 if (step == 5 and s is seqs[0]) or (step < 3 and s in seqs[2:]) else 1):
                s.token_ids.append(int(torch.randint(vocab, (), generator=gen)))
        rows = list(range(len(live)))
        pen = pool.take(rows, live)
        logits = torch.randn(len(live), vocab, generator=gen) * 3
        logits[:, 7] = float("-inf")
        whole, entries = penalize_rows(logits.clone(), pen), penalize_entries(logits.clone(), pen)
        assert torch.equal(whole, entries), step
        for i, s in enumerate(live):
            p, ref = s.params, logits[i:i + 1].clone()
            if p.repetition_penalty != 1.0:
                ref = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([s.token_ids.tolist()]), ref)
            out = torch.tensor(s.token_ids[len(s.prompt_token_ids):].tolist(), dtype=torch.long)
            counts = torch.bincount(out, minlength=vocab).float()
            ref = ref[0] - (p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float())
            torch.testing.assert_close(whole[i], ref, rtol=1e-6, atol=1e-6)
        # a pipeline step ships its batch to every stage: pickled as the set entries, restored exactly
        data = pickle.dumps(pen)
        back = pickle.loads(data)
        for name in ("rows", "repetition", "presence", "frequency", "seen", "counts"):
            assert torch.equal(getattr(back, name), getattr(pen, name)), name
    # at a real vocabulary's size the entries are a small part of the tables
    big = [seq(i, kinds[3]) for i in range(2)]
    for s in big:
        s.vocab_size = 151936
        s.token_ids.extend(torch.randint(151936, (500,), generator=gen).tolist())
    pen = PenaltyPool(4, 151936, torch.device("cpu")).take([0, 1], big)
    data = pickle.dumps(pen)
    assert torch.equal(pickle.loads(data).counts, pen.counts) and len(data) < (5 * pen.seen.numel()) // 50


def test_penalty_rows_after_drafts_count_them_and_the_pool_keeps_only_committed_tokens():
    """A step verifying drafts (engine/spec_decode.py) has k + 1 rows per sequence; row j is penalized as if
    drafts[:j] were committed output: HF's repetition processor and OpenAI's presence / frequency over the
    committed tokens plus those drafts. The next step, after the commit kept only some drafts, sees the committed
    tokens alone: a rejected draft leaves nothing in the pool. Whole-row and entries-only forms agree bit for
    bit; rows of a sequence without drafts, and an unpenalized kind, are mixed in."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(1)
    vocab = 200
    kinds = [dict(repetition_penalty=1.4, frequency_penalty=0.6), dict(presence_penalty=0.9),
             dict(repetition_penalty=0.7, frequency_penalty=-0.3, presence_penalty=0.2)]
    seqs = []
    for i, kw in enumerate(kinds):
        prompt = torch.randint(vocab, (6 + i,), generator=gen).tolist()
        seqs.append(Sequence(f"d{i}", None, prompt, SamplingParams(temperature=0, **kw), frozenset(), 4096, vocab))
        seqs[-1].block_table = [1]
    pool = PenaltyPool(8, vocab, torch.device("cpu"))

    def reference(logits_row, s, extra):
        p, ids = s.params, s.token_ids.tolist() + extra
        ref = logits_row[None].clone()
        if p.repetition_penalty != 1.0:
            ref = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([ids]), ref)
        counts = torch.bincount(torch.tensor(ids[len(s.prompt_token_ids):], dtype=torch.long), minlength=vocab)
        return ref[0] - (p.frequency_penalty * counts.float() + p.presence_penalty * (counts > 0).float())

    for step in range(6):
        for s in seqs if step else ():
            s.token_ids.append(int(torch.randint(vocab, (), generator=gen)))
        # drafts that repeat the sequence's own tokens (what the n-gram proposer drafts), some twice
        drafts = [[], [], []]
        if step % 2:
            drafts[1] = [int(seqs[1].token_ids[-1])] * 2 + [int(seqs[1].token_ids[0])]
            drafts[2] = [int(t) for t in seqs[2].token_ids[-3:]]
        rows, row_seqs, row_drafts = [], [], []
        for s, d in zip(seqs, drafts):
            for j in range(len(d) + 1):
                rows.append(len(rows))
                row_seqs.append(s)
                row_drafts.append(d[:j])
        pen = pool.take(rows, row_seqs, row_drafts)
        logits = torch.randn(len(rows), vocab, generator=gen) * 3
        whole, entries = penalize_rows(logits.clone(), pen), penalize_entries(logits.clone(), pen)
        assert torch.equal(whole, entries), step
        for i, (s, extra) in enumerate(zip(row_seqs, row_drafts)):
            torch.testing.assert_close(whole[i], reference(logits[i], s, extra), rtol=1e-6, atol=1e-6)
        if step % 2:  # the commit: sequence 1 keeps its first draft, sequence 2 none of its
            seqs[1].token_ids.append(drafts[1][0])


# ---- logprobs -----------------------------------------------------------------------------------------------
def test_logprobs_match_hf_log_softmax(fam):
    llm, hf = fam
    params = [greedy(max_tokens=10, logprobs=5), seeded(3, max_tokens=10, logprobs=3),
              greedy(max_tokens=10, logprobs=0), greedy(max_tokens=10),
              seeded(4, max_tokens=10, logprobs=20, repetition_penalty=1.5)]
    outs = llm.generate(PROMPTS[:len(params)], params)
    assert outs[3].logprobs is None
    for o, p in zip(outs, params):
        if p.logprobs is None:
            continue
        assert len(o.logprobs) == len(o.token_ids)
        lp = torch.log_softmax(prefix_logits(hf, o.prompt_token_ids, o.token_ids), dim=-1)
        for i, (t, entry) in enumerate(zip(o.token_ids, o.logprobs)):
            assert entry.token_id == t
            assert abs(entry.logprob - lp[i, t].item()) < LP_TOL, f"token {i}: chosen logprob"
            assert len(entry.top) == p.logprobs
            if not p.logprobs:
                continue
            ref = lp[i].topk(p.logprobs + 1)
            ids, vals = [a for a, _ in entry.top], [v for _, v in entry.top]
            assert torch.allclose(torch.tensor(vals), ref.values[:-1], atol=LP_TOL, rtol=0), f"token {i}"
            for a, v in entry.top:
                assert abs(lp[i, a].item() - v) < LP_TOL, f"token {i}: top id {a} has the wrong logprob"
            if ref.values[-2] - ref.values[-1] > LP_TOL:  # no tie at the cut: the id set is determined
                assert set(ids) == set(ref.indices[:-1].tolist())


# ---- stop conditions --------------------------------------------------------------------------------------------
def test_eos_stops_and_min_tokens_forbids_it(fam):
    llm, hf = fam
    prompt = find_eos_prompt(hf)
    plain = llm.generate([prompt], greedy(max_tokens=8))[0]
    assert plain.token_ids == [EOS_ID] and plain.finish_reason == "stop" and plain.text == ""
    o = llm.generate([prompt], greedy(max_tokens=8, min_tokens=3))[0]
    assert EOS_ID not in o.token_ids[:3] and len(o.token_ids) >= 3
    assert EOS_ID not in o.token_ids[:-1]
    assert (o.finish_reason, len(o.token_ids)) == ("length", 8) or (
        o.finish_reason == "stop" and o.token_ids[-1] == EOS_ID)
    assert_greedy_path(hf, prompt, o.token_ids, ban([EOS_ID], before=3))
    ign = llm.generate([prompt], greedy(max_tokens=5, ignore_eos=True))[0]
    assert ign.token_ids[0] == EOS_ID and len(ign.token_ids) == 5 and ign.finish_reason == "length"
    assert_idle_and_clean(llm)


def test_min_tokens_forbids_eos_when_sampling(fam):
    llm, hf = fam
    prompt = find_eos_prompt(hf)
    free = llm.generate([prompt] * 8, [SamplingParams(temperature=1.0, seed=s, max_tokens=6)
                                       for s in range(8)])
    assert any(o.token_ids[0] == EOS_ID for o in free), "EOS never sampled first: test is vacuous"
    held = llm.generate([prompt] * 8, [SamplingParams(temperature=1.0, seed=s, max_tokens=6, min_tokens=2)
                                       for s in range(8)])
    for o in held:
        assert EOS_ID not in o.token_ids[:2] and len(o.token_ids) >= 2


def test_stop_token_ids_and_min_tokens(llm2, llama):
    hf = llama[1]
    base = llm2.generate(PROMPTS, greedy(max_tokens=16, ignore_eos=True))
    for o in base:
        assert_greedy_path(hf, o.prompt_token_ids, o.token_ids)
    # stop token j: the first position whose token is new and whose preceding text decodes cleanly
    case = next(((o, o.token_ids, j) for o in base for j in range(2, 16)
                 if o.token_ids[j] not in o.token_ids[:j] and EOS_ID not in o.token_ids[:j + 1]
                 and not decode(o.token_ids[:j]).endswith("\ufffd")), None)
    assert case is not None, "no greedy output offers a usable stop token"
    o, g, j = case
    stopped = llm2.generate([o.prompt_token_ids], greedy(max_tokens=16, stop_token_ids=[g[j]]))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == g[:j + 1]
    assert stopped.text == decode(g[:j])
    # min_tokens bans the stop id (and EOS) until min_tokens tokens exist
    held = llm2.generate([o.prompt_token_ids], greedy(max_tokens=16, stop_token_ids=[g[0]], min_tokens=3))[0]
    assert g[0] not in held.token_ids[:3] and held.token_ids[0] != g[0]
    assert g[0] not in held.token_ids[:-1]
    if held.finish_reason == "stop":
        assert held.token_ids[-1] in (g[0], EOS_ID) and len(held.token_ids) > 3
    else:
        assert held.finish_reason == "length" and len(held.token_ids) == 16
    assert_greedy_path(hf, o.prompt_token_ids, held.token_ids, ban([g[0], EOS_ID], before=3))


def test_max_tokens_finishes_with_length(llm2, llm1):
    for llm in (llm2, llm1):
        for n in (1, 2, 7):
            outs = llm.generate(PROMPTS, greedy(max_tokens=n, ignore_eos=True))
            assert all(len(o.token_ids) == n and o.finish_reason == "length" for o in outs)
            outs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=5, max_tokens=n, ignore_eos=True))
            assert all(len(o.token_ids) == n and o.finish_reason == "length" for o in outs)


def _stop_case(llm, hf):
    """(prompt ids, greedy ids, oracle text, stop string spanning a token boundary, its offset)."""
    outs = llm.generate(PROMPTS, greedy(max_tokens=32, ignore_eos=True))
    for o in outs:
        g = o.token_ids
        assert_greedy_path(hf, o.prompt_token_ids, g)
        full = decode(g)
        for k in range(1, len(g)):
            head = decode(g[:k])
            b = len(head)
            stop = full[b - 2:b + 2]
            if (b >= 3 and full.startswith(head) and len(stop) == 4 and stop.isprintable()
                    and "\ufffd" not in full[:b + 2] and full.find(stop) == b - 2 and full.count(stop) == 1):
                return o.prompt_token_ids, g, full, stop, b - 2
    raise AssertionError("no greedy output has a clean stop string across a token boundary")


def test_stop_string_cuts_text(fam):
    llm, hf = fam
    prompt, g, full, stop, at = _stop_case(llm, hf)
    done_at = next(n for n in range(1, len(g) + 1) if stop in decode(g[:n]))
    assert stop not in decode(g[:done_at - 1]) and len(decode(g[:done_at - 1])) > at  # spans tokens
    o = llm.generate([prompt], greedy(max_tokens=32, ignore_eos=True, stop=[stop, "no such stop"]))[0]
    assert o.finish_reason == "stop"
    assert o.text == full[:at]
    assert o.token_ids == g[:done_at]
    inc = llm.generate([prompt], greedy(max_tokens=32, ignore_eos=True, stop=stop,
                                        include_stop_str_in_output=True))[0]
    assert inc.finish_reason == "stop" and inc.text == full[:at + len(stop)]
    assert inc.token_ids == g[:done_at]


def test_stop_string_streamed_deltas_never_leak_it(fam):
    llm, hf = fam
    prompt, g, full, stop, at = _stop_case(llm, hf)
    eng = llm.engine
    rid = eng.add_request(prompt, greedy(max_tokens=32, ignore_eos=True, stop=stop), stream=True)
    deltas, final = [], None
    while eng.has_unfinished():
        for out in eng.step():
            assert out.request_id == rid
            deltas.append(out.delta_text)
            if out.finished:
                final = out
    assert final.text == full[:at] and "".join(deltas) == final.text
    streamed = ""
    for d in deltas[:-1]:
        streamed += d
        assert full[:at].startswith(streamed)


def test_stop_string_ignored_before_min_tokens(fam):
    llm, hf = fam
    prompt, g, full, stop, at = _stop_case(llm, hf)
    done_at = next(n for n in range(1, len(g) + 1) if stop in decode(g[:n]))
    same = llm.generate([prompt], greedy(max_tokens=32, ignore_eos=True, stop=stop, min_tokens=done_at))[0]
    assert same.finish_reason == "stop" and same.token_ids == g[:done_at]
    later = llm.generate([prompt], greedy(max_tokens=32, ignore_eos=True, stop=stop,
                                          min_tokens=done_at + 1))[0]
    assert later.finish_reason == "length" and later.token_ids == g  # the stop occurs only once in `full`


def test_greedy_argmax_takes_the_first_maximum_like_torch_argmax():
    """The sampler's row argmax (max(dim).indices, faster on CPU) against torch.argmax on tie-heavy rows,
    -inf rows (everything banned) and NaN rows."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 40, (64, 49152), generator=gen).float()
    x[3] = float("-inf")
    x[5, 17] = float("nan")
    assert torch.equal(argmax(x), x.argmax(dim=-1))
    assert argmax(x)[3] == 0 and argmax(x)[5] == 17
