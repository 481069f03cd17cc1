"""Prompt logprobs (vLLM's `prompt_logprobs`): the model's logprob of each prompt token given the ones before.

Prompt token i is scored by the logits at position i-1, so a prefill chunk covering positions [s, e) scores
tokens s+1 .. e (the prompt's last position predicts the first output token and is the sampler's). Only
steps with a chunk of a request that asked build a plan (host lists at launch); the forward then computes
log_softmax over those positions' logits on the device (fp32, the raw model distribution as for sampled
tokens) and the commit reads the results after the step's wait. Every other step pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.outputs import TokenLogprob

ROWS_PER_PASS = 256  # positions whose [rows, V] logits are materialized at once (bounds the scratch)


@dataclass(slots=True)
class PromptLogprobPlan:
    """Which hidden rows of a step to score, against which prompt tokens, and whose they are."""

    rows: list[int]  # hidden-state rows (token offsets in the step's flat batch)
    targets: list[int]  # the prompt token each row predicts
    spans: list[tuple[object, int, int]]  # (sequence, index of its first scored prompt token, count)
    k: int  # top-k to keep (the largest any of the step's requests asked)
    # Filled by the forward (device tensors): chosen logprob [R], rank [R], top logprobs / ids [R, k].
    logprob: torch.Tensor | None = None
    rank: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None


def plan_step(chunks) -> PromptLogprobPlan | None:
    """The plan for a step's chunks (engine.scheduler.ScheduledChunk), None when no chunk needs one."""
    rows, targets, spans, k, t = [], [], [], -1, 0
    for c in chunks:
        seq = c.seq
        want = seq.params.prompt_logprobs
        last = len(seq.prompt_token_ids) - 1  # positions < last score a prompt token
        if want is not None and c.start < last:
            end = min(c.start + c.num_tokens, last)
            rows.extend(range(t, t + end - c.start))
            targets.extend(seq.prompt_token_ids[c.start + 1:end + 1])
            spans.append((seq, c.start + 1, end - c.start))
            k = max(k, want)
        t += c.num_tokens
    return PromptLogprobPlan(rows, targets, spans, k) if spans else None


@torch.inference_mode()
def compute(plan: PromptLogprobPlan, hidden: torch.Tensor, logits_fn) -> None:
    """Score the plan's rows of `hidden` ([num_tokens, H]) with `logits_fn` (hidden rows -> [R, V] fp32)."""
    dev = hidden.device
    rows = torch.tensor(plan.rows, dtype=torch.long).to(dev, non_blocking=True)
    targets = torch.tensor(plan.targets, dtype=torch.long).to(dev, non_blocking=True)
    parts = []
    for i in range(0, len(plan.rows), ROWS_PER_PASS):
        lp = torch.log_softmax(logits_fn(hidden.index_select(0, rows[i:i + ROWS_PER_PASS])).float(), dim=-1)
        chosen = lp.gather(1, targets[i:i + ROWS_PER_PASS, None])  # [r, 1]
        rank = (lp > chosen).sum(dim=-1) + 1  # vLLM's rank: 1 + tokens strictly more likely
        top = lp.topk(plan.k, dim=-1) if plan.k > 0 else None
        parts.append((chosen[:, 0], rank, top))
    # Copied to the host here, queued behind the scoring: the step's event covers them, so `commit` reads host
    # memory (a .tolist() of a device tensor there would wait for whatever the stream runs next: the following
    # step's forward, in the pipelined loop). non_blocking D2H lands in pinned memory; on CPU it is a no-op.
    def host(t: torch.Tensor) -> torch.Tensor:
        return t.to("cpu", non_blocking=True)

    plan.logprob = host(torch.cat([p[0] for p in parts]))
    plan.rank = host(torch.cat([p[1] for p in parts]))
    if plan.k > 0:
        plan.top_logprobs = host(torch.cat([p[2].values for p in parts]))
        plan.top_ids = host(torch.cat([p[2].indices for p in parts]))


def commit(plan: PromptLogprobPlan) -> None:
    """Store the scored prompt tokens into their sequences (after the step's wait: results are final).

    Indexed by prompt position, so a prefill recomputed after a preemption overwrites what it had."""
    lps, ranks = plan.logprob.tolist(), plan.rank.tolist()  # host memory (compute's copies)
    top_lps = plan.top_logprobs.tolist() if plan.top_ids is not None else None  # host memory
    top_ids = plan.top_ids.tolist() if plan.top_ids is not None else None  # host memory
    r = 0
    for seq, first, count in plan.spans:
        out, k, prompt = seq.prompt_logprobs, seq.params.prompt_logprobs, seq.prompt_token_ids
        for i in range(first, first + count):
            top = list(zip(top_ids[r][:k], top_lps[r][:k])) if k else []
            out[i] = TokenLogprob(prompt[i], lps[r], top, ranks[r])
            r += 1
