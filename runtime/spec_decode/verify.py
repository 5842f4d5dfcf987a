"""What a verify step keeps, and vLLM's speculative counters. Pure Python.

The model scores the last accepted token and the k drafts in one step: row i of the result is the token
the request samples after the draft's first i tokens. Drafts are accepted while each equals the token
sampled before it; the first mismatch is replaced by the sampled token, and when all k match, row k
gives one more (the bonus token). Greedy, that is exactly the tokens of decoding one at a time. Sampling,
a draft from prompt lookup is a point mass q = 1 on d: standard speculative sampling accepts d with
probability min(1, p(d) / q(d)) = p(d), and on rejection samples the residual max(0, p - q) normalised,
which is p without d. Sampling x ~ p and accepting when x == d does both at once: P(keep d) = p(d), and
a rejected row's x is distributed as p given x != d. So each row is sampled as a plain decode would be
(its own seeded generator, in order), and the distribution of the output is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def num_accepted(drafts: list[int], sampled: list[int]) -> int:
    """How many leading drafts equal the token sampled before them (`sampled` has one row more)."""
    assert len(sampled) == len(drafts) + 1
    n = 0
    while n < len(drafts) and sampled[n] == drafts[n]:
        n += 1
    return n


@dataclass
class SpecCounters:
    """vLLM's spec_decode counters: drafts (verify steps of a request), draft tokens, accepted tokens, and
    the accepted tokens at each draft position (position i counts requests whose first i + 1 drafts held)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += accepted
        while len(self.accepted_per_pos) < num_drafted:
            self.accepted_per_pos.append(0)
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
