"""The workloads on the core: image classification, LLM generation, text embeddings."""
