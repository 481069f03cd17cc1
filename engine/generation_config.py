"""The model's own sampling defaults: its generation_config.json, applied where a request leaves a field unset.

Model makers publish the sampling they recommend there (Qwen2.5-Instruct: temperature 0.7, top_p 0.8, top_k 20,
repetition_penalty 1.05; Llama 3 Instruct: temperature 0.6, top_p 0.9; Gemma 3: top_k 64, top_p 0.95). vLLM
applies them by default (`--generation-config auto`), so a Tandem user moving from vLLM gets the same sampling
for the same request. The engine fields keep vLLM's names and meanings (engine/config.py):

- `generation_config`: "auto" reads `generation_config.json` in the model's directory (none there: no
  defaults); "vllm" reads none (the API's own defaults, temperature 1.0 and no top-k/top-p/min-p cut); any other
  value is a directory whose `generation_config.json` is read.
- `override_generation_config`: a dict of generation-config keys merged over what was read (over nothing with
  "vllm"), e.g. {"temperature": 0.5}.

Which keys apply, as vLLM takes them: temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens,
which caps every request's max_tokens (a server-wide limit, not only a default). Values apply as the file
writes them (vLLM reads the file's difference from transformers' GenerationConfig(), whose sampling fields are
all unset since transformers 5, so the same). `do_sample` is not read (vLLM does not either): a request for
greedy output sets temperature 0.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

# generation_config.json key -> SamplingParams field
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
FILE = "generation_config.json"
INTEGER_FIELDS = ("top_k", "max_tokens")


def sampling_defaults(model_dir: str, generation_config: str = "auto",
                      override: dict | None = None) -> dict[str, float | int]:
    """SamplingParams field -> the value a request gets when it leaves that field unset ("max_tokens": the cap
    on every request's). ValueError naming the file or key for anything unusable."""
    if generation_config == "vllm":
        found = {}
    elif generation_config == "auto":
        found = _read(Path(model_dir) / FILE, required=False)
    else:
        folder = Path(generation_config)
        if not folder.is_dir():
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory holding {FILE}; "
                             f"{generation_config!r} is none of them")
        found = _read(folder / FILE, required=True)
    unknown = sorted(set(override or {}) - set(KEYS))
    if unknown:
        raise ValueError(f"override_generation_config: {', '.join(map(repr, unknown))} not applied by Tandem; "
                         f"the keys it applies are {', '.join(KEYS)}")
    source = "generation_config" if generation_config != "auto" else str(Path(model_dir) / FILE)
    defaults = _check({KEYS[k]: v for k, v in found.items()}, source)
    defaults.update(_check({KEYS[k]: v for k, v in (override or {}).items() if v is not None},
                           "override_generation_config"))
    return defaults


def _read(path: Path, required: bool) -> dict:
    """The applied keys a generation_config.json sets (null: unset)."""
    if not path.is_file():
        if required:
            raise ValueError(f"generation_config: {path} does not exist")
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not readable JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return {k: data[k] for k in KEYS if data.get(k) is not None}


def _check(fields: dict, source: str) -> dict:
    """The fields as SamplingParams takes them; ValueError naming the source on a value no request could run
    with (found at startup, not on the first request)."""
    from engine.sampling_params import SamplingParams

    out = {}
    for field, value in fields.items():
        integral = field in INTEGER_FIELDS
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not numeric or (integral and value != int(value)):
            raise ValueError(f"{source}: {field} must be a finite {'integer' if integral else 'number'}; "
                             f"got {value!r}")
        out[field] = int(value) if integral else float(value)
    try:
        SamplingParams(**out)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    return out


def cap_max_tokens(max_tokens: int | None, defaults: dict) -> int | None:
    """A request's max_tokens under the generation config's cap (None stays None when there is no cap)."""
    cap = defaults.get("max_tokens")
    if cap is None:
        return max_tokens
    return cap if max_tokens is None else min(max_tokens, cap)
