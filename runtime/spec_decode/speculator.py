"""The engine's side of speculative decoding, per step: propose, borrow snapshot pages, settle. Pure Python.

Attention needs no rollback: a rejected draft's K and V sit past the sequence's computed length and are
overwritten by the tokens that follow. A state layer (Mamba-1, Mamba-2, Gated DeltaNet, short conv, the
state half of a parallel or shared-attention hybrid) folds each position into its one state, so a verify
step computes a sequence's last token and its k drafts position by position, as decoding would
(runtime/waves.py), and keeps the state after each of the first k positions in a page of its own (one page
id per state group per draft, borrowed from the free pages for the step; the pool must hold them besides a
sequence, which start-up checks). When all drafts hold, the sequence's state pages hold the state after
them; when draft j + 1 is rejected, the state kept after position j is copied back. Either way the
accepted tokens are computed: nothing is replayed.
"""

from __future__ import annotations

from typing import Any

from runtime.cache.manager import CacheManager
from runtime.scheduler import Batch
from runtime.sequence import Sequence
from runtime.spec_decode import ngram
from runtime.spec_decode.config import SpeculativeConfig
from runtime.spec_decode.verify import SpecCounters, num_accepted


# A verify step costs more than the decode it replaces (bench/speculative.py). So a request whose verify
# keeps fewer than half its drafts stops proposing for 4, 8, 16, ... MAX_PAUSE steps, and from then on
# proposes only on a match of prompt_lookup_max tokens (a short match that failed was likely a
# coincidence), until a verify keeps all its drafts. This changes which steps verify, never the tokens.
FIRST_PAUSE, MAX_PAUSE = 4, 64


def _back_off(seq: Sequence, accepted: int, num_drafts: int) -> None:
    pause = seq.spec_backoff[1]
    if 2 * accepted < num_drafts:
        pause = min(MAX_PAUSE, 2 * pause or FIRST_PAUSE)
        seq.spec_backoff = (pause, pause)
    elif accepted == num_drafts:
        seq.spec_backoff = (0, 0)


class Speculator:
    def __init__(self, config: SpeculativeConfig, num_state_groups: int, max_model_len: int, drafter: Any = None):
        self.config = config
        self.drafter = drafter  # a DraftProposer (runtime/spec_decode/draft.py) for a draft model, else prompt lookup
        self.num_state_groups = num_state_groups
        self.max_model_len = max_model_len
        self.counters = SpecCounters()
        self._extra: dict[str, int] = {}  # request id -> drafts to count as computed once appended

    # Before scheduling --------------------------------------------------------------------------

    def propose(self, running: list[Sequence]) -> None:
        for seq in running:
            seq.speculates = True
        rooms = [self._room(seq) for seq in running]
        if self.drafter is not None:
            for seq, drafts in zip(running, self.drafter.propose(running, rooms)):
                seq.spec_token_ids = drafts
            return
        for seq, room in zip(running, rooms):
            seq.spec_token_ids = self._guess(seq, room) if room else []

    def _guess(self, seq: Sequence, room: int) -> list[int]:
        """Up to `room` drafts for a sequence that may speculate (a subclass proposes otherwise)."""
        # After drafts failed, only the longest match proposes (see FIRST_PAUSE above).
        low = self.config.prompt_lookup_max if seq.spec_backoff[1] else self.config.prompt_lookup_min
        if seq.prompt_lookup is None:
            seq.prompt_lookup = ngram.PromptLookup()
        return seq.prompt_lookup.propose(seq.token_ids, room, low, self.config.prompt_lookup_max)

    def _room(self, seq: Sequence) -> int:
        """How many drafts `seq` may have this step (0: none)."""
        # A grammar would have to accept each draft before it is scored; such requests decode one at a time.
        # Drafts follow the last token only: a sequence still computing earlier ones (recomputed after
        # preemption) proposes once it has caught up.
        catching_up = seq.num_computed_tokens + 1 < seq.num_tokens
        if seq.grammar is not None or catching_up or seq.num_computed_tokens < len(seq.prompt_token_ids):
            return 0
        left, pause = seq.spec_backoff
        if left:
            seq.spec_backoff = (left - 1, pause)
            return 0
        room = min(self.config.num_speculative_tokens, self.max_model_len - seq.num_tokens - 1)
        if seq.params.max_tokens is not None:  # the last sampled token comes on top of the drafts
            room = min(room, seq.params.max_tokens - len(seq.output_token_ids) - 1)
        return max(0, room)

    def observe(self, batch: Batch, runner) -> None:
        """After the forward pass, before sampling: what a proposer reads from the step (the MTP head its
        hidden states); prompt lookup needs nothing."""

    # After scheduling ---------------------------------------------------------------------------

    def checkpoint(self, batch: Batch, cache: CacheManager) -> list[tuple[int, int]]:
        """Keep the drafts the budget left room for, and borrow for the step the pages that keep a drafted
        sequence's state after each of its positions but the last (one per state group per draft, wave-major:
        runtime.runner.plan_step reads them). Drafts the free pages cannot cover are dropped. Returns the page
        copies to run before the step: none (the states are kept during the forward pass)."""
        groups = self.num_state_groups
        for i, seq in enumerate(batch.seqs):
            n = batch.num_new_tokens[i]
            seq.spec_token_ids = seq.spec_token_ids[:max(0, seq.num_computed_tokens + n - seq.num_tokens)]
            if not seq.spec_token_ids or not groups:
                continue
            room = min(len(seq.spec_token_ids), cache.num_free_pages // groups)
            batch.num_new_tokens[i] -= len(seq.spec_token_ids) - room
            seq.spec_token_ids = seq.spec_token_ids[:room]
            seq.checkpoint_pages = cache.borrow(room * groups) if room else []
        return []

    # After the forward pass ---------------------------------------------------------------------

    def settle(self, batch: Batch, seqs: list[Sequence], tokens: list[list[int] | None]) -> tuple[list[int],
                                                                                                 list[tuple[int, int]]]:
        """Per sampled sequence, how many of its rows to keep; and the copies that restore rejected states.

        `tokens`: per sequence, the token sampled at each row (None where sampling failed). Each drafted
        sequence's count in `batch` becomes what the cache holds correctly after the step."""
        index = {id(seq): i for i, seq in enumerate(batch.seqs)}
        keep, restores = [], []
        for seq, sampled in zip(seqs, tokens):
            drafts = seq.spec_token_ids
            if not drafts:
                keep.append(1)
                continue
            i = index[id(seq)]
            if sampled is None:  # the request fails; its count must still stay within its tokens
                batch.num_new_tokens[i] -= len(drafts)
                keep.append(1)
                continue
            accepted = num_accepted(drafts, sampled)
            self.counters.observe(len(drafts), accepted)
            _back_off(seq, accepted, len(drafts))
            if seq.spec_counters is None:
                seq.spec_counters = SpecCounters()
            seq.spec_counters.observe(len(drafts), accepted)
            keep.append(accepted + 1)
            if self.num_state_groups and accepted < len(drafts):  # the state after the last accepted position
                groups = self.num_state_groups
                restores.extend(zip(seq.checkpoint_pages[accepted * groups:(accepted + 1) * groups], seq.state_pages))
            batch.num_new_tokens[i] -= len(drafts)  # the accepted drafts count once they are tokens
            self._extra[seq.request_id] = accepted
        return keep, restores

    def release(self, batch: Batch, cache: CacheManager) -> None:
        """After the step's copies ran: the pages that kept its states go back to the pool."""
        for seq in batch.seqs:
            cache.give_back(seq.checkpoint_pages)
            seq.checkpoint_pages = []

    def advance(self, seqs: list[Sequence]) -> None:
        """After the accepted drafts were appended: they are computed (their KV and state are in the cache)."""
        for seq in seqs:
            extra = self._extra.pop(seq.request_id, 0)
            if not seq.is_finished:
                seq.num_computed_tokens += extra
            seq.spec_token_ids = []

    def forget(self, request_id: str) -> None:
        """A request finished (or was aborted, or failed): the draft model's cache of it goes back to its pool."""
        if self.drafter is not None:
            self.drafter.free(request_id)
