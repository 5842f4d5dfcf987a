"""`LLM`: offline batched generation, shaped like vLLM's."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterator
from typing import Sequence as Seq

from tqdm.auto import tqdm

from runtime.config import DEFAULT_MODEL, EngineConfig
from runtime.engine import Engine, Prompt
from runtime.lora.request import LoRARequest
from runtime.outputs import RequestOutput
from runtime.sampling_params import SamplingParams, generation_defaults


class LLM:
    """Load a model once, then generate for many prompts with continuous batching.

    >>> llm = LLM()  # the small hybrid model that ships with Tandem
    >>> out = llm.generate(["The page pool"], SamplingParams(temperature=0, max_tokens=16))
    >>> out[0].outputs[0].text
    """

    def __init__(self, model: str | Path | None = None, **options: Any):
        """`options` are EngineConfig's fields (dtype, max_model_len, kv_cache_memory, device, ...):
        the same names, defaults and help as the command line's options (`tandem generate --help`)."""
        known = {f.name for f in dataclasses.fields(EngineConfig) if f.init and f.name != "model"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword arguments {', '.join(unknown)}; "
                            f"it takes EngineConfig's: {', '.join(sorted(known))}")
        config = EngineConfig(model=str(model if model is not None else DEFAULT_MODEL), **options)
        self.engine = Engine(config)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (as vLLM's); requests in flight keep their pages. True when done."""
        return self.engine.reset_prefix_cache()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the defaults of the model's generation_config.json (temperature, top_p, top_k,
        min_p, repetition_penalty, max_new_tokens), as vLLM's: what `generate` and `chat` use when given none."""
        return SamplingParams(**generation_defaults(self.engine.config.model_dir))

    def chat(
        self,
        messages: Seq[dict[str, Any]] | Seq[Seq[dict[str, Any]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Generate a reply to one conversation (a list of {"role", "content"} messages) or to each of a list
        of them, through the tokenizer's chat template or `chat_template` (a Jinja template string), as vLLM's.
        `tools` (OpenAI's function definitions) go to the template, for templates that show them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        kwargs = {**(chat_template_kwargs or {}), **({"tools": tools} if tools is not None else {})}
        prompts = [render_chat(self.get_tokenizer(), conversation, chat_template, add_generation_prompt,
                               continue_final_message, kwargs)
                   for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order. `lora_request`: one LoRA adapter for
        every prompt, or one (or None) per prompt (with enable_lora=True; docs/features/lora.md)."""
        ids = self._submit(prompts, sampling_params, stream=False, lora_request=lora_request)
        return self._run(ids, use_tqdm)

    def stream(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> Iterator[tuple[int, RequestOutput]]:
        """Yield (prompt index, output so far) after every step that advances a prompt; the last output
        of each prompt has `finished` set. Closing the iterator early (or Ctrl-C) aborts what is left."""
        ids = self._submit(prompts, sampling_params, stream=True)
        index = {request_id: i for i, request_id in enumerate(ids)}
        try:
            while self.engine.has_unfinished():
                for output in self.engine.step():
                    yield index[output.request_id], output
        finally:
            for request_id in ids:
                self.engine.abort(request_id)

    def _submit(self, prompts, sampling_params, stream: bool, lora_request=None) -> list[str]:
        prompts = _prompt_list(prompts)
        loras = _lora_list(lora_request, len(prompts))
        params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else _params_list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        # Tokenize and validate every prompt before queueing any, so a bad one leaves nothing half-done.
        tokenized = []
        for prompt, p in zip(prompts, params):
            text, token_ids = self.engine.tokenize(prompt)
            self.engine.validate(token_ids, p)
            tokenized.append({"prompt": text, "prompt_token_ids": token_ids})
        for lora in loras:
            self.engine.add_lora(lora)
        return [self.engine.add_request(prompt, p, stream=stream, lora_request=lora)
                for prompt, p, lora in zip(tokenized, params, loras)]

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


def _prompt_list(prompts: Any) -> list[Prompt]:
    """`prompts` as a list; anything but a prompt or a list of them is refused here, by name, rather than
    failing later as a TypeError (None) or being iterated as something else."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and all(isinstance(p, (str, dict)) for p in prompts):
        return list(prompts)
    raise ValueError("prompts must be a string, a {\"prompt_token_ids\": [...]} dict, or a list of them, "
                     f"got {_shown(prompts)}")


def _lora_list(lora_request: Any, count: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    if isinstance(lora_request, (list, tuple)) and all(r is None or isinstance(r, LoRARequest) for r in lora_request):
        if len(lora_request) != count:
            raise ValueError(f"got {count} prompts but {len(lora_request)} LoRA requests")
        return list(lora_request)
    raise ValueError(f"lora_request must be a LoRARequest, a list of them (or None), got {_shown(lora_request)}")


def _params_list(params: Any) -> list[SamplingParams]:
    # A string is iterable, and would become one "sampling params" per character.
    if isinstance(params, (list, tuple)) and all(isinstance(p, SamplingParams) for p in params):
        return list(params)
    raise ValueError(f"sampling_params must be a SamplingParams, a list of them, or None, got {_shown(params)}")


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{text if len(text) <= 60 else text[:60] + '...'} ({type(value).__name__})"


def render_chat(tokenizer, messages: Seq[dict[str, Any]], chat_template: str | None, add_generation_prompt: bool,
                continue_final_message: bool, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The prompt (text and token ids) a chat template makes of `messages`."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; pass one as LLM.chat(..., chat_template=TEMPLATE)")
    messages = [{**m, "content": _text(m.get("content"))} for m in messages]
    text = tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, **kwargs)
    # The template writes the special tokens it wants (a BOS, say); encoding must not add them a second time.
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


def _text(content: Any) -> Any:
    """OpenAI's list of content parts, as one string ([{"type": "text", "text": ...}, ...])."""
    if isinstance(content, list):
        return "".join(part["text"] for part in content if part.get("type") == "text")
    return content
