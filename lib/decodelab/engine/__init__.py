"""The serving engine: `LLM` (llm) and its settings (`EngineArgs`, args), the scheduler, sequences, the paged KV block allocator,
paged attention, and speculative decoding inside the batch. Imports decoding and model."""
