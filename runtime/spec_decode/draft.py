"""The draft model method: a second, smaller model with the same tokenizer proposes each step's drafts.

The draft model runs on the same engine code as the model (any architecture, hybrid or not), in a page pool
of its own laid out from its own declarations. Per drafted request it keeps a shadow sequence whose cache
follows the request's tokens: each step the shadow computes the tokens it has not seen (the prompt at first,
then the tokens the last verify kept), which gives the first draft, then decodes its own drafts one at a
time. Drafts are the draft model's argmax, a point mass, so verify.py's acceptance stays exact for greedy
and sampled requests alike; the draft model's numerics decide how many drafts hold, never the tokens.

Rollback of the draft's own cache, at the next proposal, once the verify has settled the request's tokens:
attention is cut back to the longest prefix the shadow computed that the request's tokens still have. A
state layer has folded the drafts it was fed, so its state pages were copied to checkpoint pages (the
shadow's own, held while it lives) after the catch-up and before the first draft was fed: when a fed draft
was rejected, the checkpoint is copied back and the accepted tokens are computed again with the next catch-up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from runtime import kernels
from runtime.cache.layout import CacheLayout
from runtime.cache.manager import CacheManager
from runtime.cache.pool import default_cache_bytes
from runtime.config import EngineConfig
from runtime.hf_config import ConfigError
from runtime.options import plural, spell
from runtime.runner import ModelRunner, resolve_device
from runtime.sampling_params import SamplingParams
from runtime.scheduler import Batch
from runtime.sequence import Sequence

logger = logging.getLogger("tandem")


def draft_engine_config(target: EngineConfig, num_pages: int | None = None) -> EngineConfig:
    """The draft model's config: the model's dtype, device, kernels and lengths, a pool of its own."""
    spec = target.speculative
    assert spec is not None and spec.model is not None
    try:
        return EngineConfig(spec.model, dtype=target.dtype, device=target.device, kernel_backend=target.kernel_backend,
                            max_model_len=target.derived_max_model_len, max_num_seqs=target.max_num_seqs,
                            num_pages=num_pages, enforce_eager=target.enforce_eager, threads=target.derived_threads,
                            mamba_ssm_dtype=target.mamba_ssm_dtype)
    except ConfigError as err:
        raise ConfigError(f"{spell('speculative_config')}: the draft model {spec.model}: {err}") from None


def draft_pages_per_sequence(layout: CacheLayout, max_model_len: int) -> int:
    """Page ids of the draft pool a sequence of `max_model_len` tokens holds, its state checkpoints included."""
    return layout.pages_per_sequence(max_model_len) + layout.num_state_groups


def draft_pool_pages(layout: CacheLayout, max_num_seqs: int, max_model_len: int, budget: int) -> int:
    """The draft pool: every sequence at full length, or what `budget` bytes (the model's pool budget) hold."""
    return min(max_num_seqs * draft_pages_per_sequence(layout, max_model_len), budget // layout.bytes_per_page_id)


@dataclass
class Shadow:
    """A request as the draft model's cache holds it: its tokens, then the drafts fed to the draft model."""

    seq: Sequence
    checkpoint_pages: list[int] = field(default_factory=list)
    checkpoint_at: int | None = None  # computed tokens the checkpoint's state holds; None: no checkpoint
    base: int = 0  # the request's tokens when `drafts` were proposed
    drafts: list[int] = field(default_factory=list)


class DraftProposer:
    def __init__(self, target: EngineConfig, tokenizer):
        probe = draft_engine_config(target)
        device = resolve_device(target.device)
        budget = target.kv_cache_memory or default_cache_bytes(device)
        max_model_len = target.derived_max_model_len
        pages = draft_pool_pages(probe.cache, target.max_num_seqs, max_model_len, budget)
        needed = draft_pages_per_sequence(probe.cache, max_model_len)
        if pages < needed:
            raise ValueError(
                f"{spell('speculative_config')}: the draft model's pool ({plural(pages, 'page')} of "
                f"{probe.cache.bytes_per_page_id:,} B) cannot hold one sequence of {max_model_len} tokens, which "
                f"needs {plural(needed, 'page')}: the draft's pool takes {spell('kv_cache_memory')} bytes again "
                f"(without it, what the device has free after the model's pool); raise it or lower "
                f"{spell('max_model_len')}")
        self.config = draft_engine_config(target, pages)
        _check_tokenizer(self.config, tokenizer)
        binding = kernels.snapshot()  # the draft's runner binds the kernels again; the model's binding stays
        self.runner = ModelRunner(self.config)
        kernels.restore(binding)
        self.cache = CacheManager(self.config.cache, self.runner.num_pages)
        self.groups = self.config.cache.num_state_groups
        self._shadows: dict[str, Shadow] = {}
        logger.info("draft model %s: %d pages of its own", target.speculative.model, self.runner.num_pages)

    def propose(self, seqs: list[Sequence], rooms: list[int]) -> list[list[int]]:
        """Per sequence, up to its room of drafts (none where the room is 0 or the draft pool is full)."""
        live = {seq.request_id for seq in seqs}
        for request_id in [r for r in self._shadows if r not in live]:
            self.free(request_id)
        drafts: list[list[int]] = [[] for _ in seqs]
        active = []
        for i, (seq, room) in enumerate(zip(seqs, rooms)):
            if room < 1:
                continue
            shadow = self._shadows.get(seq.request_id)
            if shadow is not None and shadow.base == seq.num_tokens and len(shadow.drafts) >= room:
                drafts[i] = shadow.drafts[:room]  # proposed already for these tokens (greedy: the same again)
                continue
            shadow = self._sync(seq)
            if self._reserve(shadow, room):
                active.append((i, shadow, room))
        self._copy_pages()
        if active:
            self._draft(seqs, active, drafts)
        return drafts

    def free(self, request_id: str) -> None:
        shadow = self._shadows.pop(request_id, None)
        if shadow is not None:
            self.cache.free(shadow.seq)
            self.cache.give_back(shadow.checkpoint_pages)

    # Keeping the draft's cache on the request's tokens ------------------------------------------

    def _sync(self, seq: Sequence) -> Shadow:
        """The request's shadow, its cache cut back to what still holds for the request's tokens."""
        shadow = self._shadows.get(seq.request_id)
        if shadow is None:
            shadow = self._shadows[seq.request_id] = Shadow(_shadow_seq(seq))
        s, tokens = shadow.seq, seq.token_ids
        held = _common_prefix(s.token_ids[:s.num_computed_tokens], tokens)
        if not self.groups:
            s.num_computed_tokens = min(held, len(tokens) - 1)  # at least one token left to compute
        elif s.num_computed_tokens > held or s.num_computed_tokens >= len(tokens):
            at = shadow.checkpoint_at
            if at is not None and at <= held and at < len(tokens):
                self.cache.copies.extend(zip(shadow.checkpoint_pages, s.state_pages))
                s.num_computed_tokens = at
            else:  # nothing to go back to: compute the request again from its first token
                self.cache.free(s)
                s.num_computed_tokens = 0
        s.output_token_ids = tokens[len(s.prompt_token_ids):]
        shadow.checkpoint_at, shadow.drafts, shadow.base = None, [], seq.num_tokens
        return shadow

    def _reserve(self, shadow: Shadow, room: int) -> bool:
        """Pages for the catch-up and the `room - 1` drafts fed back, and the checkpoint; False if none are free."""
        s = shadow.seq
        num_new = s.num_uncomputed_tokens + room - 1
        checkpoint = self.groups if not shadow.checkpoint_pages else 0
        if self.cache.pages_needed(s, num_new) + checkpoint > self.cache.num_free_pages:
            return False
        self.cache.allocate(s, num_new)
        if checkpoint:
            shadow.checkpoint_pages = self.cache.borrow(checkpoint)
        return True

    def _copy_pages(self) -> None:
        copies = self.cache.take_copies()
        if copies:
            self.runner.copy_pages(copies)

    # Drafting -----------------------------------------------------------------------------------

    def _draft(self, seqs: list[Sequence], active: list[tuple[int, Shadow, int]], drafts: list[list[int]]) -> None:
        """The catch-up step gives every active request its first draft; each later step feeds the last
        draft back to the requests with room for more."""
        self._step(seqs, active, [a[1].seq.num_uncomputed_tokens for a in active])
        for _, shadow, room in active:
            if self.groups and room > 1:  # the state before any draft is fed
                self.cache.copies.extend(zip(shadow.seq.state_pages, shadow.checkpoint_pages))
                shadow.checkpoint_at = shadow.seq.num_computed_tokens
        self._copy_pages()
        for r in range(1, max(room for *_, room in active)):
            more = [a for a in active if a[2] > r]
            for _, shadow, _ in more:
                shadow.seq.output_token_ids.append(shadow.drafts[-1])
            self._step(seqs, more, [1] * len(more))
        for i, shadow, _ in active:
            drafts[i] = list(shadow.drafts)

    def _step(self, seqs: list[Sequence], active: list[tuple[int, Shadow, int]], counts: list[int]) -> None:
        """One forward pass of the draft model; each shadow gets its argmax as its next draft."""
        shadows = [a[1] for a in active]
        sampled, logits = self.runner.execute(Batch([s.seq for s in shadows], counts))
        row = {id(seq): i for i, seq in enumerate(sampled)}
        for (i, shadow, _), n in zip(active, counts):
            shadow.seq.num_computed_tokens += n
            shadow.drafts.append(_argmax(logits[row[id(shadow.seq)]], seqs[i].params.allowed_token_ids))


def _argmax(logits: torch.Tensor, allowed: tuple[int, ...] | None) -> int:
    # A draft the request may never sample would only be rejected.
    if allowed is None:
        return int(logits.argmax())
    return allowed[int(logits[list(allowed)].argmax())]


def _shadow_seq(seq: Sequence) -> Sequence:
    shadow = Sequence(seq.request_id, list(seq.prompt_token_ids), SamplingParams())
    # The draft computes generated tokens as the model recomputes them after preemption (runner._kind).
    shadow.speculates = True
    return shadow


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _check_tokenizer(config: EngineConfig, tokenizer) -> None:
    """A draft directory that carries a tokenizer must carry the model's (the vocabulary sizes matched already)."""
    from runtime.loader import TOKENIZER_FILES, load_tokenizer

    if not any((config.model_dir / name).is_file() for name in TOKENIZER_FILES):
        return
    if load_tokenizer(config).get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"{spell('speculative_config')}: the draft model {config.model} has another tokenizer than "
                         "the model's (its vocabulary maps tokens to other ids); a draft model must share the "
                         "model's tokenizer")
