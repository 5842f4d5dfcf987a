"""The engine: requests in, one scheduler step and one forward pass at a time, outputs out.

`LLM.generate` drives it to completion; the server drives the same loop asynchronously.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from runtime import kernels
from runtime.cache.manager import CacheManager
from runtime.cache.prefix import PrefixCache, prefix_block_size
from runtime.lora.request import LoRARequest
from runtime.config import EngineConfig
from runtime.distributed.microbatch import MicroBatches, live_part
from runtime.distributed.runner import TensorParallelRunner
from runtime.loader import load_tokenizer
from runtime.models.interface import Feature, Status
from runtime.options import plural, spell
from runtime.outputs import CompletionOutput, Logprob, RequestOutput
from runtime.parallel import ParentRequest, child_id, child_params
from runtime.runner import ModelRunner, PromptLogits
from runtime.sampler import Sampler, SamplerOutput, top_logprobs
from runtime.sampling_params import SamplingParams
from runtime.scheduler import Batch, Scheduler, SchedulerLimits
from runtime.sequence import Sequence
from runtime.spec_decode.draft import DraftProposer
from runtime.spec_decode.rows import sample_verify_rows
from runtime.spec_decode.mtp import MTPSpeculator, check_mtp_config
from runtime.spec_decode.speculator import Speculator
from runtime.stats import (
    BATCH_BUCKETS,
    E2E_BUCKETS,
    ITL_BUCKETS,
    TTFT_BUCKETS,
    EngineStats,
    Histogram,
)
from runtime.structured_outputs.grammars import GrammarCompiler

logger = logging.getLogger("tandem")

Prompt = str | dict[str, Any]


def check_capabilities(config: EngineConfig) -> None:
    """Refuse what the model's declaration says it cannot do, with the declaration's own note."""
    decl = config.declaration
    caps = decl.capabilities

    def require(support, what: str) -> None:
        if support.status not in (Status.SUPPORTED, Status.PARTIAL):
            note = f": {support.note}" if support.note else ""
            raise ValueError(f"{decl.architecture} does not support {what} ({support.status.value}{note})")

    require(caps.engine, "the engine")
    if config.enable_prefix_caching:
        require(caps.feature(Feature.PREFIX_CACHING), "prefix caching")
    if config.tensor_parallel_size > 1:
        require(caps.feature(Feature.TENSOR_PARALLEL), "tensor parallelism")
    if config.speculative is not None:
        require(caps.feature(Feature.SPECULATIVE_DECODING), f"speculative decoding ({spell('speculative_config')})")
    if config.enable_lora:
        require(caps.feature(Feature.LORA), "LoRA adapters")
    if config.pipeline_parallel_size > 1:
        require(caps.feature(Feature.PIPELINE_PARALLEL), "pipeline parallelism")
    if config.enable_chunked_prefill:
        require(caps.feature(Feature.CHUNKED_PREFILL), f"chunked prefill (pass {spell('enable_chunked_prefill', False)})")


def eos_token_ids(config: EngineConfig, tokenizer) -> set[int]:
    ids = set()
    generation = config.model_dir / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def make_prefix_cache(config: EngineConfig) -> PrefixCache | None:
    if not config.enable_prefix_caching:
        return None
    decl = config.declaration
    chunk_size = decl.mamba_chunk_size(config.hf_config) if decl.has_state() else None
    return PrefixCache(config.cache, prefix_block_size(config.cache, chunk_size, config.attention_alignment))


@dataclass
class EngineCounters:
    """Running totals since start, for `Engine.stats()`; generation never reads them."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    # Finished requests by finish reason: "stop", "length", "abort" or "error".
    finished: Counter[str] = field(default_factory=Counter)
    # Preemptions of requests that have finished; those of live ones are on their sequences.
    preemptions_of_finished: int = 0
    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    inter_token_latency: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e_request_latency: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    batch_size: Histogram = field(default_factory=lambda: Histogram(BATCH_BUCKETS))


@dataclass
class Timing:
    """When a request arrived and when it last got a token (time.monotonic), for the latency histograms."""

    arrival: float
    last_token: float | None = None


class Engine:
    def __init__(self, config: EngineConfig):
        check_capabilities(config)
        # The kernel binding is per process: an engine that fails to start must not leave the
        # engines built before it on its backend (a failed CUDA engine broke an earlier CPU one).
        binding = kernels.snapshot()
        try:
            self._start(config)
        except BaseException:
            kernels.restore(binding)
            if "runner" in self.__dict__:
                self.shutdown()
            raise

    def shutdown(self) -> None:
        """Release what the engine holds outside this process (a tensor-parallel engine's shards on the other ranks)."""
        self.runner.shutdown()

    def _start(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config)
        torch.manual_seed(config.seed)
        check_mtp_config(config)
        self.runner = ModelRunner(config) if config.world_size == 1 else TensorParallelRunner(config)
        self.cache = CacheManager(config.cache, self.runner.num_pages, prefix=make_prefix_cache(config))
        self.max_model_len = self._fit_max_model_len()
        limits = SchedulerLimits(config.max_num_seqs, config.derived_max_num_batched_tokens,
                                 config.enable_chunked_prefill, config.max_loras if config.enable_lora else 0)
        if not config.enable_chunked_prefill and limits.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"{spell('max_num_batched_tokens', limits.max_num_batched_tokens)} is smaller than "
                f"{spell('max_model_len', self.max_model_len)}; without chunked prefill a whole prompt must fit "
                "in one step"
            )
        self.scheduler = Scheduler(self.cache, limits)
        self.sampler = Sampler()
        self.eos_token_ids = eos_token_ids(config, self.tokenizer)
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))
        self._ids = itertools.count()
        self._seqs: dict[str, Sequence] = {}
        self._parents: dict[str, ParentRequest] = {}
        self._generators: dict[str, torch.Generator | None] = {}
        self._timings: dict[str, Timing] = {}
        self.counters = EngineCounters()
        spec = config.speculative
        drafter = DraftProposer(config, self.tokenizer) if spec is not None and spec.model is not None else None
        self.speculator = None if spec is None else Speculator(spec, config.cache.num_state_groups, self.max_model_len,
                                                               drafter)
        if spec is not None and spec.method == "mtp":
            self.speculator = MTPSpeculator(config, self.max_model_len, self.runner)
        # Micro-batches in flight, one per stage; one at a time with a draft model or an MTP head, whose proposers
        # keep a cache per running request and drop those they are not asked about (the ones in flight would be).
        pp = config.pipeline_parallel_size
        one_at_a_time = drafter is not None or isinstance(self.speculator, MTPSpeculator)
        self.microbatches = MicroBatches(self, depth=1 if one_at_a_time else pp) if pp > 1 else None

    def _fit_max_model_len(self) -> int:
        layout, wanted = self.config.cache, self.config.derived_max_model_len
        if self.cache.num_pages >= layout.pages_per_sequence(wanted):
            return wanted
        blocks = (self.cache.num_pages - layout.num_state_groups) // max(1, layout.num_attention_groups)
        fits = blocks * (layout.block_size or 0)
        if self.config.max_model_len is not None or fits < 1:
            # A pool too small for even one block of every layer has no max_model_len to suggest.
            lower = f", or lower {spell('max_model_len')} to {fits} or less" if fits >= 1 else ""
            raise ValueError(
                f"the page pool ({plural(self.cache.num_pages, 'page')}) cannot hold one sequence of {wanted} "
                f"tokens ({spell('max_model_len', wanted)}), which needs "
                f"{plural(layout.pages_per_sequence(wanted), 'page')}: raise {spell('kv_cache_memory')} or "
                f"{spell('num_pages')}{lower}"
            )
        logger.warning("max_model_len lowered from %d to %d tokens to fit the page pool", wanted, fits)
        return fits

    # Requests -----------------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt given as text or as {"prompt_token_ids": [...]}."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        raise ValueError('a prompt is a string or {"prompt_token_ids": [...]}')

    def validate(self, token_ids: list[int], params: SamplingParams | None = None) -> None:
        """Refuse a request that could never run, before it takes any page."""
        if not token_ids:
            raise ValueError("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, more than fits in "
                f"{spell('max_model_len', self.max_model_len)} with room for one new token; shorten the prompt "
                f"or raise {spell('max_model_len')}"
            )
        vocab = self.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        if params is not None:
            for name, ids in params.token_ids_to_check().items():
                bad = [t for t in ids if not 0 <= t < vocab]
                if bad:
                    raise ValueError(f"{name}: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
            params.check_some_token_allowed(self.eos_token_ids)
            if params.seed is not None and not -(2**63) <= params.seed + params.n - 1 < 2**64:
                raise ValueError(f"seed {params.seed} is out of range; use a 64-bit integer")
            for name in ("logprobs", "prompt_logprobs"):
                value = getattr(params, name)
                if value is not None and value > self.config.max_logprobs:
                    raise ValueError(f"{name}={value} is more than {spell('max_logprobs', self.config.max_logprobs)}"
                                     f"; ask for fewer, or raise {spell('max_logprobs')}")
            if params.structured_outputs is not None:
                # Compiled (or found in the cache) now, so a bad schema is refused before anything is queued.
                self.grammars.compile(params.structured_outputs)

    def add_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
                    stream: bool = False, lora_request: LoRARequest | None = None) -> str:
        """Queue a request. With `stream`, every step that advances it returns an output, not only the last;
        with `lora_request`, the request runs through that LoRA adapter (checked and loaded now)."""
        text, token_ids = self.tokenize(prompt)
        self.validate(token_ids, params)
        self.add_lora(lora_request)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._seqs or request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.n == 1:
            self._add_seq(Sequence(request_id, token_ids, params, prompt=text, stream=stream,
                                   lora_request=lora_request))
            return request_id
        children = [Sequence(child_id(request_id, i), token_ids, child_params(params, i), prompt=text, stream=stream,
                             parent_id=request_id, index=i, lora_request=lora_request) for i in range(params.n)]
        self._parents[request_id] = ParentRequest(request_id, children)
        for seq in children:
            self._add_seq(seq)
        return request_id

    def add_lora(self, lora_request: LoRARequest | None) -> None:
        """Read and check an adapter now (a ValueError naming it if it does not fit); None: nothing to do."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if self.runner.lora is None:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r}: the engine was started without LoRA; "
                             f"pass {spell('enable_lora', True)}")
        self.runner.lora.add(lora_request)

    def remove_lora(self, lora_id: int) -> None:
        """Forget an adapter's checked copy and free its slot (requests still using it read it again)."""
        if self.runner.lora is not None:
            self.runner.lora.remove(lora_id)

    def _add_seq(self, seq: Sequence) -> None:
        params = seq.params
        self._seqs[seq.request_id] = seq
        self._generators[seq.request_id] = (
            torch.Generator(device=self.runner.device).manual_seed(params.seed) if params.seed is not None else None
        )
        self._timings[seq.request_id] = Timing(time.monotonic())
        if params.structured_outputs is not None:
            seq.grammar = self.grammars.matcher(params.structured_outputs)
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]
        self.scheduler.add(seq)
        self.counters.prompt_tokens += len(seq.prompt_token_ids)

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its pages; unknown or finished ids are ignored."""
        parent = self._parents.pop(request_id, None)
        if parent is not None:
            for child in parent.children:
                self.abort(child.request_id)
            return
        seq = self._seqs.get(request_id)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, "abort")
            self._forget(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.microbatches)

    # The step -----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; return outputs of finished and streaming requests. (Pipeline
        stages: start micro-batches until enough are in flight, and land the oldest.)

        An error in one request's sampling or post-processing ends that request alone, with finish
        reason "error"; the others in the step go on as if it had not been there. An error in the
        forward pass raises: the batch ran as one, so no single request can be blamed.
        """
        if self.microbatches is not None:
            return self.microbatches.step()  # several steps in flight through the pipeline's stages
        batch = self._schedule()
        return self._land(batch, self.runner.run(batch)) if batch else []

    def _schedule(self, busy: frozenset[str] = frozenset(), max_seqs: int | None = None) -> Batch:
        """The next step's batch, its pages ready; `busy` and `max_seqs`: see Scheduler.schedule."""
        if self.speculator is not None:
            self.speculator.propose([s for s in self.scheduler.running if s.request_id not in busy])
        batch = self.scheduler.schedule(busy, max_seqs)
        assert batch or busy or not self.scheduler.has_unfinished(), "the scheduler made no progress"
        if not batch:
            return batch
        self._copy_pages()  # cached snapshots into the states of sequences that resume from them
        if self.speculator is not None:
            self.cache.copies.extend(self.speculator.checkpoint(batch, self.cache))
            self._copy_pages()  # drafted sequences' states, in case a draft is rejected
        self.counters.batch_size.observe(len(batch.seqs))
        return batch

    def _land(self, batch: Batch, results: tuple[list[Sequence], torch.Tensor, list[PromptLogits]]
              ) -> list[RequestOutput]:
        """Sample the step's logits and account for it: the outputs of its requests."""
        seqs, logits, prompt_logits = results
        if self.speculator is not None:
            self.speculator.observe(batch, self.runner)  # the MTP head reads the step's hidden states
        if any(seq.is_finished for seq in batch.seqs):  # aborted while the step was in flight (micro-batches)
            if self.speculator is not None:
                self.speculator.release(batch, self.cache)
            batch, seqs, logits, prompt_logits = live_part(batch, seqs, logits, prompt_logits)
        verified = self._verify(batch, seqs, logits)
        self.scheduler.update(batch)
        self._copy_pages()  # rejected drafts' states restored; states snapshotted at block boundaries
        if self.speculator is not None:
            self.speculator.release(batch, self.cache)
        for chunk in prompt_logits:
            self._add_prompt_logprobs(chunk)
        if not seqs:
            return []
        sampled = verified if verified is not None else [[row] for row in self._sample(seqs, logits)]
        now = time.monotonic()
        outputs = []
        for seq, rows in zip(seqs, sampled):
            output = self._postprocess(seq, rows, now)
            if output is not None:
                outputs.append(output)
        if self.speculator is not None:
            self.speculator.advance(seqs)
        return outputs

    def _verify(self, batch: Batch, seqs: list[Sequence], logits: torch.Tensor) -> list[list] | None:
        """With drafts in the step: per sequence, the rows it keeps (runtime/spec_decode/verify.py)."""
        if self.speculator is None or not any(seq.spec_token_ids for seq in seqs):
            return None
        rows = sample_verify_rows(self, seqs, logits)
        tokens = [None if isinstance(r, Exception) else [row[0] for row in r] for r in rows]
        keep, restores = self.speculator.settle(batch, seqs, tokens)
        self.cache.copies.extend(restores)  # before any snapshot the update queues
        return [[r] if isinstance(r, Exception) else r[:k] for r, k in zip(rows, keep)]

    def _copy_pages(self) -> None:
        copies = self.cache.take_copies()
        if copies:
            self.runner.copy_pages(copies)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's reset_prefix_cache); requests in flight keep their pages."""
        self.cache.reset_prefix_cache()
        return True

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[tuple | Exception]:
        """Per sequence, (token, top logprobs, sampled logprob), or the error that made it unsampleable.

        The whole batch is sampled at once; if that fails, each row is sampled alone (its seeded
        generator rewound first), so a row that cannot be sampled fails alone and the others get
        the very tokens they would have got.
        """
        generators = [self._generators[s.request_id] for s in seqs]
        states = [g.get_state() if g is not None else None for g in generators]
        try:
            return _rows(self._sample_rows(seqs, logits, generators))
        except Exception:
            # Each request that then fails alone logs its own line; the traceback is for debugging only.
            logger.debug("sampling the batch of %d failed; sampling each request alone", len(seqs), exc_info=True)
        for generator, state in zip(generators, states):
            if generator is not None:
                generator.set_state(state)
        rows: list[tuple | Exception] = []
        for i, seq in enumerate(seqs):
            try:
                rows += _rows(self._sample_rows([seq], logits[i : i + 1], generators[i : i + 1]))
            except Exception as err:
                rows.append(err)
        return rows

    def _sample_rows(self, seqs: list[Sequence], logits: torch.Tensor,
                     generators: list[torch.Generator | None]) -> SamplerOutput:
        grammars = [s.grammar for s in seqs] if any(s.grammar is not None for s in seqs) else None
        return self.sampler(logits, [s.params for s in seqs], generators, [self._banned(s) for s in seqs],
                            [(s.prompt_token_ids, s.output_token_ids) for s in seqs], grammars)

    def _add_prompt_logprobs(self, chunk: PromptLogits) -> None:
        """Logprobs of the prompt tokens that `chunk`'s positions predict; positions recomputed after a
        preemption were counted the first time."""
        seq = chunk.seq
        logprobs = chunk.logits.to(torch.float32).log_softmax(dim=-1)
        for row, target in enumerate(range(chunk.start + 1, chunk.start + 1 + len(logprobs))):
            if target == len(seq.prompt_logprobs):
                top = top_logprobs(logprobs[row], seq.params.prompt_logprobs, seq.prompt_token_ids[target])
                seq.prompt_logprobs.append(self._decoded(top))

    def _decoded(self, top: dict[int, Logprob]) -> dict[int, Logprob]:
        for token, logprob in top.items():
            logprob.decoded_token = self.tokenizer.decode([token])
        return top

    def _postprocess(self, seq: Sequence, rows: list[tuple | Exception], now: float) -> RequestOutput | None:
        """Append the sampled tokens (several when drafts were accepted) and check the stops after each; an
        error here ends this request alone."""
        try:
            for row in rows:
                if isinstance(row, Exception):
                    raise row
                self._append(seq, *row)
                self._observe_token(seq, now)
                if seq.is_finished:
                    break
            output = self._emit(seq)
        except Exception as err:
            # One line per failed request, however many fail; the traceback only when debugging.
            logger.warning("request %s failed: %s: %s", seq.request_id, type(err).__name__, err)
            logger.debug("request %s failed", seq.request_id, exc_info=err)
            return self._fail(seq, f"{type(err).__name__}: {err}")
        if seq.is_finished:
            self._forget(seq)
        return output

    def _fail(self, seq: Sequence, reason: str) -> RequestOutput:
        """End `seq` with finish reason "error", free its pages, and make its last output."""
        if not seq.is_finished:
            self.scheduler.finish(seq, "error")
        seq.finish_reason = "error"
        completion = CompletionOutput(seq.index, "", list(seq.output_token_ids), finish_reason="error")
        if seq.parent_id is not None:
            output = self._parents[seq.parent_id].update(seq, completion, error=reason)
        else:
            output = RequestOutput(seq.request_id, seq.prompt, list(seq.prompt_token_ids), [completion],
                                   finished=True, num_preemptions=seq.num_preemptions,
                                   num_cached_tokens=seq.num_cached_tokens, error=reason)
        self._forget(seq)
        return output

    def _banned(self, seq: Sequence) -> list[int]:
        if len(seq.output_token_ids) >= seq.params.min_tokens:
            return []
        if seq.grammar is not None and seq.grammar.can_only_end():
            return []  # the structured output is complete: it ends now, however few tokens it has
        return sorted(set(seq.params.stop_token_ids) | (set() if seq.params.ignore_eos else self.eos_token_ids))

    def _append(self, seq: Sequence, token: int, top: dict[int, Logprob] | None, logprob: float | None) -> None:
        if seq.grammar is not None:
            seq.grammar.accept(token)
        seq.output_token_ids.append(token)
        self.counters.generated_tokens += 1
        if top is not None:
            seq.logprobs.append(self._decoded(top))
            seq.cumulative_logprob += logprob
        stop = self._stop(seq, token)
        if stop is not None:
            self.scheduler.finish(seq, *stop)

    def _stop(self, seq: Sequence, token: int) -> tuple[str, int | str | None] | None:
        """(finish reason, stop reason) if `token` ends the sequence, else None."""
        params = seq.params
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop", None
        if token in params.stop_token_ids:
            return "stop", token
        if seq.grammar is not None and seq.grammar.finished:
            return "stop", None  # the structured output is complete: nothing more may follow
        if params.stop:
            stop = self._find_stop_string(seq)
            if stop is not None:
                return "stop", stop
        if params.max_tokens is not None and len(seq.output_token_ids) >= params.max_tokens:
            return "length", None
        if seq.num_tokens >= self.max_model_len:
            return "length", None
        return None

    def _find_stop_string(self, seq: Sequence) -> str | None:
        """The earliest stop string in the text so far; the text is cut there."""
        text = self.decode(seq)
        found = [(text.find(s), s) for s in seq.params.stop if s in text]
        if not found:
            return None
        index, stop = min(found)
        seq.text = text[: index + len(stop)] if seq.params.include_stop_str_in_output else text[:index]
        return stop

    def decode(self, seq: Sequence) -> str:
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=seq.params.skip_special_tokens)

    def _emit(self, seq: Sequence) -> RequestOutput | None:
        """The output this step gives for `seq`'s request: every step while streaming, else once finished."""
        if seq.parent_id is not None:
            return self._parents[seq.parent_id].update(seq, self._completion(seq))
        return self.output(seq) if seq.is_finished or seq.stream else None

    def output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(seq.request_id, seq.prompt, list(seq.prompt_token_ids), [self._completion(seq)],
                             finished=seq.is_finished, num_preemptions=seq.num_preemptions,
                             num_cached_tokens=seq.num_cached_tokens,
                             prompt_logprobs=list(seq.prompt_logprobs) if seq.params.prompt_logprobs is not None
                             else None, spec_decode=copy.deepcopy(seq.spec_counters))

    def _completion(self, seq: Sequence) -> CompletionOutput:
        text = seq.text if seq.text is not None else self.decode(seq)
        return CompletionOutput(
            index=seq.index,
            text=text,
            token_ids=list(seq.output_token_ids),
            cumulative_logprob=seq.cumulative_logprob if seq.params.logprobs is not None else None,
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )

    def _observe_token(self, seq: Sequence, now: float) -> None:
        timing = self._timings[seq.request_id]
        if timing.last_token is None:
            self.counters.time_to_first_token.observe(now - timing.arrival)
        else:
            self.counters.inter_token_latency.observe(now - timing.last_token)
        timing.last_token = now

    def _forget(self, seq: Sequence) -> None:
        counters = self.counters
        counters.finished[seq.finish_reason] += 1
        counters.preemptions_of_finished += seq.num_preemptions
        timing = self._timings.pop(seq.request_id, None)
        if timing is not None and seq.finish_reason in ("stop", "length"):
            counters.e2e_request_latency.observe(time.monotonic() - timing.arrival)
        self._seqs.pop(seq.request_id, None)
        self._generators.pop(seq.request_id, None)
        if self.speculator is not None:
            self.speculator.forget(seq.request_id)
        parent = self._parents.get(seq.parent_id) if seq.parent_id is not None else None
        if parent is not None and all(child.is_finished for child in parent.children):
            del self._parents[seq.parent_id]

    # What the engine reports --------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """A frozen snapshot of the engine's state and totals since start (for /metrics and tests)."""
        counters, scheduler = self.counters, self.scheduler
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_pages_used=self.cache.num_pages - self.cache.num_free_pages,
            num_pages_total=self.cache.num_pages,
            num_preemptions=counters.preemptions_of_finished + sum(s.num_preemptions for s in self._seqs.values()),
            prompt_tokens=counters.prompt_tokens,
            generated_tokens=counters.generated_tokens,
            finished=dict(counters.finished),
            time_to_first_token=counters.time_to_first_token.snapshot(),
            inter_token_latency=counters.inter_token_latency.snapshot(),
            e2e_request_latency=counters.e2e_request_latency.snapshot(),
            batch_size=counters.batch_size.snapshot(),
            prefix_cache_queries=self.cache.num_queried_tokens,
            prefix_cache_hits=self.cache.num_hit_tokens,
            spec_decode=copy.deepcopy(self.speculator.counters) if self.speculator is not None else None,
        )

    @property
    def vocab_size(self) -> int:
        return self.runner.model.config.vocab_size


def _rows(sampled: SamplerOutput) -> list[tuple]:
    return list(zip(sampled.token_ids, sampled.logprobs, sampled.sampled_logprobs))
