"""Sampling a verify step: each sequence's last token and drafts are rows of their own. Imports no torch.

Row i of a drafted sequence is sampled as the decode after its first i drafts would be: the same
parameters and seeded generator (in order), the min_tokens bans and the penalties' history of that point.
"""

from __future__ import annotations

from typing import Any

from runtime.sequence import Sequence


def _rows_of(engine: Any, seqs: list[Sequence]) -> tuple[list, ...]:
    params, generators, banned, histories, grammars = [], [], [], [], []
    for seq in seqs:
        ban, output = engine._banned(seq), seq.output_token_ids
        for i in range(len(seq.spec_token_ids) + 1):
            params.append(seq.params)
            generators.append(engine._generators[seq.request_id])
            banned.append(ban if len(output) + i < seq.params.min_tokens else [])
            histories.append((seq.prompt_token_ids, output + seq.spec_token_ids[:i]))
            grammars.append(seq.grammar)
    return params, generators, banned, histories, grammars if any(g is not None for g in grammars) else None


def _sample(engine: Any, seqs: list[Sequence], logits: Any) -> list[list[tuple]]:
    params, generators, banned, histories, grammars = _rows_of(engine, seqs)
    out = engine.sampler(logits, params, generators, banned, histories, grammars)
    rows = list(zip(out.token_ids, out.logprobs, out.sampled_logprobs))
    per_seq, at = [], 0
    for seq in seqs:
        n = len(seq.spec_token_ids) + 1
        per_seq.append(rows[at : at + n])
        at += n
    return per_seq


def sample_verify_rows(engine: Any, seqs: list[Sequence], logits: Any) -> list[list[tuple] | Exception]:
    """Per sequence, (token, top logprobs, sampled logprob) of each of its rows, or the error that made
    it unsampleable; as Engine._sample, a failed batch is sampled again one sequence at a time."""
    generators = [engine._generators[s.request_id] for s in seqs]
    states = [g.get_state() if g is not None else None for g in generators]
    try:
        return _sample(engine, seqs, logits)
    except Exception:
        pass
    for generator, state in zip(generators, states):
        if generator is not None:
            generator.set_state(state)
    result: list[list[tuple] | Exception] = []
    at = 0
    for seq in seqs:
        n = len(seq.spec_token_ids) + 1
        try:
            result += _sample(engine, [seq], logits[at : at + n])
        except Exception as err:
            result.append(err)
        at += n
    return result
