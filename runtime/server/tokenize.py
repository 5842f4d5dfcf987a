"""Tokenization and chat templating on a worker thread of their own, off the event loop and the engine thread.

A 5 MB prompt took 9 s to tokenize: on the engine thread it stalled every stream, on the event loop
every request (even /health). Here it stalls only the requests queued behind it for this worker. The
worker owns its tokenizer: a tokenizer is not safe to share between threads.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from jinja2 import TemplateError


class TokenizerWorker:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-tokenizer")

    async def _run(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, function, *args)

    async def encode(self, text: str) -> dict:
        """{"prompt": text, "prompt_token_ids": ids}, what the engine takes."""
        return await self._run(self._encode, text, True)

    async def render_chat(self, messages: list[dict], add_generation_prompt: bool,
                          tools: list[dict] | None = None) -> dict:
        """The prompt the chat template makes of the messages (and the tools, for templates that show them),
        as text and token ids."""
        return await self._run(self._render_chat, messages, add_generation_prompt, tools)

    def _encode(self, text: str, add_special_tokens: bool) -> dict:
        return {"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=add_special_tokens)}

    def _render_chat(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None) -> dict:
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False, tools=tools)
        except TemplateError as err:
            raise ValueError(f"the chat template refused these messages: {err}") from None
        # The template writes the special tokens it wants (a BOS, say); encoding must not add them a second time.
        return self._encode(text, False)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
