"""Speculative decoding: a proposer guesses tokens, one model step verifies them.

See docs/features/speculative_decoding.md. `config` parses vLLM's `speculative_config`; `ngram` proposes by
prompt lookup and `draft` with a draft model (a second model in a pool of its own: the one module here that
runs torch); `rows` and `verify` sample the verify rows, decide what is accepted and keep the counters;
`speculator` ties it to the engine's step, with the pages that keep the states a rejected draft rolls back to
(the verify itself decodes position by position: runtime/waves.py).
`plan` is what `tandem plan --speculative-config` prints about them.
"""
