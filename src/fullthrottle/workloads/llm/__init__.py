"""LLM generation: a Llama-architecture decoder and its CUDA-graph decode loop."""
