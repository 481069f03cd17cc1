"""User input is validated at the edge: ValueError naming the field (and the allowed range), and a bad request
never harms the engine (nothing queued, no KV blocks held, the next request runs normally)."""

from __future__ import annotations

import os
import re

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams

VOCAB = 512


BAD_PARAMS = [
    ("temperature", {"temperature": -1}),
    ("temperature", {"temperature": float("nan")}),
    ("temperature", {"temperature": "hot"}),
    ("top_p", {"top_p": 0}),
    ("top_p", {"top_p": 1.5}),
    ("top_k", {"top_k": -2}),
    ("top_k", {"top_k": 2.5}),
    ("min_p", {"min_p": 2}),
    ("min_p", {"min_p": -0.1}),
    ("repetition_penalty", {"repetition_penalty": 0}),
    ("repetition_penalty", {"repetition_penalty": -1.0}),
    ("presence_penalty", {"presence_penalty": 3}),
    ("frequency_penalty", {"frequency_penalty": -3}),
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": 1.5}),
    ("min_tokens", {"min_tokens": -1}),
    ("min_tokens", {"min_tokens": 5, "max_tokens": 4}),
    ("logprobs", {"logprobs": 21}),
    ("logprobs", {"logprobs": -1}),
    ("stop", {"stop": [""]}),
    ("stop", {"stop": ""}),
    ("stop", {"stop": 5}),
    ("stop", {"stop": ["ok", 5]}),
    ("seed", {"seed": "x"}),
    ("seed", {"seed": 1.0}),
    ("seed", {"seed": 2**64}),  # beyond int64/uint64: torch's manual_seed cannot take it
    ("stop_token_ids", {"stop_token_ids": [-1]}),
    ("stop_token_ids", {"stop_token_ids": ["7"]}),
    ("ignore_eos", {"ignore_eos": "yes"}),
]


@pytest.mark.parametrize("field,kwargs", BAD_PARAMS,
                         ids=[",".join(f"{k}={v!r}" for k, v in kw.items()) for _, kw in BAD_PARAMS])
def test_invalid_sampling_params_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=re.escape(field)):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [
    {}, {"temperature": 0}, {"temperature": 2.0, "top_p": 1.0, "top_k": 0}, {"top_k": -1}, {"top_k": 1},
    {"min_p": 1.0}, {"repetition_penalty": 2.0}, {"presence_penalty": -2, "frequency_penalty": 2},
    {"max_tokens": None}, {"max_tokens": 1, "min_tokens": 1}, {"logprobs": 0}, {"logprobs": 20},
    {"stop": "x"}, {"stop": ["a", "bc"]}, {"seed": 0}, {"seed": -5}, {"stop_token_ids": [0, 511]},
])
def test_valid_sampling_params_are_accepted(kwargs):
    SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def ckpt(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.mark.parametrize("field,value", [
    ("dtype", "float64"), ("dtype", "fp32"),
    ("device", "tpu"), ("device", "cuda:0x"),
    ("scheduler", "lifo"),
    ("pipeline_depth", 0), ("pipeline_depth", 4),
    ("block_size", 0), ("block_size", -16), ("block_size", "16"),
    ("max_num_seqs", 0), ("max_num_batched_tokens", 0), ("num_kv_blocks", 0), ("max_model_len", 0),
    ("num_cpu_blocks", -1),
])
def test_invalid_engine_config_names_the_field(ckpt, field, value):
    with pytest.raises(ValueError, match=re.escape(field)):
        EngineConfig(model=str(ckpt[0]), **{field: value})
    with pytest.raises(ValueError, match=re.escape(field)):
        LLM(str(ckpt[0]), **{field: value})


@pytest.mark.parametrize("field,value", [
    ("seed", "x"),  # today: RuntimeError from torch at LLM construction
    ("seed", 2**64),  # today: "Overflow when unpacking long long"
    ("enable_prefix_caching", "no"),  # today: accepted, and a truthy string turns caching ON
    ("cuda_graphs", "off"),
    ("admission_margin", "x"),  # today: TypeError
    ("cpu_kv_cache_bytes", -5),  # today: accepted, silently a 1-block KV cache
    ("cpu_executor_thread", "auto"),  # None is auto
    ("cpu_threads", 0),
    ("cpu_threads", 1.5),
    ("stream_interval", 0),
    ("pipeline_depth", 4),
    ("pipeline_depth", True),
])
def test_engine_config_rejects_other_bad_fields(ckpt, field, value):
    """docs/architecture.md, code conventions: every config field is validated where the config is built, by name."""
    with pytest.raises(ValueError, match=re.escape(field)):
        EngineConfig(model=str(ckpt[0]), **{field: value})


def test_missing_model_dir_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="model"):
        EngineConfig(model=str(tmp_path / "nope"))


MAX_LEN = 32


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(str(ckpt[0]), device="cpu", block_size=4, num_kv_blocks=64, max_model_len=MAX_LEN)


def hf_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits)


def assert_healthy(llm: LLM, hf) -> None:
    """Nothing left behind, every block free, and a fresh request still matches HF greedy."""
    assert not llm.engine.has_unfinished()
    llm.check_integrity()
    s = llm.stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"]
    assert s["num_waiting"] == 0 and s["num_running"] == 0
    prompt = [5, 17, 99, 300, 42]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    ref, logits = hf_greedy(hf, prompt, 6)
    for i, (a, b) in enumerate(zip(out.token_ids, ref)):
        if a != b:
            top2 = logits[i].topk(2).values
            assert top2[0] - top2[1] < 1e-3, f"token {i}: engine {a} vs HF {b}"
            break
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    s = llm.stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"]


@pytest.mark.parametrize("prompt,pattern", [
    ("", "prompt"),
    ([], "prompt"),
    ([1, 2, "3"], "prompt"),
    ([1, 2.0], "prompt"),
    ([1, True], "prompt"),
    ([3, VOCAB], str(VOCAB)),
    ([-1, 4], r"-1"),
    ([4] * MAX_LEN, "max_model_len"),
    ([4] * (MAX_LEN + 10), "max_model_len"),
])
def test_engine_rejects_bad_prompt(llm, ckpt, prompt, pattern):
    with pytest.raises(ValueError, match=pattern):
        llm.engine.add_request(prompt, SamplingParams(max_tokens=2))
    assert_healthy(llm, ckpt[1])


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 88, -1])
def test_out_of_vocab_message_names_id_and_range(llm, bad):
    with pytest.raises(ValueError) as exc:
        llm.generate([[5, 6, bad, 7]], SamplingParams(max_tokens=2))
    msg = str(exc.value)
    assert str(bad) in msg, msg
    assert f"[0, {VOCAB})" in msg or f"0..{VOCAB - 1}" in msg or f"[0, {VOCAB - 1}]" in msg, msg


def test_prompt_just_under_max_model_len_is_served(llm, ckpt):
    out = llm.generate([[4] * (MAX_LEN - 1)], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    assert_healthy(llm, ckpt[1])


def test_stop_token_id_out_of_vocab_is_rejected(llm, ckpt):
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(["hello"], SamplingParams(stop_token_ids=[VOCAB]))
    assert_healthy(llm, ckpt[1])


@pytest.mark.parametrize("bad_at", [0, 1, 3])
def test_bad_prompt_in_batch_raises_and_engine_stays_usable(llm, ckpt, bad_at):
    prompts: list = ["The quick brown fox", [5, 6, 7], "Paged attention", [9, 10, 11, 12]]
    prompts[bad_at] = [1, 2, VOCAB + 5] if bad_at != 1 else ""
    before = llm.stats()
    with pytest.raises(ValueError):
        llm.generate(prompts, SamplingParams(max_tokens=4))
    after = llm.stats()  # "a bad one raises ValueError and runs nothing" (LLM.generate)
    assert (after["steps"], after["generation_tokens"]) == (before["steps"], before["generation_tokens"])
    assert_healthy(llm, ckpt[1])


def test_bad_params_in_batch_raise_and_engine_stays_usable(llm, ckpt):
    with pytest.raises(ValueError):
        llm.generate(["a", "b"], [SamplingParams()])  # one SamplingParams for two prompts
    with pytest.raises(ValueError, match="params"):
        llm.generate(["a", "b"], [SamplingParams(), {"temperature": 0}])
    assert_healthy(llm, ckpt[1])


def test_bad_request_while_others_run(llm, ckpt):
    """A rejected add_request in the middle of a run leaves the running requests untouched."""
    eng, hf = llm.engine, ckpt[1]
    prompt = [8, 9, 10, 11, 12, 13]
    rid = eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    eng.step()
    with pytest.raises(ValueError):
        eng.add_request([VOCAB * 2], SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request([5, 6], SamplingParams(), request_id=rid)
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert list(done) == [rid]
    ref, logits = hf_greedy(hf, prompt, 8)
    for i, (a, b) in enumerate(zip(done[rid].token_ids, ref)):
        if a != b:
            top2 = logits[i].topk(2).values
            assert top2[0] - top2[1] < 1e-3, f"token {i}: engine {a} vs HF {b}"
            break
    assert_healthy(llm, hf)


def test_max_model_len_caps_generation(llm):
    for max_tokens in (None, 100):
        out = llm.generate([[4, 5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                             ignore_eos=True))[0]
        assert len(out.token_ids) == MAX_LEN - 5 and out.finish_reason == "length"


def test_request_outgrowing_the_whole_kv_cache_never_stalls(ckpt):
    """2 blocks of 4 hold 8 positions: a 5-token prompt fits, 5 + 10 tokens never can. Acceptable: reject the
    config (the cache cannot hold one max_model_len sequence), reject the request, or finish it ("length")
    when it cannot grow. Not acceptable: the request waits forever and LLM.generate never returns."""
    try:
        llm = LLM(str(ckpt[0]), device="cpu", block_size=4, num_kv_blocks=2)
    except ValueError as exc:
        assert "num_kv_blocks" in str(exc) or "max_model_len" in str(exc)
        return
    eng = llm.engine
    try:
        rid = eng.add_request([5, 6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    except ValueError as exc:
        assert "max_tokens" in str(exc) or "KV" in str(exc) or "num_kv_blocks" in str(exc)
        return
    finished = []
    for _ in range(100):
        if not eng.has_unfinished():
            break
        finished += [o for o in eng.step() if o.finished]
    stalled = eng.has_unfinished()
    if stalled:
        eng.abort(rid)
        while eng.has_unfinished():
            eng.step()
    assert not stalled, "a request that outgrew the KV cache stalled the engine (generate would hang)"
    assert [o.request_id for o in finished] == [rid]
    # 8 positions hold the 5 prompt tokens and 3 outputs; a 4th output can still be sampled from them
    out = finished[0]
    assert out.finish_reason == "length" and 1 <= len(out.token_ids) <= 4
    ref, logits = hf_greedy(ckpt[1], [5, 6, 7, 8, 9], len(out.token_ids))
    for i, (a, b) in enumerate(zip(out.token_ids, ref)):
        if a != b:
            top2 = logits[i].topk(2).values
            assert top2[0] - top2[1] < 1e-3, f"token {i}: engine {a} vs HF {b}"
            break
    llm.check_integrity()
    assert llm.stats()["kv_blocks_free"] == 2


def test_cpu_forward_thread_only_when_a_core_is_spare():
    """cpu_executor_thread=None: a forward thread only if the intra-op threads leave a core for the loop."""
    import os

    import torch

    from engine.model_runner import cpu_thread_helps

    cores, before = len(os.sched_getaffinity(0)), torch.get_num_threads()
    try:
        torch.set_num_threads(cores)
        assert not cpu_thread_helps(None) and cpu_thread_helps(True)
        if cores > 1:
            torch.set_num_threads(cores - 1)
            assert cpu_thread_helps(None) and not cpu_thread_helps(False)
    finally:
        torch.set_num_threads(before)


def test_cpu_threads_sets_the_engine_processes_intra_op_threads(ckpt):
    """cpu_threads: the engine process's torch threads (a Ray actor's default is its CPU reservation), which
    also decides the forward thread (no core is left when the threads take them all)."""
    import os

    import torch

    from engine import LLM

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        cores = len(os.sched_getaffinity(0))
        llm = LLM(str(ckpt[0]), cpu_threads=cores)
        assert torch.get_num_threads() == cores
        assert llm.stats()["executor"] == "InlineExecutor"
        llm.shutdown()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("depth,thread,resolved", [(None, False, 1), (None, True, 2), (2, False, 2), (1, True, 1)])
def test_pipeline_depth_auto_defers_commits_only_when_the_forward_overlaps_the_loop(ckpt, depth, thread, resolved):
    """pipeline_depth=None: 2 (the prefill's first token commits one tick later, under the next forward) with a
    forward thread, 1 (it commits in the tick that computed it) when the forward runs inline on the loop thread,
    where deferring the commit overlaps nothing. An explicit depth is kept either way."""
    from engine import LLM

    llm = LLM(str(ckpt[0]), device="cpu", pipeline_depth=depth, cpu_executor_thread=thread)
    try:
        assert llm.stats()["executor"] == ("SerialExecutor" if thread and depth != 1 else "InlineExecutor")
        assert llm.stats()["pipeline_depth"] == resolved
        llm.engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, temperature=0), stream=True)
        first_tick = llm.engine.step()
        assert len(first_tick) == (1 if resolved == 1 else 0)
        outputs = first_tick + [o for _ in range(8) for o in llm.engine.step()]
        assert [len(o.token_ids) for o in outputs] == [1, 2, 3, 4]
    finally:
        llm.shutdown()


OPENMP_TEAMS_PROBE = """
import os, time
import torch
from engine import LLM
from engine.config import DEFAULT_MODEL_DIR
from engine.executor import _omp_pause_resource_all, release_openmp_threads

def tasks():
    return len(os.listdir("/proc/self/task"))

def settle(expect):  # a released team's threads exit just after the call returns
    for _ in range(200):
        if tasks() == expect:
            return expect
        time.sleep(0.01)
    return tasks()

big = torch.ones(1 << 20)
assert _omp_pause_resource_all() is not None, "no OpenMP runtime found"
big.add_(1)  # this thread's team: 1 worker beside it (OMP_NUM_THREADS=2)
with_team = tasks()
release_openmp_threads()
print("released", with_team - settle(with_team - 1))
big.add_(1)
print("restarted", settle(with_team) - (with_team - 1))
llm = LLM(str(DEFAULT_MODEL_DIR), device="cpu")  # builds on this thread: its regions start a team here
after_build = tasks()
big.add_(1)
print("team after build", settle(after_build + 1) - after_build)
"""


def test_an_engine_leaves_no_openmp_team_on_the_thread_that_built_it():
    """OpenMP gives each thread that opens parallel regions its own team; with more team threads than cores
    every team sleeps between regions instead of spinning, so an engine stepped on another thread than the
    one that built it (AsyncLLM's loop) ran every region through a futex wake-up. The builder's team is
    released once the engine is built: the next region on that thread has to start a worker again."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", OPENMP_TEAMS_PROBE], env={**os.environ, "OMP_NUM_THREADS": "2"},
                         capture_output=True, text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr[-2000:]
    lines = dict(line.rsplit(" ", 1) for line in out.stdout.strip().splitlines()[-3:])
    assert lines == {"released": "1", "restarted": "1", "team after build": "1"}, out.stdout


@pytest.mark.parametrize("device,threads,given,budget", [
    ("cpu", 1, None, 512), ("cpu", 2, None, 1024), ("cpu", 3, None, 1536), ("cpu", 4, None, 2048),
    ("cpu", 16, None, 2048), ("sim", 2, None, 2048), ("cuda", 2, None, 2048), ("cpu", 2, 4096, 4096),
    ("sim", 2, 300, 300)])
def test_token_budget_auto_scales_with_cpu_threads(device, threads, given, budget):
    """max_num_batched_tokens=None: 2048 on a GPU or the simulated one; on CPU 512 tokens per forward thread
    within 512..2048, so a step of prompt tokens stays under ~1 s (fp32) on any core count; a given value wins."""
    from engine.config import EngineConfig

    cfg = EngineConfig(device=device, cpu_threads=threads, max_num_batched_tokens=given)
    assert cfg.max_num_batched_tokens == given
    assert cfg.token_budget() == budget


def test_engine_resolves_the_token_budget_once_and_chunks_prompts_by_it(ckpt):
    """The engine reads the resolved number everywhere (scheduler, step buffers, stats): three 200-token prompts
    on 1 CPU thread are prefilled in steps of at most 512 tokens (the third one chunked)."""
    from engine import LLM

    before = torch.get_num_threads()
    llm = LLM(str(ckpt[0]), device="cpu", cpu_threads=1, enable_prefix_caching=False, pipeline_depth=1)
    try:
        assert llm.engine.config.max_num_batched_tokens == 512
        assert llm.stats()["max_num_batched_tokens"] == 512
        llm.engine.drain_step_records()
        llm.generate([[7] * 200, [8] * 200, [9] * 200], SamplingParams(max_tokens=1, temperature=0))
        tokens = [r.num_tokens for r in llm.engine.drain_step_records()]
        assert tokens == [512, 88], tokens
    finally:
        llm.shutdown()
        torch.set_num_threads(before)
