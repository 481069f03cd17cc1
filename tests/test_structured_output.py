"""Structured output: grammar-constrained decoding on tiny random checkpoints and the embedded model.

Oracles, all independent of the engine: `json.loads` + `jsonschema` for JSON schema outputs, Python's `re`
for regexes, string equality for choices, and Hugging Face transformers on the same fp32 weights for the
greedy mask check (every constrained greedy token is HF's argmax over the tokens a fresh xgrammar matcher,
replayed over the output in the test, allows at that position: a mask applied one step late or to the
wrong row fails it).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import jsonschema
import pytest
import torch
import xgrammar as xgr

from engine import LLM, AsyncLLM, EngineConfig, LLMEngine, SamplingParams
from engine.sampling_params import StructuredOutputsParams as SO
from tiny_models import tokenizer

TIE_GAP = 1e-3
PROMPTS = ["The quick brown fox", "Paged attention keeps", "emoji and accents"]
EMBEDDED_PROMPTS = ["Return the config as JSON:", "def parse(data):", "The result is"]

SCHEMAS = {
    "flat": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                              "ok": {"type": "boolean"}}, "required": ["id", "ok"]},
    "nested": {"type": "object", "required": ["user", "tags"], "properties": {
        "user": {"type": "object", "required": ["name", "age"], "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 150}}},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}}},
    "numbers": {"type": "object", "required": ["x", "n"], "properties": {
        "x": {"type": "number", "minimum": -10, "maximum": 10},
        "n": {"type": "integer", "minimum": -5, "maximum": 5}}},
    "patterns": {"type": "object", "required": ["code", "month"], "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
        "month": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])$"}}},
    "array_of_objects": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"k": {"enum": [1, 2, "three", None]}}, "required": ["k"]}},
    "any_of": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 3}]},
    "optional_and_const": {"type": "object", "required": ["v", "list"], "properties": {
        "v": {"const": "fixed"}, "opt": {"type": "string", "maxLength": 4},
        "list": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 3}, "maxItems": 4}}},
    "defs_ref": {"$defs": {"pt": {"type": "object", "required": ["x", "y"], "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 99},
        "y": {"type": "integer", "minimum": 0, "maximum": 99}}}},
        "type": "object", "required": ["a", "b"],
        "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}}},
}
REGEXES = [r"[a-z]{1,8}@[a-z]{2,6}\.(com|org|net)", r"\d{3}-\d{4}", r"(0|[1-9]\d{0,2})(\.\d{1,2})?",
           r"[A-Z][a-z]{0,6}( [A-Z][a-z]{0,6}){0,2}", r"#[0-9a-fA-F]{6}", r"\(\d{1,3}, ?\d{1,3}\)",
           r"[αβγ]{1,3}-[0-9]"]
CHOICES = [["yes", "no", "maybe not"], ['a"b', "x\\y", "new\nline", "ü😀"], ["no", "nope", "no way"],
           ["{", "}"]]
SAMPLING = [dict(temperature=0), dict(temperature=1.0, seed=7), dict(temperature=0.8, top_p=0.9, seed=3)]


# ---- fixtures and helpers ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def llm2(llama):
    llm = LLM(str(llama[0]), device="cpu", pipeline_depth=2, block_size=4, num_kv_blocks=1024)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def embedded():
    llm = LLM(device="cpu")
    yield llm
    llm.shutdown()


def so(**kw) -> SO:
    return SO(**kw)


def params(constraint: SO | None, max_tokens: int = 300, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, structured_outputs=constraint, **kw)


def check_json(text: str, schema: dict):
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


def json_cases(prompts: list[str]) -> list[tuple[str, str, SamplingParams]]:
    """Every schema x layout x sampling mode, over the prompts in turn: (schema name, prompt, params).

    With free whitespace a gap may hold up to MAX_JSON_WHITESPACE characters, one token each at worst: ~20
    gaps of defs_ref can take 320 tokens of whitespace alone, so those cases get room for it (at 300 tokens a
    sampled run of the embedded model ran out once the sampler's random stream changed)."""
    cases = []
    for i, (name, schema) in enumerate(SCHEMAS.items()):
        for compact in (False, True):
            for j, samp in enumerate(SAMPLING):
                prompt = prompts[(i + j) % len(prompts)]
                cases.append((name, prompt, params(so(json=schema, disable_any_whitespace=compact),
                                                   max_tokens=300 if compact else 1000, **samp)))
    return cases


def assert_clean(llm: LLM) -> None:
    llm.check_integrity()
    s = llm.stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"] and s["num_compiling"] == 0


# ---- every output is valid ----------------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["tiny_llama", "embedded"])
def test_json_schema_outputs_parse_and_validate(model, request):
    llm = request.getfixturevalue("llm2" if model == "tiny_llama" else "embedded")
    cases = json_cases(PROMPTS if model == "tiny_llama" else EMBEDDED_PROMPTS)
    outs = llm.generate([p for _, p, _ in cases], [sp for _, _, sp in cases])
    for (name, _, _), out in zip(cases, outs):
        assert out.finish_reason == "stop", (name, out.finish_reason, out.text)
        check_json(out.text, SCHEMAS[name])
    assert_clean(llm)


@pytest.mark.parametrize("model", ["tiny_llama", "embedded"])
def test_regex_choice_and_json_object_outputs_are_exact(model, request):
    llm = request.getfixturevalue("llm2" if model == "tiny_llama" else "embedded")
    prompts = PROMPTS if model == "tiny_llama" else EMBEDDED_PROMPTS
    constraints = [so(regex=r) for r in REGEXES] + [so(choice=c) for c in CHOICES]
    if model == "embedded":  # any JSON object is unbounded: a random model need not ever close it
        constraints += [so(json_object=True), so(json_object=True, disable_any_whitespace=True)]
    cases = [(c, prompts[i % 3], params(c, **SAMPLING[i % 3])) for i, c in enumerate(constraints)]
    outs = llm.generate([p for _, p, _ in cases], [sp for _, _, sp in cases])
    for (c, _, _), out in zip(cases, outs):
        assert out.finish_reason == "stop", (c, out.text)
        if c.regex is not None:
            assert re.fullmatch(c.regex, out.text), (c.regex, out.text)
        elif c.choice is not None:
            assert out.text in c.choice
        else:
            assert isinstance(json.loads(out.text), dict), out.text
    assert_clean(llm)


def test_ebnf_grammar_and_choice_that_ends_under_ignore_eos(llm2):
    grammar = 'root ::= "(" num ", " num ")"\nnum ::= [0-9] | [1-9] [0-9]'
    outs = llm2.generate(PROMPTS[:2], [params(so(grammar=grammar), temperature=0),
                                       params(so(choice=["left", "right"]), temperature=0, ignore_eos=True)])
    assert outs[0].finish_reason == "stop" and re.fullmatch(r"\((\d|[1-9]\d), (\d|[1-9]\d)\)", outs[0].text)
    # ignore_eos cannot make a finished grammar run on: its stop token ends the request
    assert outs[1].finish_reason == "stop" and outs[1].text in ("left", "right")


def test_max_tokens_mid_structure_finishes_with_length(llm2):
    schema = SCHEMAS["nested"]
    full = llm2.generate([PROMPTS[0]], params(so(json=schema), temperature=0))[0]
    assert full.finish_reason == "stop" and len(full.token_ids) > 6
    cut = llm2.generate([PROMPTS[0]], params(so(json=schema), max_tokens=5, temperature=0))[0]
    assert cut.finish_reason == "length" and cut.token_ids == full.token_ids[:5]
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.text)


# ---- the mask is right, at the right step, on the right row ---------------------------------------------------
def hf_masked_argmax_path(hf, compiled, prompt_ids: list[int], out_ids: list[int], vocab: int):
    """For each output position: is the engine's token HF's argmax over what a fresh matcher allows?"""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt_ids + out_ids])).logits[0].float()
    logits = logits[len(prompt_ids) - 1:]
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, vocab)
    for i, tok in enumerate(out_ids):
        matcher.fill_next_token_bitmask(mask)
        row = logits[i:i + 1].clone()
        xgr.apply_token_bitmask_inplace(row, mask)
        best = int(row.argmax())
        assert row[0, tok] >= row[0, best] - TIE_GAP, f"position {i}: engine {tok}, masked argmax {best}"
        assert matcher.accept_token(tok)


def test_greedy_constrained_tokens_are_hf_masked_argmax_in_a_mixed_batch(llm2, llama):
    """Constrained and unconstrained greedy rows share steps (prefills, decodes, a chunked prefill):
    each constrained token is HF's argmax under the grammar's mask for exactly that row and position, and
    the unconstrained rows equal their solo runs."""
    _, hf = llama
    tok = tokenizer()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=hf.config.vocab_size, stop_token_ids=[0])
    compiler = xgr.GrammarCompiler(info)
    constraints = [so(json=SCHEMAS["patterns"], disable_any_whitespace=True), so(regex=REGEXES[0]),
                   so(json=SCHEMAS["numbers"])]
    compiled = [compiler.compile_json_schema(json.dumps(SCHEMAS["patterns"]), any_whitespace=False),
                compiler.compile_regex(REGEXES[0]),
                compiler.compile_json_schema(json.dumps(SCHEMAS["numbers"]), any_whitespace=True,
                                             max_whitespace_cnt=16)]
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    long_prompt = " ".join(PROMPTS * 6)  # a chunked prefill next to the decodes
    prompts = [PROMPTS[0], long_prompt, PROMPTS[1], PROMPTS[2], PROMPTS[0], long_prompt]
    sps = [params(constraints[0], temperature=0), plain, params(constraints[1], temperature=0), plain,
           params(constraints[2], temperature=0), plain]
    llm = LLM(str(llama[0]), device="cpu", block_size=4, num_kv_blocks=1024, max_num_batched_tokens=32)
    outs = llm.generate(prompts, sps)
    for k, i in enumerate((0, 2, 4)):
        assert outs[i].finish_reason == "stop"
        ids = tok.encode(prompts[i])
        hf_masked_argmax_path(hf, compiled[k], ids, outs[i].token_ids, hf.config.vocab_size)
    for i in (1, 3, 5):
        assert outs[i].token_ids == llm.generate([prompts[i]], plain)[0].token_ids
    llm.shutdown()


def test_every_pipeline_depth_gives_identical_constrained_outputs(llama, llm2):
    """Seeded sampling (and greedy), constrained mixed with plain rows, with and without chunked prefill."""
    cases = json_cases(PROMPTS)[::2] + [
        ("regex", PROMPTS[1], params(so(regex=REGEXES[3]), temperature=1.0, seed=11)),
        ("choice", PROMPTS[2], params(so(choice=CHOICES[2]), temperature=1.2, seed=5)),
        ("plain", PROMPTS[0], SamplingParams(max_tokens=30, temperature=1.0, seed=2)),
        ("allowed", PROMPTS[1], SamplingParams(max_tokens=12, temperature=1.0, seed=4,
                                               allowed_token_ids=list(range(30, 90)), logit_bias={"40": 3.0}))]
    prompts, sps = [p for _, p, _ in cases], [sp for _, _, sp in cases]
    ref = [o.token_ids for o in llm2.generate(prompts, sps)]
    for kw in (dict(pipeline_depth=1), dict(pipeline_depth=1, max_num_batched_tokens=8),
               dict(pipeline_depth=2, max_num_batched_tokens=8), dict(pipeline_depth=3),
               dict(pipeline_depth=3, max_num_batched_tokens=8, cpu_executor_thread=True)):
        llm = LLM(str(llama[0]), device="cpu", block_size=4, num_kv_blocks=1024, **kw)
        assert [o.token_ids for o in llm.generate(prompts, sps)] == ref, kw
        assert_clean(llm)
        llm.shutdown()


def test_preempted_constrained_requests_are_not_replayed_into_their_matcher(llama, llm2):
    """Too few KV blocks: requests are preempted (soft reset) and recomputed from their committed tokens.
    Matchers are advanced at commit only, so outputs are unchanged and still valid."""
    cases = [(n, PROMPTS[i % 3], params(so(json=SCHEMAS[n], disable_any_whitespace=True), max_tokens=80,
                                        temperature=1.0, seed=i))
             for i, n in enumerate(["nested", "defs_ref", "numbers", "patterns"])]
    prompts, sps = [p for _, p, _ in cases], [sp for _, _, sp in cases]
    ref = llm2.generate(prompts, sps)
    for depth in (1, 2, 3):
        small = LLM(str(llama[0]), device="cpu", block_size=4, num_kv_blocks=24, pipeline_depth=depth,
                    admission_margin=0.0)
        outs = small.generate(prompts, sps)
        assert small.stats()["num_preemptions"] > 0
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
        for (name, _, _), out in zip(cases, outs):
            assert out.finish_reason == "stop"
            check_json(out.text, SCHEMAS[name])
        assert_clean(small)
        small.shutdown()


def test_constraints_that_leave_no_token_end_the_request_cleanly(llm2):
    """min_tokens forbids the stop token a complete grammar needs: the request ends "stop" with its complete
    match. allowed_token_ids disjoint from the grammar: nothing can be produced, the request is aborted.
    Neither commits the token drawn from an all -inf row, and the engine serves on."""
    letters = list(range(67, 80))  # 'a'..'m' in the test tokenizer
    outs = llm2.generate(PROMPTS[:3], [params(so(choice=["ab"]), temperature=0, min_tokens=5),
                                       params(so(regex="[0-9]{2}"), temperature=1.0, seed=1,
                                              allowed_token_ids=letters),
                                       params(so(regex="[a-m]{3}"), temperature=0, allowed_token_ids=letters)])
    assert (outs[0].finish_reason, outs[0].text) == ("stop", "ab")
    assert (outs[1].finish_reason, outs[1].token_ids) == ("abort", [])
    assert outs[2].finish_reason == "stop" and re.fullmatch("[a-m]{3}", outs[2].text)
    assert_clean(llm2)


# ---- allowed_token_ids and logit_bias against HF ---------------------------------------------------------------
def test_allowed_token_ids_and_logit_bias_follow_hf(llm2, llama):
    _, hf = llama
    allowed = list(range(40, 140, 3))
    bias = {str(allowed[5]): 4.0, str(allowed[9]): -100.0, "7": 50.0}  # 7 is not allowed: bias cannot undo that
    out = llm2.generate([PROMPTS[0]], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                                     allowed_token_ids=allowed, logit_bias=bias))[0]
    ids = tokenizer().encode(PROMPTS[0])
    with torch.no_grad():
        logits = hf(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1:].float()
    for i, tok in enumerate(out.token_ids):
        row = torch.full_like(logits[i], float("-inf"))
        row[allowed] = logits[i, allowed]
        for t, b in bias.items():
            row[int(t)] += b
        assert row[tok] >= row.max() - TIE_GAP, f"position {i}"
    assert set(out.token_ids) <= set(allowed) and allowed[9] not in out.token_ids


# ---- compilation: off the loop, cached, failures are the request's alone -------------------------------------
def slow_schema(n: int = 120) -> dict:
    props = {f"field_{i}": {"type": "object", "required": [f"x{j}" for j in range(8)], "properties": {
        f"x{j}": {"type": "string", "pattern": f"^[a-z]{{{j},{j + 3}}}[0-9]+$"} for j in range(8)}}
        for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)}


def test_slow_compile_does_not_delay_other_requests(llama):
    """A schema that takes xgrammar seconds to compile (480 fields: ~2.7 s on a 2-core Sapphire Rapids, where
    the 120-field default took 0.4 s and sometimes beat the 16 tokens below): an unconstrained request added
    after it streams all its tokens while the compile is still running (the compile holds neither the loop nor
    the GIL)."""
    engine = LLMEngine(EngineConfig(model=str(llama[0]), device="cpu", block_size=4, num_kv_blocks=256))
    slow = engine.add_request(PROMPTS[0], params(so(json=slow_schema(480)), max_tokens=2, temperature=0))
    fast = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    compile_future = engine.compiling[0][1]
    t0, finished = time.monotonic(), {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = (out, time.monotonic() - t0, compile_future.done())
    fast_out, fast_s, compiled_then = finished[fast]
    assert len(fast_out.token_ids) == 16 and not compiled_then, (
        f"the plain request finished after {fast_s:.2f} s, only once the grammar had compiled")
    slow_out = finished[slow][0]
    assert slow_out.finish_reason == "length" and slow_out.error is None and slow_out.text.startswith("{")
    assert finished[slow][1] > fast_s
    engine.check_integrity()
    engine.shutdown()


def test_abort_while_compiling_frees_the_request(llama):
    engine = LLMEngine(EngineConfig(model=str(llama[0]), device="cpu", block_size=4, num_kv_blocks=256))
    release = threading.Event()
    real_compile = engine.structured.backend.compile
    engine.structured.backend.compile = lambda p: release.wait(10) and real_compile(p)
    rid = engine.add_request(PROMPTS[0], params(so(regex="[a-z]{4}")))
    [out] = engine.abort(rid)
    assert out.finished and out.finish_reason == "abort" and not engine.has_unfinished()
    assert engine.stats()["num_compiling"] == 0
    release.set()
    assert engine.step() == []
    engine.check_integrity()
    engine.shutdown()


def test_compiled_grammars_are_cached_per_spec(llm2):
    before = llm2.stats()["grammar_compiles"]
    schema = {"type": "object", "properties": {"q": {"type": "integer", "minimum": 0, "maximum": 5},
                                               "r": {"type": "boolean"}}, "required": ["q", "r"]}
    reordered = {"type": "object", "properties": {"r": {"type": "boolean"},
                                                  "q": {"type": "integer", "minimum": 0, "maximum": 5}},
                 "required": ["q", "r"]}
    cases = [so(json=schema), so(json=json.dumps(schema, indent=2)), so(json=schema, disable_any_whitespace=True),
             so(json=reordered)]
    outs = llm2.generate(PROMPTS[:1] * len(cases), [params(c, temperature=0) for c in cases])
    assert all(check_json(o.text, schema) for o in outs)
    # Property order is part of the grammar: the output lists properties in the schema's order.
    assert [list(json.loads(o.text)) for o in outs] == [["q", "r"]] * 3 + [["r", "q"]]
    assert outs[0].text == outs[1].text  # the same schema as a dict or as JSON text: one grammar
    assert llm2.stats()["grammar_compiles"] - before == 3


BAD_CONSTRAINTS = [
    ("structured_outputs.json", dict(json={"type": "no-such-type"}), "Unsupported type"),
    ("structured_outputs.json", dict(json={"type": "integer", "minimum": 5, "maximum": 1}), "minimum"),
    ("structured_outputs.regex", dict(regex="(ab"), "parenthesis"),
    ("structured_outputs.grammar", dict(grammar="root ::= undefined_rule"), "undefined_rule"),
]


@pytest.mark.parametrize("field,kw,reason", BAD_CONSTRAINTS, ids=[b[0] + "-" + b[2] for b in BAD_CONSTRAINTS])
def test_uncompilable_constraint_is_a_value_error_and_nothing_runs(llm2, field, kw, reason):
    steps = llm2.stats()["steps"]
    with pytest.raises(ValueError, match=re.escape(field)) as exc:
        llm2.generate(PROMPTS, [params(None), params(SO(**kw)), params(None)])
    assert reason in str(exc.value) and "cannot compile" in str(exc.value)
    assert llm2.stats()["steps"] == steps
    assert_clean(llm2)
    assert llm2.generate([PROMPTS[0]], params(so(choice=["ok"])))[0].text == "ok"


def test_engine_fails_only_the_request_whose_grammar_does_not_compile(llama):
    """Direct engine use: the bad grammar is found on the compile pool, after add_request returned; that
    request ends with an error, the one beside it is untouched."""
    engine = LLMEngine(EngineConfig(model=str(llama[0]), device="cpu", block_size=4, num_kv_blocks=256))
    release = threading.Event()  # holds every compile until both requests are queued (no race with it)
    real_compile = engine.structured.backend.compile
    engine.structured.backend.compile = lambda p: release.wait(10) and real_compile(p)
    bad_schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}, "required": ["a"]}
    bad = engine.add_request(PROMPTS[0], params(so(json=bad_schema)))
    good = engine.add_request(PROMPTS[1], params(so(regex=REGEXES[1]), temperature=0))
    assert engine.stats()["num_compiling"] == 2
    release.set()
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert done[bad].finish_reason == "abort" and "structured_outputs.json: cannot compile" in done[bad].error
    assert done[good].finish_reason == "stop" and re.fullmatch(REGEXES[1], done[good].text)
    with pytest.raises(ValueError, match="structured_outputs.json"):  # now cached: rejected at once
        engine.add_request(PROMPTS[0], params(so(json=bad_schema)))
    engine.check_integrity()
    engine.shutdown()


def test_async_streams_a_bad_grammar_error_a_slow_one_and_plain_ones_side_by_side(llama):
    """AsyncLLM: the bad grammar's stream raises ValueError; while a slow schema compiles, a plain request
    streams to the end; then the slow one runs and validates."""
    allm = AsyncLLM(model=str(llama[0]), device="cpu", block_size=4, num_kv_blocks=256)
    done: list[str] = []

    async def run(name: str, prompt: str, sp: SamplingParams):
        outs = [o async for o in allm.generate(prompt, sp)]
        done.append(name)
        return outs[-1]

    async def bad():
        with pytest.raises(ValueError, match=r"structured_outputs\.regex: cannot compile: .*parenthesis"):
            await run("bad", PROMPTS[0], params(so(regex="(ab")))
        done.append("bad raised")

    async def main():
        # 480 fields (~2.7 s to compile), as above: the 120-field schema's 0.4 s beat the plain request's 16
        # tokens in 3 of 4 runs once the engine's OpenMP team spins (it shares the 2 cores with the compile)
        return await asyncio.gather(run("slow", PROMPTS[0], params(so(json=slow_schema(480)), max_tokens=3)),
                                    bad(), run("plain", PROMPTS[1], SamplingParams(max_tokens=16, ignore_eos=True)))

    slow, _, plain = asyncio.run(main())
    allm.shutdown()
    assert done.index("plain") < done.index("slow") and "bad raised" in done
    assert len(plain.token_ids) == 16 and slow.finish_reason == "length" and slow.text.startswith("{")


def hold_compiles(engine) -> threading.Event:
    """Every compile on `engine` waits for the returned event (a compile that takes as long as a test wants)."""
    release = threading.Event()
    real_compile = engine.structured.backend.compile
    engine.structured.backend.compile = lambda p: release.wait(30) and real_compile(p)
    return release


def test_grammar_over_its_compile_timeout_fails_in_every_entry_point(llama):
    """grammar_compile_timeout_s bounds the wait: LLM.generate raises before anything runs, LLMEngine fails
    the request at its next step, AsyncLLM's stream raises; each names the field and the limit. The compile
    that was already running finishes and is cached, so the same grammar later runs at once."""
    cfg = dict(device="cpu", block_size=4, num_kv_blocks=256, grammar_compile_timeout_s=0.2)
    message = r"structured_outputs\.regex: did not compile within 0\.2 s \(grammar_compile_timeout_s\)"
    llm = LLM(str(llama[0]), **cfg)
    release = hold_compiles(llm.engine)
    started = time.monotonic()
    with pytest.raises(ValueError, match=message):
        llm.generate(PROMPTS[:2], [params(None), params(so(regex="[a-z]{3}"))])
    assert 0.2 <= time.monotonic() - started < 5 and llm.stats()["steps"] == 0
    release.set()
    assert re.fullmatch("[a-z]{3}", llm.generate([PROMPTS[0]], params(so(regex="[a-z]{3}")))[0].text)
    assert_clean(llm)
    llm.shutdown()

    engine = LLMEngine(EngineConfig(model=str(llama[0]), **cfg))
    release = hold_compiles(engine)
    slow = engine.add_request(PROMPTS[0], params(so(regex="[0-9]{2}")))
    plain = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    release.set()
    assert done[slow].finish_reason == "abort" and re.search(message, done[slow].error)
    assert done[plain].finish_reason == "length" and len(done[plain].token_ids) == 400
    engine.check_integrity()
    engine.shutdown()

    allm = AsyncLLM(model=str(llama[0]), **cfg)
    release = hold_compiles(allm.engine)

    async def main():
        with pytest.raises(ValueError, match=message):
            async for _ in allm.generate(PROMPTS[0], params(so(regex="x[a-z]"))):
                pass
        release.set()
        return [o async for o in allm.generate(PROMPTS[1], SamplingParams(max_tokens=4, ignore_eos=True))][-1]

    assert len(asyncio.run(main()).token_ids) == 4
    allm.shutdown()


# ---- parameter validation ------------------------------------------------------------------------------------
def deep_schema(levels: int) -> dict:
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


BAD_PARAMS = [
    ("structured_outputs.json is nested too deeply", lambda: SO(json=deep_schema(2000))),
    ("structured_outputs.json is nested too deeply", lambda: SO(json="[" * 100_000 + "]" * 100_000)),
    ("structured_outputs must set exactly one", lambda: SO()),
    ("structured_outputs must set exactly one", lambda: SO(regex="a", choice=["a"])),
    ("structured_outputs.json is not valid JSON", lambda: SO(json="{nope")),
    ("structured_outputs.json must be a JSON schema object", lambda: SO(json="[1]")),
    ("structured_outputs.choice must be a non-empty list", lambda: SO(choice="abc")),
    ("structured_outputs.choice must contain non-empty strings", lambda: SO(choice=["a", ""])),
    ("structured_outputs.regex must be a non-empty string", lambda: SO(regex=5)),
    ("structured_outputs.disable_any_whitespace must be a boolean", lambda: SO(json_object=True,
                                                                               disable_any_whitespace="y")),
    ("structured_outputs must be a StructuredOutputsParams", lambda: SamplingParams(structured_outputs={"x": 1})),
    ("allowed_token_ids must be a non-empty list", lambda: SamplingParams(allowed_token_ids=[])),
    ("allowed_token_ids must be an integer", lambda: SamplingParams(allowed_token_ids=[1, -2])),
    ("logit_bias value must be in [-100.0, 100.0]", lambda: SamplingParams(logit_bias={"3": 101})),
    ("logit_bias token id must be an integer", lambda: SamplingParams(logit_bias={"-3": 1})),
    ("logit_bias must be a mapping", lambda: SamplingParams(logit_bias=[1, 2])),
]


@pytest.mark.parametrize("message,make", BAD_PARAMS, ids=[m for m, _ in BAD_PARAMS])
def test_bad_constraint_params_raise_value_error_naming_the_field(message, make):
    with pytest.raises(ValueError, match=re.escape(message)):
        make()


def test_out_of_vocab_constraint_token_ids_are_rejected(llm2):
    for kw, field in ((dict(allowed_token_ids=[3, 512]), "allowed_token_ids"),
                      (dict(logit_bias={"600": 1.0}), "logit_bias")):
        with pytest.raises(ValueError, match=f"{field} token ids must be in \\[0, 512\\)"):
            llm2.generate(PROMPTS[:1], SamplingParams(**kw))
    assert_clean(llm2)
