"""Prompt lookup (vLLM's "ngram" method): find the sequence's last n tokens earlier in its own prompt and
output, and propose the tokens that followed them. Pure Python."""

from __future__ import annotations


def propose(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of `token_ids`
    (from `max_n` tokens down to `min_n`); [] when no suffix recurs.

    Runs every decode step over the whole sequence, so the scan is list.index's (in C) over the earlier
    positions of the last token, latest first; each is extended backwards to the length it matches."""
    num = len(token_ids)
    if num < 2:
        return []
    earlier = token_ids[-2::-1]  # position num - 2 - i at index i
    best_n, best_end, i = 0, -1, -1
    while best_n < max_n:
        try:
            i = earlier.index(token_ids[-1], i + 1)
        except ValueError:
            break
        end = num - 2 - i  # the last token of this occurrence
        n = 1
        while n < max_n and end - n >= 0 and token_ids[end - n] == token_ids[num - 1 - n]:
            n += 1
        if n > best_n:  # strictly longer: among equal lengths the latest (found first) stays
            best_n, best_end = n, end
    if best_n < min_n:
        return []
    return token_ids[best_end + 1 : best_end + 1 + k]
