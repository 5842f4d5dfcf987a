"""GGUF files as models (llama.cpp's format): config from the metadata, tokenizer, weights kept quantized."""
