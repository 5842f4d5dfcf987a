# The shape of vLLM's parallel sampling usage (docs.vllm.ai, SamplingParams `n`: several completions per
# prompt, in `RequestOutput.outputs`), written for Tandem: the import line and the model are the only
# Tandem-specific lines.
from runtime import LLM, SamplingParams

llm = LLM(model="runtime/default_model")
sampling_params = SamplingParams(n=4, temperature=1.0, top_p=0.95, max_tokens=16, seed=0)
outputs = llm.generate(["The page pool holds", "A hybrid model"], sampling_params)

for output in outputs:
    print(f"Prompt: {output.prompt!r}")
    for completion in output.outputs:
        print(f"  sample {completion.index}: {completion.text!r} ({completion.finish_reason})")
