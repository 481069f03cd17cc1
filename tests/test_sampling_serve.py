"""Logprobs and several choices over HTTP with the official `openai` client: completions echo (with and
without logprobs, text_offset), vLLM's prompt_logprobs extra, chat logprobs + top_logprobs streamed and whole;
n > 1 (streamed interleaved by index, seeded, with echo) and best_of.

One private Serve cluster (one engine replica) on the embedded model. Oracle: Hugging Face transformers'
log_softmax over the same checkpoint in fp32 (the engine runs fp32 on CPU)."""

from __future__ import annotations

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.config import DEFAULT_MODEL_DIR
from serve_cluster import serve_cluster

MODEL = "tandem-default"
PROMPT = "Return the number of"
ATOL = 2e-3  # fp32 on both sides; different GEMM kernels


@pytest.fixture(scope="module")
def client():
    with serve_cluster({"num_replicas": 1}) as c:
        yield openai.OpenAI(base_url=c.api_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hf():
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, local_files_only=True, dtype=torch.float32)
    return tok, model.eval()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row i is the distribution of token i+1."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_completion_echo_with_logprobs_matches_hf(client, hf):
    tok, model = hf
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True,
                                  logprobs=2, extra_body={"ignore_eos": True})
    c = r.choices[0]
    prompt_ids = tok.encode(PROMPT)
    n = len(prompt_ids)
    assert c.text.startswith(PROMPT)
    lp = c.logprobs
    assert len(lp.tokens) == n + r.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ids = prompt_ids + hf_greedy(model, prompt_ids, 6)
    ref = hf_logprobs(model, ids)
    assert lp.tokens == [tok.decode([t]) for t in ids]
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - ref[i - 1, ids[i]].item()) < ATOL, i
        top = ref[i - 1].topk(2)
        assert sorted(lp.top_logprobs[i].values(), reverse=True) == pytest.approx(top.values.tolist(), abs=ATOL)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert lp.text_offset[n] == len(PROMPT)  # the first generated token starts right after the echo


def test_completion_echo_without_logprobs_and_streamed_echo(client):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    assert r.choices[0].text == PROMPT + plain.choices[0].text and r.choices[0].logprobs is None
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True,
                                            logprobs=1, stream=True))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


def test_prompt_logprobs_extra_on_both_endpoints(client, hf):
    tok, model = hf
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 3})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    ids = tok.encode(PROMPT)
    ref = hf_logprobs(model, ids)
    assert len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):
        mine = plp[i][str(ids[i])]
        assert abs(mine["logprob"] - ref[i - 1, ids[i]].item()) < ATOL
        assert mine["rank"] == int((ref[i - 1] > ref[i - 1, ids[i]]).sum()) + 1
        assert mine["decoded_token"] == tok.decode([ids[i]])
        top = sorted((v["logprob"] for v in plp[i].values() if v["rank"] <= 3), reverse=True)
        assert top == pytest.approx(ref[i - 1].topk(3).values.tolist(), abs=ATOL)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 0})
    plp = chat.model_extra["prompt_logprobs"]
    assert plp[0] is None and all(len(e) == 1 for e in plp[1:])
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": 99})
    assert err.value.body["param"] == "prompt_logprobs"


def test_chat_logprobs_streamed_equal_whole_and_hf(client, hf):
    tok, model = hf
    messages = [{"role": "user", "content": "What does os.path.join do?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                           logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    streamed = [e for c in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                          temperature=0, logprobs=True, top_logprobs=3, stream=True,
                                                          extra_body={"ignore_eos": True})
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    # Same tokens; values equal up to float noise (the second request's prefill may hit the prefix cache).
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in streamed] == \
        [(e.token, [t.token for t in e.top_logprobs]) for e in content]
    flat = [[e.logprob] + [t.logprob for t in e.top_logprobs] for e in streamed]
    assert flat == [pytest.approx([e.logprob] + [t.logprob for t in e.top_logprobs], abs=1e-5) for e in content]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tok.encode(text, add_special_tokens=False)
    out_ids = hf_greedy(model, prompt_ids, 8)
    ref = hf_logprobs(model, prompt_ids + out_ids)
    for j, e in enumerate(content):
        row = ref[len(prompt_ids) - 1 + j]
        assert e.token == tok.decode([out_ids[j]]) and abs(e.logprob - row[out_ids[j]].item()) < ATOL
        assert e.bytes == list(e.token.encode())
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(row.topk(3).values.tolist(), abs=ATOL)


# ---- n > 1 and best_of ----------------------------------------------------------------------------------------
def test_n3_streamed_chat_interleaves_choices_each_equal_to_hf(client, hf):
    tok, model = hf
    messages = [{"role": "user", "content": "Name a prime number."}]
    stream = client.chat.completions.create(model=MODEL, messages=messages, n=3, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    text, roles, finish, order, usage = {}, {}, {}, [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            order.append(c.index)
            roles.setdefault(c.index, c.delta.role)
            text[c.index] = text.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    assert sorted(text) == [0, 1, 2] and roles == {0: "assistant", 1: "assistant", 2: "assistant"}
    assert finish == {0: "length", 1: "length", 2: "length"}
    assert order != sorted(order), "choices stream interleaved as their tokens commit, not one after another"
    prompt_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    expected = tok.decode(hf_greedy(model, list(prompt_ids), 8))
    assert text == {0: expected, 1: expected, 2: expected}
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids), 3 * 8), "the prompt counts once"


def test_n3_seeded_samples_are_distinct_reproducible_and_stream_like_whole(client):
    kw = dict(model=MODEL, prompt=PROMPT, n=3, max_tokens=10, temperature=1.0, seed=1234,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    texts = [c.text for c in whole.choices]
    assert len(set(texts)) == 3
    assert [c.text for c in client.completions.create(**kw).choices] == texts
    streamed = {}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == texts
    assert whole.usage.completion_tokens == 30


def test_best_of_returns_the_samples_with_the_highest_mean_logprob(client):
    """best_of=4 draws the same four samples as n=4 with the same seed (sample i is seeded seed + i): the
    two it returns must be the two best of those by mean token logprob, and usage counts all four."""
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=99, extra_body={"ignore_eos": True})
    every = client.completions.create(n=4, logprobs=0, **kw)
    mean = {c.text: sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in every.choices}
    best = client.completions.create(n=2, best_of=4, **kw)
    assert [c.text for c in best.choices] == sorted(mean, key=mean.get, reverse=True)[:2]
    assert [c.index for c in best.choices] == [0, 1]
    assert all(c.logprobs is None for c in best.choices), "logprobs were not asked for"
    assert best.usage.completion_tokens == 4 * 6


def test_echo_with_logprobs_on_every_choice(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, n=2, max_tokens=3, temperature=0, echo=True,
                                  logprobs=1, extra_body={"ignore_eos": True})
    first, second = r.choices
    assert first.text == second.text and first.text.startswith(PROMPT)
    assert first.logprobs.tokens == second.logprobs.tokens
    assert first.logprobs.token_logprobs[0] is None and second.logprobs.token_logprobs[0] is None
    assert second.logprobs.token_logprobs == pytest.approx(first.logprobs.token_logprobs, abs=1e-6)
