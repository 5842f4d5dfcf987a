"""Prompt lookup (vLLM's "ngram" method): find the sequence's last n tokens earlier in its own prompt and
output, and propose the tokens that followed them. Pure Python."""

from __future__ import annotations


def propose(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of `token_ids`
    (from `max_n` tokens down to `min_n`); [] when no suffix recurs."""
    num = len(token_ids)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        suffix = token_ids[num - n:]
        # The latest match proposes what the sequence did most recently: editing runs copy the nearest text.
        for start in range(num - n - 1, -1, -1):
            if token_ids[start:start + n] == suffix:
                return token_ids[start + n:start + n + k]
    return []
