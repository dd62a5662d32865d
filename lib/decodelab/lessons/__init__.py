"""Exercise references that the engine never uses (bpe, forward_pass, sampling, gqa, prefill_decode,
kv_size, tiled_attention, gpu_kernel, continuous_batching, speculative_decoding, beam_search) and the measurements the
notebooks make (measure, perplexity). Imports engine, decoding and model; nothing below imports it."""
