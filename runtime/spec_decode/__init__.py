"""Speculative decoding: a proposer guesses tokens, one model step verifies them (docs/features/speculative_decoding.md).

`config` parses vLLM's `speculative_config`; `ngram` proposes by prompt lookup; `verify` decides what is
accepted and keeps the counters; `rollback` says what a rejected draft costs each kind of cache. All pure Python.
"""
