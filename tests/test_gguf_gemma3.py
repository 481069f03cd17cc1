"""Gemma 3 270M's Q4_K_M GGUF file served as it ships (engine/models/gguf_loader.py): its Q5_0, Q4_K, Q6_K and
Q8_0 tensors stay in their blocks. Oracles: the `gguf` package's dequantize (the weights, bit for bit) and Hugging
Face transformers' greedy decoding on transformers' own fp32 dequantization of the same file
(engine.models.from_gguf.gemma3_dir), never Tandem's code.

Greedy agreement is asserted as tests/test_gguf_model.py does for SmolLM2: token for token, or a first difference
where HF's two best logits are within a near-tie (NEAR_TIE with the exact path, TANDEM_QUANT_ACTIVATIONS=fp32;
NEAR_TIE_INT8 with int8 activations, which move the logits about as bf16 does). One prompt decodes across
position 512, Gemma 3's sliding window."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import LLM, SamplingParams
from engine.cpu.quant import BLOCK_BYTES, BLOCK_WEIGHTS, QuantEmbedding, QuantLinear, QuantWeight
from engine.models import from_gguf
from engine.models.gguf_loader import weight_bytes
from test_gguf_model import NEAR_TIE, NEAR_TIE_INT8, compare

NEW_TYPES = ("Q5_0", "Q4_K", "Q6_K")
TOKENS = 16
SHORT = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,",
         "The three primary colors are", "Water boils at a temperature of", "import numpy as np\n\nx = np.",
         "The quick brown fox", "In 1969, the first humans"]
PASSAGE = "The river runs north past the old mill, then turns east toward the sea. "
WINDOW = 512


def random_blocks(qtype: str, rows: int, k: int, seed: int) -> np.ndarray:
    """Random bytes for `rows` rows of `qtype` blocks, their fp16 scales set to finite values in [-0.1, 0.1]."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, k // BLOCK_WEIGHTS[qtype] * BLOCK_BYTES[qtype]), dtype=np.uint8)
    blocks = raw.reshape(rows, -1, BLOCK_BYTES[qtype])
    halves = {"Q8_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}[qtype]
    for at in halves:
        scale = rng.uniform(-0.1, 0.1, size=blocks.shape[:2]).astype(np.float16)
        blocks[..., at:at + 2] = scale.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return raw


@pytest.mark.parametrize("qtype", [*NEW_TYPES, "Q8_0", "Q4_1"])
def test_dequantize_is_gguf_bit_for_bit(qtype):
    """The torch dequantization (embedding lookups and the fallback) of made-up blocks equals gguf's."""
    raw = random_blocks(qtype, 7, 512, seed=len(qtype) + ord(qtype[1]))
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(7, 512)
    got = QuantWeight(qtype, torch.from_numpy(raw.copy()), 512).dequantize().numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_k_quants_need_whole_super_blocks():
    with pytest.raises(ValueError, match="a Q4_K weight needs in_features divisible by 256, got 640"):
        QuantWeight("Q4_K", torch.zeros(2, 360, dtype=torch.uint8), 640)


if missing := from_gguf.gemma3_missing_packages():
    pytest.skip(f"Gemma 3 270M's chunk packages are not installed ({', '.join(missing)}; scripts/bootstrap.sh "
                "installs them)", allow_module_level=True)


@pytest.fixture(scope="module")
def gguf_file():
    return from_gguf.gemma3_gguf()


@pytest.fixture(scope="module")
def hf_dir():
    return from_gguf.gemma3_dir()


@pytest.fixture(scope="module")
def llm(gguf_file, hf_dir):
    llm = LLM(str(gguf_file), tokenizer=str(hf_dir), device="cpu", max_num_seqs=16, enable_prefix_caching=False)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def prompts(hf_dir) -> list[list[int]]:
    """Token ids with the BOS: the short prompts, then one that decodes across the sliding window."""
    tok = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    ids = [tok(p).input_ids for p in SHORT]
    passage = tok(PASSAGE * 64).input_ids
    return [*ids, passage[:WINDOW - 8]]


@pytest.fixture(scope="module")
def hf_greedy(hf_dir, prompts) -> list[tuple[list[int], list[torch.Tensor]]]:
    """HF's greedy tokens and the logits it chose each from, one prompt at a time."""
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager",
                                              local_files_only=True).eval()
    out = []
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.no_grad():
            gen = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=TOKENS, do_sample=False,
                              output_logits=True, return_dict_in_generate=True)
        out.append((gen.sequences[0, x.shape[1]:].tolist(), [s[0] for s in gen.logits]))
    return out


def greedy(llm, prompts):
    return llm.generate(prompts, SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True))


def test_the_files_blocks_are_held_as_they_are(llm, gguf_file, hf_dir):
    """Every linear holds the file's own blocks (their types as the file's, bytes decoded by gguf equal to
    transformers' weights), the embedding stays Q8_0, norms are transformers' (1 + w stored, w held), and the
    weights held are within 10% of the file's size."""
    model = llm.engine.core.runner.model
    hf = load_file(str(hf_dir / "model.safetensors"))
    reader = gguf.GGUFReader(str(gguf_file))
    file_types = {t.name: t.tensor_type.name for t in reader.tensors}
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert isinstance(attn.qkv_proj, QuantLinear) and isinstance(model.embed_tokens, QuantEmbedding)
    assert [p.qtype for p in attn.qkv_proj.parts] == ["Q5_0", "Q8_0"] == \
        [file_types["blk.0.attn_q.weight"], file_types["blk.0.attn_v.weight"]]
    assert [p.qtype for p in mlp.down_proj.parts] == [file_types["blk.0.ffn_down.weight"]] == ["Q6_K"]
    assert [p.qtype for p in attn.o_proj.parts] == ["Q4_K"]
    held = {t for layer in model.layers for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                    layer.mlp.gate_up_proj, layer.mlp.down_proj)
            for t in (p.qtype for p in lin.parts)}
    assert set(NEW_TYPES) <= held

    def decoded(w: QuantWeight) -> torch.Tensor:
        values = gguf.quants.dequantize(w.data.numpy(), gguf.GGMLQuantizationType[w.qtype])
        return torch.from_numpy(values).reshape(w.out_features, w.in_features)

    for i in (0, 5, 17):  # a sliding layer, the first global one, the last
        layer, name = model.layers[i], f"model.layers.{i}"
        assert torch.equal(decoded(layer.self_attn.o_proj.parts[0]), hf[f"{name}.self_attn.o_proj.weight"])
        assert torch.equal(decoded(layer.mlp.down_proj.parts[0]), hf[f"{name}.mlp.down_proj.weight"])
        qkv = torch.cat([decoded(p) for p in layer.self_attn.qkv_proj.parts])
        want = torch.cat([hf[f"{name}.self_attn.{p}_proj.weight"] for p in "qkv"])
        assert torch.equal(qkv, want)
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
            assert torch.equal(layer.get_submodule(norm).weight, hf[f"{name}.{norm}.weight"]), norm
    assert torch.equal(model.norm.weight, hf["model.norm.weight"])
    size = gguf_file.stat().st_size
    assert abs(weight_bytes(model) - size) <= 0.1 * size, (weight_bytes(model), size)


def test_exact_path_greedy_equals_hf(llm, prompts, hf_greedy, monkeypatch):
    monkeypatch.setenv("TANDEM_QUANT_ACTIVATIONS", "fp32")
    ties = compare(greedy(llm, prompts), hf_greedy, NEAR_TIE)
    assert len(ties) <= 1


def test_int8_activations_differ_from_hf_only_at_near_ties(llm, prompts, hf_greedy, monkeypatch):
    monkeypatch.setenv("TANDEM_QUANT_ACTIVATIONS", "int8")
    outs = greedy(llm, prompts)
    compare(outs, hf_greedy, NEAR_TIE_INT8)
    assert sum(out.token_ids[0] == tokens[0] for out, (tokens, _) in zip(outs, hf_greedy)) >= len(prompts) - 1
