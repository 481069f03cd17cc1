"""The offline API: LLM(...).generate(prompts, params) -> list[RequestOutput]."""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from concurrent.futures import TimeoutError as FutureTimeout

from engine.config import EngineConfig
from engine.llm_engine import create_engine
from engine.lora.request import LoRARequest
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats


class LLM:
    """Run batches of prompts to completion on one device.

    `LLM()` with no model loads the embedded default model shipped in the repo. Keyword arguments are the
    EngineConfig fields (see docs/architecture.md).
    """

    def __init__(self, model: str | None = None, **kwargs):
        self.config = EngineConfig(model=model, **kwargs)
        self.engine = create_engine(self.config)
        self.tokenizer = self.engine.tokenizer
        self._sampling_defaults = self.config.sampling_defaults()  # read once (checked in EngineConfig)

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 lora_request: LoRARequest | str | Seq[LoRARequest | str | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order (a prompt with n > 1 samples gives n
        outputs in a row, RequestOutput.index 0..n-1).

        `lora_request`: one LoRA adapter for every prompt, or one per prompt (None = the base model); a
        LoRARequest(name, path) or the name of an adapter in lora_modules / lora_dir.
        Every prompt is validated before any is queued, so a bad one raises ValueError and runs nothing.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None:
            params = self.get_default_sampling_params()
        params_list = self._params_per_prompt(prompts, params)
        loras = _per_prompt(lora_request, len(prompts))
        self._compile(params_list)
        ids = []
        try:
            for prompt, p, lora in zip(prompts, params_list, loras):
                ids.append(self.engine.add_request(prompt, p, lora_request=lora))
        except ValueError:
            for rid in ids:
                self.engine.abort(rid)
            self._drain()
            raise
        done: dict[tuple[str, int], RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id, out.index] = out
        return [done[rid, i] for rid, p in zip(ids, params_list) for i in range(p.n)]

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        """One chat turn through the tokenizer's chat template."""
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        return self.generate([list(ids)], params)[0]

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's defaults (its generation_config.json, EngineConfig.generation_config):
        what `generate` uses when given no params, as vLLM's LLM does; change fields on the copy returned."""
        return SamplingParams(**self._sampling_defaults)

    @staticmethod
    def _params_per_prompt(prompts, params) -> list[SamplingParams]:
        if isinstance(params, SamplingParams):
            return [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        return list(params)

    def _compile(self, params_list: list[SamplingParams]) -> None:
        """Compile every grammar (in parallel, off this thread) and raise the first bad one's ValueError
        before anything runs; the engine then finds them in its cache."""
        structured, timeout = self.engine.structured, self.config.grammar_compile_timeout_s
        futures = [(p, structured.compile_async(p)) for p in params_list if isinstance(p, SamplingParams)]
        deadline = time.monotonic() + timeout
        for p, f in futures:
            if f is None:
                continue
            try:
                f.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                raise structured.timed_out(p, f, timeout) from None

    def _drain(self) -> None:
        while self.engine.has_unfinished():
            self.engine.step()

    def stats(self) -> EngineStats:
        """The engine's typed snapshot (engine/stats.py): `stats.num_waiting`, or `stats["num_waiting"]`."""
        return self.engine.stats()

    def check_integrity(self) -> None:
        self.engine.check_integrity()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def _per_prompt(lora_request, n: int) -> list:
    if lora_request is None or isinstance(lora_request, (str, LoRARequest)):
        return [lora_request] * n
    if len(lora_request) != n:
        raise ValueError(f"got {len(lora_request)} lora_requests for {n} prompts")
    return list(lora_request)
