"""Decoding one request: sampling, generation with a KV cache, speculative decoding and its
drafters (a draft model, prompt lookup, the EAGLE-style feature drafter, a depth-1 draft tree).
Imports the model layer, never the engine."""
