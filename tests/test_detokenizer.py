"""IncrementalDetokenizer against the tokenizer's own full decode (the oracle): streamed deltas, multi-byte
UTF-8 split across byte-level tokens, and stop-string holdback."""

from __future__ import annotations

import functools

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from tiny_models import tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé テキスト 😀 emoji and accents.",
    "日本語の文章です 🚀🎉 café naïve Ελληνικά — “quotes” ½",
    "family 👩\u200d👩\u200d👧 flag 🇫🇷 e\u0301 combining; 한국어 and ﬁ ligature",
]
PROMPTS = {"none": "", "ascii": "The quick brown fox", "multibyte": "x 日本"}


def ids_of(text: str) -> list[int]:
    return tokenizer().encode(text, add_special_tokens=False)


def decode(ids: list[int], skip_special_tokens: bool = True) -> str:
    return tokenizer().decode(ids, skip_special_tokens=skip_special_tokens)


def make(prompt: str = "", **params) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer().backend_tokenizer, ids_of(prompt), SamplingParams(**params))


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], int | None]:
    """Feed ids one by one, taking a delta after each; stop at a stop string. -> (deltas, stop index)."""
    deltas = []
    for n, t in enumerate(ids):
        if detok.add(t):
            deltas.append(detok.take_delta(finished=True))
            return deltas, n
        deltas.append(detok.take_delta(finished=False))
    deltas.append(detok.take_delta(finished=True))
    return deltas, None


def test_texts_really_split_characters_across_tokens():
    """Guard: the test texts exercise partial UTF-8 (a token that decodes to an incomplete character)."""
    split = [t for t in TEXTS if any(decode(ids_of(t)[:n]).endswith("\ufffd")
                                     for n in range(1, len(ids_of(t))))]
    assert len(split) >= 2


@pytest.mark.parametrize("prompt", list(PROMPTS))
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_equal_full_decode(text, prompt):
    ids = ids_of(text)
    assert decode(ids) == text
    detok = make(PROMPTS[prompt])
    emitted = ""
    for n, t in enumerate(ids, start=1):
        assert detok.add(t) is False
        delta = detok.take_delta(finished=False)
        assert "\ufffd" not in delta, f"delta {delta!r} after token {n} holds half a character"
        emitted += delta
        assert text.startswith(emitted)
        head = decode(ids[:n])
        if "\ufffd" not in head:  # whole characters are streamed as soon as they are complete
            assert emitted == head
    emitted += detok.take_delta(finished=True)
    assert emitted == detok.text == text


def test_special_tokens_follow_skip_special_tokens():
    ids = ids_of("one ") + [1] + ids_of("two 😀") + [2, 0]
    for skip in (True, False):
        detok = make(skip_special_tokens=skip)
        deltas, _ = stream(detok, ids)
        assert "".join(deltas) == detok.text == decode(ids, skip_special_tokens=skip)
    assert "<|im_start|>" not in decode(ids) and "<|im_start|>" in decode(ids, skip_special_tokens=False)


def _assert_holdback(text: str, stops: list[str], **params):
    """Stream `text` with `stops`; return (deltas, stop token index, final text). Asserts that nothing
    streamed before the finish is later retracted (a stop prefix that completes is never leaked)."""
    detok = make(stop=stops, **params)
    ids = ids_of(text)
    deltas, at = stream(detok, ids)
    final = detok.text
    assert "".join(deltas) == final
    emitted = ""
    for d in deltas[:-1]:
        emitted += d
        assert final.startswith(emitted), f"streamed {emitted!r} but the final text is {final!r}"
    return ids, at, final


@pytest.mark.parametrize("text,stop", [
    ("The quick brown fox jumps over the lazy dog.", "brown fox"),
    ("The quick brown fox jumps over the lazy dog.", "fox jumps o"),
    ("The quick brown fox jumps over the lazy dog.", "The"),
    ("日本語の文章です 🚀🎉 café", "本語の"),
    ("日本語の文章です 🚀🎉 café", "🎉 ca"),
    ("Ünïcödé テキスト 😀 emoji", "テキ"),
])
def test_stop_string_cuts_at_first_occurrence(text, stop):
    ids, at, final = _assert_holdback(text, [stop])
    cut = text.index(stop)
    assert final == text[:cut]
    # the stop is detected at the token that completes it, per the tokenizer's own decode
    assert at == next(n for n in range(len(ids)) if stop in decode(ids[:n + 1]))


def test_stop_spanning_several_tokens_is_found():
    text, stop = "The quick brown fox jumps over the lazy dog.", "brown fox jumps"
    ids = ids_of(text)
    first = next(n for n in range(len(ids)) if len(decode(ids[:n + 1])) > text.index(stop))
    last = next(n for n in range(len(ids)) if stop in decode(ids[:n + 1]))
    assert last - first >= 2, "the stop string should span at least three tokens"
    _, at, final = _assert_holdback(text, [stop])
    assert at == last and final == "The quick "


def test_include_stop_str_in_output():
    text = "日本語の文章です 🚀🎉 café"
    for stop in ("文章", "🚀🎉"):
        _, at, final = _assert_holdback(text, [stop], include_stop_str_in_output=True)
        assert at is not None and final == text[:text.index(stop) + len(stop)]


def test_first_completed_stop_wins_then_earliest_start():
    """Stops are found as they complete; among those completing at one token the earliest start wins."""
    text = "The quick brown fox jumps over the lazy dog."
    _, at, final = _assert_holdback(text, ["lazy", "fox", "quick brown fox", "quick brown fox jumps over"])
    ids = ids_of(text)
    assert at == next(n for n in range(len(ids)) if "fox" in decode(ids[:n + 1]))
    assert final == "The "


@pytest.mark.parametrize("stop", ["brown cat", "dog.!", "fox jumps under"])
def test_partial_stop_match_is_released(stop):
    """A held-back prefix that never completes is streamed in the end, and holdback is no longer than
    len(stop) - 1 characters."""
    text = "The quick brown fox jumps over the lazy dog."
    detok = make(stop=[stop])
    ids, emitted = ids_of(text), ""
    for n, t in enumerate(ids, start=1):
        assert detok.add(t) is False
        emitted += detok.take_delta(finished=False)
        assert len(emitted) >= len(decode(ids[:n])) - (len(stop) - 1)
    emitted += detok.take_delta(finished=True)
    assert emitted == detok.text == text


def test_stops_not_checked_when_told_not_to():
    text, stop = "The quick brown fox", "quick"
    detok = make(stop=[stop])
    for t in ids_of(text):
        assert detok.add(t, check_stops=False) is False
    assert detok.text == text


@functools.lru_cache(maxsize=1)
def metaspace_tokenizer() -> Tokenizer:
    """A SentencePiece-style tokenizer (Llama/Mistral): words carry a leading "▁" that the decoder turns
    into a space, except at the very start of the decoded text, so a piece's text depends on its context."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.train_from_iterator([TEXTS[0] + " " + TEXTS[1]] * 50,
                            trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"]))
    return tok


@pytest.mark.parametrize("split", [1, 3, 6, 9])
def test_output_decodes_in_prompt_context(split):
    """The output's text is what it adds to the prompt's text: decode(prompt + out) minus decode(prompt),
    so the first output word keeps its leading space."""
    tok = metaspace_tokenizer()
    ids = tok.encode(TEXTS[0] + " " + TEXTS[1]).ids
    prompt, out = ids[:split], ids[split:]
    expected = tok.decode(prompt + out)[len(tok.decode(prompt)):]
    assert expected.startswith(" ") and tok.decode(prompt + out).startswith(tok.decode(prompt))
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams())
    deltas, _ = stream(detok, out)
    assert "".join(deltas) == detok.text == expected


def test_output_without_prompt_decodes_like_the_tokenizer():
    tok = metaspace_tokenizer()
    out = tok.encode(TEXTS[1]).ids
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    deltas, _ = stream(detok, out)
    assert "".join(deltas) == tok.decode(out) == TEXTS[1]


def test_prompt_ending_inside_a_character_does_not_leak_into_the_output():
    """A token-id prompt cut in the middle of a multi-byte character (its text ends in U+FFFD): the output
    text is the output tokens' own text, with no prompt characters in front."""
    full = ids_of("ab 日本語")
    cut = next(i for i in range(1, len(full)) if decode(full[:i]).endswith("\ufffd"))
    prompt, output = full[:cut], ids_of(" and more text")
    detok = IncrementalDetokenizer(tokenizer().backend_tokenizer, prompt, SamplingParams())
    for t in output:
        detok.add(t)
    assert detok.text == decode(output)



def random_ids(seed: int, n: int = 120) -> list[int]:
    """Words of the test texts (characters split over tokens), special tokens, arbitrary ids (possibly
    invalid UTF-8) and ids past the tokenizer's vocabulary (a model's may be larger; they add no text)."""
    import random

    rng = random.Random(seed)
    vocab = tokenizer().backend_tokenizer.get_vocab_size(with_added_tokens=True)
    ids: list[int] = []
    while len(ids) < n:
        kind = rng.random()
        if kind < 0.6:
            words = ids_of(rng.choice(TEXTS))
            a = rng.randrange(len(words))
            ids += words[a:a + rng.randint(1, 12)]
        elif kind < 0.75:
            ids.append(rng.randrange(3))  # the special tokens (tiny_models: ids 0-2)
        elif kind < 0.78:
            ids.append(vocab + rng.randrange(8))
        else:
            ids.append(rng.randrange(vocab))
    return ids


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_table_fast_path_adds_what_decode_stream_adds_at_every_step(seed, skip_special_tokens):
    """Byte-level tokenizers take each whole-character token's text from a table (engine.detokenizer
    token_texts): step by step, the text added must be exactly what tokenizers' DecodeStream adds, through
    characters split over several tokens, special tokens and arbitrary ids (possibly invalid UTF-8)."""
    from tokenizers.decoders import DecodeStream

    tok = tokenizer().backend_tokenizer
    ids = random_ids(seed)
    prompt = ids_of("The quick brown fox")  # ends on a whole character: the oracle primes with the same tail
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    fast = IncrementalDetokenizer(tok, prompt, params)
    assert fast._texts is not None  # the table path is the one under test
    oracle = DecodeStream(ids=prompt[-4:], skip_special_tokens=skip_special_tokens)
    for t in ids:
        before = len(fast.text)
        fast.add(t)
        assert fast.text[before:] == (oracle.step(tok, t) or ""), (t, ids)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_extend_adds_what_decode_stream_adds_over_the_run(seed, skip_special_tokens):
    """extend() (a request without stop strings: a report's tokens at once, engine/output_processor.py) must
    leave the text tokenizers' DecodeStream builds from the same tokens after every run of tokens, the runs mixing
    tokens that decode on their own (joined) with parts of characters and ids past the vocabulary (add())."""
    import random

    from tokenizers.decoders import DecodeStream

    tok = tokenizer().backend_tokenizer
    rng = random.Random(seed)
    ids = random_ids(seed, 400)
    prompt = ids_of("The quick brown fox")
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    fast = IncrementalDetokenizer(tok, prompt, params)
    oracle = DecodeStream(ids=prompt[-4:], skip_special_tokens=skip_special_tokens)
    expected, i = "", 0
    while i < len(ids):
        run = ids[i:i + rng.randint(1, 40)]
        fast.extend(run)
        expected += "".join(oracle.step(tok, t) or "" for t in run)
        assert fast.text == expected, (run, ids)
        i += len(run)


def test_extend_finishes_a_character_a_previous_report_left_open():
    """A report that ends inside a character (its last token's bytes are not whole) leaves the stream open; the
    next report's tokens go through the stream until the character ends, even tokens that decode on their own
    (DecodeStream is the oracle), so no text is taken from the table while bytes wait there."""
    from tokenizers.decoders import DecodeStream

    tok = tokenizer().backend_tokenizer
    params = SamplingParams()
    prompt = ids_of("The quick brown fox")
    fast = IncrementalDetokenizer(tok, prompt, params)
    split = next(ids for ids in map(ids_of, TEXTS) if any(fast._texts[t] is None for t in ids))
    k = next(i for i, t in enumerate(split) if fast._texts[t] is None)
    whole = ids_of(" and")  # decodes on its own
    runs = [split[:k + 1], whole, split[k + 1:], whole]
    oracle = DecodeStream(ids=prompt[-4:], skip_special_tokens=True)
    expected = ""
    for run in runs:
        fast.extend(run)
        expected += "".join(oracle.step(tok, t) or "" for t in run)
        assert fast.text == expected, run
    assert fast._texts is not None and all(fast._texts[t] is not None for t in whole)


def test_non_byte_level_tokenizers_keep_the_stream():
    detok = IncrementalDetokenizer(metaspace_tokenizer(), [], SamplingParams())
    assert detok._texts is None


@pytest.mark.parametrize("seed", range(8))
def test_many_stop_strings_are_found_as_one_at_a_time_would(seed):
    """The automaton (engine.detokenizer, from AHO_MIN_STOPS strings on) finds the same stop as searching
    each string in turn: the earliest start, ties to the string listed first; overlaps and repeats."""
    import random

    from engine.detokenizer import find_stop, stop_matcher

    rng = random.Random(seed)
    alphabet = "abcab日本 "
    text = "".join(rng.choice(alphabet) for _ in range(400))
    stops = tuple("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(40))
    stops += stops[:3]  # a stop listed twice keeps its first index
    matcher = stop_matcher(stops)
    for search_from in range(0, len(text), 7):
        assert find_stop(text, search_from, stops, matcher) == find_stop(text, search_from, stops)


def test_fifty_thousand_stop_strings_stream_like_one():
    stops = [f"never{i}" for i in range(50_000)] + [" jumps"]
    text = "The quick brown fox jumps over the lazy dog."
    _, at, final = _assert_holdback(text, stops)
    assert at is not None and final == "The quick brown fox"


@pytest.mark.parametrize("text", TEXTS[1:])
def test_extend_at_every_cut_equals_decode_stream(text):
    """A text whose characters split over tokens, reported in two parts cut at every token: after each part the
    text is what tokenizers' DecodeStream has emitted (a part ending inside a character holds its bytes back
    until the next one completes it), and the whole is the tokenizer's decode."""
    from tokenizers.decoders import DecodeStream

    tok = tokenizer().backend_tokenizer
    ids = ids_of(text)
    for cut in range(1, len(ids)):
        fast = IncrementalDetokenizer(tok, [], SamplingParams())
        oracle = DecodeStream(ids=[], skip_special_tokens=True)
        expected = ""
        for part in (ids[:cut], ids[cut:]):
            fast.extend(part)
            expected += "".join(oracle.step(tok, t) or "" for t in part)
            assert fast.text == expected, cut
        assert fast.text == text
