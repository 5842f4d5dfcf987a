# The shape of vLLM's log-probability usage (docs.vllm.ai, SamplingParams `logprobs` and `prompt_logprobs`,
# whose values are `Logprob(logprob, rank, decoded_token)` objects), written for Tandem: the import line
# and the model are the only Tandem-specific lines.
from runtime import LLM, SamplingParams

llm = LLM(model="runtime/default_model")
sampling_params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, prompt_logprobs=5)
outputs = llm.generate(["The page pool holds", "A hybrid model"], sampling_params)

for output in outputs:
    print(f"Prompt: {output.prompt!r}")
    # The first prompt token has nothing before it.
    assert output.prompt_logprobs[0] is None
    for token_id, logprobs in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:]):
        logprob = logprobs[token_id]
        print(f"  prompt token {logprob.decoded_token!r}: logprob {logprob.logprob:.3f}, rank {logprob.rank}")
    completion = output.outputs[0]
    for token_id, logprobs in zip(completion.token_ids, completion.logprobs):
        top = sorted(logprobs.items(), key=lambda item: item[1].rank)
        chosen = logprobs[token_id]
        print(f"  generated {chosen.decoded_token!r} ({chosen.logprob:.3f}); top: "
              + ", ".join(f"{lp.decoded_token!r}={lp.logprob:.3f}" for _, lp in top[:5]))
    print(f"  cumulative logprob: {completion.cumulative_logprob:.3f}")
