"""Structured outputs: constrain a request's tokens to a JSON schema, a regex, a choice of strings or a
grammar (vLLM's StructuredOutputsParams), with xgrammar's token bitmasks.

`params` is pure Python (SamplingParams imports it); `grammars` imports xgrammar, only once a request asks.
"""

from runtime.structured_outputs.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
