"""Tiny random checkpoints of every supported family, built by the tests themselves (no hub).

Weights use a larger init std than HF's default so the greedy top-2 logit gap is rarely within float noise.
The families in EXTRA_FAMILIES (Gemma 2, Gemma 3, Phi-3) and MOE_FAMILIES also get random norm weights and
biases, so a mapping that swaps two norms or drops a bias cannot hide behind HF's all-equal initial values.
The MoE ones route each token to 2 of 6 experts (random routers, so the choice varies by token and layer)
and mix routed and dense layers (Qwen2-MoE through mlp_only_layers, Qwen3-MoE through decoder_sparse_step).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig,
                          MixtralConfig, Phi3Config, PreTrainedTokenizerFast, Qwen2Config, Qwen2MoeConfig,
                          Qwen3Config, Qwen3MoeConfig)

VOCAB = 512
EOS_ID = 0
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_TEXT = ("The quick brown fox jumps over the lazy dog. Paged attention keeps KV blocks in a pool. "
         "Continuous batching admits new requests every step. Ünïcödé テキスト 😀 emoji and accents. ")

_BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512, eos_token_id=EOS_ID,
             bos_token_id=None, pad_token_id=None, initializer_range=0.3, rms_norm_eps=1e-6)

FAMILIES = {
    "llama": lambda: LlamaConfig(**_BASE, tie_word_embeddings=False),
    "llama_mqa_rope_scaled": lambda: LlamaConfig(**{**_BASE, "num_key_value_heads": 1}, attention_bias=True,
                                                 rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0,
                                                                  "factor": 8.0, "low_freq_factor": 1.0,
                                                                  "high_freq_factor": 4.0,
                                                                  "original_max_position_embeddings": 64}),
    "qwen2": lambda: Qwen2Config(**_BASE, tie_word_embeddings=True),
    "qwen3": lambda: Qwen3Config(**_BASE, head_dim=32, tie_word_embeddings=True),
    "mistral": lambda: MistralConfig(**_BASE, sliding_window=24, tie_word_embeddings=False),
}

# Small soft-caps and windows so each feature changes the output of these tiny models (a real Gemma 2 caps
# at 50 / 30 and slides over 4096 positions); head_dim is explicit (Gemma's default is 256).
_GEMMA = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=12, tie_word_embeddings=True)
_ALTERNATING = ["sliding_attention", "full_attention"]
_LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0, 1.3, 1.9, 2.6, 3.1, 4.0],
                 long_factor=[1.5, 2.5, 4.0, 6.5, 9.0, 12.0], original_max_position_embeddings=64)
EXTRA_FAMILIES = {
    "gemma2": lambda: Gemma2Config(**_BASE, **_GEMMA, attn_logit_softcapping=4.0, final_logit_softcapping=1.0,
                                   attention_bias=True, layer_types=_ALTERNATING),
    # Gemma 3: q/k norms, local layers with their own RoPE (theta 10k) and global ones linearly scaled.
    "gemma3_text": lambda: Gemma3TextConfig(**_BASE, **_GEMMA, layer_types=_ALTERNATING, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}),
    # Phi-3 with a window on every layer, and (as Phi-4-mini) only part of each head rotated.
    "phi3": lambda: Phi3Config(**_BASE, sliding_window=24, tie_word_embeddings=False, partial_rotary_factor=0.5),
    # Phi-4-mini's shape of RoPE: LongRoPE over 3/4 of each head (original length 64 here).
    "phi3_longrope": lambda: Phi3Config(**_BASE, tie_word_embeddings=False, original_max_position_embeddings=64,
                                        rope_parameters={**_LONGROPE, "partial_rotary_factor": 0.75}),
}

# Small experts (moe_intermediate_size 32); Qwen2-MoE's real checkpoints leave norm_topk_prob false, Qwen3's
# set it true; Mixtral always renormalises and routes in every layer (here over a 24-token window).
_MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32)
MOE_FAMILIES = {
    "qwen2_moe": lambda: Qwen2MoeConfig(**_BASE, **_MOE, shared_expert_intermediate_size=48, norm_topk_prob=False,
                                        decoder_sparse_step=1, mlp_only_layers=[1], tie_word_embeddings=False),
    "qwen3_moe": lambda: Qwen3MoeConfig(**_BASE, **_MOE, head_dim=32, norm_topk_prob=True, decoder_sparse_step=2,
                                        tie_word_embeddings=True),
    "mixtral": lambda: MixtralConfig(**{**_BASE, "intermediate_size": 48}, num_local_experts=6, num_experts_per_tok=2,
                                     sliding_window=24, tie_word_embeddings=False),
}
_RANDOMISED = {**EXTRA_FAMILIES, **MOE_FAMILIES}


@functools.lru_cache(maxsize=1)
def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.train_from_iterator([_TEXT] * 200, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build(family: str, root: Path, seed: int = 0, **overrides) -> tuple[Path, torch.nn.Module]:
    """Save a random `family` checkpoint + tokenizer under root/family; return (dir, HF model in fp32)."""
    config = {**FAMILIES, **_RANDOMISED}[family]()
    for k, v in overrides.items():
        setattr(config, k, v)
    if getattr(config, "layer_types", None):  # one entry per layer (num_hidden_layers may be overridden)
        pattern = config.layer_types
        config.layer_types = [pattern[i % len(pattern)] for i in range(config.num_hidden_layers)]
    torch.manual_seed(seed)
    # Soft-capped attention (Gemma 2) is only right in HF's eager attention: transformers 5.17 (the H200
    # image's) ran Gemma 2 through SDPA by default, which drops the cap, and 5.24 refuses SDPA for it.
    attn = {"attn_implementation": "eager"} if getattr(config, "attn_logit_softcapping", None) else {}
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **attn).eval()
    if family in _RANDOMISED:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name or name.endswith(".bias") or name.endswith(("mlp.gate.weight", "expert_gate.weight")):
                    param.normal_(0.0, 0.3)  # routers too: HF may start them at zero (every expert tied)
            if config.model_type.startswith("gemma"):
                # Gemma multiplies embeddings by sqrt(hidden_size): dividing the random table by it keeps the
                # residual stream at the other families' scale, so the layers decide the output instead of
                # the tied embedding's self-similarity (which made every prompt repeat one token).
                model.model.embed_tokens.weight.div_(config.hidden_size ** 0.5)
    out = root / family
    model.save_pretrained(out)
    tokenizer().save_pretrained(out)
    return out, model
