"""Compiling constraints into xgrammar grammars (once per spec, cached), and one matcher per sequence.

Compiling a JSON schema can take from milliseconds to seconds; the compiled grammar is cached by the
spec's key, so the tenth request with one schema pays nothing. The cache is thread-safe: the server
compiles on a worker thread when it accepts a request, and the engine thread then finds the grammar ready.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

import torch

from runtime.structured_outputs.params import StructuredOutputsParams

# Compiled grammars kept; each holds a per-token mask table, from kilobytes to a few megabytes.
CACHE_SIZE = 256
# JSON may have free whitespace between its tokens (as vLLM), but at most this many characters in a row: a
# model that favours whitespace would otherwise spin in it until max_tokens (vLLM's known "whitespace loop").
# 20 holds a newline and the indentation of pretty-printed JSON four levels deep (four spaces a level).
MAX_WHITESPACE = 20
# The JSON schema of json_object: any object (OpenAI's JSON mode promises an object, not any JSON value).
ANY_OBJECT = {"type": "object"}


def _message(err: Exception) -> str:
    """xgrammar's error without its timestamp, C++ source location and check text."""
    text = str(err).strip()
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)
    text = re.sub(r"^Check failed: \(.*?\) is false: ", "", text)
    return text.splitlines()[0] if text else type(err).__name__


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer and vocabulary; `compile` is safe from any thread."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], cache_size: int = CACHE_SIZE):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._cache_size = cache_size
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler = None

    def warm_up(self) -> None:
        """Build the vocabulary's tables now. Building them holds the GIL (about a second for a 150k-token
        vocabulary) and reads the tokenizer: the server does it before it serves, not beside the engine thread."""
        self._xgrammar_compiler()

    def _xgrammar_compiler(self):
        # Built on first use offline: an engine that never sees a constraint never imports xgrammar.
        with self._lock:
            if self._compiler is None:
                import xgrammar

                # The model's vocabulary (the logits' width) may be larger than the tokenizer's.
                info = xgrammar.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                               stop_token_ids=self._stop_token_ids)
                self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
            return self._compiler

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar of `spec`; a constraint the library cannot compile raises ValueError naming
        its field (structured_outputs.json, .regex, .grammar)."""
        key = spec.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiled = self._compile(spec)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputsParams):
        compiler = self._xgrammar_compiler()
        kind = spec.kind
        try:
            if kind in ("json", "json_object"):
                schema = spec.json if kind == "json" else ANY_OBJECT
                whitespace = {"any_whitespace": False} if spec.disable_any_whitespace else \
                    {"any_whitespace": True, "max_whitespace_cnt": MAX_WHITESPACE}
                return compiler.compile_json_schema(json.dumps(schema), **whitespace)
            if kind == "regex":
                return compiler.compile_regex(spec.regex)
            if kind == "choice":
                # Each choice as an EBNF string literal: JSON's escapes are EBNF's.
                rule = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in spec.choice)
                return compiler.compile_grammar(f"root ::= {rule}")
            return self._compile_grammar(compiler, spec.grammar)
        except RuntimeError as err:
            raise ValueError(f"structured_outputs.{kind}: {_message(err)}") from None

    @staticmethod
    def _compile_grammar(compiler, text: str):
        """EBNF (GBNF) first, as vLLM's xgrammar backend; a grammar that is not EBNF may be Lark."""
        try:
            return compiler.compile_grammar(text)
        except RuntimeError as ebnf_error:
            if "::=" in text:
                raise
            try:
                return compiler.compile_grammar(__import__("xgrammar").Grammar.from_lark(text))
            except RuntimeError:
                raise ebnf_error from None

    def matcher(self, spec: StructuredOutputsParams) -> GrammarState:
        return GrammarState(self.compile(spec), self.vocab_size)


class GrammarState:
    """Where one sequence is in its grammar: which tokens may come next, advanced by each accepted token."""

    def __init__(self, compiled, vocab_size: int):
        import xgrammar

        self._matcher = xgrammar.GrammarMatcher(compiled)
        self._vocab_size = vocab_size

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> None:
        if not self._matcher.accept_token(token):
            raise ValueError(f"token {token} does not continue the structured output's grammar")

    def can_only_end(self) -> bool:
        """The output is complete and nothing but a stop token may follow (then min_tokens cannot hold:
        banning the stop tokens would leave no token at all)."""
        if not self._matcher.is_completed():
            return False
        import xgrammar

        bitmask = xgrammar.allocate_token_bitmask(1, self._vocab_size)
        self._matcher.fill_next_token_bitmask(bitmask)
        allowed = _unpack(bitmask[0], self._vocab_size)
        allowed[list(self._matcher.stop_token_ids)] = False
        return not bool(allowed.any())

    @property
    def finished(self) -> bool:
        """The grammar is complete and its stop token accepted, or nothing can follow what was generated."""
        return self._matcher.is_terminated()


def _unpack(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A packed bitmask row (bit i of word i // 32 allows token i) as one bool per token."""
    shifts = torch.arange(32, dtype=torch.int32)
    return ((words[:, None] >> shifts) & 1).flatten()[:vocab_size].bool()


def apply_bitmasks(logits: torch.Tensor, states: list[GrammarState | None]) -> None:
    """Ban, in place, every token that the grammar of each constrained row does not allow next; rows
    without a grammar are left exactly as they were. One bitmask for the batch, applied at once."""
    rows = [row for row, state in enumerate(states) if state is not None]
    if not rows:
        return
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(len(states), logits.shape[-1])
    for row in rows:
        states[row].fill(bitmask, row)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)
