"""Tiny random checkpoints of every supported family, built by the tests themselves (no hub).

Weights use a larger init std than HF's default so the greedy top-2 logit gap is rarely within float noise.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, PreTrainedTokenizerFast,
                          Qwen2Config, Qwen3Config)

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
    config = FAMILIES[family]()
    for k, v in overrides.items():
        setattr(config, k, v)
    if getattr(config, "layer_types", None):  # one entry per layer (num_hidden_layers may be overridden)
        config.layer_types = [config.layer_types[0]] * config.num_hidden_layers
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    out = root / family
    model.save_pretrained(out)
    tokenizer().save_pretrained(out)
    return out, model
