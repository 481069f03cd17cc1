"""The simulated accelerator (engine/sim): its clock, its cost model, and the real engine running on it.

Oracles: datasheet arithmetic (the weight-bandwidth floor from a model's published parameter count),
Photon's published step times (seed 000), wall-clock time (the virtual clock is anchored to it), and the
engine itself on real devices for what must not depend on the device (an unpressured run's outputs).
No timed assertions on this machine's speed: where busy fractions are compared, the host is slowed on
purpose by far more than any machine's noise, or the device step is made far longer than the host's work.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import jsonschema
import pytest

from engine import LLM, SamplingParams, memory
from engine.sampling_params import StructuredOutputsParams
from engine.sim import PROFILES, SIM_MODELS, CostModel, StepShape
from engine.sim.calibrate import (H200_FUSED_RUN, H200_RUN, fit, fit_h200, fit_h200_fused, h200_forward,
                                  h200_fused_forward, predicted)
from engine.sim.cost_model import PHOTON_TABLE
from engine.sim.device import SimDevice, SimEvent
from engine.models import load_hf_config, model_spec

QWEN = str(SIM_MODELS / "qwen2.5-0.5b")
LLAMA8B = str(SIM_MODELS / "llama-3.1-8b")


def sim_llm(model: str = QWEN, **kw) -> LLM:
    return LLM(model, device="sim", **{"max_model_len": 2048, "max_num_seqs": 32, **kw})


def spec_of(model: str):
    return model_spec(load_hf_config(model))


# ---- the virtual clock -------------------------------------------------------------------------------------
def test_stream_runs_in_order_from_the_later_of_free_and_issue_time():
    dev = SimDevice(trace=True)
    a = dev.run(dev.compute, 0.010, "a")
    b = dev.run(dev.compute, 0.005, "b")
    assert a.start >= a.issued and b.start == pytest.approx(a.end)  # queued behind a
    assert b.end == pytest.approx(a.end + 0.005)
    time.sleep(0.030)  # the stream drains; the next item starts when it is issued
    c = dev.run(dev.compute, 0.001, "c")
    assert c.start == c.issued and c.start > b.end + 0.010
    assert [i.kind for i in dev.trace] == ["a", "b", "c"]


def test_host_gap_is_idle_and_an_event_wait_is_not():
    dev = SimDevice()
    dev.run(dev.compute, 0.002)
    time.sleep(0.020)
    dev.run(dev.compute, 0.002)  # the stream sat free ~18 ms with nothing enqueued: a host-caused bubble
    assert dev.idle_s >= 0.015 and dev.dep_wait_s == 0
    copy = dev.run(dev.copy, 0.030)  # a long copy on the other stream
    dev.wait_event(dev.compute, SimEvent(copy.end))
    item = dev.run(dev.compute, 0.001)
    assert item.start == pytest.approx(copy.end)
    assert dev.dep_wait_s >= 0.020  # enqueued, but waiting for the copy's event
    assert dev.compute.busy_s == pytest.approx(0.005)


def test_a_gap_after_the_engine_went_idle_is_not_counted():
    dev = SimDevice()
    dev.run(dev.compute, 0.001)
    dev.idle()
    time.sleep(0.020)
    dev.run(dev.compute, 0.001)
    assert dev.idle_s == 0


def test_synchronize_blocks_until_the_event_on_the_wall_clock():
    dev = SimDevice()
    item = dev.run(dev.compute, 0.030)
    t0 = time.perf_counter()
    dev.synchronize(SimEvent(item.end))
    assert time.perf_counter() >= item.end
    assert time.perf_counter() - t0 >= 0.025
    t0 = time.perf_counter()
    dev.synchronize(SimEvent(item.end))  # already complete: returns at once
    assert time.perf_counter() - t0 < 0.005


def test_an_eager_forward_cannot_end_before_the_host_launched_it():
    dev = SimDevice()
    item = dev.run(dev.compute, 0.0001, host_s=0.003)  # 3 ms of launching, 0.1 ms of kernels
    assert item.end - item.issued >= 0.003
    assert dev.host_launch_s == pytest.approx(0.003)


def _spin_cpu(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_the_simulators_own_work_is_off_the_clock_and_a_launch_or_a_wait_inside_it_is_not():
    """emulating(): the block's CPU time, less the launch charges made in it, is taken off the virtual clock, so
    the simulator's stand-in for device work never idles the device; a launch charged inside it, or a sleep
    (no CPU: a wait for the core or the GIL stays the host's), still delays the device."""
    dev = SimDevice()
    dev.run(dev.compute, 0.002)
    wall, cpu = time.perf_counter(), time.thread_time()
    with dev.emulating():
        _spin_cpu(0.030)  # 30 ms of the simulator's own work
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    item = dev.run(dev.compute, 0.001)
    assert dev.emulation_s >= 0.029
    assert dev.idle_s < (wall - cpu) + 0.005  # idle only while this thread was off the core (a loaded machine)
    assert item.start < time.perf_counter() - 0.025  # its clock stands behind the wall clock by that work
    hidden = dev.emulation_s
    with dev.emulating():
        dev.run(dev.copy, 0.0, host_s=0.010)  # 10 ms of launching, charged inside the block
        time.sleep(0.010)  # 10 ms asleep
    dev.run(dev.compute, 0.001)
    assert dev.emulation_s - hidden < 0.004
    assert dev.idle_s >= 0.017  # both delayed the device
    assert dev.stats()["sim_emulation_s"] == dev.emulation_s


# ---- the cost model ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("gpu", ["h100", "h200", "b200", "a100"])
def test_weight_bandwidth_floor_holds_for_8b_decode(gpu):
    # Llama-3.1-8B has 8.03e9 parameters (its model card), 16.06 GB in bf16. A decode step reads all of them
    # but the input embedding table (vocab x hidden, untied: it gathers only the step's rows).
    peak = PROFILES[gpu].hbm_bytes_per_s
    spec = spec_of(LLAMA8B)
    read = (8.03e9 - spec.vocab_size * spec.hidden_size) * 2
    cost = CostModel(spec, 2, PROFILES[gpu])
    assert cost.model.weight_bytes == pytest.approx(read, rel=0.005)
    for rows in (1, 8, 64, 256):
        for graph in (True, False):
            shape = StepShape([1] * rows, [1] * rows, rows)  # the least context there can be
            fwd = cost.forward_s(shape, graph)
            assert fwd >= read / peak, (rows, graph)
            assert fwd >= 16e9 / peak, (rows, graph)  # the checkpoint's size over peak bandwidth, too


def test_sliding_layers_read_only_their_window():
    """Gemma-3-like layers (5 sliding of window 512 to 1 global): a decode row at context 4096 reads 4096 keys in
    the global layers and 512 in the sliding ones, so its KV read is (4096 + 5 * 512 + 6) / (6 * (4096 + 1)) of
    the same model with no window (one new position written per layer)."""
    import dataclasses

    spec = spec_of(QWEN)
    layers = 24
    types = tuple("full_attention" if i % 6 == 5 else "sliding_attention" for i in range(layers))
    windowed = CostModel(dataclasses.replace(spec, num_layers=layers, sliding_window=512, layer_types=types), 2,
                         PROFILES["h100"])
    full = CostModel(dataclasses.replace(spec, num_layers=layers, sliding_window=None, layer_types=()), 2,
                     PROFILES["h100"])
    decode = StepShape([1] * 64, [4096] * 64, 64)  # memory-bound: the time is the bytes
    ratio = windowed.attention_s(decode) / full.attention_s(decode)
    assert ratio == pytest.approx((4096 + 5 * 512 + 6) / (6 * (4096 + 1)), rel=1e-6)
    short = StepShape([1] * 64, [300] * 64, 64)  # inside the window: no difference
    assert windowed.attention_s(short) == pytest.approx(full.attention_s(short), rel=1e-9)


def test_cost_grows_with_context_and_rows_and_prefill_is_compute_bound():
    cost = CostModel(spec_of(QWEN), 2, PROFILES["h100"])
    short, long_ = StepShape([1] * 32, [100] * 32, 32), StepShape([1] * 32, [4000] * 32, 32)
    assert cost.forward_s(long_, True) > cost.forward_s(short, True)
    assert cost.forward_s(StepShape([1] * 256, [1000] * 256, 256), True) > \
        cost.forward_s(StepShape([1] * 8, [1000] * 8, 8), True)
    prefill = StepShape([2048], [2048], 1)
    m = cost.model
    # every layer on all 2048 rows but the last, which runs its q/k/v on all and the rest on the sampled row
    flops = 2 * (m.layer_params * (m.layers - 1) * 2048 + m.qkv_params * 2048 + (m.layer_params - m.qkv_params))
    assert cost.gemm_s(prefill) == pytest.approx(flops / (989e12 * 0.6), rel=0.05)  # compute bound
    assert cost.forward_s(prefill, graph=False) > cost.forward_s(StepShape([1], [2048], 1), graph=True)
    # scoring every position (what the last layer did before it ran on the sampled rows only) costs more:
    # by the last layer's o_proj and MLP and the LM head, on the 2047 other rows
    every = StepShape([2048], [2048], 2048)
    extra = 2 * ((m.layer_params - m.qkv_params) * 2047 + m.hidden * m.vocab * 2047)
    assert cost.gemm_s(every) - cost.gemm_s(prefill) == pytest.approx(extra / (989e12 * 0.6), rel=1e-3)


@pytest.mark.parametrize("profile", sorted(PHOTON_TABLE))
def test_shipped_photon_profiles_are_the_calibration(profile):
    """A consistency check, not an accuracy claim: the constants in PROFILES are what engine/sim/calibrate.py
    fits to Photon's rows (nobody tuned them by hand afterwards)."""
    fitted, shipped = fit(profile), PROFILES[profile]
    assert (fitted.bw_fraction, fitted.forward_fixed_s, fitted.sample_fixed_s) == \
        (shipped.bw_fraction, shipped.forward_fixed_s, shipped.sample_fixed_s)


@pytest.mark.parametrize("profile", sorted(PHOTON_TABLE))
def test_photon_profile_predicts_a_row_it_was_not_fitted_to(profile):
    """Out of sample: fitted to Photon's 1- and 32-stream rows only, the model predicts the 8-stream row it never
    saw. Measured: forward within 9.2% (3090) and 13.1% (B200), sampling 19.8% and 2.6%; the bounds below are
    those, rounded up. (Extrapolating is worse: fitted to 1 and 8 streams, the B200's 32-stream forward comes out
    57% high; docs/simulated-device.md says so.) A model that ignored the stream count (the 1-stream time for 8
    streams) would miss these rows by 27-37%, outside the bounds."""
    fitted = fit(profile, streams=(1, 32))
    fwd_ms, smp_ms, _, _ = PHOTON_TABLE[profile][8]
    fwd, smp = (t * 1e3 for t in predicted(fitted, 8))
    assert fwd == pytest.approx(fwd_ms, rel=0.15), (fwd, fwd_ms)
    assert smp == pytest.approx(smp_ms, rel=0.20), (smp, smp_ms)


def test_shipped_h200_profile_is_the_fit_to_the_gpu_run():
    """A consistency check: the h200 profile's per-kernel time in a graph is what engine/sim/calibrate.py fits to the
    one GPU run's 1-stream Qwen2.5-0.5B step (bench/results/h200_b7c3c6d)."""
    assert PROFILES["h200"] == fit_h200("qwen2.5-0.5b")


def test_h200_profile_predicts_the_other_models_step():
    """Out of sample: fitted to Qwen2.5-0.5B's 1-stream step, the h200 profile prices Llama-3.2-1B's (0.4x the
    layers' launches, 2.5x the weight bytes) within 5% of the measured 1.78 ms (+3.1%); the datasheet profile before
    the fit missed it by -8%. More rows are not modelled: at 8 and 32 streams both models' steps came out 8-16% low
    (docs/simulated-device.md), so only a loose bound holds there, which the unfitted profile (-19 to -26%)
    fails."""
    fitted, old = fit_h200("qwen2.5-0.5b"), replace(PROFILES["h200"], kernel_gap_graph_s=1.5e-6)
    measured = H200_RUN["llama-3.2-1b"][1][0]
    assert 1e3 * h200_forward(fitted, "llama-3.2-1b", 1) == pytest.approx(measured, rel=0.05)
    assert 1e3 * h200_forward(old, "llama-3.2-1b", 1) != pytest.approx(measured, rel=0.05)
    for model, rows in H200_RUN.items():
        for n in (8, 32):
            assert 1e3 * h200_forward(fitted, model, n) == pytest.approx(rows[n][0], rel=0.18), (model, n)
            assert 1e3 * h200_forward(old, model, n) != pytest.approx(rows[n][0], rel=0.18), (model, n)


def test_h200_fused_kernel_time_is_fitted_to_the_second_run():
    """The h200 profile's per-kernel time of the fused forward inside a graph is what calibrate.py fits to the
    second GPU run's 1-stream Qwen2.5-0.5B forward (bench/results/h200_08966c5); the eager layers keep theirs."""
    assert PROFILES["h200"] == fit_h200_fused("qwen2.5-0.5b")
    assert PROFILES["h200"].kernel_gap_graph_s == fit_h200("qwen2.5-0.5b").kernel_gap_graph_s


def test_h200_fused_profile_predicts_the_other_models_step():
    """Out of sample: fitted to Qwen2.5-0.5B's fused 1-stream forward, the profile prices Llama-3.2-1B's (152 against
    224 launches, 2.5x the weight bytes) within 10% of the measured 1.276 ms (-6.8%), and every 32-stream row within
    15% (-4.3%, -13.5%: the batch's growth is not modelled, as with the eager layers). Priced as the eager layers'
    small kernels, the fused forward came out 34-41% short and fails both bounds."""
    fitted = fit_h200_fused("qwen2.5-0.5b")
    unfitted = replace(fitted, fused_kernel_gap_graph_s=None)
    measured = H200_FUSED_RUN["llama-3.2-1b"][1]
    assert 1e3 * h200_fused_forward(fitted, "llama-3.2-1b", 1) == pytest.approx(measured, rel=0.10)
    assert 1e3 * h200_fused_forward(unfitted, "llama-3.2-1b", 1) != pytest.approx(measured, rel=0.10)
    for model, rows in H200_FUSED_RUN.items():
        assert 1e3 * h200_fused_forward(fitted, model, 32) == pytest.approx(rows[32], rel=0.15), model
        assert 1e3 * h200_fused_forward(unfitted, model, 32) != pytest.approx(rows[32], rel=0.15), model
    # The eager layers' pricing is untouched by the fused term (the first run's override plan).
    assert h200_forward(fitted, "qwen2.5-0.5b", 1) == h200_forward(unfitted, "qwen2.5-0.5b", 1)


def test_tensor_parallel_step_is_one_ranks_share_plus_the_link_collectives():
    """Llama-3.1-8B over 2 H100s, by hand: a layer's q/k/v/o are 4096 * (32 + 8 + 8) * 128 + 32 * 128 * 4096 =
    41,943,040 parameters and its MLP 3 * 4096 * 14336 = 176,160,768; every part halves (16 query heads, 4 KV
    heads, 7168 MLP columns, 64,128 vocabulary rows). The h100 profile's link: 360 GB/s per direction, 8 us a
    small all-reduce."""
    spec = spec_of(LLAMA8B)
    one, two = CostModel(spec, 2, PROFILES["h100"]), CostModel(spec, 2, PROFILES["h100"], tp=2)
    assert one.model.layer_params == 218_103_808 and two.model.layer_params == 109_051_904
    assert two.model.head_weight_bytes == 64_128 * 4096 * 2
    assert two.model.kv_bytes_per_token == one.model.kv_bytes_per_token / 2
    assert one.tp_comm_s(StepShape([1] * 64, [1000] * 64, 64)) == 0.0
    # 64 decode rows: 2 * 32 + 1 all-reduces of 64 * 4096 * 2 = 524,288 bytes, each 8 us + 2 * (1/2) * 524288 /
    # 360e9 = 9.4564 us, and the sampling rows' logits shard gathered: 8 us + 64 * 64128 * 4 / 360e9 = 53.60 us.
    decode = StepShape([1] * 64, [1000] * 64, 64)
    assert two.tp_comm_s(decode) == pytest.approx(65 * 9.4564e-6 + 53.60e-6, rel=1e-4)
    # Memory-bound decode: each rank reads half the weights and half the KV, but every rank still moves the
    # whole hidden-wide activations and launches every kernel, and adds the collectives: over half, under 0.7.
    ratio = two.forward_s(decode, graph=True) / one.forward_s(decode, graph=True)
    assert 0.5 < ratio < 0.7, ratio
    # Sampling stays on rank 0 over the whole vocabulary.
    assert two.sample_s(64, 3, 2.0) == one.sample_s(64, 3, 2.0)
    with pytest.raises(ValueError, match="does not divide the model's num_attention_heads 14"):
        CostModel(spec_of(QWEN), 2, PROFILES["h100"], tp=4)


def test_sim_engine_models_tensor_parallel_ranks():
    """device='sim' with tensor_parallel_size: the same tokens (the host side is one engine either way), a
    shorter modelled step and room for more KV blocks per rank."""
    runs = {}
    for tp in (1, 2):
        llm = sim_llm(LLAMA8B, sim_gpu="h100", tensor_parallel_size=tp, max_model_len=8192, max_num_seqs=256)
        outs = llm.generate(["hello"] * 8, SamplingParams(max_tokens=24, temperature=0))
        runs[tp] = [o.token_ids for o in outs], llm.stats()
        llm.shutdown()
    (tokens1, s1), (tokens2, s2) = runs[1], runs[2]
    assert tokens1 == tokens2
    assert s2["attention_backend"] == "sim:h100, tensor parallel x2 (modelled)"
    assert s2["device_busy_s"] < 0.75 * s1["device_busy_s"]
    assert s2["kv_blocks_total"] > 2 * s1["kv_blocks_total"]  # half the weights and half the KV per token


# ---- the engine on the simulated device ----------------------------------------------------------------------
def test_sim_engine_needs_no_weights_and_reports_device_time():
    assert not list(SIM_MODELS.glob("*/*.safetensors"))
    llm = sim_llm(LLAMA8B, sim_gpu="h100")
    t0 = time.perf_counter()
    outs = llm.generate(["hello"] * 4, SamplingParams(max_tokens=32, temperature=0))
    wall = time.perf_counter() - t0
    s = llm.stats()
    assert all(o.finish_reason == "length" and len(o.token_ids) == 32 for o in outs)
    vocab = len(llm.tokenizer)
    assert all(0 <= t < vocab for o in outs for t in o.token_ids)
    # 32 decode steps of an 8B model on an H100 take at least 32 weight reads: the host waited for them.
    assert s["device_busy_s"] >= 32 * 16.06e9 / 3.35e12
    assert wall >= s["device_busy_s"]
    assert s["device_busy_fraction"] > 0.5  # ~5 ms device steps dwarf the host's work per step
    assert s["sim_gpu"] == "h100" and s["steps"] >= 32
    # pricing and drawing the tokens took host time, off the device's clock; it is part of the host phases
    assert 0 < s.sim_emulation_s < s.host_prepare_s + s.host_finalize_s
    llm.check_integrity()
    llm.shutdown()


def test_steps_with_prompt_chunks_replay_mixed_graphs():
    """A burst of prompts beside running decodes, with those steps eager and with mixed-step graphs (as the CUDA
    runner decides, engine/cuda_graphs.py): the same steps and tokens; with graphs every step replays one, and the
    host's launch cost falls by exactly one eager forward's operators less one replay for each step that was eager;
    the padding positions are priced as GEMM work."""
    runs = {}
    for mixed in (False, True):
        llm = sim_llm(cuda_graphs_mixed=mixed, max_num_batched_tokens=256, sim_gpu="h100")
        outs = llm.generate([[7] * 300] * 3 + [[9] * 40] * 5, SamplingParams(max_tokens=8, temperature=0))
        runs[mixed] = [o.token_ids for o in outs], llm.stats(), llm.engine.runner.cost
        llm.shutdown()
    assert runs[False][0] == runs[True][0]
    (_, off, cost), (_, on, _) = runs[False], runs[True]
    assert on["steps"] == off["steps"] and on["graph_steps"] == on["steps"] and on["mixed_graph_steps"] > 0
    eager_steps = off["steps"] - off["graph_steps"]
    assert eager_steps > 0 and off["mixed_graph_steps"] == 0
    saved = eager_steps * (cost.host_forward_launch_s(False) - cost.host_forward_launch_s(True))
    assert off["host_launch_s"] - on["host_launch_s"] == pytest.approx(saved, rel=1e-9)
    # a step of 10 tokens padded to a graph of 64 runs the GEMMs of 64
    assert cost.gemm_s(StepShape([10], [10], 1, padded_tokens=64)) == cost.gemm_s(StepShape([64], [64], 1))


def test_tokens_are_deterministic_per_request_and_identical_at_both_depths():
    prompts = ["the same prompt", "another prompt", [5, 6, 7, 8]]
    params = [SamplingParams(max_tokens=40), SamplingParams(max_tokens=40, seed=3),
              SamplingParams(max_tokens=40, temperature=0.7)]
    runs = []
    for depth in (1, 2):
        llm = sim_llm(pipeline_depth=depth)
        runs.append([o.token_ids for o in llm.generate(prompts, params)])
        llm.shutdown()
    assert runs[0] == runs[1]
    assert len({tuple(t) for t in runs[0]}) == 3


def test_no_eos_unless_asked_and_eos_rate_gives_geometric_lengths():
    llm = sim_llm(max_num_seqs=64)
    outs = llm.generate([f"prompt {i}" for i in range(64)], SamplingParams(max_tokens=200))
    assert all(o.finish_reason == "length" for o in outs)
    llm.shutdown()
    llm = sim_llm(max_num_seqs=64, sim_eos_rate=0.05)
    outs = llm.generate([f"prompt {i}" for i in range(64)], SamplingParams(max_tokens=400))
    stopped = [len(o.token_ids) for o in outs if o.finish_reason == "stop"]
    assert len(stopped) >= 60  # P(no EOS in 400 tokens) = 0.95^400 ~ 1e-9
    mean = sum(stopped) / len(stopped)
    assert 12 < mean < 35, mean  # geometric, mean 1 / 0.05 = 20
    llm.check_integrity()
    llm.shutdown()


def test_structured_output_advances_the_grammar_on_the_sim_device():
    schema = {"type": "object", "required": ["name", "size"],
              "properties": {"name": {"type": "string", "maxLength": 8},
                             "size": {"type": "integer", "minimum": 0, "maximum": 99}}}
    llm = sim_llm(sim_eos_rate=0.3)
    outs = llm.generate(["a", "b", "c", "d"], SamplingParams(
        max_tokens=200, structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True)))
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), schema)
    choice = llm.generate(["x"], SamplingParams(
        max_tokens=50, structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"])))[0]
    assert choice.text in ("alpha", "beta")
    llm.shutdown()


def test_kv_pressure_offload_and_soft_reset_leave_outputs_unchanged():
    prompts = [[(7 * i + j) % 3000 + 10 for j in range(60 + 10 * i)] for i in range(12)]
    params = SamplingParams(max_tokens=120, temperature=0)
    free = sim_llm(max_num_seqs=12)
    want = [o.token_ids for o in free.generate(prompts, params)]
    free.shutdown()
    for cpu_blocks in (0, 256):
        llm = sim_llm(max_num_seqs=12, num_kv_blocks=60, num_cpu_blocks=cpu_blocks)
        got = [o.token_ids for o in llm.generate(prompts, params)]
        s = llm.stats()
        assert got == want
        assert s["num_preemptions"] > 0
        if cpu_blocks:
            assert s["num_offloads"] > 0 and s["blocks_swapped_in"] > 0 and s["device_copy_busy_s"] > 0
        llm.check_integrity()
        llm.shutdown()


def test_a_slowed_host_shows_bubbles_and_pipelining_hides_a_fast_one(monkeypatch):
    prompts = [f"stream {i}" for i in range(4)]
    params = SamplingParams(max_tokens=32, ignore_eos=True)

    def busy(depth: int, slow_s: float) -> float:
        llm = sim_llm(LLAMA8B, pipeline_depth=depth)  # ~7.5 ms device steps at 4 rows
        engine = llm.engine
        if slow_s:
            sched = engine.scheduler
            commit = sched.update_from_output
            monkeypatch.setattr(sched, "update_from_output", lambda step, result: (time.sleep(slow_s),
                                                                                   commit(step, result))[1])
        llm.generate(prompts, params)
        fraction = llm.stats()["device_busy_fraction"]
        llm.shutdown()
        return fraction

    fast, slowed = busy(2, 0.0), busy(2, 0.040)
    assert slowed < 0.3 < 0.6 < fast  # 40 ms of host work per ~7.5 ms step: the device waits most of the time
    assert busy(1, 0.0) < fast  # blocking: the commit and the next launch run while the device idles


def fail_forward(monkeypatch, llm: LLM, nth: int, exc: Exception) -> None:
    """The engine's nth forward raises `exc` (the others run)."""
    runner = llm.engine.runner
    forward, calls = runner._forward_job, []

    def job(step, swaps):
        calls.append(step.id)
        if len(calls) == nth:
            raise exc
        return forward(step, swaps)

    monkeypatch.setattr(runner, "_forward_job", job)


def test_a_device_fault_fails_every_request_and_marks_the_engine_unhealthy(monkeypatch):
    import asyncio

    import torch

    from engine import AsyncLLM
    from engine.async_engine import EngineDeadError

    llm = sim_llm()
    fail_forward(monkeypatch, llm, 5, torch.AcceleratorError("CUDA error: an illegal memory access was encountered"))
    outs = llm.generate(["a", "b", "c"], SamplingParams(max_tokens=50, ignore_eos=True))
    assert all(o.finish_reason == "abort" and "illegal memory access" in o.error for o in outs)
    assert "device fault" in llm.engine.health_error()
    with pytest.raises(RuntimeError, match="unhealthy"):
        llm.generate(["d"], SamplingParams(max_tokens=4))
    llm.check_integrity()  # every block came back
    llm.shutdown()

    async def serve_after_fault():
        allm = AsyncLLM(model=QWEN, device="sim", max_model_len=2048, max_num_seqs=8)
        allm.engine.core.fault = "device fault: injected"
        try:
            with pytest.raises(EngineDeadError, match="injected"):
                allm.check_health()
            with pytest.raises(EngineDeadError):
                async for _ in allm.generate("x", SamplingParams(max_tokens=4)):
                    pass
        finally:
            allm.shutdown()

    asyncio.run(serve_after_fault())


def test_a_step_failing_for_another_reason_fails_only_its_requests(monkeypatch):
    llm = sim_llm()
    fail_forward(monkeypatch, llm, 3, ValueError("bad step"))
    outs = llm.generate(["a", "b"], SamplingParams(max_tokens=20, ignore_eos=True))
    assert all(o.finish_reason == "abort" for o in outs)
    assert llm.engine.health_error() is None
    again = llm.generate(["c"], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert again.finish_reason == "length"
    llm.shutdown()


# ---- KV sizing by a memory profiling pass (engine/memory.py) -------------------------------------------------
@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_kv_cache_fills_what_the_modelled_profile_leaves(gpu):
    llm = LLM(LLAMA8B, device="sim", sim_gpu=gpu, gpu_memory_utilization=0.85)
    s = llm.stats()
    spec = spec_of(LLAMA8B)
    kv_per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 2  # bf16 K and V, every layer
    kv = s["kv_blocks_total"] * 16 * kv_per_token
    # Weights from the model card (8.03e9 parameters, bf16): KV + weights + the rest fit in 85% of the HBM...
    assert kv + 8.03e9 * 2 + s["memory_activation_peak"] + s["memory_graph_pool"] <= 0.85 * PROFILES[gpu].memory_bytes
    # ...and the KV cache takes nearly all of what is left (buffers and a CUDA context are the rest).
    assert kv >= 0.85 * PROFILES[gpu].memory_bytes - 8.03e9 * 2 - 4e9
    assert s["memory_source"] == "modelled"
    llm.shutdown()


def test_cpu_profile_is_measured_and_grows_with_the_token_budget():
    peaks = {}
    for tokens in (256, 8192):
        # the embedded model, profiled on this CPU, with a fixed byte budget for its pool
        llm = LLM(max_num_batched_tokens=tokens, cpu_kv_cache_bytes=512 * 1024**2)
        s = llm.stats()
        assert s["memory_source"] == "measured"
        # the budget bounds the CPU pool: blocks x bytes per block never exceed cpu_kv_cache_bytes
        assert s["kv_blocks_total"] * llm.engine.runner.kv_cache[0, 0, 0].numel() * 2 * 4 * 4 <= 512 * 1024**2
        peaks[tokens] = s["memory_activation_peak"]
        llm.shutdown()
    assert peaks[8192] > peaks[256] + 10 * 1024**2  # 32x the tokens: tens of MB more activations


def test_cpu_kv_budget_defaults_to_a_share_of_available_memory():
    """No cpu_kv_cache_bytes: the pool may take cpu_memory_utilization of the RAM available (vLLM's CPU
    worker sizes it from the node's memory too); an explicit budget wins; never more than is available."""
    available = memory._meminfo_kb("MemAvailable") * 1024
    usable, in_use = memory.HostMeter.usage(None, 0.25)
    assert usable - in_use == pytest.approx(0.25 * available, rel=0.05)
    usable, in_use = memory.HostMeter.usage(100 * 1024**2, 0.25)
    assert usable - in_use == 100 * 1024**2
    usable, in_use = memory.HostMeter.usage(1 << 60, 0.25)
    assert usable - in_use == pytest.approx(available, rel=0.05)
    llm = LLM(cpu_memory_utilization=0.01)  # the embedded model: ~1% of this machine's free RAM
    s = llm.stats()
    assert 0 < s["memory_kv_bytes"] <= 0.011 * available
    per_block = llm.engine.runner.kv_cache[:, :, 0].numel() * llm.engine.runner.kv_cache.element_size()
    assert s["kv_blocks_total"] == min(s["memory_kv_bytes"] // per_block,
                                       llm.engine.runner.limits.max_seqs * llm.engine.runner.limits.max_blocks)
    llm.shutdown()


def test_a_fixed_num_kv_blocks_skips_the_profiling_pass():
    llm = LLM(num_kv_blocks=64)
    assert llm.stats()["kv_blocks_total"] == 64 and llm.engine.runner.memory is None
    llm.shutdown()
