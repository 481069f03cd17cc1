"""Pipeline stages and LoRA adapters over quantized weights on CPU: GGUF files (engine/models/gguf_loader.py) and
GPTQ int4 checkpoints (engine/models/int4_loader.py, Q4_1 linears on CPU).

Every test runs the exact path (TANDEM_QUANT_ACTIVATIONS=fp32). Oracles, never Tandem's code:
- a tiny llama written here as a GGUF file with the `gguf` package (Q4_1 linears in llama.cpp's q/k row order, a
  Q8_0 embedding and head, fp32 norms): Hugging Face transformers loading that file (its own dequantization and
  q/k un-permutation) and decoding greedily; a GPTQ checkpoint written from the format's definition
  (tests/test_int4_checkpoint.py): HF on the checkpoint's dequantized weights;
- split over 2 and 3 local stages, greedy tokens equal HF's and the single-device engine's; the real SmolLM2-135M
  Q4_1 file over 2 stages against HF on transformers' dequantization of it (near-ties allowed, as
  tests/test_gguf_model.py does);
- a PEFT adapter on every linear: PEFT over the same HF model is the oracle for requests with the adapter, the HF
  model itself for requests without it, in one batch;
- a stage holds only its own layers: its weight bytes against the file's own byte count for the tensors it should
  hold (the GGUF reader's), and the tensors it reads;
- what stays refused is refused by name.
Stages run in process (LocalStageGroup), and once over Ray stage actors (the same StageWorker in an actor).
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, EngineConfig, SamplingParams
from engine.cpu.quant import QuantLinear
from engine.lora.layers import LoRALinear
from engine.models import from_gguf
from engine.models.gguf_loader import GGUFTensors, gguf_model_dir, weight_bytes
from engine.pipeline import LocalStageGroup, PipelineEngine
from test_correctness_hf import MAX_NEW, assert_matches_hf, hf_greedy, make_prompts
from test_int4_checkpoint import LINEARS, hf_on, quantize_checkpoint
from test_lora import build_adapter
from test_pipeline_parallel import run_engine

LAYERS = 4  # enough for 3 stages
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
ENGINE = dict(block_size=4, max_num_batched_tokens=16)  # chunked prefill, several blocks a sequence
T = gguf.GGMLQuantizationType


@pytest.fixture(autouse=True)
def exact_activations(monkeypatch):
    monkeypatch.setenv("TANDEM_QUANT_ACTIVATIONS", "fp32")


# ---- a tiny llama as a GGUF file ---------------------------------------------------------------------------------

def llama_cpp_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """q / k rows in llama.cpp's RoPE order, as its converter (convert_hf_to_gguf.py's permute) writes them."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(hf, out: Path, tied: bool, extra: dict[str, np.ndarray] | None = None) -> Path:
    """`hf`'s weights as a llama GGUF file: linears Q4_1, embedding (and an untied head) Q8_0, norms F32, the
    metadata transformers reads its config from; `extra` adds F32 tensors Tandem does not know."""
    c = hf.config
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(c.vocab_size)
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}

    def quantized(name: str, values: np.ndarray, kind) -> None:
        w.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)

    quantized("token_embd.weight", sd["model.embed_tokens.weight"], T.Q8_0)
    w.add_tensor("output_norm.weight", sd["model.norm.weight"], raw_dtype=T.F32)
    if not tied:
        quantized("output.weight", sd["lm_head.weight"], T.Q8_0)
    for i in range(c.num_hidden_layers):
        hf_layer, blk = f"model.layers.{i}.", f"blk.{i}."
        quantized(blk + "attn_q.weight", llama_cpp_rows(sd[hf_layer + "self_attn.q_proj.weight"],
                                                        c.num_attention_heads), T.Q4_1)
        quantized(blk + "attn_k.weight", llama_cpp_rows(sd[hf_layer + "self_attn.k_proj.weight"],
                                                        c.num_key_value_heads), T.Q4_1)
        for name, hf_name in (("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                              ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"),
                              ("ffn_down", "mlp.down_proj")):
            quantized(f"{blk}{name}.weight", sd[f"{hf_layer}{hf_name}.weight"], T.Q4_1)
        w.add_tensor(blk + "attn_norm.weight", sd[hf_layer + "input_layernorm.weight"], raw_dtype=T.F32)
        w.add_tensor(blk + "ffn_norm.weight", sd[hf_layer + "post_attention_layernorm.weight"], raw_dtype=T.F32)
    for name, values in (extra or {}).items():
        w.add_tensor(name, values, raw_dtype=T.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def hf_from_gguf(path: Path):
    """transformers' own reading of the file: its dequantized weights, q / k rows put back, in an HF model."""
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """tied -> (GGUF file, tokenizer dir, HF model on the file's weights). The config and tokenizer directory
    EngineConfig finds for each file (gguf_model_dir, cached per process) is written here into a temporary
    TANDEM_CACHE, not the user's."""
    import tiny_models

    root = tmp_path_factory.mktemp("quant_pp")
    src, hf = tiny_models.build("llama", root / "src", num_hidden_layers=LAYERS)
    made = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_CACHE", str(root / "cache"))
        for tied in (False, True):
            path = write_llama_gguf(hf, root / f"tiny{'-tied' if tied else ''}.gguf", tied)
            gguf_model_dir(os.path.abspath(path), os.path.abspath(src))
            made[tied] = (path, src, hf_from_gguf(path))
    return made


@pytest.fixture(scope="module")
def gptq(tiny_model_factory, tmp_path_factory):
    """(GPTQ checkpoint dir, HF model on its dequantized weights) of a tiny llama of LAYERS layers."""
    src, hf = tiny_model_factory("llama", num_hidden_layers=LAYERS)
    qdir = tmp_path_factory.mktemp("quant_pp_gptq") / "gptq"
    refs = quantize_checkpoint(src, qdir, "gptq", 32, True)
    return qdir, hf_on(hf, refs)


def single_engine(model: str, prompts, **kw) -> list[list[int]]:
    llm = LLM(model, **ENGINE, **kw)
    try:
        return [o.token_ids for o in llm.generate(prompts, GREEDY)]
    finally:
        llm.shutdown()


def stage_engine(model: str, stages: int, **kw):
    return PipelineEngine(EngineConfig(model=model, pipeline_parallel_size=stages, **ENGINE, **kw), LocalStageGroup)


def stage_models(engine) -> list:
    return [w.model for w in engine.core.runner.stages.workers]


# ---- pipeline stages -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stages,tied", [(2, False), (3, True)], ids=["2-stages-untied", "3-stages-tied"])
def test_gguf_stages_match_hf_and_the_single_engine(tiny_gguf, stages, tied):
    """Each stage holds its layers' quantized linears, the first the embedding, the last the norm and head (a tied
    head: the embedding's blocks there too); every stage runs its decode steps through the decode stack."""
    path, tok, hf = tiny_gguf[tied]
    prompts = make_prompts(seed=1)
    single = single_engine(str(path), prompts, tokenizer=str(tok))
    engine = stage_engine(str(path), stages, tokenizer=str(tok))
    outs = run_engine(engine, prompts, GREEDY)
    for prompt, out, ref in zip(prompts, outs, single):
        assert out.token_ids == ref
        assert_matches_hf(hf, prompt, out.token_ids)
    models = stage_models(engine)
    assert [m.embed_tokens is not None for m in models] == [True] + [False] * (stages - 2) + [tied]
    assert [m.norm is not None for m in models] == [False] * (stages - 1) + [True]
    assert models[-1].head_packed is not None
    for m in models:
        assert all(isinstance(layer.mlp.down_proj, QuantLinear) for layer in m.layers)
        assert m.cpu_stack.stack is not None and m.cpu_stack.reason is None, m.cpu_stack.reason


@pytest.mark.parametrize("stages", [2, 3])
def test_gptq_stages_match_hf_and_the_single_engine(gptq, stages):
    qdir, hf = gptq
    prompts = make_prompts(seed=2)
    single = single_engine(str(qdir), prompts)
    engine = stage_engine(str(qdir), stages)
    outs = run_engine(engine, prompts, GREEDY)
    for prompt, out, ref in zip(prompts, outs, single):
        assert out.token_ids == ref
        assert_matches_hf(hf, prompt, out.token_ids)
    models = stage_models(engine)
    assert sum(isinstance(m, QuantLinear) for model in models for m in model.modules()) == 4 * LAYERS
    assert all(m.cpu_stack.stack is not None for m in models), [m.cpu_stack.reason for m in models]


def test_real_smollm2_q4_1_over_two_stages_matches_hf():
    """SmolLM2-135M's Q4_1 file split 15 + 15 layers: the single engine's tokens, and HF's on transformers'
    dequantization of the file (token for token, or a first difference at a near-tie)."""
    from test_gguf_model import QUESTIONS, TOKENS, compare
    from test_gguf_model import hf_greedy as hf_chat_greedy
    from transformers import AutoTokenizer

    q4, hf_dir = from_gguf.smollm2_gguf(), from_gguf.smollm2_dir()
    tok = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in QUESTIONS[:3]]
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, local_files_only=True).eval()
    want = hf_chat_greedy(hf, tok, texts)
    params = SamplingParams(max_tokens=TOKENS, temperature=0)
    small = dict(tokenizer=str(hf_dir), max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64)
    llm = LLM(str(q4), **small)
    single = llm.generate(texts, params)
    llm.shutdown()
    engine = PipelineEngine(EngineConfig(model=str(q4), pipeline_parallel_size=2, **small), LocalStageGroup)
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    outs = run_engine(engine, ids, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in single]
    assert len(compare(outs, want)) <= 1
    assert [m.layer_range for m in stage_models(engine)] == [(0, 15), (15, 30)]


def test_gguf_over_ray_stage_actors_matches_hf(tiny_gguf):
    """The offline LLM over 2 Ray stage actors (cluster/pipeline.py): each actor builds its stage from the GGUF
    file the StageSpec names. Ray starts inside the test, so the actors inherit the exact path's setting."""
    from ray_local import local_ray

    path, tok, hf = tiny_gguf[True]
    prompts = make_prompts(seed=6, lengths=(3, 17, 40))
    with local_ray(4, "tandem-quant-pp-test"):
        llm = LLM(str(path), tokenizer=str(tok), pipeline_parallel_size=2, pp_stage_num_cpus=1.0, **ENGINE)
        try:
            assert "over Ray" in llm.stats()["attention_backend"]
            outs = llm.generate(prompts, GREEDY)
            llm.check_integrity()
        finally:
            llm.shutdown()
    for prompt, out in zip(prompts, outs):
        assert_matches_hf(hf, prompt, out.token_ids)


# ---- a stage holds only its own layers -----------------------------------------------------------------------------

def build_stage(model_dir: str, layers, gguf_file: str | None = None):
    from engine.attention import get_backend
    from engine.models.loader import build_model, load_hf_config, model_spec

    config = load_hf_config(model_dir)
    return build_model(model_dir, config, model_spec(config), 64, get_backend("cpu"), torch.float32,
                       torch.device("cpu"), layers=layers, gguf_file=gguf_file)


def stage_tensors(first: int, end: int, last: bool):
    """Whether a SmolLM2 tensor name belongs to the stage of layers first..end-1 (the head is tied: the last
    stage holds the embedding for it)."""
    def wanted(name: str) -> bool:
        if name.startswith("blk."):
            return first <= int(name.split(".")[1]) < end
        return (name == "token_embd.weight" and (first == 0 or last)) or (last and name == "output_norm.weight")
    return wanted


def test_smollm2_stages_hold_only_their_layers_bytes(monkeypatch):
    """SmolLM2's Q4_1 file over 2 stages: each stage's weights are exactly the file's bytes for its own tensors
    (the first: the embedding and layers 0-14; the last: layers 15-29, the final norm and the tied head, which is
    the embedding's blocks again), and a stage reads no other layer's tensor."""
    q4 = from_gguf.smollm2_gguf()
    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(q4)).tensors}  # the file's own byte counts
    model_dir = EngineConfig(model=str(q4)).model_dir
    read: list[str] = []
    need = GGUFTensors._need
    monkeypatch.setattr(GGUFTensors, "_need", lambda self, name: read.append(name) or need(self, name))
    held = []
    for first, end in ((0, 15), (15, 30)):
        read.clear()
        stage = build_stage(model_dir, (first, end), str(q4))
        wanted = stage_tensors(first, end, last=end == 30)
        held.append(weight_bytes(stage))
        assert held[-1] == sum(n for name, n in sizes.items() if wanted(name)), (first, end)
        assert set(read) == {name for name in sizes if wanted(name)}
    # together: the whole file, with the embedding twice (the first stage embeds, the last projects with it)
    assert sum(held) == sum(sizes.values()) + sizes["token_embd.weight"]
    print(f"SmolLM2 Q4_1 weight bytes: file {sum(sizes.values())}, stages {held}")


def test_gptq_stage_holds_only_its_layers_linears(gptq):
    qdir, _ = gptq
    whole = build_stage(str(qdir), None)
    per_layer = sum(m.nbytes for m in whole.layers[0].modules() if isinstance(m, QuantLinear))
    for layers in ((0, 1), (1, 3), (3, 4)):
        stage = build_stage(str(qdir), layers)
        linears = [m for m in stage.modules() if isinstance(m, QuantLinear)]
        assert len(linears) == 4 * (layers[1] - layers[0])
        assert sum(m.nbytes for m in linears) == per_layer * (layers[1] - layers[0])
        assert (stage.embed_tokens is not None, stage.norm is not None) == (layers[0] == 0, layers[1] == LAYERS)


def test_a_tensor_no_stage_places_is_refused_by_the_stage_that_owns_it(tiny_gguf, tmp_path):
    """The file's tensors are accounted for stage by stage: an unknown tensor of layer 3 fails the stage holding
    layer 3 only; one outside the layers fails every stage."""
    path, tok, hf = tiny_gguf[False]
    model_dir = EngineConfig(model=str(path), tokenizer=str(tok)).model_dir
    odd = write_llama_gguf(hf, tmp_path / "odd.gguf", tied=False,
                           extra={"blk.3.attn_sinks.weight": np.ones(4, np.float32)})
    build_stage(model_dir, (0, 2), str(odd))
    with pytest.raises(ValueError, match=r"holds tensors Tandem does not place: \['blk.3.attn_sinks.weight'\]"):
        build_stage(model_dir, (2, 4), str(odd))
    odd = write_llama_gguf(hf, tmp_path / "odd2.gguf", tied=False, extra={"mystery.weight": np.ones(4, np.float32)})
    for layers in ((0, 2), (2, 4)):
        with pytest.raises(ValueError, match="mystery.weight"):
            build_stage(model_dir, layers, str(odd))


# ---- LoRA adapters ------------------------------------------------------------------------------------------------

def check_lora_batch(llm: LLM, peft, hf, prompts) -> None:
    """One batch, requests with and without the adapter: PEFT's tokens and the base model's, and the adapter
    really changes the output."""
    loras = ["a", None] * (len(prompts) // 2)
    outs = llm.generate(prompts, GREEDY, lora_request=loras)
    llm.check_integrity()
    for prompt, lora, out in zip(prompts, loras, outs):
        assert_matches_hf(peft if lora else hf, prompt, out.token_ids)
    assert hf_greedy(peft, prompts[0])[0] != hf_greedy(hf, prompts[0])[0], "the adapter changes nothing"
    model = llm.engine.runner.model
    for layer in model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                       layer.mlp.down_proj):
            assert isinstance(linear, LoRALinear) and isinstance(linear.base, QuantLinear)
    assert model.cpu_stack.stack is None and "LoRA" in model.cpu_stack.reason  # declined, by reason


def test_lora_over_a_gguf_model_matches_peft(tiny_gguf, tmp_path):
    path, tok, hf = tiny_gguf[True]
    peft = build_adapter(hf, tmp_path / "adapter", seed=1, r=8, lora_alpha=16, target_modules=list(LINEARS))
    llm = LLM(str(path), tokenizer=str(tok), lora_modules={"a": str(tmp_path / "adapter")}, max_lora_rank=8,
              **ENGINE)
    try:
        check_lora_batch(llm, peft, hf, make_prompts(seed=4, lengths=(5, 21, 40, 9)))
    finally:
        llm.shutdown()


def test_lora_over_a_gptq_checkpoint_matches_peft(gptq, tmp_path):
    qdir, hf = gptq
    peft = build_adapter(hf, tmp_path / "adapter", seed=2, r=8, lora_alpha=16, target_modules=list(LINEARS))
    llm = LLM(str(qdir), lora_modules={"a": str(tmp_path / "adapter")}, max_lora_rank=8, **ENGINE)
    try:
        check_lora_batch(llm, peft, hf, make_prompts(seed=5, lengths=(6, 33, 17, 12)))
    finally:
        llm.shutdown()


# ---- what stays refused ---------------------------------------------------------------------------------------------

def test_what_stays_refused_is_refused_by_name(tiny_gguf, gptq):
    path, tok, _ = tiny_gguf[False]
    qdir, _ = gptq
    with pytest.raises(ValueError, match="LoRA adapters .* are not supported with pipeline_parallel_size > 1"):
        EngineConfig(model=str(path), tokenizer=str(tok), enable_lora=True, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="LoRA adapters .* over the Triton int4 GEMM"):
        EngineConfig(model=str(qdir), device="cuda", dtype="bfloat16", enable_lora=True)
    with pytest.raises(ValueError, match="LoRA adapters .* over the Triton int4 GEMM"):
        EngineConfig(model=str(qdir), fused_forward=True, enable_lora=True)
    with pytest.raises(ValueError, match="pipeline_parallel_size > 1 on cuda"):
        EngineConfig(model=str(qdir), device="cuda", dtype="bfloat16", pipeline_parallel_size=2)
