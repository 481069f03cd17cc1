"""The grammar backend: xgrammar compiles constraints against the model's tokenizer.

xgrammar (not llguidance) because it ships a small manylinux wheel, compiles JSON schema, regex and EBNF
to token-level automata with a precomputed per-token cache, fills int32 bitmasks [rows, ceil(V/32)] on the
host (the format a device-side apply wants) and masks CPU logits with a C++ kernel. Everything
xgrammar-specific lives in this file.
"""

from __future__ import annotations

import functools
import json
import threading

import torch
import xgrammar as xgr

from engine.sampling_params import StructuredOutputsParams

# With free whitespace allowed, a JSON gap holds at most this many whitespace characters: enough for
# pretty-printed output, and a model cannot loop on spaces or newlines until max_tokens.
MAX_JSON_WHITESPACE = 16

CompiledGrammar = xgr.CompiledGrammar
GrammarMatcher = xgr.GrammarMatcher


class GrammarBackend:
    """Compiles StructuredOutputsParams for one tokenizer. Thread-safe; the tokenizer's vocabulary table
    (TokenizerInfo) is built on first use, on a compile thread, so engines that never see a constrained
    request pay nothing for it."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        # The model's logits have vocab_size columns (embedding rows), which may differ from the
        # tokenizer's size: xgrammar is told the model's size and forbids ids the tokenizer lacks.
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._stop_token_ids = sorted(stop_token_ids) or None
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Compile one constraint; raises ValueError naming `structured_outputs.<kind>` and the problem."""
        compiler = self._get_compiler()
        kind = params.kind
        try:
            if kind == "json":
                schema = json.dumps(bounded_strings_as_patterns(json.loads(params.json)), ensure_ascii=False)
                return compiler.compile_json_schema(schema, **_json_layout(params))
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', strict_mode=False,
                                                    **_json_layout(params))
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(params.choice))
            return compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar reports bad input as RuntimeError
            raise ValueError(f"structured_outputs.{kind}: cannot compile: {_reason(exc)}") from None

    def matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        return xgr.GrammarMatcher(compiled)

    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self._stop_token_ids)
                # Our own cache (manager) holds compiled grammars; xgrammar's would be a second copy.
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            return self._compiler


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF accepting exactly one of `choices`. xgrammar's EBNF string literals take JSON escapes."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


_NOT_SCHEMAS = ("enum", "const", "default", "examples")  # keys whose values are data, not subschemas
# One JSON string character that needs no escape, as positive code point ranges: no control characters,
# no quote or backslash, no surrogates. (A negated class such as [^\x00-\x1f] lets xgrammar 0.2.8's
# regex path accept overlong UTF-8 byte sequences; positive ranges do not.)
_PLAIN_JSON_CHAR = "[ !#-\\[\\]-\ud7ff\ue000-\uffff\U00010000-\U0010ffff]"


def bounded_strings_as_patterns(schema):
    """Rewrite `{"type": "string", "minLength": a, "maxLength": b}` as the pattern `^<char>{a,b}$`.

    Why by hand: xgrammar 0.2.8 compiles a length-bounded string to a bare character class that admits
    raw control characters (U+0000-U+001F), which JSON forbids, so the output fails to parse (xgrammar
    issue #800, fix not released). Its pattern path builds a JSON-string-aware regex instead. The pattern
    only narrows the language (no escape sequences), so every output still fits the schema.
    """
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _NOT_SCHEMAS else bounded_strings_as_patterns(v) for k, v in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and not {"pattern", "format", "enum", "const"} & out.keys():
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f"^{_PLAIN_JSON_CHAR}{{{low},{high}}}$"
    return out


def _json_layout(params: StructuredOutputsParams) -> dict:
    if params.disable_any_whitespace:
        return {"any_whitespace": False}
    return {"any_whitespace": True, "max_whitespace_cnt": MAX_JSON_WHITESPACE}


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ source location prefix ("[time] file.cc:123: ")."""
    text = str(exc).strip()
    _, sep, rest = text.partition(".cc:")
    if sep:
        text = rest.split(": ", 1)[-1] if ": " in rest else rest
    if text.startswith("Check failed:") and " is false: " in text:
        text = text.split(" is false: ", 1)[1]
    return text.splitlines()[0] if text else type(exc).__name__


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int, pin_memory: bool = False) -> torch.Tensor:
    """A host int32 bitmask [rows, ceil(V/32)]; bit j of row i set = token j allowed (all set here)."""
    return torch.full((rows, bitmask_width(vocab_size)), -1, dtype=torch.int32, pin_memory=pin_memory)


def ids_to_bitmask(token_ids: list[int], vocab_size: int) -> torch.Tensor:
    """[ceil(V/32)] int32 with exactly the bits of `token_ids` set (allowed_token_ids)."""
    words = torch.zeros(bitmask_width(vocab_size), dtype=torch.int64)
    ids = torch.tensor(sorted(set(token_ids)), dtype=torch.int64)
    words.index_add_(0, ids >> 5, torch.ones_like(ids) << (ids & 31))
    return words.to(torch.int32)  # wraps bit 31 to the sign bit, which is what int32 bitmasks hold


def fill_bitmask_batch(matchers: list[GrammarMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
    """bitmask[rows[i]] <- the next-token mask of matchers[i] (xgrammar spreads rows over threads)."""
    _batch_matcher().batch_fill_next_token_bitmask(matchers, bitmask, rows)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits[r, j] = -inf where bit j of bitmask[r] is clear, for r in rows (in place)."""
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)


@functools.cache
def _batch_matcher() -> xgr.BatchGrammarMatcher:
    return xgr.BatchGrammarMatcher(max_threads="auto")
