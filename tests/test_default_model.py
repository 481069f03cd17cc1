"""The embedded default model: loads like any HF checkpoint, matches HF, answers with recognisable text."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import DEFAULT_MODEL_DIR, LLM, SamplingParams

# Common English words; a random-token model would almost never produce three of them.
_ENGLISH = {"the", "a", "of", "to", "is", "and", "in", "for", "return", "returns", "if", "this", "that",
            "be", "an", "list", "value", "file", "module", "name", "object", "string", "given", "with"}


@pytest.fixture(scope="module")
def llm():
    return LLM()


@pytest.fixture(scope="module")
def hf():
    return AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, local_files_only=True).eval()


def test_checkpoint_is_small_and_in_hf_layout():
    names = {p.name for p in DEFAULT_MODEL_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert sum(p.stat().st_size for p in DEFAULT_MODEL_DIR.iterdir()) < 20 * 1024**2
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR, local_files_only=True)
    assert tok.chat_template


@pytest.mark.parametrize("prompt", ["Return a new", "This module provides", "The file object"])
def test_greedy_plain_text_equals_hf_and_reads_as_english(llm, hf, prompt):
    """min_tokens keeps the (terse) model talking long enough to judge; HF gets the same constraint."""
    out = llm.generate([prompt], SamplingParams(max_tokens=32, min_tokens=24, temperature=0))[0]
    ids = llm.tokenizer.encode(prompt)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=24,
                          do_sample=False)[0, len(ids):].tolist()
    assert out.token_ids == ref[: len(out.token_ids)] and len(out.token_ids) >= 24
    words = re.findall(r"[a-z]+", out.text.lower())
    assert len([w for w in words if w in _ENGLISH]) >= 6, out.text


def test_chat_answer_is_recognisable_and_stops_at_end_of_turn(llm):
    out = llm.chat([{"role": "user", "content": "What does os.path.join do?"}],
                   SamplingParams(max_tokens=48, temperature=0))
    words = re.findall(r"[a-z]+", out.text.lower())
    assert len([w for w in words if w in _ENGLISH]) >= 2, out.text
    assert out.finish_reason == "stop" and out.token_ids[-1] in llm.engine.eos_token_ids
    assert "<|im_end|>" not in out.text
