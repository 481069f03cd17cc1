"""Multi-LoRA over HTTP: one private Serve cluster on the tiny llama checkpoint with random PEFT adapters,
driven with the official `openai` client.

Oracles: HF + PEFT's greedy tokens for the adapter (through the offline engine's tokens, which must equal
them, and its text for the same prompt ids), the OpenAI error body, and vLLM's /v1/models shape.
"""

from __future__ import annotations

import json
import shutil

import openai
import pytest

from engine import LLM, SamplingParams
from serve_cluster import serve_cluster
from test_correctness_hf import assert_matches_hf
from test_lora import build_adapter

BASE = "llama"  # the served name of the tiny checkpoint (its directory's name)
PROMPT = [7, 33, 101, 250, 19, 402, 88, 5, 61, 300, 12, 45]
NEW = 12


@pytest.fixture(scope="module")
def setup(tiny_model_factory, tmp_path_factory):
    path, hf = tiny_model_factory("llama")
    root = tmp_path_factory.mktemp("lora_serve")
    sql = build_adapter(hf, root / "sql", seed=21, r=16, lora_alpha=32,
                        target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])
    lora_dir = root / "dir"
    build_adapter(hf, lora_dir / "found", seed=22, r=8, lora_alpha=8, target_modules=["o_proj", "up_proj"])
    shutil.copytree(root / "sql", lora_dir / "broken")
    cfg = json.loads((lora_dir / "broken" / "adapter_config.json").read_text())
    (lora_dir / "broken" / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    args = {"model": str(path), "device": "cpu", "num_replicas": 1, "lora_modules": {"sql": str(root / "sql")},
            "lora_dir": str(lora_dir), "max_loras": 2, "num_kv_blocks": 64}
    with serve_cluster(args) as cluster:
        yield cluster, path, hf, sql, args


@pytest.fixture(scope="module")
def client(setup):
    return openai.OpenAI(base_url=setup[0].api_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(setup):
    _, path, hf, sql, args = setup
    llm = LLM(str(path), lora_modules=args["lora_modules"], lora_dir=args["lora_dir"], max_loras=2)
    yield llm
    llm.shutdown()


def complete(client, model: str, stream: bool = False) -> str:
    kw = dict(model=model, prompt=PROMPT, max_tokens=NEW, temperature=0, extra_body={"ignore_eos": True})
    if not stream:
        return client.completions.create(**kw).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)


def test_adapter_by_either_name_equals_hf_peft_and_differs_from_base(setup, client, offline):
    _, _, hf, sql, _ = setup
    out = offline.generate([PROMPT], SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True),
                           lora_request="sql")[0]
    assert_matches_hf(sql, PROMPT, out.token_ids, NEW)  # the offline engine's tokens are PEFT's
    texts = {model: complete(client, model) for model in (f"{BASE}:sql", "sql")}
    assert texts[f"{BASE}:sql"] == texts["sql"] == out.text
    assert complete(client, "sql", stream=True) == out.text
    assert complete(client, BASE) != out.text  # the adapter changes the output
    found = offline.generate([PROMPT], SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True),
                             lora_request="found")[0]
    assert complete(client, f"{BASE}:found") == found.text  # found in lora_dir at first use


def test_chat_under_an_adapter_names_it_in_the_response(client):
    r = client.chat.completions.create(model=f"{BASE}:sql", messages=[{"role": "user", "content": "fox"}],
                                       max_tokens=4, temperature=0)
    assert r.model == f"{BASE}:sql" and r.choices[0].finish_reason in ("stop", "length")


def test_models_lists_adapters_with_their_parent(client, setup):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {BASE, "sql", "found", "broken"}
    assert getattr(models["sql"], "parent") == BASE and getattr(models["found"], "parent") == BASE
    assert getattr(models["sql"], "root").endswith("/sql")


@pytest.mark.parametrize("model", [f"{BASE}:nope", "nope", "other:sql", f"{BASE}:../dir/found"])
def test_unknown_adapter_is_404_naming_it(client, model):
    with pytest.raises(openai.NotFoundError) as err:
        complete(client, model)
    body = err.value.body
    assert body["code"] == "model_not_found" and body["param"] == "model" and f"`{model}`" in body["message"]


def test_unsupported_adapter_is_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as err:
        complete(client, "broken")
    assert "LoRA adapter 'broken'" in err.value.body["message"] and "DoRA" in err.value.body["message"]
    assert complete(client, "sql")  # the engine goes on serving
