"""The GPU runtime's device-independent parts, exercised on CPU.

- The Triton backend (under Triton's interpreter here) inside the whole engine equals Hugging Face fp32
  greedy, with decode steps, and steps carrying prompt chunks, replayed from "graphs" recorded on the slots'
  fixed buffers (emulated capture: the same padded, buffer-driven path a CUDA graph runs), at pipeline depth
  1 and 2.
- Step buffers: staging, padding rows, the pending-token gather, exactly as a step reads them.
- The hot-path modules contain no synchronizing calls.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention import triton_paged
from engine.config import EngineConfig
from engine.cuda_graphs import GraphPlan, capture_sizes, mixed_sizes
from engine.block_tables import BlockTables
from engine.scheduler import ScheduledChunk
from engine.sequence import Sequence
from engine.slot import Step
from engine.step_buffers import BufferLimits, StepBuffers
from test_correctness_hf import assert_matches_hf, make_prompts

ROOT = Path(__file__).resolve().parents[1]
needs_triton = pytest.mark.skipif(not triton_paged.usable_on(torch.device("cpu")),
                                  reason="triton (interpreter) not available")


NEW_TOKENS = 10  # the Triton interpreter is slow: short generations keep these tests quick


def run(llm: LLM, prompts) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    llm.check_integrity()
    return [o.token_ids for o in outs]


def triton_llm(path, depth: int, graph_max: int | None, mixed: bool = False, **kw) -> LLM:
    llm = LLM(str(path), device="cpu", attention_backend="triton", pipeline_depth=depth, block_size=4,
              max_num_batched_tokens=16, max_num_seqs=8, num_kv_blocks=96, **kw)
    if graph_max is not None:
        llm.engine.runner.capture_graphs(max_batch_size=graph_max, emulate=True, mixed=mixed)
    return llm


@needs_triton
@pytest.mark.parametrize("family,depth,graph_max,mixed", [("llama", 2, 8, False), ("qwen2", 1, 8, True),
                                                          ("mistral", 2, 8, True), ("qwen3", 2, 2, True)])
def test_triton_backend_and_graph_replay_match_hf(tiny_model_factory, family, depth, graph_max, mixed):
    """Chunked prefills interleave with decodes; decodes replay padded graphs (graph_max=2: batches of more than
    two decodes do not fit one). Without mixed-step graphs the steps with prompt chunks, and decode batches past
    the graphs, run eagerly; with them every step of this engine (16 tokens, 8 sequences at most) replays a graph.
    Mistral's sliding window (24) is crossed by the longest prompt."""
    path, hf = tiny_model_factory(family)
    llm = triton_llm(path, depth, graph_max, mixed)
    prompts = make_prompts(seed=11, lengths=(3, 9, 30, 17, 6))  # 5 decodes replay the graph of 8
    for prompt, ours in zip(prompts, run(llm, prompts)):
        assert_matches_hf(hf, prompt, ours, NEW_TOKENS)
    stats = llm.stats()
    assert stats["attention_backend"] == "triton"
    if mixed:
        assert stats["graph_steps"] == stats["steps"] and stats["mixed_graph_steps"] > 0
    else:
        assert 0 < stats["graph_steps"] < stats["steps"] and stats["mixed_graph_steps"] == 0


@needs_triton
@pytest.mark.parametrize("mixed", [False, True], ids=["decode-graphs", "mixed-graphs"])
def test_graph_replay_equals_eager_token_for_token(tiny_model_factory, mixed):
    """Same engine config with and without (emulated) graphs: identical outputs, depth 2."""
    path, _ = tiny_model_factory("llama")
    prompts = make_prompts(seed=12, lengths=(5, 12, 2, 21, 8))
    eager, graphed = triton_llm(path, 2, None), triton_llm(path, 2, 8, mixed)
    assert run(eager, prompts) == run(graphed, prompts)
    stats = graphed.stats()
    assert eager.stats()["graph_steps"] == 0 and stats["graph_steps"] > 0
    assert (stats["mixed_graph_steps"] > 0) == mixed


@needs_triton
def test_prompt_logprobs_steps_stay_eager_beside_mixed_graphs(tiny_model_factory):
    """A step scoring prompt tokens reads every position's hidden state, which no graph returns: it runs eagerly,
    the other steps replay graphs, and the scores equal an eager engine's."""
    path, _ = tiny_model_factory("llama")
    prompts = make_prompts(seed=13, lengths=(9, 20))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=1)
    eager, graphed = triton_llm(path, 2, None), triton_llm(path, 2, 8, mixed=True)
    want, got = eager.generate(prompts, params), graphed.generate(prompts, params)
    def scores(out):
        return [None if x is None else (x.token_id, round(x.logprob, 5), x.rank) for x in out.prompt_logprobs]
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert scores(g) == scores(w) and len(scores(w)) == len(g.prompt_token_ids)
    stats = graphed.stats()
    assert 0 < stats["graph_steps"] < stats["steps"]


@needs_triton
def test_forks_and_drafts_replay_mixed_graphs_as_eager_steps_run(tiny_model_factory):
    """n > 1 siblings forked off a prompt (their sampling rows read the parent's logits row) and n-gram drafts
    verified (a sampling row per draft position) in steps replayed from mixed-step graphs: the same tokens as
    the eager engine's."""
    path, _ = tiny_model_factory("llama")
    prompts = make_prompts(seed=14, lengths=(11, 7))
    forks = SamplingParams(max_tokens=6, temperature=0.8, seed=5, n=2)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    repeat = [[3, 9] + [5, 6, 7, 8] * 3 + [5, 6]]  # a phrase repeated: the n-gram proposer has drafts at once
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    runs = []
    for graph_max in (None, 8):
        llm = triton_llm(path, 2, graph_max, mixed=graph_max is not None)
        outs = [o.token_ids for o in llm.generate(prompts, forks)]  # (n outputs in a row per prompt)
        spec_llm = triton_llm(path, 2, graph_max, mixed=graph_max is not None, speculative_config=spec)
        outs.append(spec_llm.generate(repeat, greedy)[0].token_ids)
        runs.append((outs, llm.stats(), spec_llm.stats()))
    (eager, _, _), (graphed, stats, spec_stats) = runs
    assert graphed == eager
    assert stats["num_forks"] == 2 and stats["mixed_graph_steps"] > 0
    assert spec_stats["spec_verify_chunks"] > 0 and spec_stats["graph_steps"] == spec_stats["steps"]


def test_mixed_sizes_and_the_graph_a_step_replays():
    assert mixed_sizes(16, 8) == [(16, 1), (16, 2), (16, 4), (16, 8)]
    assert mixed_sizes(40, 64) == [(16, 1), (16, 2), (16, 4), (16, 8), (16, 15), (32, 1), (32, 2), (32, 4), (32, 8),
                                   (32, 16), (32, 31), (40, 1), (40, 2), (40, 4), (40, 8), (40, 16), (40, 32), (40, 39)]
    with pytest.raises(ValueError, match="max_tokens >= 2"):
        mixed_sizes(1, 4)
    plan = GraphPlan(capture_sizes(8), mixed_sizes(2048, 256))

    def step(*chunks, forks=(), prompt_logprobs=None):
        chunk_list = [ScheduledChunk(None, 0, n, samples) for n, samples in chunks]
        rows = [c for c in chunk_list if c.samples] + list(forks)
        return Step(0, None, chunk_list, rows, sum(n for n, _ in chunks), 0.0, prompt_logprobs=prompt_logprobs,
                    forks=list(forks))
    assert plan.for_step(step((1, True), (1, True), (1, True))) == (4, None)  # decodes: the decode graph of 4
    assert plan.for_step(step(*[(1, True)] * 9)) == (16, 15)  # past the decode graphs: a mixed one
    assert plan.for_step(step((1, True), (100, False))) == (128, 2)  # a prompt chunk: tokens and sequences padded
    assert plan.for_step(step((30, True), (1, True), forks=[object()] * 3)) == (32, 8)  # a logits row per fork too
    assert plan.for_step(step(*[(1, True)] * 200, (30, True))) == (256, 255)  # 201 sequences fit only below 256
    assert plan.for_step(step((2049, False))) is None  # past the largest graph: eager
    assert plan.for_step(step((10, True), prompt_logprobs=object())) is None  # scores every position: eager
    assert GraphPlan(capture_sizes(8)).for_step(step((1, True), (10, False))) is None  # no mixed graphs: eager


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_sizes(50) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 50]
    with pytest.raises(ValueError, match="max_batch_size"):
        capture_sizes(0)


def staged_seq(token_ids: list[int], table: list[int], pending: int | None = None) -> Sequence:
    """A sequence as the runner sees it at staging: its token ids, block table and (when its last token is
    still on the device) the row of the previous step that sampled it."""
    seq = Sequence("r", None, token_ids, SamplingParams(), frozenset(), 64, 512)
    seq.block_table = table
    if pending is not None:
        seq.num_pending, seq.pending_src = 1, pending
    return seq


def test_step_buffers_stage_pad_upload_and_gather():
    limits = BufferLimits(max_tokens=8, max_seqs=6, max_blocks=3)
    bufs, tables = StepBuffers(limits, torch.device("cpu")), BlockTables(limits.table_rows - 1, 3)
    device_table = torch.zeros(limits.table_rows, 3, dtype=torch.int32)
    bufs.block_tables.fill_(-7)  # stale rows from an earlier step must not matter
    # two decodes, the second with its token pending on the device (row 1 of the previous slot's samples)
    a = staged_seq([3, 1, 4, 1, 5, 9, 2, 11], [5, 6])
    b = staged_seq(list(range(20, 29)), [9, 10, 11], pending=1)
    bufs.stage_step([ScheduledChunk(a, 7, 1, True), ScheduledChunk(b, 9, 1, True)], tables, 4, pad_to=4)
    assert bufs.num_deltas == 5  # both rows are new: every entry goes over
    bufs.upload()
    bufs.apply_tables(device_table, full_width=True)
    bufs.gather_pending(torch.tensor([70, 71, 72]))
    d = bufs.dev
    assert d["input_ids"][:4].tolist() == [11, 71, 0, 0]
    assert d["positions"][:4].tolist() == [7, 9, 0, 0]
    assert d["slot_mapping"][:4].tolist() == [6 * 4 + 3, 11 * 4 + 1, -1, -1]  # padding rows write no KV
    assert d["seq_lens"][:4].tolist() == [8, 10, 0, 0]  # ... and attend to nothing
    assert d["query_start_loc"][:5].tolist() == [0, 1, 2, 3, 4]
    assert bufs.block_tables[:2].tolist() == [[5, 6, 0], [9, 10, 11]]
    graph_meta = bufs.metadata(block_size=4, full_width=True, host_lists=False)
    assert graph_meta.seq_lens_host == [] and graph_meta.block_tables.data_ptr() == bufs.block_tables.data_ptr()
    # The next step: `a` (its token from the last step pending) gained a block, one delta; `b` left; `c`
    # prefills 3 tokens in a new row.
    a.block_table.append(7)
    a.num_pending, a.pending_src = 1, 0
    c = staged_seq([1, 2, 3], [0])
    bufs.stage_step([ScheduledChunk(a, 8, 1, True), ScheduledChunk(c, 0, 3, True)], tables, 4)
    assert bufs.num_deltas == 2
    bufs.upload()
    bufs.apply_tables(device_table, full_width=False)
    bufs.gather_pending(torch.tensor([90, 91]))
    meta = bufs.metadata(block_size=4)
    assert d["input_ids"][:4].tolist() == [90, 1, 2, 3]
    assert d["positions"][:4].tolist() == [8, 0, 1, 2]
    assert d["slot_mapping"][:4].tolist() == [7 * 4 + 0, 0, 1, 2]
    assert meta.query_start_loc.tolist() == [0, 1, 4] and meta.query_lens_host == [1, 3]
    assert meta.seq_lens_host == [9, 3] and meta.block_tables.tolist() == [[5, 6, 7], [0, 0, 0]]
    assert d["logits_indices"][:2].tolist() == [0, 3]
    assert meta.slot_mapping.data_ptr() == d["slot_mapping"].data_ptr()


def test_step_buffers_pad_a_mixed_step_to_its_graph():
    """A decode and a prompt chunk padded to a mixed-step graph of 8 tokens and 4 sequences: the padding positions
    write no KV and belong to no sequence, the padding sequences have no tokens and no context (the spare table
    row), and the padding logits rows read row 0."""
    limits = BufferLimits(max_tokens=8, max_seqs=6, max_blocks=3)
    bufs, tables = StepBuffers(limits, torch.device("cpu")), BlockTables(limits.table_rows - 1, 3)
    bufs.np["logits_indices"][:] = 99  # stale values from an earlier step must not matter
    a = staged_seq([3, 1, 4, 1, 5, 9, 2, 11], [5, 6])
    c = staged_seq([1, 2, 3], [0])
    bufs.stage_step([ScheduledChunk(a, 7, 1, True), ScheduledChunk(c, 0, 3, True)], tables, 4, pad_to=8, pad_seqs=4)
    assert (bufs.num_tokens, bufs.num_seqs, bufs.num_rows) == (8, 4, 2)
    bufs.upload()
    d = bufs.dev
    assert d["input_ids"][:8].tolist() == [11, 1, 2, 3, 0, 0, 0, 0]
    assert d["positions"][:8].tolist() == [7, 0, 1, 2, 0, 0, 0, 0]
    assert d["slot_mapping"][:8].tolist() == [6 * 4 + 3, 0, 1, 2, -1, -1, -1, -1]
    assert d["seq_lens"][:4].tolist() == [8, 3, 0, 0]
    assert d["query_start_loc"][:5].tolist() == [0, 1, 4, 4, 4]
    assert d["logits_indices"][:4].tolist() == [0, 3, 0, 0]
    assert d["table_rows"][2:4].tolist() == [limits.table_rows - 1] * 2
    with pytest.raises(ValueError, match="exceeds the slot buffers"):
        bufs.stage_step([ScheduledChunk(c, 0, 3, True)], tables, 4, pad_to=8, pad_seqs=7)


def test_block_table_rows_are_reused_only_once_nothing_can_read_them():
    tables = BlockTables(2, 4)
    a, b = staged_seq([1], [3]), staged_seq([1], [4])
    ra, rb = tables.row(a), tables.row(b)
    assert ra != rb
    c = staged_seq([1], [5])
    with pytest.raises(RuntimeError, match="block-table rows"):
        tables.row(c)  # a and b may still be read by an in-flight step
    a.released = True  # finished and drained
    assert tables.row(c) == ra and tables.take_deltas(np.zeros(8, np.int32), np.zeros(8, np.int32)) == 3
    b.block_table = [8, 9]  # freed and re-admitted: a new list, so its row is rewritten in full
    tables.row(b)
    idx, val = np.zeros(8, np.int32), np.zeros(8, np.int32)
    assert tables.take_deltas(idx, val) == 2 and val[:2].tolist() == [8, 9] and idx[0] == rb * 4


@pytest.mark.parametrize("window_groups", [0, 2])
def test_table_deltas_scattered_into_a_copy_rebuild_the_tables(window_groups):
    """What the device does with a step's deltas (scatter them into its copy of the table), over steps where
    rows are admitted, grow by one block (a decode step: many rows at once), grow by several, or are replaced,
    keeps the copy equal to the host tables."""
    import random

    rng = random.Random(window_groups)
    tables = BlockTables(12, 6, window_groups)
    device = np.zeros_like(tables.host)
    seqs = [staged_seq([1], []) for _ in range(10)]
    for _ in range(30):
        for seq in rng.sample(seqs, rng.randint(1, 10)):
            if rng.random() < 0.1:
                seq.block_table = []  # freed and re-admitted: a new list
            grow = min(rng.choice([1, 1, 1, 2, 4]), 6 - len(seq.block_table))
            seq.block_table = seq.block_table + [rng.randrange(1, 500) for _ in range(grow)]
            seq.window_table = [rng.randrange(1, 500) for _ in range(len(seq.block_table) * window_groups)]
            tables.row(seq)
        idx, val = np.zeros(12 * 6 * 3, np.int32), np.zeros(12 * 6 * 3, np.int32)
        k = tables.take_deltas(idx, val)
        device.reshape(-1)[idx[:k]] = val[:k]
        assert (device == tables.host).all()
        for seq in seqs:
            if seq.table_row is not None:
                assert device[seq.table_row, :len(seq.block_table)].tolist() == seq.block_table


@pytest.mark.parametrize("all_pending", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_decode_rows_stage_what_the_general_loop_stages(seed, all_pending):
    """A step of one-token sampling chunks (every decode step) is staged with numpy (StepBuffers._decode_rows);
    the general loop (_chunk_rows) is the oracle: the same positions, input ids, logits rows and gathers for
    any mix of rows whose token is known on the host and rows whose token is still on the device, and for the
    pipelined loop's usual step, where every row's token is still on the device."""
    import random

    rng = random.Random(seed)
    seqs, chunks = [], []
    for i in range(rng.randint(1, 64)):
        n = rng.randint(1, 40)
        pending = all_pending or rng.random() < 0.7
        seq = staged_seq([rng.randrange(1000) for _ in range(n)], [i], pending=rng.randrange(64) if pending else None)
        seqs.append(seq)
        chunks.append(ScheduledChunk(seq, n if pending else rng.randrange(n), 1, True))
    fast = StepBuffers._decode_rows(chunks, seqs)
    general = StepBuffers._chunk_rows(chunks, ())
    assert [np.asarray(x).tolist() for x in fast] == [list(x) for x in general]


def test_step_buffers_reject_oversized_steps():
    limits = BufferLimits(max_tokens=2, max_seqs=2, max_blocks=1)
    bufs = StepBuffers(limits, torch.device("cpu"))
    with pytest.raises(ValueError, match="exceeds the slot buffers"):
        bufs.stage_step([ScheduledChunk(staged_seq([1, 2, 3], [0]), 0, 3, True)], BlockTables(4, 1), 4)


# ---- the hot path does not synchronize -------------------------------------------------------------------------
# Every engine module: a new file on the step path is checked without anyone remembering to list it. Code off the
# hot path (load time, the simulator's host-side bookkeeping) marks its lines like any other.
HOT_PATH = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "engine").rglob("*.py"))
BANNED = re.compile(r"\.item\(\)|\.cpu\(\)|\.tolist\(\)|\.numpy\(\)|torch\.cuda\.synchronize|\.synchronize\(\)")
# A line may still hold one of these when it reads host memory or is the one documented wait: its comment
# says which ("# host memory", "# sync-ok: ...", or the commit's event wait).
ALLOWED = re.compile(r"# host memory|# sync-ok:|# host views")


def hot_path_violations(text: str) -> list[str]:
    bad = []
    for line in text.splitlines():
        code = line.split("#", 1)[0]
        if BANNED.search(code) and not ALLOWED.search(line):
            bad.append(line.strip())
    return bad


def test_hot_path_has_no_synchronizing_calls():
    assert {"engine/model_runner.py", "engine/prompt_logprobs.py", "engine/attention/triton_paged.py"} <= set(HOT_PATH)
    found = {f: hot_path_violations((ROOT / f).read_text()) for f in HOT_PATH}
    assert {f: v for f, v in found.items() if v} == {}


def test_hot_path_check_catches_a_sync():
    assert hot_path_violations("x = logits.argmax().item()\ny = t.cpu()  # why\n") == [
        "x = logits.argmax().item()", "y = t.cpu()  # why"]
    assert hot_path_violations("tokens = host.tolist()  # host memory\n") == []


def test_attention_backend_is_validated(tiny_model_factory):
    with pytest.raises(ValueError, match="attention_backend must be one of auto, torch, cpu, triton, flash_attn"):
        EngineConfig(attention_backend="xformers")
    path, _ = tiny_model_factory("llama")
    with pytest.raises(ValueError, match="flash_attn"):
        LLM(str(path), device="cpu", attention_backend="flash_attn")


def test_every_backend_declares_whether_it_can_be_captured():
    from engine.attention import _BACKENDS
    assert {name: cls.supports_graphs for name, cls in _BACKENDS.items()} == {
        "torch": False, "cpu": False, "triton": True, "flash_attn": True}
