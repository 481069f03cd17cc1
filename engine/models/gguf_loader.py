"""Serve a GGUF file's weights as they are: `LLM(model="file.gguf", tokenizer=DIR)` (vLLM's spelling).

The file is read with the `gguf` package (gguf.GGUFReader). Linears and the token embedding stay in their
quantized blocks (engine/cpu/quant.py, engine/cpu/gemm_quant.cpp: Q8_0, Q4_1, Q5_0, Q4_K, Q6_K); float tensors
(F32, F16, BF16: norms, and any linear the file keeps in float) are converted to fp32, which is exact. Any other
tensor type (Q5_1, Q2_K, Q3_K, Q5_K, IQ*, ...) is refused, naming the tensor and its type:
`python -m engine.models.from_gguf FILE OUT_DIR` still serves such a file dequantized to fp32.

The engine also needs a checkpoint directory for everything that is not weights: `gguf_model_dir` writes one
(once, into TANDEM_CACHE, default ~/.cache/tandem) with the config transformers reads from the GGUF's metadata
and the tokenizer of `tokenizer=DIR` (vLLM recommends the base model's; its generation_config.json is copied
too), or, without one, the tokenizer transformers converts from the GGUF.

Architectures: llama (Llama, SmolLM2, Mistral written as llama) and gemma3 (Gemma 3's text models). llama.cpp's
converter permutes a llama's attn_q / attn_k rows for its RoPE layout; they are put back here, on the quantized
rows (a row permutation moves whole rows of blocks), as transformers does on the dequantized ones. It writes a
Gemma's RMSNorm weights as 1 + w (Gemma scales by 1 + w); here, as in transformers, w = that - 1 in fp32.
Runs on CPU in fp32 activations only. A pipeline stage (`layers=(start, end)`) reads only its own layers'
tensors, the embedding on the first stage and the final norm and head on the last (with a tied head, the
embedding's blocks too). LoRA adapters wrap its quantized linears as any other (engine/lora/layers.py).
Tensor parallelism shards it (engine/models/tp.py's take_shard): each rank copies out of the memory
map only its rows of q/k/v and gate/up (un-permuted after the slice: the permutation moves rows within a head, and
a rank's rows are whole heads), its K blocks of attn_output and ffn_down (refused, naming the tensor, its type and
K, where K / tp is not a whole number of the type's blocks: 32 weights, 256 for Q4_K / Q6_K), and its vocabulary
rows of the embedding and head (zero blocks past the vocabulary, which dequantize to 0).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.cpu import kernels as cpu_native
from engine.cpu import linear as cpu_linear
from engine.cpu.quant import (BLOCK_BYTES, BLOCK_WEIGHTS, QUANT_TYPES, QuantEmbedding, QuantLinear, QuantWeight,
                              quantized_bytes)
from engine.models.decoder import DecoderLM, ModelSpec
from engine.models.tp import TPShard, check_block_aligned, parallelize, take_shard
from engine.models.from_gguf import write_dir_atomically

SUPPORTED_ARCHITECTURES = ("llama", "gemma3")
FLOAT_TYPES = ("F32", "F16", "BF16")
IGNORED = ("rope_freqs.weight",)  # llama 3's RoPE factors: the config's rope scaling already carries them
_FORMAT_VERSION = "1"  # bump when what gguf_model_dir writes changes


def is_gguf(model: str) -> bool:
    return str(model).lower().endswith(".gguf")


def reader(gguf_file: str | Path):
    """The file's tensors and scalar metadata (_TensorReader, a gguf.GGUFReader); ValueError naming the file when
    it is not a GGUF file."""
    try:
        return _tensor_reader_class()(str(gguf_file))
    except Exception as exc:  # noqa: BLE001 - the gguf package raises ValueError, OSError, struct errors...
        raise ValueError(f"cannot read GGUF file {str(gguf_file)!r}: {type(exc).__name__}: {exc}") from exc


@functools.cache
def _tensor_reader_class():
    """gguf.GGUFReader, less the parsing of metadata arrays (vocabulary, merges, scores, token types).

    GGUFReader makes two numpy views of every element of every array field, which is most of its time on a
    file with a large vocabulary (seconds: bench/README.md, GGUF load time). Loading weights reads none of them
    (the tokenizer comes from the model directory gguf_model_dir writes once), so this reader steps over each
    array by its lengths and leaves it out of `fields`; get_field of one raises KeyError naming it rather than
    answering None. Scalars, strings and tensors are GGUFReader's own. (Built on first use, so that `gguf` is
    imported only when a GGUF file is read: engine/models/loader.py imports this module on every start.)"""
    import struct

    import gguf

    vt = gguf.GGUFValueType

    class _TensorReader(gguf.GGUFReader):
        def __init__(self, path: str):
            super().__init__(path)
            self.arrays = [name for name, f in self.fields.items() if f.types and f.types[0] == vt.ARRAY]
            for name in self.arrays:
                del self.fields[name]

        def get_field(self, key: str):
            if key in self.arrays:
                raise KeyError(f"GGUF metadata array {key!r} is not parsed by engine.models.gguf_loader's "
                               "reader (gguf.GGUFReader reads it)")
            return super().get_field(key)

        def _get_field_parts(self, orig_offs: int, raw_type: int):
            if vt(raw_type) != vt.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            return self._array_size(orig_offs), [], [], [vt.ARRAY]  # (the field is dropped in __init__)

        def _array_size(self, offs: int) -> int:
            """Bytes of the array value at `offs` (its item type, count and items), nested arrays included."""
            order = "<" if self.endianess == gguf.GGUFEndian.LITTLE else ">"
            item, count = struct.unpack_from(order + "IQ", self.data, offs)
            end, item = offs + 12, vt(item)
            scalar = self.gguf_scalar_to_np.get(item)
            if scalar is not None:
                return end + count * np.dtype(scalar).itemsize - offs
            length = struct.Struct(order + "Q").unpack_from
            for _ in range(count):
                if item == vt.STRING:
                    end += 8 + length(self.data, end)[0]
                elif item == vt.ARRAY:
                    end += self._array_size(end)
                else:
                    raise ValueError(f"unknown GGUF value type {item} in an array at byte {offs}")
            return end - offs

    return _TensorReader


def check_architecture(gguf_file: str | Path, file_reader=None) -> str:
    """general.architecture of the file, ValueError unless Tandem runs it quantized."""
    field = (file_reader or reader(gguf_file)).get_field("general.architecture")
    arch = field.contents() if field is not None else "unknown"
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} ({gguf_file}) is not supported quantized; valid: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)} (python -m engine.models.from_gguf FILE OUT_DIR "
                         "serves others dequantized)")
    return arch


@functools.cache
def gguf_model_dir(gguf_file: str, tokenizer: str | None) -> str:
    """The directory of config.json and tokenizer files the engine reads for `gguf_file` (see the top), written
    on first use, whole or not at all, and found again after by the file's path, size, mtime and `tokenizer`."""
    src = Path(gguf_file).resolve()
    stat = src.stat()
    key = f"{src}|{stat.st_size}|{stat.st_mtime_ns}|{tokenizer and Path(tokenizer).resolve()}|{_FORMAT_VERSION}"
    root = Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem")) / "gguf"
    out = root / f"{src.stem}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"
    if (out / "config.json").exists():
        return str(out)
    check_architecture(src)
    write_dir_atomically(out, "config.json", lambda tmp: _write_model_dir(src, tokenizer, tmp))
    return str(out)


def _write_model_dir(src: Path, tokenizer: str | None, out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(src.parent, gguf_file=src.name).to_dict()
    config.pop("quantization_config", None)  # the directory holds no weights; the GGUF file is the quantization
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer is None:
        AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name).save_pretrained(out)
        return
    AutoTokenizer.from_pretrained(tokenizer, local_files_only=True).save_pretrained(out)
    generation = Path(tokenizer) / "generation_config.json"
    if generation.exists():
        shutil.copy(generation, out / "generation_config.json")


# ---- weights -----------------------------------------------------------------------------------------------------
class GGUFTensors:
    """The file's tensors by name, read on demand: quantized ones as QuantWeights (their bytes copied out of the
    memory map, so the file can go), float ones as fp32 torch tensors; every tensor read is remembered, so the
    loader can refuse a file with tensors it did not place."""

    def __init__(self, gguf_file: str | Path):
        import gguf

        self.path = str(gguf_file)
        self._gguf = gguf
        file_reader = reader(self.path)
        self.arch = check_architecture(self.path, file_reader)
        self.tensors = {t.name: t for t in file_reader.tensors}
        self.used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def type_of(self, name: str) -> str:
        return self.tensors[self._need(name)].tensor_type.name

    def _need(self, name: str) -> str:
        if name not in self.tensors:
            raise ValueError(f"GGUF file {self.path!r} lacks tensor {name!r}")
        self.used.add(name)
        return name

    def float(self, name: str) -> torch.Tensor:
        t = self.tensors[self._need(name)]
        kind = t.tensor_type.name
        if kind not in FLOAT_TYPES:
            raise ValueError(f"GGUF tensor {name!r} is {kind}; Tandem reads it only as a float "
                             f"({', '.join(FLOAT_TYPES)})")
        values = self._gguf.quants.dequantize(t.data, t.tensor_type)  # exact for float types
        return torch.from_numpy(values.copy()).float().reshape(*reversed([int(n) for n in t.shape]))

    def blocks(self, name: str) -> tuple[str, FileRows, int]:
        """(type, the block rows [N, K / QK * block bytes] read on demand, K) of quantized tensor `name`."""
        t = self.tensors[self._need(name)]
        kind = t.tensor_type.name
        if kind not in QUANT_TYPES:
            raise ValueError(f"GGUF tensor {name!r} is {kind}; Tandem runs GGUF {', '.join(QUANT_TYPES)} quantized "
                             f"and {', '.join(FLOAT_TYPES)} as floats (python -m engine.models.from_gguf FILE OUT_DIR "
                             "serves other types dequantized)")
        k, n = (int(v) for v in t.shape)
        return kind, FileRows(t.data.reshape(n, -1)), k

    def row_parallel(self) -> list[tuple[str, str, int]]:
        """(name, type, K) of every quantized attn_output / ffn_down weight: the ones a tensor-parallel rank splits
        along K."""
        return [(name, t.tensor_type.name, int(t.shape[0])) for name, t in self.tensors.items()
                if name.endswith((".attn_output.weight", ".ffn_down.weight")) and t.tensor_type.name not in FLOAT_TYPES]

    def unused(self, placed_here=lambda name: True) -> list[str]:
        """Tensors not read, of those `placed_here` says this model (one pipeline stage) should hold."""
        return sorted(n for n in set(self.tensors) - self.used - set(IGNORED) if placed_here(n))


class FileRows:
    """A quantized tensor's block rows [N, bytes] in the file's memory map; indexing (rows, or rows and byte
    columns) copies out only what it selects, so a tensor-parallel rank never holds the rest."""

    def __init__(self, data):
        self.data = data
        self.shape = data.shape

    def __getitem__(self, index) -> torch.Tensor:
        return torch.from_numpy(np.array(self.data[index]))


def _unpermute(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of a llama attn_q / attn_k weight (float, or quantized block rows) or bias back in the checkpoint's
    order: llama.cpp stores each head's rotary pairs interleaved ([head, dim / 2, 2] rows); transformers' reverse
    permutation, on whole rows. It moves rows within a head only, so it applies alike to any run of whole heads (a
    tensor-parallel rank's)."""
    n = w.shape[0]
    perm = torch.arange(n).view(n // head_dim, head_dim // 2, 2).transpose(1, 2).reshape(-1)
    return w.index_select(0, perm)


class _Placer:
    """Puts the file's tensors into a DecoderLM built on the meta device: quantized linears and embedding as
    modules holding their bytes (before to_empty, which leaves them alone), float ones recorded for after it. With
    `tp`, every tensor is this rank's shard (engine/models/tp.py's take_shard), cut out of the file's rows."""

    def __init__(self, tensors: GGUFTensors, spec: ModelSpec, norm_shift: float, tp: TPShard | None = None):
        self.t, self.spec, self.norm_shift, self.tp = tensors, spec, norm_shift, tp
        self.after: list[tuple[torch.Tensor | str, torch.Tensor]] = []  # (parameter name, value) once allocated

    def linear(self, owner: nn.Module, attr: str, pname: str, names: list[str], permuted: list[bool]) -> None:
        """owner.attr := the rows of `names` stacked (q/k/v, gate/up), each unpermuted when `permuted` says."""
        kinds = {self.t.type_of(f"{n}.weight") for n in names}
        biases = [self.weight(f"{n}.bias", f"{pname}.bias", i, p) for i, (n, p) in enumerate(zip(names, permuted))
                  if f"{n}.bias" in self.t]
        bias = torch.cat(biases) if biases else None
        parts = [self.weight(f"{n}.weight", f"{pname}.weight", i, p) for i, (n, p) in enumerate(zip(names, permuted))]
        if kinds <= set(FLOAT_TYPES):  # a float linear: its parameters are filled after to_empty
            self.after.append((f"{pname}.weight", torch.cat(parts)))
            if bias is not None:
                self.after.append((f"{pname}.bias", bias))
            return
        setattr(owner, attr, QuantLinear(parts, bias))

    def weight(self, name: str, pname: str, shard: int = 0, permuted: bool = False) -> QuantWeight | torch.Tensor:
        """Tensor `name` (this rank's shard of it for parameter `pname`, tp.take_shard's `shard`): fp32 for a float
        type, else a QuantWeight of its blocks; unpermuted after the slice (a rank's rows are whole heads)."""
        if self.t.type_of(name) in FLOAT_TYPES:
            w = self.t.float(name)
            w = w if self.tp is None else take_shard(w, pname, shard, self.tp)
            return _unpermute(w, self.spec.head_dim) if permuted else w
        kind, rows, k = self.t.blocks(name)
        data = rows[:] if self.tp is None else take_shard(rows, pname, shard, self.tp, kind, name)
        if permuted:
            data = _unpermute(data, self.spec.head_dim)
        return QuantWeight(kind, data, data.shape[1] // BLOCK_BYTES[kind] * BLOCK_WEIGHTS[kind])

    def embedding(self, model: DecoderLM) -> None:
        w = self.weight("token_embd.weight", "embed_tokens.weight")
        if isinstance(w, QuantWeight):
            model.embed_tokens = QuantEmbedding(w)
        else:
            self.after.append(("embed_tokens.weight", w))

    def norm(self, pname: str, name: str) -> None:
        self.after.append((pname, self.t.float(name) - self.norm_shift))


def check_tensor_parallel(gguf_file: str | Path, size: int) -> None:
    """ValueError naming the first quantized attn_output / ffn_down weight whose K `size` ranks cannot split on
    block boundaries (EngineConfig calls it; the load checks each tensor again as it slices it)."""
    for name, kind, k in GGUFTensors(gguf_file).row_parallel():
        check_block_aligned(name, kind, k, size)


def build_gguf_model(gguf_file: str, spec: ModelSpec, rotary, local, backend, dtype: torch.dtype,
                     device: torch.device, layers: tuple[int, int] | None = None,
                     tp: TPShard | None = None) -> DecoderLM:
    """The model with the file's weights (engine/models/loader.py's build_model calls it for a GGUF), or with
    `layers=(start, end)` one pipeline stage holding only its own tensors (DecoderLM's stage layout);
    `rotary` the RoPE tables for `spec`, `local` those of Gemma 3's sliding layers (None for one table). With
    `tp`, one tensor-parallel rank's shard: `spec` is then its local_spec."""
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError(f"a GGUF model runs quantized on CPU in float32 only, not {device.type} {dtype} "
                         "(CUDA quantized kernels are not built)")
    tensors = GGUFTensors(gguf_file)
    gemma = tensors.arch == "gemma3"
    with torch.device("meta"):
        model = DecoderLM(spec, None, backend, layers)
    place = _Placer(tensors, spec, norm_shift=1.0 if gemma else 0.0, tp=tp)
    _place_layers(model, place, permuted=not gemma)
    if model.embed_tokens is not None:  # the first stage, and a last one whose head is the tied embedding
        place.embedding(model)
    head = None
    if model.is_last:
        place.norm("norm.weight", "output_norm.weight")
        head = _read_head(model, place, gguf_file)
    unused = tensors.unused(functools.partial(_in_stage, model))
    if unused:
        raise ValueError(f"GGUF file {gguf_file!r} holds tensors Tandem does not place: {unused[:8]}")
    model.lm_head = None
    model = model.to_empty(device=device)
    model.rotary = rotary.to(device)
    model.rotary_local = local.to(device) if local is not None else None
    model.reset_kv_scales(device)
    params = dict(model.named_parameters())
    for pname, value in place.after:
        if params[pname].shape != value.shape:
            raise ValueError(f"weight shape mismatch for {pname}: GGUF {tuple(value.shape)} vs model "
                             f"{tuple(params[pname].shape)}")
        params[pname].data.copy_(value)
    if tp is not None:
        parallelize(model, tp)
    model = model.eval().requires_grad_(False)
    if model.is_last:
        _pack_head(model, head)
    if cpu_linear.available(dtype):  # linears the file keeps in float, if any
        cpu_linear.pack_linears(model.layers)
    model.use_cpu_kernels(cpu_native.load(), dtype)
    return model


def _read_head(model: DecoderLM, place: _Placer, gguf_file: str) -> QuantWeight | torch.Tensor | None:
    """The last stage's untied head (this rank's vocabulary rows of it under tensor parallelism); None for a tied
    head (the embedding, read back by _pack_head)."""
    if "output.weight" in place.t:
        return place.weight("output.weight", "lm_head.weight")
    if not model.spec.tie_word_embeddings:
        raise ValueError(f"GGUF file {gguf_file!r} has no output.weight and its config does not tie the head")
    return None


def _in_stage(model: DecoderLM, name: str) -> bool:
    """Whether tensor `name` belongs to `model` (one pipeline stage, or the whole model): its layers' blocks, the
    embedding where it holds one, the final norm and head on the last stage; any other name on every stage."""
    if name.startswith("blk."):
        first, end = model.layer_range
        return first <= int(name.split(".")[1]) < end
    if name == "token_embd.weight":
        return model.embed_tokens is not None
    if name in ("output_norm.weight", "output.weight"):
        return model.is_last
    return True


def _place_layers(model: DecoderLM, place: _Placer, permuted: bool) -> None:
    """Every layer's tensors (a stage's: the file's block numbers global, the model's parameters local);
    `permuted`: the file's attn_q / attn_k rows are in llama.cpp's RoPE order."""
    for i, layer in enumerate(model.layers):
        blk, attn, mlp = f"blk.{i + model.layer_range[0]}", layer.self_attn, layer.mlp
        place.linear(attn, "qkv_proj", f"layers.{i}.self_attn.qkv_proj",
                     [f"{blk}.attn_q", f"{blk}.attn_k", f"{blk}.attn_v"], [permuted, permuted, False])
        place.linear(attn, "o_proj", f"layers.{i}.self_attn.o_proj", [f"{blk}.attn_output"], [False])
        place.linear(mlp, "gate_up_proj", f"layers.{i}.mlp.gate_up_proj", [f"{blk}.ffn_gate", f"{blk}.ffn_up"],
                     [False, False])
        place.linear(mlp, "down_proj", f"layers.{i}.mlp.down_proj", [f"{blk}.ffn_down"], [False])
        place.norm(f"layers.{i}.input_layernorm.weight", f"{blk}.attn_norm.weight")
        if layer.sandwich:  # Gemma: the attention output normed, the MLP between two norms
            place.norm(f"layers.{i}.post_attention_layernorm.weight", f"{blk}.post_attention_norm.weight")
            place.norm(f"layers.{i}.pre_feedforward_layernorm.weight", f"{blk}.ffn_norm.weight")
            place.norm(f"layers.{i}.post_feedforward_layernorm.weight", f"{blk}.post_ffw_norm.weight")
        else:
            place.norm(f"layers.{i}.post_attention_layernorm.weight", f"{blk}.ffn_norm.weight")
        if attn.q_norm is not None:
            place.norm(f"layers.{i}.self_attn.q_norm.weight", f"{blk}.attn_q_norm.weight")
            place.norm(f"layers.{i}.self_attn.k_norm.weight", f"{blk}.attn_k_norm.weight")


def _pack_head(model: DecoderLM, head: QuantWeight | torch.Tensor | None) -> None:
    """The LM head as DecoderLM.logits reads it: a QuantWeight is called as it is (a tied one shares the
    embedding's bytes); a float one is packed where the CPU GEMM runs, else kept for F.linear."""
    if head is None:
        embed = model.embed_tokens
        head = embed.qweight if isinstance(embed, QuantEmbedding) else embed.weight
    if isinstance(head, QuantWeight):
        model.head_packed = head
    elif cpu_linear.available(head.dtype):
        model.head_packed = cpu_linear.pack_weight(head)
    else:
        model.lm_head = nn.Linear(head.shape[1], head.shape[0], bias=False)
        model.lm_head.weight.data = head


def weight_bytes(model: DecoderLM) -> int:
    """Bytes of the model's weights as held: parameters plus quantized blocks (not the RoPE tables), an untied
    quantized head included (a QuantWeight on the model, not a module; a tied one is the embedding's bytes)."""
    head = model.head_packed
    untied = isinstance(head, QuantWeight) and head is not getattr(model.embed_tokens, "qweight", None)
    return sum(p.numel() * p.element_size() for p in model.parameters()) + quantized_bytes(model) + \
        (head.nbytes if untied else 0)
