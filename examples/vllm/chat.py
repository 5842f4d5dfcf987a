# The shape of vLLM's chat example (docs.vllm.ai, "LLM.chat";
# https://github.com/vllm-project/vllm/blob/main/examples/offline_inference/basic/chat.py),
# written for Tandem: the import line and the model are the only Tandem-specific lines.
from runtime import LLM, SamplingParams

llm = LLM(model="runtime/default_model")
sampling_params = SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, top_k=20)


def print_outputs(outputs):
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}")
        print(f"Generated text: {generated_text!r}")
    print("-" * 80)


conversation = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hello! How can I assist you today?"},
    {"role": "user", "content": "Write an essay about the page pool."},
]
outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
print_outputs(outputs)

# Batch inference with the llm.chat API.
conversations = [conversation for _ in range(10)]
outputs = llm.chat(conversations, sampling_params, use_tqdm=True)
print_outputs(outputs)

# A chat template can be supplied; otherwise the tokenizer's own is used.
chat_template = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}<assistant>"
outputs = llm.chat(conversations[:2], sampling_params, use_tqdm=False, chat_template=chat_template)
print_outputs(outputs)
