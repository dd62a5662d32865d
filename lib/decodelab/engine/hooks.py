"""`EngineHooks`: the stages of the engine a learner's function can replace, each notebook's closing cell.

    llm = LLM(model="smollm2", hooks=EngineHooks(sample=my_sample))

    sample(logits [V], params, generator) -> int           the sampling rule
    repetition_penalty(logits [V], token_ids [L], penalty) -> logits [V]   before `sample`, when penalty != 1
    accept_draft_tokens(draft_tokens, draft_probs, target_probs, generator) -> LongTensor
    allocator(num_blocks, block_size, enable_prefix_caching) -> a BlockAllocator-like object
    scheduler(allocator, max_num_seqs, max_num_batched_tokens) -> a Scheduler-like object
    step(engine) -> list[StreamEvent]                     one iteration of the loop (`engine_step`)
    linear(nn.Linear) -> a quantized layer                 each decoder-layer linear, with quantization set
        llm = LLM(model="smollm2", quantization="int8", hooks=EngineHooks(linear=Int8Linear.from_linear))
    forward(weights, config, input_ids [1, N], attend, positions [N]) -> logits [1, N, V]
        the model as a function of its state dict (notebook 01's `forward`), run on every packed batch
        in place of the model's modules; `attend` is the paged batch's (or the attention hook's)
    attention(cache, layer_index, q, k, v) -> out          attention over a cache with `append`
        (notebook 01's `attention`), run for each sequence over its paged blocks
        (`decodelab.engine.paged_attention.PagedSequenceCache`), inside the library's model or `forward`

With the library's own `sample` and `repetition_penalty` (`samples_with_library_code`), the engine
samples every row of a step at once (`decodelab.decoding.sampling.sample_batch`); with a learner's,
it calls theirs row by row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from decodelab.decoding.sampling import apply_repetition_penalty, sample
from decodelab.engine.block_allocator import BlockAllocator
from decodelab.engine.scheduler import Scheduler
from decodelab.params import SamplingParams


def sample_one(logits: torch.Tensor, params: SamplingParams, generator) -> int:
    """The default sampling hook: logits [V] -> token id."""
    return int(sample(logits, params, generator))


@dataclass
class EngineHooks:
    sample: Callable = sample_one
    accept_draft_tokens: Callable | None = None
    allocator: Callable = BlockAllocator
    scheduler: Callable = Scheduler
    step: Callable | None = None  # None: engine_step
    linear: Callable | None = None  # None: the library's QuantizedLinear (used only with quantization)
    repetition_penalty: Callable = apply_repetition_penalty
    forward: Callable | None = None  # None: the model's own modules
    attention: Callable | None = None  # None: PagedBatch's attention

    @property
    def samples_with_library_code(self) -> bool:
        """Are the sample and repetition_penalty stages the library's own (no learner's hook)?"""
        return self.sample is sample_one and self.repetition_penalty is apply_repetition_penalty
