"""Fit the photon-* profiles to Photon's measured forward and sampling times.

    python -m engine.sim.calibrate        # prints the fitted constants and the residuals per row

Photon's workload as modelled (cost_model.PHOTON_WORKLOAD): moondream2's text decoder in bf16, n streams
decoding at a mean context of prompt + L / 2, temperature sampling (no top-k/top-p, no seeds). With the
per-kernel terms at zero the forward is memory-bound, forward(n) = X(n) / bw_fraction + forward_fixed_s,
linear in (1 / bw_fraction, forward_fixed_s): a least-squares fit over n = 1, 8, 32 (bw_fraction capped at 1,
the datasheet peak). Photon's times grow less than linearly in n (the 3090's per-stream cost falls from
0.26 ms between 1 and 8 streams to 0.15 ms between 8 and 32; the B200's from 0.096 to 0.028 ms), which
a linear bandwidth model cannot follow exactly: the fit lands within ~8% of every row. Sampling's fixed term
is the mean of what the measured sampling times leave after the modelled logits passes.
"""

from __future__ import annotations

from dataclasses import replace

from engine.models import load_hf_config, model_spec
from engine.sim import SIM_MODELS
from engine.sim.cost_model import PHOTON_TABLE, PHOTON_WORKLOAD, PROFILES, CostModel, GpuProfile, StepShape

# Kernels and logits passes of temperature sampling (engine/sim/runner.py sampling_work, no seeds).
PHOTON_SAMPLING = (9, 7.0)


def sim_spec(name: str):
    """The spec of one of engine/sim/models' config-only model directories."""
    return model_spec(load_hf_config(str(SIM_MODELS / name)))


def photon_spec():
    return sim_spec("moondream2-text")


def photon_shape(streams: int) -> StepShape:
    context = PHOTON_WORKLOAD["prompt_tokens"] + PHOTON_WORKLOAD["output_tokens"] // 2
    return StepShape([1] * streams, [context] * streams, streams)


def predicted(profile: GpuProfile, streams: int) -> tuple[float, float]:
    """(forward, sampling) seconds the cost model gives a Photon decode step of `streams` rows."""
    cost = CostModel(photon_spec(), 2, profile)
    return cost.forward_s(photon_shape(streams), graph=True), cost.sample_s(streams, *PHOTON_SAMPLING)


def fit(name: str, streams: tuple[int, ...] | None = None) -> GpuProfile:
    """The profile's constants fitted to Photon's rows for `streams` (None: every row, what PROFILES ships);
    fitting on some rows and predicting the others is how the tests check the model out of sample."""
    table = {n: row for n, row in PHOTON_TABLE[name].items() if streams is None or n in streams}
    unit = replace(PROFILES[name], bw_fraction=1.0, forward_fixed_s=0.0, sample_fixed_s=0.0)
    xs, ys, rest = [], [], []
    for n, (fwd_ms, smp_ms, _, _) in table.items():
        fwd1, smp1 = predicted(unit, n)  # at bw_fraction 1: X(n), and the sampling passes
        xs.append(fwd1)
        ys.append(fwd_ms / 1e3)
        rest.append((smp_ms / 1e3, smp1))
    a, c = _least_squares(xs, ys)  # forward = a * X + c, a = 1 / bw_fraction
    bw = 1.0 / a
    if bw > 1.0:  # no faster than the datasheet peak: refit the fixed term alone
        bw = 1.0
        c = sum(y - x for x, y in zip(xs, ys)) / len(xs)
    sample_fixed = sum(m - v / bw for m, v in rest) / len(rest)
    return replace(PROFILES[name], bw_fraction=round(bw, 3), forward_fixed_s=round(c, 6),
                   sample_fixed_s=round(sample_fixed, 6))


def _least_squares(xs: list[float], ys: list[float]) -> tuple[float, float]:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


# The first GPU run (bench/results/h200_b7c3c6d/photon_cuda.json, docs/gpu.md "First run on a GPU"): random-weight
# bf16 checkpoints decoding on one H200 under CUDA graphs, with the eager decoder of then (40 launches a layer: 38
# PyTorch kernels and 2 Triton ones), prompts of H200_PROMPT tokens; per model, streams -> (forward ms, sampling ms,
# mean generated length L), medians of the steady decode steps. A step's mean context is H200_PROMPT + L / 2.
H200_RUN = {
    "qwen2.5-0.5b": {1: (2.026, 0.083, 188.1), 8: (2.199, 0.347, 90.7), 32: (2.375, 0.528, 122.9)},
    "llama-3.2-1b": {1: (1.780, 0.077, 140.7), 8: (2.032, 0.304, 121.1), 32: (2.225, 0.469, 100.5)},
}
H200_PROMPT, H200_LAYER_KERNELS = 64, 40


def _decode_s(profile: GpuProfile, model: str, streams: int, context: float,
              kernels_per_layer: int | None = None) -> float:
    """Seconds the cost model gives a bf16 decode step of `streams` rows at `context` under a graph; the
    launches are the decoder's as built unless `kernels_per_layer` says otherwise."""
    cost = CostModel(sim_spec(model), 2, profile, kernels_per_layer=kernels_per_layer)
    return cost.forward_s(StepShape([1] * streams, [context] * streams, streams), graph=True)


def _fit_gap(profile: GpuProfile, field: str, model: str, measured_ms: float, context: float,
             kernels_per_layer: int | None = None) -> GpuProfile:
    """`profile` with its per-kernel time `field` fitted to `model`'s measured 1-stream forward: at one row a step is
    its weights over the bandwidth plus one graph's launches, so what the measured step leaves after the first is the
    kernels' share. The other model's rows check it out of sample."""
    unit = replace(profile, **{field: 0.0})
    kernels = CostModel(sim_spec(model), 2, unit, kernels_per_layer=kernels_per_layer).model.kernels_per_forward
    gap = (measured_ms / 1e3 - _decode_s(unit, model, 1, context, kernels_per_layer)) / kernels
    return replace(profile, **{field: round(gap, 9)})


def h200_forward(profile: GpuProfile, model: str, streams: int) -> float:
    """Seconds the cost model gives a decode step of the first H200 run (`model`, `streams` rows at its context)."""
    context = H200_PROMPT + H200_RUN[model][streams][2] / 2
    return _decode_s(profile, model, streams, context, H200_LAYER_KERNELS)


def fit_h200(model: str = "qwen2.5-0.5b") -> GpuProfile:
    """The h200 profile with the eager layers' per-kernel time inside a graph fitted to the first run."""
    forward_ms, _, generated = H200_RUN[model][1]
    return _fit_gap(PROFILES["h200"], "kernel_gap_graph_s", model, forward_ms, H200_PROMPT + generated / 2,
                    H200_LAYER_KERNELS)


# The second GPU run (bench/results/h200_08966c5/followup/graphs_fused_cuda.json, docs/gpu.md "Second run on a
# GPU"): the fused forward under CUDA graphs, prompts of 128 tokens, a step's context about 128 + 35 (the
# profiled window's middle); per model, streams -> forward ms: the window's device kernel time per step less its
# sampling kernels (the argmax reduction and one copy, from the run's per-kernel breakdown).
H200_FUSED_RUN = {"qwen2.5-0.5b": {1: 1.0437, 32: 1.1142}, "llama-3.2-1b": {1: 1.2764, 32: 1.4350}}
H200_FUSED_CONTEXT = 128 + 35


def h200_fused_forward(profile: GpuProfile, model: str, streams: int) -> float:
    """Seconds the cost model gives a decode step of the second H200 run (the fused forward's plan)."""
    return _decode_s(profile, model, streams, H200_FUSED_CONTEXT)


def fit_h200_fused(model: str = "qwen2.5-0.5b") -> GpuProfile:
    """fit_h200's profile with the fused forward's per-kernel time inside a graph fitted to the second run."""
    return _fit_gap(fit_h200(), "fused_kernel_gap_graph_s", model, H200_FUSED_RUN[model][1], H200_FUSED_CONTEXT)


def main() -> None:
    p = fit_h200_fused()
    print(f"h200: kernel_gap_graph_s={p.kernel_gap_graph_s:.3e} (fitted to qwen2.5-0.5b at 1 stream, eager layers)")
    for model, rows in H200_RUN.items():
        for n, (fwd_ms, _, _) in rows.items():
            f = 1e3 * h200_forward(p, model, n)
            print(f"  {model} {n:2d} streams: forward {f:.3f} ms (measured {fwd_ms}, {100 * (f / fwd_ms - 1):+.1f}%)")
    print(f"h200: fused_kernel_gap_graph_s={p.fused_kernel_gap_graph_s:.3e} (fitted to qwen2.5-0.5b at 1 stream, "
          "fused forward)")
    for model, rows in H200_FUSED_RUN.items():
        for n, fwd_ms in rows.items():
            f = 1e3 * h200_fused_forward(p, model, n)
            print(f"  {model} {n:2d} streams: forward {f:.3f} ms (measured {fwd_ms}, {100 * (f / fwd_ms - 1):+.1f}%)")
    for name in PHOTON_TABLE:
        p = fit(name)
        print(f"{name}: bw_fraction={p.bw_fraction}, forward_fixed_s={p.forward_fixed_s:.6f}, "
              f"sample_fixed_s={p.sample_fixed_s:.6f}")
        for n, (fwd_ms, smp_ms, _, _) in PHOTON_TABLE[name].items():
            f, s = predicted(p, n)
            print(f"  {n:2d} streams: forward {1e3 * f:.2f} ms (Photon {fwd_ms}), sampling {1e3 * s:.3f} ms "
                  f"(Photon {smp_ms})")


if __name__ == "__main__":
    main()
