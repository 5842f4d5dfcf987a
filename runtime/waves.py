"""The rows of a step's decode section, in waves. Pure Python.

A decode computes one generated token; a verify (speculative decoding) computes the last generated token
and its k drafts, which a state layer (Mamba, Gated DeltaNet, short conv) must fold into its state one
position after another, exactly as decoding them one at a time would. So the decode section is laid out
wave-major: wave i holds position i of every sequence that has one, and the sequences are sorted by their
number of rows, longest first, so that wave i is the first n_i sequences and a contiguous run of rows:

    sequences   A (t d1 d2)   B (t d1)   C (t)          counts 3, 2, 1
    rows        A0 B0 C0 | A1 B1 | A2                 waves 3, 2, 1 sequences

A state layer updates each wave with its decode kernel (the state pages are the first n_i of the
sequences'), and between waves keeps each continuing sequence's state in a page of its own, so that the
state after any accepted draft is there to resume from. Attention and every other layer see the rows as
independent decodes, each with its own position and length.
"""

from __future__ import annotations


def decode_waves(counts: list[int]) -> list[int]:
    """Sequences in each wave, given each decode-section sequence's rows (sorted, longest first)."""
    assert all(a >= b for a, b in zip(counts, counts[1:])), "decode sequences are sorted, longest first"
    return [sum(1 for n in counts if n > i) for i in range(counts[0])] if counts else []


def wave_rows(counts: list[int]) -> list[list[int]]:
    """Per decode-section sequence, the row of each of its positions."""
    rows: list[list[int]] = [[] for _ in counts]
    row = 0
    for n in decode_waves(counts):
        for seq in range(n):
            rows[seq].append(row)
            row += 1
    return rows


def row_sequences(counts: list[int]) -> list[int]:
    """The sequence of each row of the decode section, in row order."""
    return [seq for n in decode_waves(counts) for seq in range(n)]
