"""engine/cpu/decode_stack.py: a CPU decode step's layers in one call (decode_attention.cpp's DecodeStack) against
the Python layers it replaces (DecoderLayer.forward_fused), on the same engine: the same kernels in the same order,
so the same tokens and the same logprobs, bit for bit, in fp32, bf16 and with quantized linears under both
activation paths; the steps it takes are counted, so a test cannot pass with the stack unused. Models it cannot
run say why and keep the Python layers (and HF's tokens: tests/test_correctness_hf.py and the GGUF tests run
through the stack wherever it applies)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention import cpu_native
from engine.cpu.linear import tandem_gemm
from test_int4_checkpoint import quantize_checkpoint

pytestmark = pytest.mark.skipif(cpu_native.load() is None, reason="the CPU extension does not build here")
PROMPTS = [[5, 9, 33, 2, 71, 14, 9, 8, 100, 3] * 3, [17, 4, 4, 250], [8, 8]]


class Counted:
    """The built DecodeStack, counting the steps it runs."""

    def __init__(self, stack):
        self.stack, self.calls = stack, 0

    def run(self, *args):
        self.calls += 1
        return self.stack.run(*args)


def generate(llm, through_stack: bool):
    model = llm.engine.runner.model
    saved = model.cpu_stack
    if not through_stack:
        model.cpu_stack = lambda *args: None
    try:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
        outs = llm.generate(PROMPTS, params)
    finally:
        model.cpu_stack = saved
    return [(o.token_ids, [(lp.logprob, lp.top) for lp in o.logprobs]) for o in outs]


def stack_equals_python_layers(llm) -> int:
    """Generates through the Python layers, then through the stack; asserts they agree; returns the steps the stack
    ran."""
    python = generate(llm, through_stack=False)
    helper = llm.engine.runner.model.cpu_stack
    generate(llm, through_stack=True)  # built for the engine's KV cache (the memory profile's steps had their own)
    assert helper.reason is None and helper.stack is not None, helper.reason
    helper.stack = counted = Counted(helper.stack)
    assert generate(llm, through_stack=True) == python
    return counted.calls


@pytest.mark.parametrize("family", ["llama", "llama_mqa_rope_scaled", "qwen2", "mistral", "phi3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_steps_through_the_stack_equal_the_python_layers(tiny_model_factory, family, dtype):
    """Biases (Qwen2's q/k/v, Llama's attention_bias), one KV head, scaled RoPE, a sliding window (Mistral, Phi-3),
    partial rotary (Phi-3); chunked prefill beside decodes (16-token budget), so mixed steps take the Python layers
    and decode-only steps the stack."""
    path, _ = tiny_model_factory(family)
    llm = LLM(str(path), dtype=dtype, block_size=4, max_num_batched_tokens=16, enable_prefix_caching=False)
    try:
        if tandem_gemm(getattr(torch, dtype)) is None:
            # AVX-512 without AVX512-BF16: bf16 linears are oneDNN's (engine/cpu/linear.py), which the stack does not
            # run; it must say so and leave the steps to the Python layers, whose tokens are then the ones served.
            python = generate(llm, through_stack=False)
            assert generate(llm, through_stack=True) == python
            helper = llm.engine.runner.model.cpu_stack
            assert helper.stack is None and "a linear the stack does not run" in helper.reason, helper.reason
            return
        assert stack_equals_python_layers(llm) >= 8
    finally:
        llm.shutdown()


@pytest.mark.parametrize("activations", ["int8", "fp32"])
def test_quantized_linears_through_the_stack_equal_the_python_layers(tiny_model_factory, tmp_path, monkeypatch,
                                                                     activations):
    """A GPTQ checkpoint's linears as Q4_1 blocks (packed where the CPU has AVX-512 VNNI), with q/k/v biases."""
    monkeypatch.setenv("TANDEM_QUANT_ACTIVATIONS", activations)
    path, _ = tiny_model_factory("qwen2")
    qdir = tmp_path / "qwen2-gptq"
    quantize_checkpoint(path, qdir, "gptq", 32, True)
    llm = LLM(str(qdir), block_size=4, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert stack_equals_python_layers(llm) >= 8
    llm.shutdown()


@pytest.mark.parametrize("family,why", [("qwen3", "q/k norms"), ("mixtral", "not a dense MLP"),
                                        ("gemma2", None)])  # sandwich norms: never the fused layers, never asked
def test_models_it_cannot_run_say_why_and_keep_the_python_layers(tiny_model_factory, family, why):
    path, _ = tiny_model_factory(family)
    llm = LLM(str(path), dtype="float32", block_size=4)
    outs = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    helper = llm.engine.runner.model.cpu_stack
    assert len(outs[0].token_ids) == 4 and helper.stack is None
    assert helper.reason is None if why is None else why in helper.reason
    llm.shutdown()


def test_lora_keeps_the_python_layers(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    llm = LLM(str(path), dtype="float32", block_size=4, enable_lora=True)
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    helper = llm.engine.runner.model.cpu_stack
    assert helper.stack is None and "LoRA" in helper.reason
    llm.shutdown()
