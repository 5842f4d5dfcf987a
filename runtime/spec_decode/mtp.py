"""The "mtp" method: the checkpoint's multi-token-prediction head proposes the drafts (Qwen3-Next, Qwen3.5).

The head at position p reads the target's final hidden state h_p and the token at p + 1, and predicts
the token at p + 2 (runtime/models/qwen3_next/mtp.py). Its attention layer has a K/V cache of its own per
sequence (HeadKV, outside the page pool), which holds one entry per position the head has run on with
the target's hidden state:
- after each forward pass, `observe` keeps every row's hidden state with its position and input token;
- before the next step, `propose` first catches each running sequence's head up: the rows whose input is
  the sequence's token there (a rejected draft's row and those after it are not) and whose next token is
  known run through the head, past the positions it already holds (a replay after a rejected verify, or
  a recompute after preemption, repeats positions the head has). The last of them, at the sequence's
  second-to-last token, gives the first draft; each further draft runs the head on its own output and
  the previous draft. Those entries are dropped again (truncation) once the drafts are made: the next
  catch-up writes the positions from the target's hidden states.
- a sequence's cache lives while it runs: it is dropped when the sequence finishes or is preempted, and
  rebuilt from the recompute's rows. Positions read from the prefix cache never ran through the target
  here, so the head attends over the positions it saw; that makes drafts worse, never tokens different.
Exactness is the verify step's (runtime/spec_decode/verify.py): a draft is kept only where it equals the
token the target samples. Drafts are the head's greedy tokens (a point mass, as prompt lookup's are).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from runtime.gguf.config import gguf_path
from runtime.models.qwen3_next.mtp import HeadKV, require_mtp_tensors
from runtime.options import spell
from runtime.runner import plan_order
from runtime.scheduler import Batch
from runtime.sequence import Sequence
from runtime.spec_decode.draft import _argmax
from runtime.spec_decode.speculator import Speculator

# The config keys that give the number of MTP layers: Qwen3.5's, and vLLM's for Qwen3-Next (DeepSeek's
# spelling); absent, the checkpoint's mtp.layers.N say.
LAYER_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")


@dataclass
class _Rows:
    """One sequence's rows of a step: the first position, the input tokens, the hidden states."""

    start: int
    token_ids: list[int]
    hidden: torch.Tensor


@dataclass
class _HeadState:
    kv: list[HeadKV]  # per MTP layer (the first holds the positions fed by the target's hidden states)
    end: int = 0  # the position after the last one the head has run on
    last: torch.Tensor | None = None  # the head's output at position end - 1


def check_mtp_config(config) -> None:
    """What refuses "mtp" before anything loads: a model without heads, or what the head cannot run with."""
    if config.speculative is None or config.speculative.method != "mtp":
        return
    method = f'{spell("speculative_config")}: method "mtp"'
    instead = 'use {"method": "ngram", ...}'
    module, _, name = config.declaration.implementation.partition(":")
    if not hasattr(getattr(importlib.import_module(module), name), "load_mtp_head"):
        raise ValueError(f"{method} reads the multi-token-prediction heads of Qwen3-Next and Qwen3.5 checkpoints, "
                         f"and {config.declaration.architecture} has none; {instead}")
    if gguf_path(config.model) is not None:
        raise ValueError(f"{method} reads the head from safetensors checkpoints, not GGUF files; {instead}")
    require_mtp_tensors(config.model_dir)  # before the model loads, not after


class MTPSpeculator(Speculator):
    def __init__(self, engine_config, max_model_len: int, runner):
        super().__init__(engine_config.speculative, engine_config.cache.num_state_groups, max_model_len)
        self.model = runner.model
        configured = engine_config.hf_config.first(*LAYER_KEYS)
        self.head = self.model.load_mtp_head(engine_config.model_dir, int(configured) if configured else None,
                                             engine_config.checkpoint_quantization)
        # Under tensor parallelism the model's embedding and LM head are shards, whose forward passes are
        # collectives: the head uses whole copies (runtime/models/qwen3_next/mtp.py).
        vocabulary = self.head.vocabulary
        self.embed = self.head.embed_tokens or (vocabulary.embed if vocabulary else self.model.input_embeddings())
        self.compute_logits = vocabulary.compute_logits if vocabulary else self.model.compute_logits
        self.rotary = self.model.model.rotary
        self._rows: dict[str, _Rows] = {}
        self._heads: dict[str, _HeadState] = {}

    # After the forward pass ---------------------------------------------------------------------

    def observe(self, batch: Batch, runner) -> None:
        hidden, at = runner.last_hidden, 0
        for i in plan_order(batch):
            seq, n = batch.seqs[i], batch.num_new_tokens[i]
            start = seq.num_computed_tokens
            num_drafts = max(0, start + n - seq.num_tokens)
            ids = seq.token_ids[start : start + n - num_drafts] + seq.spec_token_ids[:num_drafts]
            if seq.grammar is None:  # a request with a grammar never speculates
                self._rows[seq.request_id] = _Rows(start, ids, hidden[at : at + n])
            at += n
        assert at == hidden.shape[0]

    # Before scheduling --------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, running: list[Sequence]) -> None:
        live = {seq.request_id for seq in running}
        for table in (self._rows, self._heads):
            for request_id in [r for r in table if r not in live]:
                del table[request_id]  # finished or preempted: its cache goes
        for seq in running:
            rows = self._rows.pop(seq.request_id, None)
            if rows is not None:
                self._catch_up(seq, rows)
        super().propose(running)

    def _catch_up(self, seq: Sequence, rows: _Rows) -> None:
        tokens = seq.token_ids
        # Rows whose input is the sequence's token there, and whose next token is known.
        usable = 0
        while (usable < len(rows.token_ids) and rows.start + usable + 1 < len(tokens)
               and rows.token_ids[usable] == tokens[rows.start + usable]):
            usable += 1
        state = self._heads.get(seq.request_id)
        if state is None:
            state = self._heads[seq.request_id] = _HeadState([HeadKV() for _ in self.head.layers])
        first = max(rows.start, state.end)  # positions the head holds already are the same again
        if first >= rows.start + usable:
            return
        skip = first - rows.start
        positions = torch.arange(first, rows.start + usable, device=rows.hidden.device)
        next_ids = torch.tensor(tokens[first + 1 : rows.start + usable + 1], device=rows.hidden.device)
        out = self._run(next_ids, rows.hidden[skip:usable], positions, state.kv[0], 0)
        state.end, state.last = rows.start + usable, out[-1:]

    def _run(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, kv, step: int):
        cos, sin = self.rotary(positions, hidden.dtype)
        return self.head(self.embed(token_ids), hidden, cos, sin, kv, step)

    @torch.inference_mode()
    def _guess(self, seq: Sequence, room: int) -> list[int]:
        state = self._heads.get(seq.request_id)
        if state is None or state.end != seq.num_tokens - 1:  # the head has not seen the last hidden state
            return []
        committed, hidden, drafts = [kv.length for kv in state.kv], state.last, []
        device = hidden.device
        for step in range(room):
            # Among the tokens the request may sample, as a draft model's drafts: any other would only be rejected.
            token = _argmax(self.compute_logits(hidden)[0], seq.params.allowed_token_ids)
            drafts.append(token)
            if step + 1 == room:
                break
            position = torch.tensor([state.end + step], device=device)  # the head last ran at end - 1
            layer = (step + 1) % len(state.kv)
            hidden = self._run(torch.tensor([token], device=device), hidden, position, state.kv[layer], step + 1)
        for kv, length in zip(state.kv, committed):
            kv.truncate(length)  # the drafts' entries go; the target's hidden states rewrite them
        return drafts
