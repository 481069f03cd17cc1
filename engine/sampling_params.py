"""Per-request sampling parameters (vLLM / OpenAI names), validated once at construction."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
_MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values
_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """A grammar the output must follow (vLLM's StructuredOutputsParams); set exactly one of:

      json         a JSON schema (dict, or its JSON text): the output is one JSON value valid against it
      regex        the output fully matches this regular expression
      choice       the output is exactly one of these strings
      grammar      an EBNF grammar (xgrammar/GBNF syntax, root rule `root`)
      json_object  True: the output is one JSON object (OpenAI's response_format json_object)

    disable_any_whitespace: JSON without free whitespace (one fixed layout: `{"a": 1, "b": 2}`);
    by default JSON may carry whitespace between tokens, a bounded amount per gap.
    Schemas, regexes and grammars are compiled by the engine; one it cannot compile fails the request
    with a ValueError naming `structured_outputs.<kind>` and the problem.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(_STRUCTURED_KINDS)}; "
                             f"got {', '.join(given) or 'none'}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        if self.choice is not None:
            object.__setattr__(self, "choice", _choices(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        for name in ("json_object", "disable_any_whitespace"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"structured_outputs.{name} must be a boolean, got {getattr(self, name)!r}")

    @property
    def kind(self) -> str:
        return next(k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str | tuple[str, ...] | bool:
        """The constraint itself, canonical: a schema is its compact JSON text (key order kept)."""
        return getattr(self, self.kind)

    @property
    def cache_key(self) -> tuple:
        """Equal for constraints that compile to the same grammar (the compile cache's key)."""
        return self.kind, self.spec, self.disable_any_whitespace


def _schema_text(schema: dict | str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
        except RecursionError:
            raise ValueError(_TOO_DEEP) from None
    if not isinstance(schema, dict):
        raise ValueError(f"structured_outputs.json must be a JSON schema object, got {type(schema).__name__}")
    try:
        # Key order is kept: it is the order in which the output lists an object's properties.
        return json.dumps(schema, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"structured_outputs.json is not serializable as JSON: {exc}") from None
    except RecursionError:
        raise ValueError(_TOO_DEEP) from None


_TOO_DEEP = "structured_outputs.json is nested too deeply to process (hundreds of levels)"


def _choices(choice) -> tuple[str, ...]:
    if isinstance(choice, str) or not isinstance(choice, (list, tuple)) or not choice:
        raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {choice!r}")
    if not all(isinstance(c, str) and c for c in choice):
        raise ValueError(f"structured_outputs.choice must contain non-empty strings only, got {choice!r}")
    return tuple(choice)


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature=0 is greedy. Invalid values raise ValueError naming the field and its allowed range;
    a request never reaches the engine loop with a bad value.
    """

    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; 0: chosen token only; k: chosen + top-k alternatives
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Constrained decoding: a grammar (see StructuredOutputsParams), a whitelist of token ids, and
    # OpenAI's logit_bias (token id -> value in [-100, 100] added to the logit before sampling).
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None
    logit_bias: dict[int, float] | None = None
    stop_strings: tuple[str, ...] = field(init=False, default=())
    # vLLM's prompt_logprobs: None off; 0: each prompt token's own logprob (the first is None); k: plus top-k.
    # Such a request never reads the prefix cache (every prompt position's logits are computed).
    prompt_logprobs: int | None = None
    # Samples of the prompt (OpenAI's n): they share its KV blocks (forked after its prefill, copy-on-write)
    # and come back as outputs with RequestOutput.index 0..n-1; sample i is seeded with seed + i.
    n: int = 1

    def __post_init__(self) -> None:
        self.stop_strings = _normalize_stop(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.top_k = -1 if self.top_k in (0, None) else self.top_k
        self._validate()
        self._validate_constraints()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def _validate(self) -> None:
        _check_int("max_tokens", self.max_tokens, 1, allow_none=True)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} "
                             f"and max_tokens={self.max_tokens}")
        _check_float("temperature", self.temperature, 0.0, 100.0)
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, -1)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, 100.0, low_open=True)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_int("seed", self.seed, -(2**63), allow_none=True)
        if self.seed is not None and self.seed > 2**64 - 1:
            raise ValueError(f"seed must be in [-2**63, 2**64 - 1], got {self.seed}")
        _check_int("n", self.n, 1)
        _check_int("logprobs", self.logprobs, 0, allow_none=True)
        if self.logprobs is not None and self.logprobs > MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        _check_int("prompt_logprobs", self.prompt_logprobs, 0, allow_none=True)
        if self.prompt_logprobs is not None and self.prompt_logprobs > MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        for tid in self.stop_token_ids:
            _check_int("stop_token_ids", tid, 0)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")


    def _validate_constraints(self) -> None:
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                   StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, "
                             f"got {type(self.structured_outputs).__name__}")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids:
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, "
                                 f"got {self.allowed_token_ids!r}")
            for tid in self.allowed_token_ids:
                _check_int("allowed_token_ids", tid, 0)
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)

    @property
    def constrained(self) -> bool:
        """True when some tokens may be forbidden at a step (a grammar or a whitelist)."""
        return self.structured_outputs is not None or self.allowed_token_ids is not None


def sibling_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index` of an n > 1 request: seeded with seed + index (wrapping in the seed's range), so the
    samples differ and each is reproducible; the prompt's logprobs are scored once, by sample 0."""
    seed = params.seed
    if seed is not None:
        seed = seed + index if seed + index <= 2**64 - 1 else seed + index - 2**64
    return dataclasses.replace(params, seed=seed, prompt_logprobs=None)


def _logit_bias(bias) -> dict[int, float]:
    """Token id (int, or its decimal string as OpenAI's JSON sends it) -> bias in [-100, 100]."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a mapping of token id to bias, got {bias!r}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        tid = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        _check_int("logit_bias token id", tid, 0)
        _check_float("logit_bias value", value, -_MAX_LOGIT_BIAS, _MAX_LOGIT_BIAS)
        out[tid] = float(value)
    return out


def _normalize_stop(stop: list[str] | str | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    if any(s == "" for s in items):
        raise ValueError("stop must not contain empty strings")
    return tuple(items)


def _check_int(name: str, value, low: int, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value}")


def _check_float(name: str, value, low: float, high: float, *, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"{name} must be a number in {'(' if low_open else '['}{low}, {high}], "
                         f"got {value!r}")
    if value < low or value > high or (low_open and value == low):
        raise ValueError(f"{name} must be in {'(' if low_open else '['}{low}, {high}], got {value}")
