"""Random-weight checkpoints with real model shapes, and the machine facts the GPU benchmarks report.

No hub: the configs of Qwen2.5-0.5B, Llama-3.2-1B and Qwen2.5-1.5B are written out below (from their
published config.json), the weights are drawn with the library's own initialiser, and the tokenizer is a
word-level vocabulary "t0".."t{V-1}" (the benchmarks feed token ids; it only has to detokenize).
`--tiny` variants keep each family's structure at toy sizes for CPU runs of the same scripts.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (AutoModelForCausalLM, GenerationConfig, LlamaConfig, PreTrainedTokenizerFast,
                          Qwen2Config)

_QWEN_ROPE = {"rope_type": "default", "rope_theta": 1000000.0}
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

REAL = {
    "qwen2.5-0.5b": (Qwen2Config, dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                       num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                       max_position_embeddings=32768, rms_norm_eps=1e-6,
                                       tie_word_embeddings=True, rope_parameters=_QWEN_ROPE)),
    "llama-3.2-1b": (LlamaConfig, dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                       num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                       vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
                                       tie_word_embeddings=True, rope_parameters=_LLAMA3_ROPE)),
    "qwen2.5-1.5b": (Qwen2Config, dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                       num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                       max_position_embeddings=131072, rms_norm_eps=1e-6,
                                       tie_word_embeddings=True, rope_parameters=_QWEN_ROPE)),
}
_TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, vocab_size=4096, max_position_embeddings=4096)
MODEL_NAMES = tuple(REAL)


@dataclass
class Checkpoint:
    name: str
    path: Path
    hf: torch.nn.Module  # the same weights as a transformers model (the peer), on the benchmark device
    weight_bytes: int  # parameters read per decode step (tied embeddings once)
    vocab_size: int


def build_checkpoint(name: str, root: Path, device: str, dtype: torch.dtype, tiny: bool,
                     mean_output_len: int = 110) -> Checkpoint:
    """Random weights in `root/name`. EOS is a set of about V / mean_output_len token ids, so sampled
    outputs end by EOS after ~mean_output_len tokens on average (runs that ignore EOS are unaffected)."""
    cls, kwargs = REAL[name]
    kwargs = {**kwargs, **_TINY} if tiny else dict(kwargs)
    if tiny and kwargs["rope_parameters"]["rope_type"] == "llama3":  # keep the scaling valid at toy length
        kwargs["rope_parameters"] = {**kwargs["rope_parameters"], "original_max_position_embeddings": 1024}
    vocab = kwargs["vocab_size"]
    eos = list(range(1, vocab, mean_output_len))
    config = cls(**kwargs, bos_token_id=None, eos_token_id=eos[0], pad_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval().requires_grad_(False)
    path = root / name
    model.save_pretrained(path)
    GenerationConfig(eos_token_id=eos, pad_token_id=None).save_pretrained(path)
    word_tokenizer(vocab).save_pretrained(path)
    unique = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return Checkpoint(name, path, model, sum(unique.values()), vocab)


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0")


# ---- the machine ------------------------------------------------------------------------------------------
def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} ({os.cpu_count()} cores, CPU)"


def machine(device: str) -> dict:
    info = {"device": device_name(device), "torch": torch.__version__, "python": platform.python_version(),
            "load_avg": os.getloadavg(), "cpus": os.cpu_count()}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(sms=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1),
                    cuda=torch.version.cuda)
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    import transformers
    info["transformers"] = transformers.__version__
    return info


def memory_bandwidth(device: str, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Measured copy bandwidth in bytes/s, counting bytes read plus bytes written (median of repeats)."""
    src = torch.randn(nbytes // 4, device=device)  # random data, never zeros
    dst = torch.empty_like(src)
    times = []
    for i in range(repeats + 2):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            t = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            t = time.perf_counter() - t0
        if i >= 2:  # warm-up excluded
            times.append(t)
    return 2 * nbytes / statistics.median(times)
