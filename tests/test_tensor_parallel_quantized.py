"""Tensor parallelism over quantized weights (engine/models/tp.py's take_shard, the GGUF / int4 / FP8 loaders).

- Shards, against the whole weight's bytes: every rank's rows (q/k/v, gate/up) and K blocks (o, down) put back
  together are the whole tensor's blocks, for Q8_0, Q4_1, Q5_0, Q4_K, Q6_K and FP8; a vocabulary shard's padding
  is zero blocks, which dequantize (gguf's own dequantize) to 0.
- Refusals, by name: a K that does not split on a type's blocks, heads that do not divide (the real SmolLM2 Q4_1
  file: 9 heads over 2 ranks).
- TP=2 in process (tests/test_tensor_parallel.py's local_engine) on the exact path (TANDEM_QUANT_ACTIVATIONS=fp32:
  fp32 activations times the exactly dequantized weights) gives Hugging Face's greedy tokens on independently
  dequantized weights: a tiny llama GGUF file written here (q/k rows permuted as llama.cpp's converter does, read
  back by transformers' own GGUF loader), a GPTQ and an FP8 checkpoint written by their tests' format code.
- TP=2 against TP=1 on the int8-activation default: x's Q8_0 blocks are the same on every rank (a K split falls on
  block boundaries), so the two differ only in the order the partial sums are added; the test asserts equal
  tokens or a first difference at a near-tie of TP=1's own logits.
- FP8 with dynamic per-token activations: each rank quantizes its own K slice of a token (the reference does the
  same per half of o_proj's and down_proj's inputs).
- Each rank holds about half of the whole model's quantized bytes.
- The worker rank as a Ray actor (its own process) reads the GGUF file itself and gives the in-process tokens.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from engine.cpu.quant import BLOCK_BYTES, BLOCK_WEIGHTS, QuantWeight, quantized_bytes
from engine.models import from_gguf
from engine.models.decoder import ModelSpec
from engine.models.gguf_loader import FileRows, _unpermute, weight_bytes
from engine.models.tp import TPShard, take_shard
from test_correctness_hf import assert_matches_hf, make_prompts
from test_pipeline_parallel import GREEDY, run_engine
from test_tensor_parallel import OPTS, local_engine

T = gguf.GGMLQuantizationType


def _spec(**kw) -> ModelSpec:
    base = dict(family="llama", vocab_size=515, hidden_size=512, intermediate_size=1024, num_layers=1, num_heads=8,
                num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, qkv_bias=False, o_bias=False, mlp_bias=False,
                qk_norm=False, tie_word_embeddings=True, sliding_window=None, max_position_embeddings=64,
                hidden_act="silu")
    return ModelSpec(**{**base, **kw})


def random_blocks(qtype: str, n: int, k: int, gen: torch.Generator, scale: float = 0.01) -> torch.Tensor:
    """[n, K / QK * bytes] made-up blocks whose fp16 fields are small finite numbers (so gguf decodes them)."""
    nb, size = k // BLOCK_WEIGHTS[qtype], BLOCK_BYTES[qtype]
    raw = torch.randint(0, 256, (n, nb, size), generator=gen, dtype=torch.uint8)
    halves = {"Q8_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}[qtype]
    for at in halves:
        raw[..., at:at + 2] = (torch.rand(n, nb, 1, generator=gen) * scale).half().view(torch.uint8)
    return raw.reshape(n, -1)


def dequantized(qtype: str, blocks: torch.Tensor, k: int) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), T[qtype])).reshape(blocks.shape[0], k)


# ---- shards against the whole weight ---------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K"])
def test_rank_shards_reassemble_the_whole_weights_blocks(qtype):
    spec, size = _spec(), 2
    gen = torch.Generator().manual_seed(1)
    d, inter, hidden = spec.head_dim, spec.intermediate_size, spec.hidden_size
    whole = {"q": random_blocks(qtype, spec.num_heads * d, hidden, gen),
             "k": random_blocks(qtype, spec.num_kv_heads * d, hidden, gen),
             "gate": random_blocks(qtype, inter, hidden, gen),
             "o": random_blocks(qtype, hidden, spec.num_heads * d, gen),
             "down": random_blocks(qtype, hidden, inter, gen),
             "embed": random_blocks(qtype, spec.vocab_size, hidden, gen)}
    ranks = [TPShard(r, size, spec, None) for r in range(size)]

    def parts(name, pname, shard=0):  # through FileRows, as the GGUF loader reads a memory-mapped tensor
        return [take_shard(FileRows(whole[name].numpy()), pname, shard, tp, qtype, name) for tp in ranks]

    assert torch.equal(torch.cat(parts("q", "layers.0.self_attn.qkv_proj.weight", 0)), whole["q"])
    assert torch.equal(torch.cat(parts("k", "layers.0.self_attn.qkv_proj.weight", 1)), whole["k"])
    assert torch.equal(torch.cat(parts("gate", "layers.0.mlp.gate_up_proj.weight", 0)), whole["gate"])
    for name, pname in (("o", "layers.0.self_attn.o_proj.weight"), ("down", "layers.0.mlp.down_proj.weight")):
        shards = parts(name, pname)
        assert all(s.shape[1] == whole[name].shape[1] // size for s in shards)  # K blocks, not rows
        assert torch.equal(torch.cat(shards, dim=1), whole[name])
        k = whole[name].shape[1] // BLOCK_BYTES[qtype] * BLOCK_WEIGHTS[qtype]
        values = torch.cat([dequantized(qtype, s, k // size) for s in shards], dim=1)
        assert torch.equal(values, dequantized(qtype, whole[name], k))  # the split keeps every block's weights
    embed = parts("embed", "embed_tokens.weight")
    vs = -(-spec.vocab_size // size)
    assert {e.shape[0] for e in embed} == {vs}
    joined = torch.cat(embed)
    assert torch.equal(joined[:spec.vocab_size], whole["embed"])
    pad = joined[spec.vocab_size:]
    assert pad.shape[0] == 1 and not pad.any()
    assert not dequantized(qtype, pad, hidden).any(), "a zero block must dequantize to 0"
    assert not QuantWeight(qtype, pad.clone(), hidden).dequantize().any()  # Tandem's own reading too


def test_llama_q_rows_unpermuted_per_rank_equal_the_whole_unpermuted_then_sliced():
    """llama.cpp's q/k permutation moves rows within a head: a rank's heads unpermuted alone are the same rows."""
    spec, size = _spec(), 2
    whole = random_blocks("Q4_1", spec.num_heads * spec.head_dim, spec.hidden_size, torch.Generator().manual_seed(2))
    unpermuted = _unpermute(whole, spec.head_dim)
    rows = spec.num_heads * spec.head_dim // size
    for r in range(size):
        part = take_shard(whole, "layers.0.self_attn.qkv_proj.weight", 0, TPShard(r, size, spec, None), "Q4_1")
        assert torch.equal(_unpermute(part, spec.head_dim), unpermuted[r * rows:(r + 1) * rows])


def test_fp8_shards_keep_their_row_scales():
    """FP8: a column split takes each row's scale with the row; a K split keeps every row's scale whole."""
    spec, size = _spec(), 2
    w = torch.randn(spec.hidden_size, spec.intermediate_size).to(torch.float8_e4m3fn)
    scale = torch.rand(spec.hidden_size)
    ranks = [TPShard(r, size, spec, None) for r in range(size)]
    down = [take_shard(w, "down_proj.weight", 0, tp) for tp in ranks]
    assert torch.equal(torch.cat(down, dim=1).view(torch.uint8), w.view(torch.uint8))
    assert all(torch.equal(take_shard(scale, "down_proj.weight_scale", 0, tp), scale) for tp in ranks)
    gate = torch.randn(spec.intermediate_size, spec.hidden_size).to(torch.float8_e4m3fn)
    gate_scale = torch.rand(spec.intermediate_size)
    rows = [take_shard(gate, "gate_up_proj.weight", 0, tp) for tp in ranks]
    scales = [take_shard(gate_scale, "gate_up_proj.weight_scale", 0, tp) for tp in ranks]
    assert torch.equal(torch.cat(rows).view(torch.uint8), gate.view(torch.uint8))
    assert torch.equal(torch.cat(scales), gate_scale) and scales[0].shape[0] == rows[0].shape[0]


# ---- refusals ---------------------------------------------------------------------------------------------------
def test_a_k_split_inside_a_block_is_refused_by_name():
    spec = _spec(intermediate_size=768)  # 384 inputs a rank: 12 blocks of 32, 1.5 super-blocks of 256
    tp = TPShard(0, 2, spec, None)
    blocks = random_blocks("Q4_K", spec.hidden_size, 768, torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 cannot split blk.0.ffn_down.weight \(Q4_K, "
                                         r"K=768\) on its block boundaries: a row-parallel shard of 384 inputs is "
                                         r"not a whole number of Q4_K blocks \(256 weights each\)"):
        take_shard(blocks, "layers.0.mlp.down_proj.weight", 0, tp, "Q4_K", "blk.0.ffn_down.weight")
    take_shard(random_blocks("Q8_0", spec.hidden_size, 768, torch.Generator()), "layers.0.mlp.down_proj.weight", 0,
               tp, "Q8_0")  # 32-blocks split there


def test_smollm2_q4_1_refuses_two_ranks_naming_its_heads():
    """SmolLM2-135M: 9 query heads and 3 KV heads do not split over 2 ranks (its K splits would: 288 and 768
    inputs a rank are whole Q4_1 blocks)."""
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide the model's num_attention_heads 9, "
                                         "num_key_value_heads 3"):
        local_engine(from_gguf.smollm2_gguf(), device="cpu")


# ---- a tiny llama GGUF file, written here ---------------------------------------------------------------------
def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q / k rows (each head's rotary halves interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def write_llama_gguf(path, hf, types: dict[str, str], tied: bool) -> str:
    """hf's weights (a random tiny LlamaForCausalLM) as a llama GGUF file: linears quantized by the gguf package to
    the type `types` gives their GGUF name's last part (default Q8_0), norms F32, q/k rows permuted."""
    c = hf.config
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("context_length", c.max_position_embeddings), ("embedding_length", c.hidden_size),
                       ("block_count", c.num_hidden_layers), ("feed_forward_length", c.intermediate_size),
                       ("rope.dimension_count", c.hidden_size // c.num_attention_heads),
                       ("attention.head_count", c.num_attention_heads),
                       ("attention.head_count_kv", c.num_key_value_heads), ("vocab_size", c.vocab_size)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.rope.freq_base", float(c.rope_parameters["rope_theta"]))
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", c.rms_norm_eps)

    def add(name: str, w: torch.Tensor, kind: str) -> None:
        arr = w.detach().float().numpy()
        if kind in ("Q4_K", "Q6_K"):  # gguf cannot quantize to K-quants: made-up blocks of small weights
            gen = torch.Generator().manual_seed(len(name))
            data = random_blocks(kind, arr.shape[0], arr.shape[1], gen, 2e-4 if kind == "Q4_K" else 1e-4).numpy()
        else:
            data = arr if kind == "F32" else gguf.quants.quantize(arr, T[kind])
        writer.add_tensor(name, data, raw_dtype=T[kind])

    state = hf.state_dict()
    add("token_embd.weight", state["model.embed_tokens.weight"], types.get("token_embd", "Q8_0"))
    if not tied:
        add("output.weight", state["lm_head.weight"], types.get("output", "Q8_0"))
    add("output_norm.weight", state["model.norm.weight"], "F32")
    for i in range(c.num_hidden_layers):
        for hf_name, short in GGUF_NAMES.items():
            w = state[f"model.layers.{i}.{hf_name}.weight"]
            if short in ("attn_q", "attn_k"):
                heads = c.num_attention_heads if short == "attn_q" else c.num_key_value_heads
                w = torch.from_numpy(_permute(w.numpy(), heads))
            kind = "F32" if "norm" in short else types.get(f"blk.{i}.{short}", types.get(short, "Q8_0"))
            add(f"blk.{i}.{short}.weight", w, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tiny_model_factory):
    """(file, tokenizer dir, HF model read back from the file by transformers' own GGUF loader) for a random
    llama of 4 heads over 2 KV heads, hidden 64, MLP 128 (32-input K blocks a rank), vocabulary 513 (odd: the
    last rank's vocabulary shard has a padding row), Q4_1 attention, Q8_0 MLP and Q5_0 gate, untied or tied."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    root = tmp_path_factory.mktemp("tp_gguf")
    tok_dir, _ = tiny_model_factory("llama")
    made = {}

    def get(tied: bool, kquants: bool = False, intermediate: int = 128):
        """`kquants`: ffn_down Q4_K in layer 0 and Q6_K in layer 1 (MLP `intermediate` wide); no HF model then."""
        key = (tied, kquants, intermediate)
        if key not in made:
            torch.manual_seed(5)
            config = LlamaConfig(hidden_size=64, intermediate_size=intermediate, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=513,
                                 max_position_embeddings=512, initializer_range=0.3, rms_norm_eps=1e-6,
                                 tie_word_embeddings=tied)
            hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
            types = {"attn_q": "Q4_1", "attn_k": "Q4_1", "attn_v": "Q4_1", "attn_output": "Q4_1",
                     "ffn_gate": "Q5_0", "output": "Q4_1"}
            if kquants:
                types.update({"blk.0.ffn_down": "Q4_K", "blk.1.ffn_down": "Q6_K"})
            name = f"tiny-{'tied' if tied else 'untied'}{'-kq' if kquants else ''}-{intermediate}.gguf"
            path = write_llama_gguf(root / name, hf, types, tied)
            ref = AutoModelForCausalLM.from_pretrained(str(root), gguf_file=name, dtype=torch.float32).eval()
            assert ref.config.tie_word_embeddings == tied
            made[key] = path, str(tok_dir), ref
        return made[key]

    return get


@pytest.fixture
def exact(monkeypatch):
    monkeypatch.setenv("TANDEM_QUANT_ACTIVATIONS", "fp32")


@pytest.mark.parametrize("tied,kquants", [(False, False), (True, False), (True, True)])
def test_tp2_gguf_greedy_equals_transformers_on_the_files_weights(tiny_gguf, tied, kquants, exact):
    """Q4_1 / Q5_0 / Q8_0 (32-weight blocks), and with `kquants` ffn_down in Q4_K and Q6_K super-blocks split at
    256 inputs a rank."""
    path, tok, ref = tiny_gguf(tied, kquants, 512 if kquants else 128)
    prompts = make_prompts(seed=31, lengths=(5, 19, 40))
    engine = local_engine(path, tokenizer=tok)
    try:
        assert engine.stats()["tensor_parallel_size"] == 2
        for prompt, out in zip(prompts, run_engine(engine, prompts, GREEDY)):
            assert_matches_hf(ref, prompt, out.token_ids)
        stack = engine.runner.model.cpu_stack  # the one-call decode step declines the row-parallel linears
        assert stack.stack is None and (engine.runner.model.norm_kernel is None or "linear" in stack.reason)
    finally:
        engine.shutdown()


def test_tp2_x_pp2_gguf_greedy_equals_transformers(tiny_gguf, exact):
    """Each pipeline stage reads its own layers' blocks and shards them over its own group of 2 ranks (the last
    stage its vocabulary rows of the head): the file's model as transformers reads it, token for token."""
    from engine import EngineConfig
    from engine.pipeline import LocalStageGroup, PipelineEngine

    path, tok, ref = tiny_gguf(False)
    config = EngineConfig(model=path, tokenizer=tok, **{**OPTS, "num_kv_blocks": 96}, pipeline_parallel_size=2)
    engine = PipelineEngine(config, LocalStageGroup)
    try:
        assert "x tensor parallel 2" in engine.stats()["attention_backend"]
        prompts = make_prompts(seed=37, lengths=(5, 19, 40))
        for prompt, out in zip(prompts, run_engine(engine, prompts, GREEDY)):
            assert_matches_hf(ref, prompt, out.token_ids)
    finally:
        engine.shutdown()
    steps = [f.result(timeout=10) for f in engine.runner.stages.followers]  # each stage's rank 1 ran every step
    assert len(steps) == 2 and min(steps) > 0


@pytest.mark.parametrize("family,method,sym", [("qwen2", "gptq", True), ("llama_mqa_rope_scaled", "awq", False)])
def test_tp2_int4_greedy_equals_hf_on_the_checkpoints_weights(tiny_model_factory, tmp_path, family, method, sym,
                                                               exact):
    """Group 64: a rank's 32 o_proj inputs cut each group in half (Q4_1 blocks of 32 carry their group's scale, so
    only 32-alignment matters). qwen2 (symmetric GPTQ): q/k/v biases sliced with their rows; llama with one KV head
    (AWQ, asymmetric): the KV head's rows replicated on both ranks, o_proj's bias added once after the all-reduce."""
    from test_int4_checkpoint import hf_on, quantize_checkpoint

    path, hf = tiny_model_factory(family)
    qdir = tmp_path / method
    reference = hf_on(hf, quantize_checkpoint(path, qdir, method, 64, sym))
    prompts = make_prompts(seed=32, lengths=(5, 19, 40))
    engine = local_engine(qdir)
    try:
        attn = engine.runner.model.layers[0].self_attn
        kv_rows = 16  # one KV head a rank: split (2 over 2 ranks) or replicated (1 on both)
        assert attn.qkv_proj.parts[0].qtype == "Q4_1" and attn.qkv_proj.out_features == 32 + 2 * kv_rows
        assert attn.qkv_proj.bias.shape == (32 + 2 * kv_rows,)
        assert (attn.o_proj.bias is not None) == (family != "qwen2") and attn.o_proj.linear.bias is None
        for prompt, out in zip(prompts, run_engine(engine, prompts, GREEDY)):
            assert_matches_hf(reference, prompt, out.token_ids)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("family,acts", [("llama", None), ("llama", "tensor"), ("llama_mqa_rope_scaled", None)])
def test_tp2_fp8_greedy_equals_hf_on_the_checkpoints_weights(tiny_model_factory, tmp_path, family, acts):
    """Weight-only per-channel FP8 and static per-tensor W8A8 (q, k, v input scales differ: three parts a rank):
    both are the single device's arithmetic (a static scale quantizes x elementwise, whatever the split). One KV
    head (replicated) with random q/k/v/o biases: o_proj's added once, after the all-reduce."""
    from test_fp8_checkpoint import ct_qconfig, hf_on, write_fp8

    path, hf = tiny_model_factory(family)
    qdir = tmp_path / "fp8"
    strategy = "channel" if acts is None else "tensor"
    refs = write_fp8(path, qdir, ct_qconfig(strategy, acts), strategy, static=acts == "tensor",
                     biases=family != "llama")
    reference = hf_on(hf, refs, acts)
    prompts = make_prompts(seed=33, lengths=(5, 19, 40))
    engine = local_engine(qdir)
    try:
        attn = engine.runner.model.layers[0].self_attn
        assert attn.qkv_proj.weight.shape == (64, 64) and len(attn.qkv_proj.parts) == (1 if acts is None else 3)
        assert (attn.o_proj.bias is not None) == (family != "llama") and attn.o_proj.linear.bias is None
        for prompt, out in zip(prompts, run_engine(engine, prompts, GREEDY)):
            assert_matches_hf(reference, prompt, out.token_ids)
    finally:
        engine.shutdown()


def test_misaligned_k_splits_are_refused_by_name_at_config_and_load(tiny_gguf, tiny_model_factory, tmp_path):
    from engine import EngineConfig
    from test_int4_checkpoint import quantize_checkpoint

    path, tok, _ = tiny_gguf(True, True, 256)  # ffn_down Q4_K / Q6_K with K = 256: 128 inputs a rank
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 cannot split blk.0.ffn_down.weight \(Q4_K, K=256\) "
                                         r"on its block boundaries: a row-parallel shard of 128 inputs"):
        EngineConfig(model=path, tokenizer=tok, tensor_parallel_size=2)
    EngineConfig(model=path, tokenizer=tok)  # whole, it runs
    qdir = tmp_path / "gptq"
    quantize_checkpoint(tiny_model_factory("llama")[0], qdir, "gptq", 32, True)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 cannot split "
                                         r"model.layers.0.self_attn.o_proj.qweight \(Q4_1, K=64\) on its block "
                                         r"boundaries: a row-parallel shard of 16 inputs is not a whole number of "
                                         r"Q4_1 blocks \(32 weights each\)"):
        local_engine(qdir, tensor_parallel_size=4)


def test_tp2_fp8_dynamic_activations_are_quantized_per_rank_slice(tiny_model_factory, tmp_path):
    """FP8_DYNAMIC: a row-parallel rank holds only its K slice of each token's input, so it quantizes that slice
    with its own per-token scale (as vLLM's row-parallel layers do); the reference quantizes o_proj's and
    down_proj's inputs per token per half of K, every other linear's per whole token."""
    from test_fp8_checkpoint import LINEARS, ct_qconfig, e4m3_round_trip, hf_on, write_fp8

    path, hf = tiny_model_factory("llama")
    qdir = tmp_path / "fp8"
    reference = hf_on(hf, write_fp8(path, qdir, ct_qconfig("channel", "token"), "channel"))
    for name, module in reference.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in LINEARS:
            halves = 2 if leaf in ("o_proj", "down_proj") else 1
            module.register_forward_pre_hook(
                lambda m, args, n=halves: (torch.cat([e4m3_round_trip(c) for c in args[0].chunk(n, -1)], -1),))
    prompts = make_prompts(seed=35, lengths=(5, 19, 40))
    engine = local_engine(qdir)
    try:
        for prompt, out in zip(prompts, run_engine(engine, prompts, GREEDY)):
            assert_matches_hf(reference, prompt, out.token_ids)
    finally:
        engine.shutdown()


def test_tp2_equals_tp1_on_the_int8_activation_path(tiny_gguf, monkeypatch):
    """The default arithmetic: x's Q8_0 blocks are the same on both ranks as on one device (column-parallel
    linears see the whole x; a row-parallel split falls on x's 32-blocks), so TP=2 differs from TP=1 only in the
    order the two ranks' partial sums are added: equal tokens, or a first difference where TP=1's own two best
    logprobs are within summation noise."""
    from engine import EngineConfig, SamplingParams
    from engine.llm_engine import LLMEngine

    monkeypatch.setenv("TANDEM_QUANT_ACTIVATIONS", "int8")
    path, tok, _ = tiny_gguf(False)
    prompts = make_prompts(seed=34, lengths=(5, 19, 40, 7))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    one = LLMEngine(EngineConfig(model=path, tokenizer=tok, device="cpu", block_size=4, num_kv_blocks=96,
                                 max_num_batched_tokens=16, max_num_seqs=8))
    try:
        want = run_engine(one, prompts, params)
    finally:
        one.shutdown()
    engine = local_engine(path, tokenizer=tok)
    try:
        got = run_engine(engine, prompts, params)
    finally:
        engine.shutdown()
    same = 0
    for w, g in zip(want, got):
        if w.token_ids == g.token_ids:
            same += 1
            continue
        pos = next(i for i, (a, b) in enumerate(zip(w.token_ids, g.token_ids)) if a != b)
        top = sorted(w.logprobs[pos].values(), key=lambda lp: -lp.logprob)
        assert top[0].logprob - top[1].logprob < 1e-3, f"TP=2 left TP=1's tokens at {pos} without a near-tie"
    print(f"TP=2 equals TP=1 on {same} of {len(prompts)} prompts")
    assert same >= len(prompts) - 1


def _ranks_and_whole(model_dir: str, gguf_file: str | None = None):
    """The whole model and both ranks' shards, built unpacked (float weights stay parameters) on the CPU."""
    from engine.attention import get_backend
    from engine.models import model_spec
    from engine.models.loader import build_model, load_hf_config
    from engine.models.tp import local_spec

    config = load_hf_config(model_dir)
    spec = model_spec(config)
    kw = dict(cpu_onednn=False, gguf_file=gguf_file)
    args = (config, spec, 64, get_backend("torch"), torch.float32, torch.device("cpu"))
    whole = build_model(model_dir, *args, **kw)
    ranks = [build_model(model_dir, config, local_spec(spec, 2), *args[2:], tp=TPShard(r, 2, spec, None), **kw)
             for r in range(2)]
    return whole, ranks


def test_each_rank_holds_about_half_the_quantized_bytes(tiny_gguf, tiny_model_factory, tmp_path, capsys):
    """Quantized linears and embedding: a rank holds its shard only (the replicated norms are a few hundred
    bytes; the vocabulary padding and the packed layout's 16-row groups a little more)."""
    from engine.models.gguf_loader import gguf_model_dir
    from test_fp8_checkpoint import ct_qconfig, write_fp8
    from test_int4_checkpoint import quantize_checkpoint

    path, tok, _ = tiny_gguf(False)
    gptq, fp8 = tmp_path / "gptq", tmp_path / "fp8"
    quantize_checkpoint(tiny_model_factory("llama")[0], gptq, "gptq", 32, True)
    write_fp8(tiny_model_factory("llama")[0], fp8, ct_qconfig("channel", "token"))
    for what, built in (("gguf", _ranks_and_whole(gguf_model_dir(path, tok), path)),
                        ("gptq", _ranks_and_whole(str(gptq))), ("fp8", _ranks_and_whole(str(fp8)))):
        whole, ranks = built
        q_whole, q_ranks = quantized_bytes(whole), [quantized_bytes(r) for r in ranks]
        print(f"{what}: whole {weight_bytes(whole)} bytes ({q_whole} quantized), ranks "
              f"{[weight_bytes(r) for r in ranks]} ({q_ranks} quantized)")
        assert all(0.45 * q_whole <= q <= 0.55 * q_whole for q in q_ranks), (what, q_whole, q_ranks)
        assert all(weight_bytes(r) <= 0.56 * weight_bytes(whole) for r in ranks), what
    # the untied file's quantized tensors, its head among them, are all counted in the whole model's bytes
    quantized_in_file = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors
                            if t.tensor_type not in (T.F32, T.F16, T.BF16))
    whole = _ranks_and_whole(gguf_model_dir(path, tok), path)[0]
    assert quantized_in_file <= weight_bytes(whole) - sum(p.numel() * 4 for p in whole.parameters())
    print(capsys.readouterr().out)


def test_ray_tp2_gguf_worker_process_equals_the_in_process_group(tiny_gguf, monkeypatch):
    """The worker rank as a Ray actor (its own process) finds the GGUF model's config directory and cuts its shard
    from the file itself: on the int8 default, the same tokens as ranks in process (the same arithmetic)."""
    from engine import LLM
    from ray_local import local_ray

    monkeypatch.setenv("TANDEM_QUANT_ACTIVATIONS", "int8")  # also what the Ray worker, without the variable, runs
    path, tok, _ = tiny_gguf(True)
    prompts = make_prompts(seed=36, lengths=(5, 19, 40))
    engine = local_engine(path, tokenizer=tok)
    try:
        want = [o.token_ids for o in run_engine(engine, prompts, GREEDY)]
    finally:
        engine.shutdown()
    with local_ray(2, "tandem-tp-quantized-test"):
        llm = LLM(path, tokenizer=tok, device="cpu", block_size=4, max_num_batched_tokens=16, max_num_seqs=8,
                  tensor_parallel_size=2, num_kv_blocks=96, tp_worker_num_cpus=1.0)
        try:
            assert "tensor parallel x2" in llm.stats()["attention_backend"]
            assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
        finally:
            llm.shutdown()
