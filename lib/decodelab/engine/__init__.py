"""The serving engine: `LLM` and its step (llm), its settings (`EngineArgs`, args), the model runner
(model_runner: the packed forward pass, copy-on-write), the stages a learner can replace (`EngineHooks`,
hooks), the scheduler, sequences, the paged KV block allocator, paged attention, and speculative
decoding inside the batch. Imports decoding and model."""
