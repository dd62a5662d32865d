"""The course's one table of exercises: for each exercise, its notebook, its name, the engine part it
builds, the library's reference it is graded against and, where the engine runs it, the
`EngineHooks` field it feeds. Everything else that lists exercises is read from here:

* `PARTS` ((notebook, exercise) -> part): `python -m decodelab progress`'s "engine part" column and
  the engine map of `course.pictures`;
* `references(notebook)` (exercise -> "module:attr"): each `autograder/checks/<topic>.py`'s
  `REFERENCES`, the integrity report's list of references a learner must not call, and the
  notebook tests' library references;
* `stage_exercises(hook)`: the exercises behind each stage of the learner's engine (`course.parts.STAGES`).

`tests/test_exercises.py` checks that the table, every notebook's exercise cells (in order) and the
hint ladders of `data/hints.json` name the same exercises. A new exercise is one line here.

This module imports nothing: the hidden checks, the grader and the course all read it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Exercise:
    notebook: str  # "02_sampling"
    name: str  # the exercise cell's grade id without "ex_": "top_k_filter"
    part: str  # the part of the engine it builds, in words: "sampling: top-k"
    reference: str  # the library's reference, "module:attr": "decodelab.decoding.sampling:top_k_filter"
    stage: str | None = None  # the EngineHooks field whose code it is part of, where the engine runs it

    @property
    def topic(self) -> str:
        """The notebook's topic, which names its checks module: "02_sampling" -> "sampling"."""
        return topic(self.notebook)


# In course order, and within a notebook in the order of its exercise cells.
EXERCISES: tuple[Exercise, ...] = (
    # 00_meet_the_model
    Exercise("00_meet_the_model", "bpe_encode", "tokenizer: byte-level BPE merges", "decodelab.lessons.bpe:bpe_encode"),
    Exercise(
        "00_meet_the_model",
        "count_parameters",
        "model size: parameter count",
        "decodelab.lessons.kv_size:parameter_count",
    ),
    Exercise(
        "00_meet_the_model",
        "decode_tokens_per_second_bound",
        "decode speed: bandwidth bound",
        "decodelab.lessons.measure:decode_tokens_per_second_bound",
    ),
    # 01_forward_pass
    Exercise(
        "01_forward_pass",
        "load_gguf_state_dict",
        "forward pass: the weights read from GGUF, dequantized",
        "decodelab.model.gguf_import:load_gguf_state_dict",
    ),
    Exercise(
        "01_forward_pass", "rms_norm", "forward pass: RMSNorm", "decodelab.lessons.forward_pass:rms_norm", "forward"
    ),
    Exercise("01_forward_pass", "rope", "forward pass: RoPE", "decodelab.lessons.forward_pass:rope", "forward"),
    Exercise(
        "01_forward_pass",
        "attention",
        "forward pass: attention",
        "decodelab.lessons.forward_pass:attention",
        "attention",
    ),
    Exercise("01_forward_pass", "mlp", "forward pass: SwiGLU MLP", "decodelab.lessons.forward_pass:mlp", "forward"),
    Exercise(
        "01_forward_pass",
        "forward",
        "forward pass: decoder layer and model loop",
        "decodelab.lessons.forward_pass:forward",
        "forward",
    ),
    # 02_sampling
    Exercise("02_sampling", "top_k_filter", "sampling: top-k", "decodelab.decoding.sampling:top_k_filter", "sample"),
    Exercise("02_sampling", "top_p_filter", "sampling: top-p", "decodelab.decoding.sampling:top_p_filter", "sample"),
    Exercise(
        "02_sampling",
        "apply_repetition_penalty",
        "sampling: repetition penalty",
        "decodelab.decoding.sampling:apply_repetition_penalty",
        "repetition_penalty",
    ),
    Exercise(
        "02_sampling",
        "process_logits",
        "sampling: a batch, each request's own settings",
        "decodelab.decoding.sampling:process_logits",
        "sample",
    ),
    Exercise("02_sampling", "sample", "sampling: drawing the token", "decodelab.decoding.sampling:sample", "sample"),
    Exercise(
        "02_sampling",
        "beam_search",
        "sampling: beam search, each beam with its own cache row",
        "decodelab.lessons.beam_search:beam_search",
    ),
    # 03_kv_cache
    Exercise(
        "03_kv_cache",
        "generate_without_cache",
        "generation loop without a cache",
        "decodelab.decoding.generate:generate_without_cache",
    ),
    Exercise("03_kv_cache", "KVCache", "KV cache", "decodelab.model.kv_cache:KVCache"),
    Exercise(
        "03_kv_cache",
        "generate_with_cache",
        "generation loop with the KV cache",
        "decodelab.decoding.generate:generate_with_cache",
    ),
    Exercise("03_kv_cache", "kv_bytes", "KV cache size", "decodelab.lessons.kv_size:kv_bytes"),
    Exercise(
        "03_kv_cache",
        "SlidingWindowKVCache",
        "KV cache of a sliding window: a ring of W slots",
        "decodelab.model.kv_cache:SlidingWindowKVCache",
    ),
    # 04_prefill_decode
    Exercise(
        "04_prefill_decode",
        "timed_generate",
        "prefill and decode, timed",
        "decodelab.lessons.prefill_decode:timed_generate",
    ),
    Exercise(
        "04_prefill_decode",
        "latencies_from_timestamps",
        "latency: TTFT and inter-token",
        "decodelab.lessons.prefill_decode:latencies_from_timestamps",
    ),
    Exercise(
        "04_prefill_decode",
        "IncrementalDetokenizer",
        "detokenizer: streaming text, a few ids per token",
        "decodelab.model.tokenizer:StreamDecoder",
    ),
    Exercise(
        "04_prefill_decode",
        "arithmetic_intensity",
        "roofline: arithmetic intensity",
        "decodelab.lessons.prefill_decode:arithmetic_intensity",
    ),
    Exercise("04_prefill_decode", "reuse_prefix", "prefix reuse", "decodelab.lessons.prefill_decode:reuse_prefix"),
    # 05_gqa
    Exercise(
        "05_gqa",
        "broadcast_gqa_attention",
        "GQA: attention without copying K/V",
        "decodelab.lessons.gqa:broadcast_gqa_attention",
    ),
    Exercise(
        "05_gqa",
        "gqa_decode_step",
        "GQA: one decode step over the cache, bytes read",
        "decodelab.lessons.gqa:gqa_decode_step",
    ),
    Exercise("05_gqa", "pool_kv_heads", "GQA: pooling K/V heads", "decodelab.lessons.gqa:pool_kv_heads"),
    # 06_quantization
    Exercise(
        "06_quantization",
        "quantize_int8_per_tensor",
        "quantization: int8 per tensor",
        "decodelab.model.quantization:quantize_int8_per_tensor",
    ),
    Exercise(
        "06_quantization",
        "quantize_int8_per_channel",
        "quantization: int8 per channel",
        "decodelab.model.quantization:quantize_int8_per_channel",
    ),
    Exercise(
        "06_quantization",
        "quantize_int4_groupwise",
        "quantization: int4 group-wise, packed",
        "decodelab.model.quantization:quantize_int4_groupwise",
    ),
    Exercise("06_quantization", "Int8Linear", "int8 linear layer", "decodelab.model.quantization:Int8Linear", "linear"),
    Exercise(
        "06_quantization",
        "replace_linears",
        "quantized model: swapping the linear layers",
        "decodelab.model.quantization:replace_linears",
    ),
    Exercise(
        "06_quantization", "Int4Linear", "int4 linear layer, group by group", "decodelab.model.quantization:Int4Linear"
    ),
    Exercise(
        "06_quantization",
        "Int8KVCache",
        "int8 KV cache, a scale per token and head",
        "decodelab.model.quantization:Int8KVCache",
    ),
    # 07_paged_kv
    Exercise(
        "07_paged_kv",
        "gather_kv",
        "paged KV: gather through a block table",
        "decodelab.engine.paged_attention:gather_kv",
    ),
    Exercise(
        "07_paged_kv",
        "paged_decode_attention",
        "paged KV: a decode batch's attention through its block tables",
        "decodelab.lessons.paged_kv:paged_decode_attention",
    ),
    Exercise("07_paged_kv", "kv_waste", "paged KV: counting the waste", "decodelab.engine.block_allocator:kv_waste"),
    Exercise(
        "07_paged_kv",
        "BlockAllocator",
        "block allocator",
        "decodelab.engine.block_allocator:BlockAllocator",
        "allocator",
    ),
    # 08_continuous_batching
    Exercise(
        "08_continuous_batching", "preempt", "scheduler: preempt", "decodelab.engine.scheduler:preempt", "scheduler"
    ),
    Exercise(
        "08_continuous_batching",
        "decode_batch",
        "scheduler: decode batch",
        "decodelab.engine.scheduler:decode_batch",
        "scheduler",
    ),
    Exercise(
        "08_continuous_batching",
        "schedule_chunked",
        "scheduler: a step with chunked prefill",
        "decodelab.engine.scheduler:schedule_chunked",
        "scheduler",
    ),
    Exercise("08_continuous_batching", "finish", "scheduler: finish", "decodelab.engine.scheduler:finish", "scheduler"),
    Exercise(
        "08_continuous_batching",
        "padded_prefill",
        "static batch: padding and its attention mask",
        "decodelab.lessons.padded_batch:padded_prefill",
    ),
    # 09_speculative_decoding
    Exercise(
        "09_speculative_decoding",
        "accept_draft_tokens",
        "speculative decoding: acceptance rule",
        "decodelab.decoding.speculative.steps:accept_draft_tokens",
        "accept_draft_tokens",
    ),
    Exercise(
        "09_speculative_decoding",
        "speculative_step",
        "speculative decoding: propose, verify, roll back",
        "decodelab.decoding.speculative.steps:speculative_step",
    ),
    Exercise(
        "09_speculative_decoding",
        "propose_from_prompt",
        "speculative decoding: prompt-lookup drafter",
        "decodelab.decoding.lookup:propose_from_prompt",
    ),
    Exercise(
        "09_speculative_decoding",
        "verify_tree",
        "speculative decoding: a draft tree in one pass",
        "decodelab.lessons.speculative_decoding:verify_tree",
    ),
    # 10_capstone_engine
    Exercise(
        "10_capstone_engine",
        "kv_blocks_for_memory",
        "engine: KV block budget",
        "decodelab.engine.llm:kv_blocks_for_memory",
    ),
    Exercise("10_capstone_engine", "engine_step", "engine: the step", "decodelab.engine.llm:engine_step", "step"),
    Exercise(
        "10_capstone_engine",
        "generate_all",
        "engine: the outer loop, outputs in prompt order",
        "decodelab.lessons.serving_loop:generate_all",
    ),
    Exercise(
        "10_capstone_engine",
        "decode_roofline_fraction",
        "engine: roofline fraction",
        "decodelab.lessons.measure:decode_roofline_fraction",
    ),
    # 11_tiled_attention
    Exercise(
        "11_tiled_attention",
        "attention_memory_bytes",
        "tiled attention: score memory",
        "decodelab.lessons.tiled_attention:attention_memory_bytes",
    ),
    Exercise(
        "11_tiled_attention",
        "online_softmax_update",
        "tiled attention: online softmax",
        "decodelab.lessons.tiled_attention:online_softmax_update",
    ),
    Exercise(
        "11_tiled_attention",
        "tiled_attention",
        "tiled attention: the tiled loop",
        "decodelab.lessons.tiled_attention:tiled_attention",
    ),
    Exercise(
        "11_tiled_attention",
        "tiled_causal_attention",
        "tiled attention: causal tiles, the future skipped",
        "decodelab.lessons.tiled_attention:tiled_causal_attention",
    ),
    Exercise(
        "11_tiled_attention",
        "combine_partial_attention",
        "tiled attention: split-K merge",
        "decodelab.lessons.tiled_attention:combine_partial_attention",
    ),
    # 12_gpu_kernel
    Exercise(
        "12_gpu_kernel",
        "gather_kv_kernel",
        "GPU kernel: reading KV blocks through the block table",
        "decodelab.lessons.gpu_kernel:gather_kv_kernel",
    ),
    Exercise(
        "12_gpu_kernel",
        "paged_attention_kernel",
        "GPU kernel: paged attention with an online softmax",
        "decodelab.lessons.gpu_kernel:paged_attention_kernel",
    ),
    Exercise(
        "12_gpu_kernel",
        "paged_attention",
        "GPU kernel: launching paged attention",
        "decodelab.lessons.gpu_kernel:paged_attention",
    ),
    # 13_calibrated_quantization (a bonus, taken right after 06_quantization)
    Exercise(
        "13_calibrated_quantization",
        "decompose",
        "calibrated quantization: LLM.int8() outlier decomposition",
        "decodelab.model.outliers:decompose",
    ),
    Exercise(
        "13_calibrated_quantization",
        "search_scales",
        "calibrated quantization: AWQ scale search",
        "decodelab.model.awq:search_scales",
    ),
    Exercise(
        "13_calibrated_quantization",
        "gptq_quantize_layer",
        "calibrated quantization: GPTQ, one linear",
        "decodelab.model.gptq:gptq_quantize_layer",
    ),
    # 14_serving
    Exercise(
        "14_serving",
        "engine_loop",
        "serving: the engine loop, requests joining between steps",
        "decodelab.lessons.serving:engine_loop",
    ),
    Exercise(
        "14_serving",
        "stream",
        "serving: a client's stream, backpressure and abort on disconnect",
        "decodelab.lessons.serving:stream",
    ),
    Exercise(
        "14_serving",
        "serving_metrics",
        "serving: TTFT, TPOT and goodput",
        "decodelab.lessons.serving:serving_metrics",
    ),
    # 15_state_space
    Exercise(
        "15_state_space",
        "selective_step",
        "state-space model: one token of the selective scan",
        "decodelab.model.mamba:selective_step",
    ),
    Exercise(
        "15_state_space",
        "selective_scan",
        "state-space model: the chunked scan over a prompt",
        "decodelab.model.mamba:selective_scan",
    ),
    Exercise(
        "15_state_space",
        "mixer_forward",
        "state-space model: the selective mixer (input-dependent Δ, B, C; A = -exp(A_log); causal conv)",
        "decodelab.lessons.state_space:mixer_forward",
    ),
    Exercise(
        "15_state_space",
        "generate_with_state",
        "state-space model: decoding that carries a fixed state instead of a cache",
        "decodelab.lessons.state_space:generate_with_state",
    ),
)

# (notebook, exercise) -> the part of the engine that exercise builds.
PARTS: dict[tuple[str, str], str] = {(e.notebook, e.name): e.part for e in EXERCISES}


def topic(notebook: str) -> str:
    """ "02_sampling" -> "sampling": the name of the notebook's checks, widgets and fixtures."""
    return notebook.split("_", 1)[1]


def notebooks() -> list[str]:
    """The notebooks that have exercises, in course order."""
    return list(dict.fromkeys(e.notebook for e in EXERCISES))


def exercises_of(notebook: str) -> list[Exercise]:
    """One notebook's exercises in the order of its cells; ValueError for a notebook without any."""
    found = [e for e in EXERCISES if e.notebook == notebook]
    if not found:
        raise ValueError(f"no exercises for notebook {notebook!r}: the table has {', '.join(notebooks())}")
    return found


def find(notebook: str, name: str) -> Exercise:
    """The exercise `name` of `notebook`; ValueError naming the notebook's exercises when there is none."""
    for exercise in exercises_of(notebook):
        if exercise.name == name:
            return exercise
    raise ValueError(f"{notebook} has no exercise {name!r}: it has {', '.join(e.name for e in exercises_of(notebook))}")


def references(notebook: str | None = None) -> dict[str, str]:
    """exercise name -> "module:attr" of the library's reference, for one notebook (a checks
    module's REFERENCES) or for the whole course."""
    chosen = EXERCISES if notebook is None else exercises_of(notebook)
    return {e.name: e.reference for e in chosen}


def stage_exercises(hook: str) -> tuple[str, tuple[str, ...]]:
    """(notebook, exercise names in cell order) of the EngineHooks field `hook`; ValueError when no
    exercise feeds it, or when exercises of two notebooks do (a stage is one notebook's code)."""
    found = [e for e in EXERCISES if e.stage == hook]
    owners = sorted({e.notebook for e in found})
    if len(owners) != 1:
        raise ValueError(f"the stage {hook!r} must be fed by the exercises of one notebook, found {owners or 'none'}")
    return owners[0], tuple(e.name for e in found)


__all__ = [
    "EXERCISES",
    "Exercise",
    "PARTS",
    "exercises_of",
    "find",
    "notebooks",
    "references",
    "stage_exercises",
    "topic",
]
