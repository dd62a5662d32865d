"""The model layer: the Llama decoder and everything it is made of or loaded from.

attention, rope, kv_cache, llama (the model), tokenizer, weights (HF-layout folders),
gguf_import, gguf_tensors, registry (named models: smollm2, tiny, tiny-draft, tiny-mamba), quantization,
packed_linear, toy (random small models for tests and demos). Imports only config/params.
"""
