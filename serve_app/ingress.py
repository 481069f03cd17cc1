"""The HTTP ingress: OpenAI routes on FastAPI behind Serve, forwarding to engine replicas by handle.

Tokenization and the chat template run here; the DeploymentHandle's request router (cluster.router)
picks the replica. Streamed chunks are flushed as soon as each engine commit arrives: no batching delay.
Before anything is parsed, GuardMiddleware (serve_app/middleware.py) enforces the body size limit and API
keys; request limits (serve_app/limits.py) are checked before a request reaches an engine.
"""

# No `from __future__ import annotations`: FastAPI must see the real request-model classes.
import asyncio
import contextlib
import functools
import importlib.metadata
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError
from ray import serve
from ray.serve.exceptions import RequestCancelledError
from ray.serve.handle import DeploymentHandle
from transformers import AutoTokenizer

from cluster.metrics import IngressMetrics, RequestTiming
from cluster.protocol import GenerateChunk, GenerateRequest
from dashboards.metrics import STATUS_CLIENT_CLOSED
from engine.lora.request import LoRARequest, find_adapter, list_adapters, split_model_name
from engine.models import load_hf_config
from engine.sampling_params import SamplingParams
from serve_app.errors import (APIError, bad_request, from_engine_failure, install_handlers, param_of,
                               replica_lost)
from serve_app.limits import Limits, check_context, check_prompts, check_request, check_tool_schemas
from serve_app.logprobs_format import set_logprob_echo
from serve_app.middleware import Guard, GuardMiddleware
from serve_app.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                chat_template_args, structured_error)
from serve_app.responses import Accumulated, ResponseBuilder, best_of, sse, usage
from serve_app.tool_parsers import get_tool_parser
from serve_app.tools import check_tools, output_parser, template_message, template_tools

logger = logging.getLogger("ray.serve")
try:
    _VERSION = importlib.metadata.version("tandem")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
    _VERSION = "unknown"

api = FastAPI(title="Tandem", description="OpenAI-compatible LLM serving on Ray Serve")


def _endpoint(request: Request) -> str:
    """The matched route (bounded label values); "other" for paths that match none."""
    return getattr(request.scope.get("route"), "path", None) or "other"


def _count_error(request: Request, status: int) -> None:
    metrics = getattr(request.app.state, "tandem_metrics", None)
    if metrics is not None:
        metrics.count(_endpoint(request), status, "error")


install_handlers(api, on_error=_count_error)
api.add_middleware(GuardMiddleware)
HEALTH_CACHE_S = 1.0  # /health asks Serve's controller at most this often
OFF_LOOP_CHARS = 8192  # longer prompts are tokenized in a worker thread
_TOKENIZE_POOL = ThreadPoolExecutor(2, thread_name_prefix="tandem-tokenize")


async def _start(engine: DeploymentHandle, request: GenerateRequest):
    """Send a request and await its first chunk, so failures before any output (overload, a bad request) get
    a real status. A replica lost before it sent anything (its actor died, or its engine went down while
    draining) costs the client nothing: the request is sent once more, and Serve's router, which has seen
    the failure, picks another replica. After the first chunk a loss is the client's error event."""
    for attempt in (1, 2):
        stream = engine.generate.remote(request)
        try:
            first = await stream.__anext__()
            break
        except asyncio.CancelledError:  # the client left: the replica call goes too (the engine aborts, frees KV)
            with contextlib.suppress(Exception):
                stream.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - retried once, or mapped to an OpenAI error
            # cancel() re-raises the rejection of a call Serve never assigned (BackPressureError): that must
            # not replace the OpenAI error (Serve would answer with its own plain-text 503, no Retry-After).
            with contextlib.suppress(Exception):
                stream.cancel()
            if attempt == 1 and replica_lost(exc):
                logger.warning("request %s: engine replica lost before its first token (%s); sending it again",
                               request.request_id, type(exc).__name__)
                continue
            raise from_engine_failure(exc) from None
    if first.rejected:  # the engine refused the request: a 400 naming the field its message starts with
        raise bad_request(first.error, param=param_of(first.error))
    return stream, first


async def _interleave(gens: list[AsyncIterator[str]], n: int, include_usage: bool) -> AsyncIterator[str]:
    """The events of a streamed prompt array: each prompt's SSE events (OpenAIIngress._sse) as they come, every
    choice's index moved to i*n + j (prompt i's choice j, vLLM's order) and every event under the first
    prompt's id; their usage summed into one event at the end when asked for, and one [DONE]. An error event
    ends the whole stream, and the other prompts' requests with it (as does a client that leaves)."""
    # Bounded: a prompt's stream is pulled only as the client takes events (the backpressure, and the coalescing
    # of commits, a single stream has), and a slow client does not pile a whole batch's events up here.
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(gens))

    async def pump(i: int, gen: AsyncIterator[str]) -> None:
        try:
            async for event in gen:
                await queue.put((i, event))
        except Exception:  # noqa: BLE001 - not expected (_sse reports failures in-band): this prompt ends here
            logger.exception("streamed prompt %d failed outside its stream", i)
        await queue.put((i, None))  # (a cancelled pump puts nothing: only the consumer cancels, and it has left)

    tasks = [asyncio.ensure_future(pump(i, gen)) for i, gen in enumerate(gens)]
    done, running, head = sse("[DONE]"), len(tasks), None
    prompt_tokens = completion_tokens = 0
    try:
        while running:
            i, event = await queue.get()
            if event is None:
                running -= 1
                continue
            if event == done:
                continue
            payload = json.loads(event[len("data: "):])
            if "error" in payload:
                yield event
                break
            if not payload["choices"]:  # the prompt's usage
                prompt_tokens += payload["usage"]["prompt_tokens"]
                completion_tokens += payload["usage"]["completion_tokens"]
                continue
            head = head or {k: payload[k] for k in ("id", "object", "created", "model")}
            payload["id"] = head["id"]
            for choice in payload["choices"]:
                choice["index"] += i * n
            yield sse(payload)
        else:
            if include_usage and head is not None:
                yield sse({**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
    finally:
        for task in tasks:
            task.cancel()
    yield done


async def _off_loop(size: int, fn, *args, **kwargs):
    """Tokenizing or templating a long text runs in a worker thread so the event loop (every other stream of
    this ingress) keeps going; a short one (under OFF_LOOP_CHARS) costs less inline than a thread hop."""
    if size < OFF_LOOP_CHARS:
        return fn(*args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_TOKENIZE_POOL, functools.partial(fn, *args, **kwargs))


@serve.ingress(api)
class OpenAIIngress:
    def __init__(self, engine: DeploymentHandle, model_dir: str, served_model_name: str, max_model_len: int,
                 api_keys: tuple[str, ...] = (), limits: dict | None = None,
                 engine_deployment: str = "EngineReplica", lora_modules: dict[str, str] | None = None,
                 lora_dir: str | None = None, tool_parser: str | None = None, engine_transport: str = "grpc",
                 sampling_defaults: dict | None = None, chat_template: str | None = None):
        # _by_reference=False: Serve's gRPC transport (AppConfig.engine_transport)
        self.engine = engine.options(stream=True, _by_reference=engine_transport != "grpc")
        self.engine_unary = engine
        self.model_name = served_model_name
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        if chat_template is not None:  # AppConfig.chat_template, loaded and checked: instead of the tokenizer's
            self.tokenizer.chat_template = chat_template
        self.vocab_size = load_hf_config(model_dir).vocab_size
        self.max_model_len = max_model_len
        self.limits = Limits(**(limits or {}))
        self.engine_deployment = engine_deployment
        self.lora_modules, self.lora_dir = lora_modules, lora_dir  # LoRA adapters requests may name
        self.tool_parser = tool_parser and get_tool_parser(tool_parser).name  # validated: the name or None
        # The model's sampling defaults for fields a request leaves unset (EngineConfig.sampling_defaults())
        self.sampling_defaults = dict(sampling_defaults or {})
        if self.sampling_defaults:
            logger.info("sampling defaults from the model's generation config, for requests that leave them unset "
                        "(max_tokens: a cap): %s; generation_config=vllm turns them off", self.sampling_defaults)
        self.metrics = IngressMetrics()
        self._health: tuple[float, int] = (0.0, 0)  # (when asked, running engine replicas)
        api.state.tandem_metrics = self.metrics  # read by the error handlers, which see every failure
        api.state.tandem_guard = Guard(tuple(api_keys), self.limits.max_body_bytes,
                                       on_reject=lambda route, status: self.metrics.count(route, status, "error"))

    # ---- routes ------------------------------------------------------------------------------------------
    @api.get("/health")
    async def health(self) -> JSONResponse:
        """200 while this ingress runs and at least one engine replica is RUNNING (it passes Serve's health
        checks: engine loop alive and progressing, no device fault), whatever the load: no request goes to
        an engine, Serve's controller is asked (at most every HEALTH_CACHE_S)."""
        running = await self._running_engine_replicas()
        if running < 1:
            raise APIError(503, "no healthy engine replica", type_="server_error", code="no_healthy_replica")
        return JSONResponse({"status": "ok", "engine_replicas": running})

    async def _running_engine_replicas(self) -> int:
        asked, running = self._health
        if time.monotonic() - asked < HEALTH_CACHE_S:
            return running
        try:
            status = await asyncio.to_thread(serve.status)
            app = status.applications[serve.get_replica_context().app_name]
            states = app.deployments[self.engine_deployment].replica_states
            running = sum(n for state, n in states.items() if str(getattr(state, "value", state)) == "RUNNING")
        except Exception as exc:  # noqa: BLE001 - the controller unreachable: report unhealthy, say why
            logger.warning("health: Serve status unavailable: %s", exc)
            running = 0
        self._health = (time.monotonic(), running)
        return running

    @api.get("/version")
    async def version(self) -> dict:
        """vLLM's /version: the server's version (the installed tandem package's), open like /health."""
        return {"version": _VERSION}

    @api.get("/v1/models")
    async def models(self) -> dict:
        adapters = [{"id": a.lora_name, "object": "model", "created": 0, "owned_by": "tandem",
                     "root": a.lora_path, "parent": self.model_name, "max_model_len": self.max_model_len}
                    for a in await asyncio.to_thread(list_adapters, self.lora_modules, self.lora_dir)]
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "tandem", "max_model_len": self.max_model_len}]
                + adapters}

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        timing = RequestTiming()
        lora = self._lora_of(body.model)  # 404 for an unknown model or adapter, before any work
        check_request(body, self.limits)
        check_prompts(body, self.limits)
        prompts = body.prompts
        if len(prompts) > 1:
            return await self._completions_batch(body, prompts, request, lora)
        prompt_ids = await self._encode_prompt(prompts[0])
        return await self._serve(body, prompt_ids, chat=False, want_logprobs=body.logprobs is not None,
                                 request=request, timing=timing, lora=lora,
                                 echo=await self._echo(body, prompts[0], prompt_ids))

    async def _completions_batch(self, body: CompletionRequest, prompts: list, request: Request,
                                 lora: LoRARequest | None) -> dict:
        """OpenAI's prompt array, not streamed: each prompt runs as an engine request of its own, all at once,
        and the response lists prompt i's n choices at indices i*n .. i*n + n - 1 (vLLM's order), with the usage
        summed. Every prompt is checked before any runs; one that fails cancels the others."""
        max_tokens = self._params(body).max_tokens  # (a bad field is a 400 here, before anything runs)
        encoded = [await self._encode_prompt(p) for p in prompts]
        for ids in encoded:
            check_context(len(ids), max_tokens, self.max_model_len, chat=False)
        echoes = [await self._echo(body, p, ids) for p, ids in zip(prompts, encoded)]
        if body.stream:
            return await self._stream_batch(body, encoded, echoes, request, lora)
        tasks = [asyncio.ensure_future(self._serve(body, ids, chat=False, want_logprobs=body.logprobs is not None,
                                                   request=request, timing=RequestTiming(), lora=lora, echo=echo))
                 for ids, echo in zip(encoded, echoes)]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:  # a failed prompt, or the client gone: nothing else keeps running
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        merged = results[0]
        merged["choices"] = [{**c, "index": i * body.n + c["index"]} for i, r in enumerate(results)
                             for c in r["choices"]]
        merged["usage"] = usage(sum(r["usage"]["prompt_tokens"] for r in results),
                                sum(r["usage"]["completion_tokens"] for r in results))
        return merged

    async def _stream_batch(self, body: CompletionRequest, encoded: list[list[int]], echoes: list[str],
                            request: Request, lora: LoRARequest | None) -> StreamingResponse:
        """A streamed prompt array: every prompt's request started at once (all or none: one that fails to start
        cancels those that did), then their events interleaved as they come (_interleave)."""
        timings = [RequestTiming() for _ in encoded]
        tasks = [asyncio.ensure_future(self._open(body, ids, False, request, timing, lora, echo, None))
                 for ids, echo, timing in zip(encoded, echoes, timings)]
        try:
            opened = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            for result in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(result, tuple):  # started: its replica call goes, and the engine frees its KV
                    result[0].cancel()
            raise
        endpoint, want_logprobs = _endpoint(request), body.logprobs is not None
        # each prompt's own stream with its usage at the end, which _interleave sums into the batch's
        gens = [self._sse(stream, first, builder, True, want_logprobs, timing, endpoint, body.continuous_usage)
                for (stream, first, builder, _), timing in zip(opened, timings)]
        return StreamingResponse(_interleave(gens, body.n, body.include_usage), media_type="text/event-stream")

    async def _echo(self, body: CompletionRequest, prompt: str | list[int], prompt_ids: list[int]) -> str:
        """The text `echo` puts before a completion: the prompt as sent, or its token ids decoded."""
        if not body.echo:
            return ""
        return prompt if isinstance(prompt, str) else \
            await _off_loop(4 * len(prompt_ids), self.tokenizer.decode, prompt_ids)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        timing = RequestTiming()
        lora = self._lora_of(body.model)  # 404 for an unknown model or adapter, before any work
        check_request(body, self.limits)
        check_tool_schemas(body, self.limits)
        check_tools(body, self.tool_parser, self.tokenizer.chat_template)
        prompt_ids = await self._render_chat(body, body.add_special_tokens)
        return await self._serve(body, prompt_ids, chat=True, want_logprobs=body.logprobs, request=request,
                                 timing=timing, lora=lora, tool_parser=output_parser(body, self.tool_parser))

    @api.post("/tokenize")
    async def tokenize(self, body: TokenizeRequest) -> JSONResponse:
        """vLLM's /tokenize: a prompt's token ids as /v1/completions encodes it, or chat messages' as
        /v1/chat/completions renders them (template, its kwargs and tools included), with the context size."""
        self._lora_of(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give either prompt or messages", param="prompt")
        if body.prompt is not None:
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await _off_loop(len(body.prompt), self.tokenizer.encode, body.prompt, add_special_tokens=add)
        else:
            ids = await self._render_chat(body, bool(body.add_special_tokens))
        strs = self.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                             "token_strs": strs})

    @api.post("/detokenize")
    async def detokenize(self, body: DetokenizeRequest) -> JSONResponse:
        """vLLM's /detokenize: token ids back to text (special tokens kept)."""
        self._lora_of(body.model)
        bad = [t for t in body.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(f"tokens must be in [0, {self.vocab_size}); got {bad[:5]}", param="tokens")
        text = await _off_loop(4 * len(body.tokens), self.tokenizer.decode, body.tokens)
        return JSONResponse({"prompt": text})

    # ---- request handling --------------------------------------------------------------------------------
    async def _render_chat(self, body, add_special_tokens: bool) -> list[int]:
        """Chat messages (and tools) through the model's chat template, then token ids: 400 naming the field
        for bad template arguments, and naming messages for what the template refuses."""
        try:
            kwargs = chat_template_args(body)
        except ValueError as exc:
            raise bad_request(str(exc), param=param_of(str(exc))) from None
        try:
            messages = [template_message(m) for m in body.messages]
            tools = template_tools(body)
            size = sum(len(m["content"]) for m in messages) + (len(str(tools)) if tools else 0)
            text = await _off_loop(size, self.tokenizer.apply_chat_template, messages, tools=tools, tokenize=False,
                                   **kwargs)
        except (ValueError, TemplateError) as exc:  # a template's raise_exception raises TemplateError
            raise bad_request(str(exc), param="messages") from None
        return await _off_loop(len(text), self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    def _lora_of(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names ("BASE:ADAPTER" or the adapter's own name); None for the base model;
        404 model_not_found naming it when there is no such model or adapter."""
        adapter = None if model is None else split_model_name(model, self.model_name)
        if adapter is None:
            return None
        found = find_adapter(adapter, self.lora_modules, self.lora_dir) \
            if self.lora_modules or self.lora_dir else None
        if found is None:
            what = f" and no LoRA adapter is named `{adapter}`" if self.lora_modules or self.lora_dir else ""
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`"
                                f"{what}", type_="not_found_error", param="model", code="model_not_found")
        return found

    async def _encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return await _off_loop(len(prompt), self.tokenizer.encode, prompt, add_special_tokens=True)
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(f"prompt token ids must be in [0, {self.vocab_size}); got {bad[:5]}",
                              param="prompt")
        return prompt

    def _params(self, body) -> SamplingParams:
        """The request's SamplingParams over the model's defaults; a 400 naming the field it cannot take."""
        try:
            return body.sampling_params(self.sampling_defaults)
        except ValueError as exc:
            message = structured_error(str(exc), body.structured_source)
            raise bad_request(message, param=param_of(message)) from None

    async def _serve(self, body, prompt_ids: list[int], chat: bool, want_logprobs: bool, request: Request,
                     timing: RequestTiming, lora: LoRARequest | None, echo: str = "", tool_parser=None):
        stream, first, builder, params = await self._open(body, prompt_ids, chat, request, timing, lora, echo,
                                                          tool_parser)
        if body.stream:
            return StreamingResponse(self._sse(stream, first, builder, body.include_usage, want_logprobs,
                                               timing, _endpoint(request), body.continuous_usage),
                                     media_type="text/event-stream")
        accs = [Accumulated() for _ in range(params.n)]  # one per sample (best_of of them when set)
        try:
            accs[first.index].add(first)
            async for chunk in stream:
                timing.chunk(chunk)
                accs[chunk.index].add(chunk)
        except (asyncio.CancelledError, RequestCancelledError):  # the client went away: 499, not an error
            self.metrics.count(_endpoint(request), STATUS_CLIENT_CLOSED, "abort")
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to an OpenAI error
            raise from_engine_failure(exc) from None
        finally:
            stream.cancel()
        self._finished(timing, _endpoint(request), accs[0].finish_reason)
        if params.n > body.n:  # best_of: usage counts every sample generated
            return builder.full(best_of(accs, body.n), want_logprobs, sum(a.num_output_tokens for a in accs))
        return builder.full(accs, want_logprobs)

    async def _open(self, body, prompt_ids: list[int], chat: bool, request: Request, timing: RequestTiming,
                    lora: LoRARequest | None, echo: str, tool_parser):
        """Check a request against the model and start it on an engine: (stream, first chunk, ResponseBuilder,
        SamplingParams). Errors before its first output are HTTP statuses."""
        params = self._params(body)
        if tool_parser is not None and tool_parser.keep_special_tokens:  # its call marker is a special token
            params.skip_special_tokens = False
        check_context(len(prompt_ids), params.max_tokens, self.max_model_len, chat)
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise bad_request(f"stop_token_ids must be in [0, {self.vocab_size}); got {bad[:5]}",
                              param="stop_token_ids")
        request_id = uuid.uuid4().hex
        builder = ResponseBuilder(request_id, body.model if lora is not None else self.model_name, chat,
                                  self._decode_token, body.n)
        builder.tool_parser, builder.echo = tool_parser, echo
        set_logprob_echo(builder, body, prompt_ids, chat)
        try:  # errors before any output become proper HTTP statuses
            stream, first = await _start(self.engine, GenerateRequest(request_id, prompt_ids, params,
                                                                      ingress_time=timing.receipt_wall,
                                                                      lora_request=lora))
        except (asyncio.CancelledError, RequestCancelledError):  # gone before the first token (a long prefill)
            self.metrics.count(_endpoint(request), STATUS_CLIENT_CLOSED, "abort")
            raise
        except APIError as err:  # a grammar that does not compile: name the field the client set
            if err.param == "structured_outputs":
                err.message = structured_error(err.message, body.structured_source)
                err.param = param_of(err.message)
            raise
        timing.chunk(first)
        return stream, first, builder, params

    async def _sse(self, stream, first: GenerateChunk, builder: ResponseBuilder, include_usage: bool,
                   want_logprobs: bool, timing: RequestTiming, endpoint: str,
                   continuous_usage: bool = False) -> AsyncIterator[str]:
        """SSE events, one per engine commit. A client that goes away cancels this generator, which
        cancels the replica call; the engine then aborts the request and frees its blocks.
        continuous_usage: every event carries the usage so far of its choice (vLLM's continuous_usage_stats)."""
        last = first
        status, reason = STATUS_CLIENT_CLOSED, "abort"  # unless the stream runs to its end

        def events(payloads: list[dict], chunk: GenerateChunk | None) -> Iterator[str]:
            for payload in payloads:
                if continuous_usage:
                    payload["usage"] = usage(first.num_prompt_tokens, chunk.num_output_tokens if chunk else 0)
                yield sse(payload)

        try:
            if builder.chat:
                for event in events(builder.first_chat_chunks(), None):
                    yield event
            for event in events(builder.chunks(first, want_logprobs), first):
                yield event
            async for chunk in stream:
                timing.chunk(chunk)
                last = chunk
                for event in events(builder.chunks(chunk, want_logprobs), chunk):
                    yield event
            if include_usage:
                yield sse(builder.usage_chunk(last.num_prompt_tokens))
            status, reason = 200, last.finish_reason
        except RequestCancelledError:  # the client went away (the call was cancelled): 499, nothing to send
            return
        except Exception as exc:  # noqa: BLE001 - reported in-band: headers are already sent
            error = from_engine_failure(exc)
            status, reason = error.status, "error"
            yield sse(error.body())
        finally:
            stream.cancel()
            if status == 200:
                self._finished(timing, endpoint, reason)
            else:
                self.metrics.count(endpoint, status, reason)
        yield sse("[DONE]")

    def _finished(self, timing: RequestTiming, endpoint: str, finish_reason: str | None) -> None:
        self.metrics.finished(timing)
        self.metrics.count(endpoint, 200, finish_reason or "unknown")

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])
