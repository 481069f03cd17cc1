"""The in-process engine: an engine core (engine/core.py) and the frontend's output processing in one thread.

The offline `LLM` runs this, as vLLM's offline LLM keeps its core in process. `step()` runs one core tick and
turns its token deltas into RequestOutputs (engine/output_processor.py); a stop string found there ends the
request in the core at once. The core's state (scheduler, runner, block manager, stats) is reachable through
this object for tests and tools (`engine.scheduler`, `engine.stats()`).
"""

from __future__ import annotations

import uuid

from engine.config import EngineConfig
from engine.core import EngineCore, create_core, engine_plugin, is_device_fault  # noqa: F401 (re-exported)
from engine.lora.request import LoRARequest
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def tokenize(tokenizer, prompt) -> tuple[str | None, list[int]]:
    """(text, token ids) of a prompt given as a string or as token ids; ValueError for anything else."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        return prompt, tokenizer.encode(prompt, add_special_tokens=True)
    # (the element types gathered in C first: the per-element check in Python runs only where one is not int)
    if not isinstance(prompt, (list, tuple)) or (set(map(type, prompt)) - {int} and not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        raise ValueError("prompt must be a string or a list of integer token ids")
    return None, list(prompt)


class LLMEngine:
    """An engine core plus the frontend's output processing, driven by one thread (not thread-safe)."""

    def __init__(self, config: EngineConfig | None = None, core: EngineCore | None = None):
        self.core = core if core is not None else create_core(config)
        self.tokenizer = self.core.tokenizer
        self.processor = OutputProcessor(self.tokenizer.backend_tokenizer)

    def __getattr__(self, name: str):
        """The core's state and methods (scheduler, runner, block_manager, stats(), check_integrity(), ...)."""
        if name == "core":  # not set yet (failed __init__): no recursion
            raise AttributeError(name)
        return getattr(self.core, name)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, stream: bool = False,
                    lora_request: LoRARequest | str | None = None) -> str:
        """Validate and queue a request; raises ValueError naming the problem (nothing else is touched).
        `stream`: an output at every commit (else only the final one). `lora_request`: the LoRA adapter to
        run it under (a LoRARequest, or a name from lora_modules / lora_dir); None = the base model."""
        request_id = request_id or uuid.uuid4().hex
        if self.processor.has(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        seq = self.make_sequence(prompt, params, request_id, lora_request)
        self.add_sequence(seq, stream)
        return request_id

    def make_sequence(self, prompt: str | list[int], params: SamplingParams | None, request_id: str,
                      lora_request: LoRARequest | str | None = None) -> Sequence:
        text, ids = tokenize(self.tokenizer, prompt)
        return self.core.make_sequence(ids, params, request_id, lora_request, prompt=text)

    def add_sequence(self, seq: Sequence, stream: bool = False) -> None:
        samples = [seq, *(seq.forks or ())]
        if not stream and not seq.params.stop_strings:  # nothing reads its tokens before the end
            for s in samples:
                s.final_only = True
        prompt_ids = seq.prompt_token_ids.tolist()  # host memory (an int64 array; outputs carry a list)
        self.processor.add(seq.request_id, seq.prompt, prompt_ids, seq.params, seq.arrival_time, stream,
                           [s.params for s in samples])
        try:
            self.core.add_sequence(seq)
        except BaseException:
            self.processor.discard(seq.request_id, len(samples))
            raise

    def step(self) -> list[RequestOutput]:
        return self._process(self.core.step())

    def abort(self, request_id: str) -> list[RequestOutput]:
        return self._process(self.core.abort(request_id))

    def _process(self, core_outputs) -> list[RequestOutput]:
        outputs, stopped = self.processor.process(core_outputs)
        if stopped:  # stop strings: the core ends those samples now (their late tokens are dropped)
            self.core.finish(stopped, "stop")
        return outputs

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()


def create_engine(config: EngineConfig) -> LLMEngine:
    """The in-process engine for `config`: single-device, pipeline-parallel or tensor-parallel core."""
    return LLMEngine(core=create_core(config))

