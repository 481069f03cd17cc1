"""GPTQ and AWQ int4 checkpoints served quantized on CPU (engine/models/int4_loader.py); their CUDA path, the
Triton int4 GEMM, is tests/test_int4_triton.py's.

The checkpoints are written here, from the formats' own definitions (AutoGPTQ's and AutoAWQ's packing, written
out in this file, not taken from the loader): random int4 codes, scales and zero points per group, packed into
qweight / qzeros / scales. The oracle is the checkpoint's dequantization, scale * (q - z), computed here:
- symmetric GPTQ (z = 8): Tandem's Q4_1 blocks dequantize to exactly those weights, and greedy decoding equals
  Hugging Face's on them, token for token (near-ties aside, as in test_correctness_hf);
- AWQ and asymmetric GPTQ: the Q4_1 min is -scale * z rounded to fp16, so each weight may differ by half an
  fp16 ulp of that product, which the test bounds; the model-level check gives HF the weights with that
  documented rounding (scale * q + fp16(-scale * z), computed here) and expects HF's greedy tokens.
The real SmolLM2-135M is quantized here to a symmetric GPTQ checkpoint (round to nearest, group 128) and must
give HF's greedy tokens on the same dequantized weights.

Every test here runs the exact path (TANDEM_QUANT_ACTIVATIONS=fp32): the int8-activation arithmetic of the same
Q4_1 kernel, and its agreement with HF, are tests/test_cpu_gemm_quant.py's and tests/test_gguf_model.py's.
"""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, EngineConfig, SamplingParams
from engine.cpu.quant import QuantLinear
from engine.models import from_gguf
from engine.models.int4_loader import int4_scheme, to_q4_1
from test_correctness_hf import MAX_NEW, assert_matches_hf, make_prompts

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i of word c holds output 8c + order[i]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(autouse=True)
def exact_activations(monkeypatch):
    monkeypatch.setenv("TANDEM_QUANT_ACTIVATIONS", "fp32")


# ---- the formats, from their definitions ------------------------------------------------------------------

def _int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (held in int64) as the int32 a checkpoint stores (two's complement)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()


def pack_gptq(q: torch.Tensor, z_stored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoGPTQ: qweight [K/8, N], weight k in bits 4*(k%8) of row k//8; qzeros [G, N/8], output n in bits 4*(n%8)."""
    qt = q.t().to(torch.int64)  # [K, N]
    qweight = sum(qt[j::8] << (4 * j) for j in range(8))
    zs = z_stored.to(torch.int64) & 0xF
    qzeros = sum(zs[:, j::8] << (4 * j) for j in range(8))
    return _int32(qweight), _int32(qzeros)


def pack_awq(q: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoAWQ (GEMM): qweight [K, N/8] and qzeros [G, N/8], word c's nibble i = output 8c + AWQ_PACK_ORDER[i]."""
    def pack(cols: torch.Tensor) -> torch.Tensor:  # [R, N]
        cols = cols.to(torch.int64)
        return _int32(sum(cols[:, AWQ_PACK_ORDER[i]::8] << (4 * i) for i in range(8)))
    return pack(q.t()), pack(z)


def random_groups(n: int, k: int, group: int, sym: bool, gen: torch.Generator):
    """Random int4 codes q [N, K], zero points z [G, N] and fp16 scales [G, N] of one linear."""
    groups = k // group
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    z = torch.full((groups, n), 8, dtype=torch.int32) if sym else \
        torch.randint(1, 16, (groups, n), generator=gen, dtype=torch.int32)
    scales = (torch.rand(groups, n, generator=gen) * 0.05 + 0.001).half()
    return q, z, scales


def reference(q, z, scales, rounded_min: bool, group: int | None = None) -> torch.Tensor:
    """The checkpoint's fp32 weight [N, K]: scale * (q - z); with `rounded_min`, scale * q + fp16(-scale * z).
    `group`: the group size (default: K over the number of groups; the last group may be short)."""
    k = q.shape[1]
    of = torch.arange(k) // (group or k // scales.shape[0])  # each input feature's group
    s, zz = scales.float().t()[:, of], z.float().t()[:, of]
    if not rounded_min:
        return (q.float() - zz) * s
    m = (-(scales.float() * z.float())).half().float().t()[:, of]
    return s * q.float() + m


def checkpoint_tensors(method: str, q, z, scales, group: int, fmt: str = "gptq") -> dict[str, torch.Tensor]:
    if method == "awq":
        qweight, qzeros = pack_awq(q, z)
        return {"qweight": qweight, "qzeros": qzeros, "scales": scales}
    qweight, qzeros = pack_gptq(q, z - (1 if fmt == "gptq" else 0))
    g_idx = (torch.arange(q.shape[1]) // group).to(torch.int32)
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}


def qconfig(method: str, group: int, sym: bool = True, fmt: str = "gptq") -> dict:
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm", "zero_point": True}
    return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": sym,
            "checkpoint_format": fmt}


# ---- the scheme and one linear -----------------------------------------------------------------------------

@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "fp8"}, "quant_method='fp8'"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits=8"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 100}, "group_size=100"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "desc_act"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "marlin"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "gemv"),
])
def test_unsupported_schemes_are_refused_by_name(qc, match):
    with pytest.raises(ValueError, match=match):
        int4_scheme(qc)


@pytest.mark.parametrize("group", [32, 128, -1])
def test_symmetric_gptq_blocks_are_the_checkpoints_weights_exactly(group):
    gen = torch.Generator().manual_seed(group % 7)
    n, k = 48, 256
    q, z, scales = random_groups(n, k, k if group == -1 else group, sym=True, gen=gen)
    t = checkpoint_tensors("gptq", q, z, scales, k if group == -1 else group)
    w = to_q4_1(int4_scheme(qconfig("gptq", group)), t["qweight"], t["qzeros"], t["scales"])
    assert torch.equal(w.dequantize(), reference(q, z, scales, rounded_min=False))
    assert w.nbytes == n * k // 32 * 20


@pytest.mark.parametrize("method,fmt", [("awq", "gptq"), ("gptq", "gptq_v2"), ("gptq", "gptq")])
def test_asymmetric_blocks_differ_by_at_most_half_an_fp16_ulp_of_the_min(method, fmt):
    gen = torch.Generator().manual_seed(3)
    n, k, group = 64, 256, 64
    q, z, scales = random_groups(n, k, group, sym=False, gen=gen)
    t = checkpoint_tensors(method, q, z, scales, group, fmt)
    w = to_q4_1(int4_scheme(qconfig(method, group, sym=False, fmt=fmt)), t["qweight"], t["qzeros"], t["scales"])
    want = reference(q, z, scales, rounded_min=False)
    got = w.dequantize()
    sz = (scales.float() * z.float()).t().repeat_interleave(group, dim=1)  # |m| before rounding
    # half an fp16 ulp of |m| (normal range: 2^-11 relative), plus fp32's rounding of d * q + m
    bound = sz * 2.0**-11 + want.abs() * 2.0**-24 + 2.0**-25
    assert ((got - want).abs() <= bound).all()
    assert not torch.equal(got, want), "no min needed rounding: the bound was never exercised"
    assert torch.equal(got, reference(q, z, scales, rounded_min=True))  # and it is exactly that rounding


def test_quantized_linear_matches_fp64_on_the_checkpoint_weights():
    gen = torch.Generator().manual_seed(5)
    n, k, group = 96, 512, 128
    q, z, scales = random_groups(n, k, group, sym=True, gen=gen)
    t = checkpoint_tensors("gptq", q, z, scales, group)
    lin = QuantLinear([to_q4_1(int4_scheme(qconfig("gptq", group)), t["qweight"], t["qzeros"], t["scales"])])
    x = torch.randn(5, k, generator=gen)
    w = reference(q, z, scales, rounded_min=False).double()
    want = x.double() @ w.t()
    gamma = k * 2.0**-24 / (1 - k * 2.0**-24)  # fp32 summation of k products
    bound = gamma * (x.double().abs() @ w.abs().t()) + 1e-30
    assert ((lin(x).double() - want).abs() <= bound).all()


# ---- whole models --------------------------------------------------------------------------------------------

def quantize_checkpoint(src, dst, method: str, group: int, sym: bool, fmt: str = "gptq", seed: int = 0,
                        exact: bool = False):
    """dst := src's checkpoint with every decoder linear replaced by random-looking int4 groups fitted to its
    weights (round to nearest), in `method`'s layout; returns {linear name: its fp32 reference weight}: the
    weights the CPU's Q4_1 blocks hold (asymmetric: with the rounded min), or with `exact` the checkpoint's
    own scale * (q - z) (what the Triton int4 GEMM computes)."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    out, refs = {}, {}
    for name, value in tensors.items():
        if not (name.endswith(".weight") and name.split(".")[-2] in LINEARS):
            out[name] = value
            continue
        w = value.float()
        n, k = w.shape
        g = k if group == -1 else group
        of = torch.arange(k) // g  # the last group is short where g does not divide K (SmolLM2's 576)
        groups = [w[:, i * g:(i + 1) * g] for i in range(-(-k // g))]
        if sym:
            s = torch.stack([(c.abs().amax(-1) / 7.5).clamp_min(1e-6) for c in groups], 1).half()  # [n, G]
            z = torch.full_like(s, 8, dtype=torch.int32)
        else:
            lo = torch.stack([c.amin(-1) for c in groups], 1)
            s = ((torch.stack([c.amax(-1) for c in groups], 1) - lo) / 15).clamp_min(1e-6).half()
            z = (-lo / s.float()).round().clamp(1, 15).to(torch.int32)
        q = ((w / s.float()[:, of]).round() + z[:, of]).clamp(0, 15).to(torch.uint8)
        z, s = z.t().contiguous(), s.t().contiguous()  # [G, n]
        base = name[: -len(".weight")]
        out.update({f"{base}.{key}": val for key, val in checkpoint_tensors(method, q, z, s, g, fmt).items()})
        refs[name] = reference(q, z, s, rounded_min=not (sym or exact), group=g)
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = qconfig(method, group, sym, fmt)
    (dst / "config.json").write_text(json.dumps(config))
    return refs


def hf_on(hf_model, refs: dict[str, torch.Tensor]):
    """A copy of the HF model whose linears hold the reference weights."""
    model = copy.deepcopy(hf_model)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, w in refs.items():
            params[name].copy_(w)
    return model


@pytest.mark.parametrize("family,method,group,sym,fmt", [
    ("llama", "gptq", 32, True, "gptq"),
    ("qwen2", "gptq", -1, True, "gptq"),  # q/k/v biases stay fp32; the tied head stays the embedding
    ("llama", "awq", 64, False, "gptq"),
    ("qwen3", "gptq", 32, False, "gptq_v2"),
])
def test_greedy_matches_hf_on_the_checkpoints_weights(tiny_model_factory, tmp_path, family, method, group, sym, fmt):
    path, hf = tiny_model_factory(family)
    qdir = tmp_path / f"{family}-{method}"
    refs = quantize_checkpoint(path, qdir, method, group, sym, fmt)
    reference_model = hf_on(hf, refs)
    llm = LLM(str(qdir), block_size=4, max_num_batched_tokens=32)
    quantized = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantLinear)]
    assert len(quantized) == 4 * hf.config.num_hidden_layers  # qkv, o, gate/up, down of every layer
    prompts = make_prompts(seed=2)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert_matches_hf(reference_model, prompt, out.token_ids)
    llm.shutdown()


def test_a_quantized_lm_head_and_unsupported_settings_are_refused(tiny_model_factory, tmp_path):
    path, _ = tiny_model_factory("llama")
    qdir = tmp_path / "q"
    quantize_checkpoint(path, qdir, "gptq", 32, True)
    with pytest.raises(ValueError, match="dtype='bfloat16' \\(on CPU"):
        EngineConfig(model=str(qdir), device="cpu", dtype="bfloat16")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8'"):
        EngineConfig(model=str(qdir), device="cpu", kv_cache_dtype="fp8")
    EngineConfig(model=str(qdir), device="sim")  # priced at the Triton GEMM's bytes
    EngineConfig(model=str(qdir), device="cuda", dtype="bfloat16", kv_cache_dtype="fp8")  # the Triton int4 GEMM
    with pytest.raises(ValueError, match="LoRA adapters .* over the Triton int4 GEMM"):
        EngineConfig(model=str(qdir), device="cuda", dtype="bfloat16", enable_lora=True)
    EngineConfig(model=str(qdir), enable_lora=True)  # over the CPU's Q4_1 linears (tests/test_quantized_pp_lora.py)
    EngineConfig(model=str(qdir), pipeline_parallel_size=2)
    tensors = load_file(str(qdir / "model.safetensors"))
    w = tensors.pop("lm_head.weight")
    tensors.update({f"lm_head.{k}": v for k, v in checkpoint_tensors(
        "gptq", torch.zeros(w.shape, dtype=torch.uint8), torch.full((w.shape[1] // 32, w.shape[0]), 8,
                                                                   dtype=torch.int32),
        torch.ones(w.shape[1] // 32, w.shape[0]).half(), 32).items()})
    save_file(tensors, str(qdir / "model.safetensors"))
    with pytest.raises(ValueError, match="lm_head.qweight"):
        LLM(str(qdir))


@pytest.mark.parametrize("group", [128, -1])
def test_the_simulated_device_prices_int4_linears_at_the_triton_layouts_bytes(tmp_path, group):
    """Llama-3.1-8B's config with a GPTQ quantization_config on the simulated H100: each decoder linear is priced
    at what int4_triton.pack holds for it (measured on a packed weight of the same shape, not from the formula),
    the head and embedding stay bf16, and the KV cache gets the memory freed."""
    from engine.models.int4_triton import pack
    from engine.sim import SIM_MODELS
    from test_fp8_checkpoint import sim_cost_and_kv_blocks as runner

    def packed_bytes(n: int, k: int) -> int:
        g = k if group == -1 else group
        z = torch.full((-(-k // g), n), 8, dtype=torch.int32)
        return pack(torch.zeros(n, k, dtype=torch.uint8), z, torch.ones(z.shape).half(), None if group == -1
                    else group).nbytes

    q4 = tmp_path / "llama-gptq"
    shutil.copytree(SIM_MODELS / "llama-3.1-8b", q4)
    config = json.loads((q4 / "config.json").read_text())
    (q4 / "config.json").write_text(json.dumps({**config, "quantization_config": qconfig("gptq", group)}))
    (bf16, bf16_blocks), (ours, q4_blocks) = runner(str(SIM_MODELS / "llama-3.1-8b")), runner(str(q4))
    h, i, q, kv = 4096, 14336, 4096, 1024
    linears = ((q + 2 * kv, h), (h, q), (2 * i, h), (h, i))
    assert ours.layer_weight_bytes == sum(packed_bytes(n, k) for n, k in linears)
    assert bf16.layer_weight_bytes == 2 * sum(n * k for n, k in linears)
    assert 3.5 < bf16.layer_weight_bytes / ours.layer_weight_bytes < 4.0  # half a byte a weight plus the groups
    assert ours.head_weight_bytes == bf16.head_weight_bytes == 128256 * h * 2
    freed, per_block = 32 * (bf16.layer_weight_bytes - ours.layer_weight_bytes), 16 * ours.kv_bytes_per_token
    assert abs((q4_blocks - bf16_blocks) * per_block - freed) <= per_block  # every freed byte to the KV cache


def test_real_smollm2_gptq_greedy_matches_hf(tmp_path):
    """SmolLM2-135M-Instruct quantized here to symmetric GPTQ (group 128, round to nearest): Tandem's greedy tokens
    equal HF's on the same dequantized weights for 8 chat prompts (or first differ at a near-tie)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = from_gguf.smollm2_dir()
    qdir = tmp_path / "smollm2-gptq"
    refs = quantize_checkpoint(src, qdir, "gptq", 128, True)
    hf = hf_on(AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval(), refs)
    tok = AutoTokenizer.from_pretrained(str(src))
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "Explain what a hash map is.",
                 "List three prime numbers.", "Who wrote Romeo and Juliet?", "What is 12 times 7?",
                 "How do plants make food?", "Why is the sky blue?"]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  tokenize=False), add_special_tokens=False) for q in questions]
    # Sized for these prompts: the default sizing profiles 256 sequences and zeroes a KV pool of half the free RAM.
    llm = LLM(str(qdir), max_num_seqs=8, max_num_batched_tokens=512, num_kv_blocks=128)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert_matches_hf(hf, list(prompt), out.token_ids)
    llm.shutdown()
