#!/usr/bin/env python3
"""Train Tandem's embedded default model from scratch on CPU.

The model is a tiny Llama-architecture decoder (with grouped-query attention)
plus a byte-level BPE tokenizer that ships a ChatML chat template.  Both are
trained on English prose taken from the Python standard library installed
with the running interpreter (PSF license, redistributable):

* module, class and function docstrings (extracted with ``ast``),
* blocks of ``#`` comments,
* the reference-manual topics in ``pydoc_data.topics``,
* synthetic chat conversations ("What does json.dumps do?" -> first paragraph
  of its docstring), rendered with the tokenizer's own chat template.

Everything is written in the Hugging Face layout (config.json,
generation_config.json, model.safetensors, tokenizer files, README.md model
card) so it loads with ``AutoModelForCausalLM`` / ``AutoTokenizer``.

Usage::

    python scripts/train_default_model.py --out engine/default_model --minutes 25
"""

from __future__ import annotations

import argparse
import ast
import io
import math
import os
import random
import sys
import sysconfig
import time
import tokenize
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

EOT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOT, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Stdlib directories that hold tests, tooling, data tables or third-party code.
SKIP_DIRS = {
    "test", "tests", "idlelib", "lib2to3", "site-packages", "encodings",
    "turtledemo", "ensurepip", "pydoc_data", "lib-dynload", "__pycache__",
}

QUESTION_TEMPLATES = {
    "module": ["What is the {name} module?", "What does the {name} module do?",
               "Tell me about the {name} module."],
    "class": ["What is {name}?", "What does the {name} class do?", "Explain {name}."],
    "function": ["What does {name} do?", "What is {name}() used for?", "Explain {name}."],
}

MODEL_SHAPE = dict(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=1024,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)

PLAIN_PROMPT = "Return a new list containing"
CHAT_QUESTION = "What does os.path.join do?"


@dataclass
class Docstring:
    """A docstring together with the object it documents."""

    qualname: str
    kind: str  # "module", "class" or "function"
    text: str


# --------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------

def iter_stdlib_sources(stdlib: Path):
    """Yield ``(module_name, source_text)`` for the stdlib's own .py files."""
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = sorted(
            d for d in dirnames if d not in SKIP_DIRS and not d.startswith("config-")
        )
        for filename in sorted(filenames):
            if not filename.endswith(".py") or filename.startswith("_sysconfigdata"):
                continue
            path = Path(dirpath, filename)
            parts = list(path.relative_to(stdlib).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            try:
                yield ".".join(parts), path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue


def extract_docstrings(module: str, source: str) -> list[Docstring]:
    """Return the module, class and function docstrings of one source file."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}.{child.name}"
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                doc = ast.get_docstring(child)
                if doc:
                    found.append(Docstring(name, kind, doc))
                visit(child, name)

    doc = ast.get_docstring(tree)
    if doc:
        found.append(Docstring(module, "module", doc))
    visit(tree, module)
    return found


def extract_comment_blocks(source: str, min_chars: int = 80, min_words: int = 10) -> list[str]:
    """Join runs of consecutive ``#`` comment lines into prose paragraphs."""
    blocks, current, last_line = [], [], -2
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type != tokenize.COMMENT:
                continue
            line = tok.start[0]
            if line != last_line + 1 and current:
                blocks.append(" ".join(current))
                current = []
            text = tok.string.lstrip("#").strip()
            if text:
                current.append(text)
            last_line = line
    except (tokenize.TokenError, SyntaxError):
        pass
    if current:
        blocks.append(" ".join(current))
    return [b for b in blocks if len(b) >= min_chars and len(b.split()) >= min_words]


def reference_topics() -> list[str]:
    """Return the Python reference-manual topics bundled for ``pydoc``."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    return [topics[key].strip() for key in sorted(topics)]


def first_paragraph(text: str, max_chars: int = 600) -> str | None:
    """Return the docstring's first paragraph as one line, if it is usable prose."""
    paragraph = " ".join(text.strip().split("\n\n", 1)[0].split())
    if len(paragraph) < 25 or len(paragraph) > max_chars or ">>>" in paragraph:
        return None
    return paragraph


def make_chat_examples(docstrings: list[Docstring], rng: random.Random) -> list[list[dict]]:
    """Turn public docstrings into one- or two-turn question/answer conversations."""
    pairs = []
    for doc in docstrings:
        if doc.qualname.rsplit(".", 1)[-1].startswith("_"):
            continue
        answer = first_paragraph(doc.text)
        if answer:
            question = rng.choice(QUESTION_TEMPLATES[doc.kind]).format(name=doc.qualname)
            pairs.append((question, answer))
    rng.shuffle(pairs)

    conversations, i = [], 0
    while i < len(pairs):
        turns = 2 if rng.random() < 0.25 and i + 1 < len(pairs) else 1
        messages = []
        for question, answer in pairs[i:i + turns]:
            messages += [{"role": "user", "content": question},
                         {"role": "assistant", "content": answer}]
        conversations.append(messages)
        i += turns
    return conversations


def collect_prose(stdlib: Path) -> tuple[list[Docstring], list[str], dict]:
    """Gather deduplicated docstrings and comment blocks from the stdlib."""
    docstrings, comments = [], []
    seen: set[str] = set()
    n_files = 0
    for module, source in iter_stdlib_sources(stdlib):
        n_files += 1
        for doc in extract_docstrings(module, source):
            if len(doc.text) >= 20 and doc.text not in seen:
                seen.add(doc.text)
                docstrings.append(doc)
        for block in extract_comment_blocks(source):
            if block not in seen:
                seen.add(block)
                comments.append(block)
    return docstrings, comments, {"source_files": n_files}


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------

def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer and wrap it with the ChatML template.

    ``eos_token`` is ``<|im_end|>`` (end of a chat turn); plain-text documents
    end with ``<|endoftext|>``, which doubles as the padding token.  Both ids
    go into generation_config.json so generation stops at either.
    """
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=EOT,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=MODEL_SHAPE["max_position_embeddings"],
    )


def encode_documents(tokenizer: PreTrainedTokenizerFast, documents: list[str]) -> torch.Tensor:
    """Encode documents into one token stream, each followed by ``<|endoftext|>``."""
    eot_id = tokenizer.convert_tokens_to_ids(EOT)
    ids: list[int] = []
    for encoding in tokenizer.backend_tokenizer.encode_batch(documents, add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(eot_id)
    return torch.tensor(ids, dtype=torch.long)


# --------------------------------------------------------------------------
# Model and training
# --------------------------------------------------------------------------

def build_model(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """Create a freshly initialised float32 Llama model sized for the tokenizer."""
    eot_id = tokenizer.convert_tokens_to_ids(EOT)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=eot_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=eot_id,
        **MODEL_SHAPE,
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=eot_id,
        eos_token_id=[tokenizer.eos_token_id, eot_id],
        pad_token_id=eot_id,
    )
    return model


def split_chunks(stream: torch.Tensor, seq_len: int, val_fraction: float,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut the stream into ``seq_len`` chunks and hold out a shuffled validation set."""
    n_chunks = len(stream) // seq_len
    chunks = stream[: n_chunks * seq_len].view(n_chunks, seq_len)
    chunks = chunks[torch.randperm(n_chunks, generator=generator)]
    n_val = max(1, int(n_chunks * val_fraction))
    return chunks[n_val:], chunks[:n_val]


def learning_rate(step: int, progress: float, peak: float, warmup: int) -> float:
    """Linear warmup by step, then cosine decay to 10% over the time budget."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, chunks: torch.Tensor, batch_size: int) -> float:
    """Mean next-token loss over the given chunks."""
    model.eval()
    losses = [model(input_ids=b, labels=b).loss.item() for b in chunks.split(batch_size)]
    model.train()
    return sum(losses) / len(losses)


def train(model: LlamaForCausalLM, train_chunks: torch.Tensor, args: argparse.Namespace,
          generator: torch.Generator) -> dict:
    """Train until the time budget runs out; return step/token/loss statistics."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    budget = args.minutes * 60
    order = torch.randperm(len(train_chunks), generator=generator)
    cursor, step, tokens, recent = 0, 0, 0, []
    start = time.monotonic()
    model.train()
    while (elapsed := time.monotonic() - start) < budget:
        if cursor + args.batch_size > len(order):
            order, cursor = torch.randperm(len(train_chunks), generator=generator), 0
        batch = train_chunks[order[cursor:cursor + args.batch_size]]
        cursor += args.batch_size

        lr = learning_rate(step, elapsed / budget, args.lr, args.warmup)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        step += 1
        tokens += batch.numel()
        recent = (recent + [loss.item()])[-args.log_every:]
        if step % args.log_every == 0:
            print(f"step {step:5d}  {elapsed / 60:5.1f} min  lr {lr:.2e}  "
                  f"loss {sum(recent) / len(recent):.3f}  {tokens / elapsed:,.0f} tok/s",
                  flush=True)
    return {
        "steps": step,
        "tokens": tokens,
        "seconds": time.monotonic() - start,
        "train_loss": sum(recent) / max(len(recent), 1),
    }


# --------------------------------------------------------------------------
# Samples and model card
# --------------------------------------------------------------------------

def generate_samples(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast,
                     seed: int, max_new_tokens: int = 60) -> dict[str, str]:
    """Greedy and sampled continuations of a plain prompt and a chat prompt."""
    chat_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": CHAT_QUESTION}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )["input_ids"]
    prompts = {"plain": tokenizer(PLAIN_PROMPT, return_tensors="pt")["input_ids"],
               "chat": chat_ids}
    model.eval()
    samples = {}
    for name, input_ids in prompts.items():
        for mode, options in [("greedy", {"do_sample": False}),
                              ("sampled", {"do_sample": True, "temperature": 0.8,
                                           "top_k": 40})]:
            torch.manual_seed(seed)
            output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                    max_new_tokens=max_new_tokens, **options)
            samples[f"{name}/{mode}"] = tokenizer.decode(output[0], skip_special_tokens=False)
    return samples


def write_model_card(out: Path, model: LlamaForCausalLM, stats: dict,
                     samples: dict[str, str]) -> None:
    """Write README.md describing data, license, architecture and training run."""
    cfg = model.config
    sample_text = "\n\n".join(f"**{name}**\n\n```\n{text}\n```" for name, text in samples.items())
    card = f"""# Tandem default model

A tiny Llama-architecture language model embedded in Tandem so the engine can
run end to end (tokenize, prefill, decode, chat template, stop tokens) without
downloading anything.  It writes Python-docstring-flavoured English and is
*not* useful as an assistant: treat it as a test fixture.

## Data and license

Trained only on text from the CPython {stats['python_version']} standard library
(Python Software Foundation License, see https://docs.python.org/3/license.html):

* {stats['docstrings']:,} unique module/class/function docstrings,
* {stats['comments']:,} comment blocks,
* {stats['topics']:,} reference-manual topics from `pydoc_data.topics`,
* {stats['chats']:,} synthetic chat conversations built from docstrings
  (user asks "What does X do?", assistant answers with the docstring's first
  paragraph), rendered with the chat template below.

Tests, idlelib, lib2to3, encodings tables and site-packages are excluded.
Corpus size: {stats['corpus_bytes'] / 1e6:.1f} MB of text, {stats['corpus_tokens']:,} tokens.
The weights and tokenizer are derived from PSF-licensed text and are
redistributed under the same terms.

## Architecture

`LlamaForCausalLM`, float32, {stats['parameters']:,} parameters:
hidden size {cfg.hidden_size}, {cfg.num_hidden_layers} layers,
{cfg.num_attention_heads} attention heads with {cfg.num_key_value_heads} key/value heads
(grouped-query attention, head dim {cfg.head_dim}), SwiGLU MLP of width
{cfg.intermediate_size}, RMSNorm, RoPE (theta {MODEL_SHAPE['rope_theta']:g}),
{cfg.max_position_embeddings} positions, input and output embeddings tied.

Tokenizer: byte-level BPE with {stats['vocab_size']:,} tokens trained with
`tokenizers`.  Special tokens: `<|endoftext|>` (document separator, padding,
bos id in config), `<|im_start|>`, `<|im_end|>` (tokenizer `eos_token`).
`generation_config.json` lists both `<|im_end|>` and `<|endoftext|>` as
`eos_token_id`.  Chat template (ChatML):

```
<|im_start|>user
What does os.path.join do?<|im_end|>
<|im_start|>assistant
```

## Training

From scratch on {stats['threads']} CPU threads: AdamW (betas 0.9/0.95, weight decay 0.1),
peak LR {stats['lr']:g} with {stats['warmup']} warmup steps and cosine decay,
batch {stats['batch_size']} x {stats['seq_len']} tokens, seed {stats['seed']}.

* Steps: {stats['steps']:,}
* Tokens seen: {stats['tokens']:,}
* Training time: {stats['seconds'] / 60:.1f} minutes
* Final training loss: {stats['train_loss']:.3f}
* Held-out loss: {stats['val_loss']:.3f}

## Samples

{sample_text}

## Regenerate

```
python scripts/train_default_model.py --out engine/default_model --minutes {stats['minutes']:g} --seed {stats['seed']}
```

Results vary slightly with the Python version (different stdlib text) and
with CPU speed (the run is bounded by wall-clock time).
"""
    (out / "README.md").write_text(card, encoding="utf-8")


# --------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("engine/default_model"))
    parser.add_argument("--minutes", type=float, default=25.0, help="training time budget")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--log-every", type=int, default=25)
    return parser.parse_args(argv)


def build_corpus(rng: random.Random) -> tuple[list[str], list[list[dict]], dict]:
    """Return plain-text documents, chat conversations and corpus statistics."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docstrings, comments, stats = collect_prose(stdlib)
    topics = reference_topics()
    stats.update(docstrings=len(docstrings), comments=len(comments), topics=len(topics))
    documents = [d.text for d in docstrings] + comments + topics
    return documents, make_chat_examples(docstrings, rng), stats


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    generator = torch.Generator().manual_seed(args.seed)

    documents, conversations, corpus_stats = build_corpus(rng)
    questions = [m["content"] for c in conversations for m in c if m["role"] == "user"]
    print(f"corpus: {corpus_stats}, {len(conversations)} conversations", flush=True)

    tokenizer = train_tokenizer(documents + questions, args.vocab_size)
    chats = [tokenizer.apply_chat_template(c, tokenize=False) for c in conversations]
    documents = documents + chats
    rng.shuffle(documents)
    stream = encode_documents(tokenizer, documents)
    train_chunks, val_chunks = split_chunks(stream, args.seq_len, 0.02, generator)
    print(f"tokens: {len(stream):,}  train chunks {len(train_chunks)}  "
          f"val chunks {len(val_chunks)}", flush=True)

    model = build_model(tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {n_params:,}", flush=True)

    stats = train(model, train_chunks, args, generator)
    stats["val_loss"] = evaluate(model, val_chunks, args.batch_size)
    print(f"done: {stats}", flush=True)

    samples = generate_samples(model, tokenizer, args.seed)
    for name, text in samples.items():
        print(f"--- {name} ---\n{text}\n", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)  # safetensors is the only format in transformers 5
    # Keep the chat template inside tokenizer_config.json, where every loader looks.
    tokenizer.save_pretrained(args.out, save_jinja_files=False)
    stats.update(corpus_stats, chats=len(chats), parameters=n_params,
                 corpus_bytes=sum(len(d.encode()) for d in documents),
                 corpus_tokens=len(stream), vocab_size=len(tokenizer),
                 python_version=sys.version.split()[0], threads=args.threads,
                 lr=args.lr, warmup=args.warmup, batch_size=args.batch_size,
                 seq_len=args.seq_len, seed=args.seed, minutes=args.minutes)
    write_model_card(args.out, model, stats, samples)
    print(f"saved to {args.out}", flush=True)


if __name__ == "__main__":
    main()
