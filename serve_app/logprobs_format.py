"""Logprobs in the wire formats: OpenAI's completions object (with text_offset, and the echoed prompt's
tokens first) and vLLM's `prompt_logprobs` list. Chat's `logprobs.content` stays in responses.py."""

from __future__ import annotations

from engine.outputs import TokenLogprob


class CompletionLogprobs:
    """One request's completions `logprobs` objects, whole or chunk by chunk.

    text_offset is each token's character offset in the returned text, counted as vLLM does: the running
    sum of the tokens' decoded lengths (from 0, the echoed prompt's tokens included)."""

    def __init__(self, decode, echo_prompt_ids: list[int] | None = None, echo_k: int = 0):
        self.decode = decode
        self.offset = 0
        self.echo_prompt_ids = echo_prompt_ids  # set when echo and logprobs: the prompt's tokens go first
        self.echo_k = echo_k

    def build(self, entries: list[TokenLogprob], prompt: list[TokenLogprob | None] | None = None) -> dict:
        """The object for `entries`, after the echoed prompt's tokens when `prompt` is given (once)."""
        lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if self.echo_prompt_ids is not None and prompt is not None:
            for tid, e in zip(self.echo_prompt_ids, prompt):
                top = None if e is None else e.top[:self.echo_k]
                self._add(lp, tid, None if e is None else e.logprob, top)
            self.echo_prompt_ids = None
        for e in entries:
            self._add(lp, e.token_id, e.logprob, e.top)
        return lp

    def _add(self, lp: dict, token_id: int, logprob: float | None, top: list | None) -> None:
        text = self.decode(token_id)
        lp["tokens"].append(text)
        lp["token_logprobs"].append(logprob)
        lp["top_logprobs"].append(None if top is None else {self.decode(t): v for t, v in top})
        lp["text_offset"].append(self.offset)
        self.offset += len(text)


def prompt_logprobs_json(entries: list[TokenLogprob | None], decode, k: int) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} holding the prompt token and the top-k alternatives (ranked 1..k)."""
    out: list[dict | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        d = {str(t): {"logprob": v, "rank": i + 1, "decoded_token": decode(t)} for i, (t, v) in enumerate(e.top[:k])}
        d[str(e.token_id)] = {"logprob": e.logprob, "rank": e.rank, "decoded_token": decode(e.token_id)}
        out.append(d)
    return out


def set_logprob_echo(builder, body, prompt_ids: list[int], chat: bool) -> None:
    """Set up a ResponseBuilder: completions echo with logprobs lists the prompt's tokens first, and a
    request's prompt_logprobs are answered in vLLM's format."""
    builder.prompt_logprobs_k = body.prompt_logprobs
    if not chat and body.echo and body.logprobs is not None:
        builder.echo_prompt_ids = prompt_ids
        builder.echo_k = body.logprobs
