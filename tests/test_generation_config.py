"""The model's sampling defaults (engine/generation_config.py), as vLLM applies them: generation_config.json's
temperature / top_p / top_k / min_p / repetition_penalty for request fields left unset, its max_new_tokens as a
cap on every request's max_tokens; `generation_config="vllm"` reads none, a directory reads its file, and
`override_generation_config` merges over what was read.

Expected values are written out from the files each test writes, never read back from the code under test.
Over HTTP: tests/test_openai_extras_serve.py."""

from __future__ import annotations

import json
import shutil

import pytest

from engine import LLM, SamplingParams
from engine.config import DEFAULT_MODEL_DIR, EngineConfig
from engine.generation_config import sampling_defaults
from serve_app.protocol import ChatCompletionRequest, CompletionRequest

QWEN_STYLE = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.7, "top_p": 0.8,
              "top_k": 20, "repetition_penalty": 1.05, "max_new_tokens": 7}


def checkpoint(tmp_path, name: str, generation: dict | None) -> str:
    """A copy of the embedded model with `generation` as its generation_config.json (None: no file)."""
    out = tmp_path / name
    shutil.copytree(DEFAULT_MODEL_DIR, out)
    (out / "generation_config.json").unlink(missing_ok=True)
    if generation is not None:
        (out / "generation_config.json").write_text(json.dumps(generation))
    return str(out)


def test_auto_reads_the_models_sampling_keys(tmp_path):
    d = checkpoint(tmp_path, "m", QWEN_STYLE)
    assert sampling_defaults(d) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
                                    "max_tokens": 7}
    assert EngineConfig(model=d).sampling_defaults() == sampling_defaults(d)


def test_values_apply_as_written_and_null_or_other_keys_do_not(tmp_path):
    """transformers 5's GenerationConfig() leaves every sampling field unset, so vLLM's diff against it is the
    file as written: top_k 50 cuts at 50; min_p null, do_sample and the token ids are not sampling defaults."""
    d = checkpoint(tmp_path, "m", {"top_k": 50, "temperature": 1.0, "top_p": 0.95, "min_p": None,
                                   "do_sample": False, "pad_token_id": 0})
    assert sampling_defaults(d) == {"top_k": 50, "temperature": 1.0, "top_p": 0.95}


def test_no_file_vllm_mode_directory_and_override(tmp_path):
    plain = checkpoint(tmp_path, "plain", None)
    assert sampling_defaults(plain) == {}
    assert EngineConfig(model=plain).sampling_defaults() == {}
    d = checkpoint(tmp_path, "m", QWEN_STYLE)
    assert sampling_defaults(d, "vllm") == {}
    assert sampling_defaults(d, "vllm", {"temperature": 0.5}) == {"temperature": 0.5}
    # the override wins over the file, key by key; an override of 1.0 is applied (it is asked for)
    assert sampling_defaults(d, "auto", {"temperature": 1.0, "max_new_tokens": 100}) == {
        "temperature": 1.0, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 100}
    other = tmp_path / "gen"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "min_p": 0.1}))
    assert sampling_defaults(plain, str(other)) == {"temperature": 0.3, "min_p": 0.1}
    cfg = EngineConfig(model=plain, generation_config=str(other), override_generation_config={"top_k": 5})
    assert cfg.sampling_defaults() == {"temperature": 0.3, "min_p": 0.1, "top_k": 5}


@pytest.mark.parametrize("kwargs, message", [
    ({"override_generation_config": {"temperatur": 0.5}}, "'temperatur' not applied"),
    ({"override_generation_config": {"temperature": -1}}, "override_generation_config: temperature"),
    ({"override_generation_config": {"top_k": 1.5}}, "top_k must be a finite integer"),
    ({"override_generation_config": {"top_p": "high"}}, "top_p must be a finite number"),
    ({"override_generation_config": [("temperature", 1)]}, "override_generation_config must be a dict"),
    ({"generation_config": "/nonexistent/dir"}, "generation_config must be 'auto', 'vllm' or a directory"),
])
def test_bad_settings_fail_at_startup_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_bad_file_fails_at_startup_naming_it(tmp_path):
    d = checkpoint(tmp_path, "m", {"temperature": -0.5})
    with pytest.raises(ValueError, match=r"generation_config\.json: temperature"):
        EngineConfig(model=d)
    (tmp_path / "m" / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not readable JSON"):
        EngineConfig(model=d)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="does not exist"):
        EngineConfig(model=d, generation_config=str(empty))


def test_requests_take_defaults_only_for_fields_they_leave_unset():
    defaults = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 7}
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]).sampling_params(defaults)
    assert (chat.temperature, chat.top_p, chat.top_k, chat.min_p, chat.repetition_penalty, chat.max_tokens) == \
        (0.7, 0.8, 20, 0.0, 1.05, 7)  # min_p: the API's default; max_tokens unset: the cap
    # set fields win, also when set to the API's own default value
    p = CompletionRequest(prompt="x", temperature=1.0, top_k=-1, max_tokens=3).sampling_params(defaults)
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (1.0, -1, 0.8, 3)
    # the cap holds against a larger request and against the completions default of 16
    assert CompletionRequest(prompt="x", max_tokens=100).sampling_params(defaults).max_tokens == 7
    assert CompletionRequest(prompt="x").sampling_params(defaults).max_tokens == 7
    with pytest.raises(ValueError, match="min_tokens must be <= max_tokens"):
        CompletionRequest(prompt="x", min_tokens=10).sampling_params(defaults)
    # no defaults: the API's (SamplingParams') own
    p = CompletionRequest(prompt="x").sampling_params()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == \
        (1.0, 1.0, -1, 0.0, 1.0, 16)


def test_offline_generate_without_params_uses_the_models_defaults(tmp_path):
    d = checkpoint(tmp_path, "m", {"top_k": 1, "temperature": 1.3, "max_new_tokens": 5})
    llm = LLM(d)
    try:
        defaults = llm.get_default_sampling_params()
        assert (defaults.top_k, defaults.temperature, defaults.max_tokens) == (1, 1.3, 5)
        prompt = "Return the number of"
        greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0].token_ids
        # top_k 1 is greedy at any temperature; the cap gives 5 tokens (unless EOS comes first)
        got = llm.generate([prompt])[0].token_ids
        assert got == greedy[:len(got)] and len(got) <= 5
    finally:
        llm.shutdown()
    plain = LLM(d, generation_config="vllm")
    try:
        assert plain.get_default_sampling_params() == SamplingParams()
    finally:
        plain.shutdown()
