# The shape of vLLM's quickstart (docs.vllm.ai, "Offline batched inference";
# https://github.com/vllm-project/vllm/blob/main/examples/offline_inference/basic/basic.py),
# written for Tandem: the import line and the model are the only Tandem-specific lines.
from runtime import LLM, SamplingParams

# Sample prompts.
prompts = [
    "Hello, my name is",
    "The page pool holds",
    "The capital of France is",
    "The future of AI is",
]
# Create a sampling params object.
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

# Create an LLM.
llm = LLM(model="runtime/default_model")
# Generate texts from the prompts. The output is a list of RequestOutput objects
# that contain the prompt, generated text, and other information.
outputs = llm.generate(prompts, sampling_params)
# Print the outputs.
for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
