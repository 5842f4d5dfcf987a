"""`LLM`: offline batched generation, shaped like vLLM's."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence as Seq

from tqdm.auto import tqdm

from runtime.config import EngineConfig
from runtime.engine import Engine, Prompt
from runtime.outputs import RequestOutput
from runtime.sampling_params import SamplingParams

DEFAULT_MODEL = Path(__file__).parent / "default_model"


class LLM:
    """Load a model once, then generate for many prompts with continuous batching.

    >>> llm = LLM()  # the small hybrid model that ships with Tandem
    >>> out = llm.generate(["The page pool"], SamplingParams(temperature=0, max_tokens=16))
    >>> out[0].outputs[0].text
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        dtype: str = "auto",
        block_size: int | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        enable_chunked_prefill: bool = True,
        enable_prefix_caching: bool = False,
        kv_cache_memory_bytes: int | None = None,
        num_pages: int | None = None,
        tensor_parallel_size: int = 1,
        mamba_ssm_dtype: str = "auto",
        seed: int = 0,
        device: str = "auto",
        kernel_backend: str = "auto",
    ):
        config = EngineConfig(
            model=str(model if model is not None else DEFAULT_MODEL),
            dtype=dtype,
            block_size=block_size,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
            enable_prefix_caching=enable_prefix_caching,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            num_pages=num_pages,
            tensor_parallel_size=tensor_parallel_size,
            mamba_ssm_dtype=mamba_ssm_dtype,
            seed=seed,
            device=device,
            kernel_backend=kernel_backend,
        )
        self.engine = Engine(config)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (as vLLM's); requests in flight keep their pages. True when done."""
        return self.engine.reset_prefix_cache()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        # Tokenize and validate every prompt before queueing any, so a bad one leaves nothing half-done.
        tokenized = []
        for prompt, p in zip(prompts, params):
            text, token_ids = self.engine.tokenize(prompt)
            self.engine.validate(token_ids, p)
            tokenized.append({"prompt": text, "prompt_token_ids": token_ids})
        ids = [self.engine.add_request(prompt, p) for prompt, p in zip(tokenized, params)]
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while self.engine.has_unfinished():
                for output in self.engine.step():
                    if output.finished:
                        done[output.request_id] = output
                        bar.update(1)
        except BaseException:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        finally:
            bar.close()
        return [done[request_id] for request_id in ids]
