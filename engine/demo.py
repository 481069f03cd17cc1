"""Offline demo on the embedded default model: `python -m engine.demo [--prompt TEXT] [--chat]`.

Streams the answer through the async API as tokens are committed. Without --prompt it answers a few
built-in prompts, or reads prompts from the terminal when one is attached.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from engine import AsyncLLM, SamplingParams

_BUILTIN = ["Return a list of", "What does os.path.join do?"]


async def _answer(llm: AsyncLLM, prompt: str, chat: bool, params: SamplingParams) -> None:
    if chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                   add_generation_prompt=True, tokenize=False)
    print(f"\n>>> {prompt!r}\n", end="", flush=True)
    async for out in llm.generate(prompt, params):
        print(out.delta_text, end="", flush=True)
        if out.finished:
            print(f"\n[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]")


async def _main(args: argparse.Namespace) -> None:
    llm = AsyncLLM(model=args.model)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    try:
        if args.prompt:
            await _answer(llm, args.prompt, args.chat, params)
        elif sys.stdin.isatty():
            while (line := input("\nprompt> ").strip()):
                await _answer(llm, line, args.chat, params)
        else:
            for i, prompt in enumerate(_BUILTIN):
                await _answer(llm, prompt, chat=i % 2 == 1, params=params)
        print(f"\nstats: {llm.stats().as_dict()}")
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="checkpoint dir (default: the embedded model)")
    parser.add_argument("--prompt", default=None)
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
