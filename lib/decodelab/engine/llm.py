"""`LLM`: the serving engine, with vLLM's public shape.

    from decodelab import LLM, SamplingParams
    llm = LLM(model="smollm2")
    outputs = llm.generate(["What is gravity?", "Name three colours."], SamplingParams(max_tokens=32))
    print(outputs[0].outputs[0].text)

Inside: a `BlockAllocator` (paged KV with prefix caching), a `Scheduler` (continuous
batching with preemption), a `PagedKVStore`, and one packed forward pass per step. By default
(`mix_decode_with_prefill=True`) the running sequences decode in the same pass that prefills
newly admitted ones, as vLLM's scheduler does, instead of pausing for it.

Hooks — swap a learner's function in for one stage (each notebook's closing cell does):
    llm = LLM(model="smollm2", hooks=EngineHooks(sample=my_sample))
    sample(logits [V], params, generator) -> int           the sampling rule
    accept_draft_tokens(draft_tokens, draft_probs, target_probs, generator) -> LongTensor
    allocator(num_blocks, block_size, enable_prefix_caching) -> a BlockAllocator-like object
    scheduler(allocator, max_num_seqs, max_num_batched_tokens) -> a Scheduler-like object
    step(engine) -> list[StreamEvent]                     one iteration of the loop (`engine_step`)
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from decodelab.decoding.generate import check_prompt, make_generator
from decodelab.model.registry import load
from decodelab.model.packed_linear import can_prepack, prepack_linear_layers, prepacked_copy
from decodelab.engine.block_allocator import BlockAllocator
from decodelab.engine.paged_attention import PagedBatch, PagedKVStore, SequenceSlice
from decodelab.params import SamplingParams
from decodelab.decoding.sampling import apply_repetition_penalty, sample
from decodelab.engine.scheduler import Scheduler
from decodelab.engine.sequence import Sequence, Status
from decodelab.model.tokenizer import StreamDecoder

DEFAULT_KV_CACHE_BYTES = 1 << 30


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


def kv_blocks_for_memory(config, memory_bytes: int, block_size: int, dtype=torch.float32) -> int:
    """How many KV blocks of `block_size` tokens fit in `memory_bytes`.

    One block holds, for every layer, K and V rows of `block_size` tokens, each row
    num_key_value_heads x head_dim values of `dtype`:
        bytes per block = 2 x num_hidden_layers x block_size x num_key_value_heads x head_dim x element size.
    Returns the whole number of blocks that fit (rounded down). Raises ValueError if
    memory_bytes or block_size is not > 0, or if not even one block fits.
    """
    if not memory_bytes > 0 or not block_size > 0:
        raise ValueError(f"memory_bytes and block_size must be > 0, got {memory_bytes!r} and {block_size!r}")
    per_block = PagedKVStore.bytes_per_block(config, block_size, dtype)
    blocks = int(memory_bytes // per_block)
    if blocks < 1:
        raise ValueError(f"{memory_bytes:,} bytes hold no KV block: one block of {block_size} tokens needs "
                         f"{per_block:,} bytes")
    return blocks


def engine_step(engine: "LLM") -> list[StreamEvent]:
    """One iteration of the serving loop; returns a StreamEvent per token it produced.

    1. Ask the scheduler which sequences run: new requests to prefill, or every running
       sequence for one decode step (the engine's scheduler mixes both: the running sequences
       decode in the steps that prefill, and is_prefill says the step prefills something). If
       nothing can run, let the engine drop a request that can never fit
       (`engine.drop_unschedulable()`) and return [].
    2. Decode steps with a draft model go to `engine.speculator.step(seqs)` (draft, verify,
       accept), which returns the events itself.
    3. Otherwise run one packed forward pass, `engine.forward(seqs)` -> logits [len(seqs), V].
    4. For each sequence and its logits row: after a prefill, start its n > 1 siblings
       (`engine.start_siblings(seq, row)`, which returns their first events); then choose a
       token (`engine.choose_token`) and append it (`engine.append_token`, which retires the
       sequence when it stops).
    """
    seqs, is_prefill = engine.scheduler.schedule()
    if not seqs:
        engine.drop_unschedulable()
        return []
    if engine.speculator is not None and not is_prefill:
        return engine.speculator.step(seqs)
    logits = engine.forward(seqs)
    events = []
    for seq, row in zip(seqs, logits):
        if is_prefill:
            events += engine.start_siblings(seq, row)
        events.append(engine.append_token(seq, engine.choose_token(seq, row)))
    return events


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length" or "error"


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    error: str | None = None
    metrics: dict = field(default_factory=dict)  # ttft_s, latency_s, preemptions


@dataclass
class StreamEvent:
    request_index: int
    sample_index: int
    token_id: int
    text: str  # new text since the last event of this sequence
    finished: bool


class LLM:
    def __init__(self, model="smollm2", device=None, dtype="float32", quantization=None, kv_block_size: int = 16,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 4096, num_kv_blocks: int | None = None,
                 kv_cache_memory: int = DEFAULT_KV_CACHE_BYTES, enable_prefix_caching: bool = True,
                 speculative_model=None, num_speculative_tokens: int = 4, max_model_len: int | None = None,
                 mix_decode_with_prefill: bool = True, prepack_weights: bool | None = None,
                 hooks: EngineHooks | None = None):
        if quantization not in (None, "int8", "int4"):
            raise ValueError(f"quantization must be None, 'int8' or 'int4', got {quantization!r}")
        # model: a name ("smollm2", "tiny"), a model folder, or a (model, tokenizer) pair
        loaded_here = isinstance(model, (str, os.PathLike))
        self.model, self.tokenizer = load(model, device=device, dtype=dtype) if loaded_here else model
        if quantization is not None:
            from decodelab.model.quantization import quantize_model
            quantize_model(self.model, bits=8 if quantization == "int8" else 4)
        # prepack_weights: None packs where it helps (CPU, bfloat16); True insists; False never
        if prepack_weights or (prepack_weights is None and can_prepack(self.model.device, self.model.dtype)):
            if loaded_here:  # nobody else holds this model: pack it in place
                prepack_linear_layers(self.model)
            else:  # the caller's model stays as it was
                self.model = prepacked_copy(self.model)
        self.config = self.model.config
        self.device = self.model.device
        self.hooks = hooks or EngineHooks()
        self.max_model_len = min(max_model_len or self.config.max_position_embeddings, self.config.max_position_embeddings)
        if num_kv_blocks is None:  # the memory budget, but no more than max_num_seqs full contexts
            enough = max_num_seqs * -(-self.max_model_len // kv_block_size)
            num_kv_blocks = min(kv_blocks_for_memory(self.config, kv_cache_memory, kv_block_size, self.model.dtype),
                                enough)
        self.store = PagedKVStore(self.config, num_kv_blocks, kv_block_size, self.device, self.model.dtype)
        self.allocator = self.hooks.allocator(num_kv_blocks, kv_block_size, enable_prefix_caching)
        self.scheduler = self.hooks.scheduler(self.allocator, max_num_seqs, max_num_batched_tokens)
        self.max_seq_len = min(self.max_model_len, num_kv_blocks * kv_block_size)
        self.speculator = None
        if speculative_model is not None:
            from decodelab.engine.speculative import BatchSpeculator
            self.speculator = BatchSpeculator(self, speculative_model, num_speculative_tokens)
        if hasattr(self.scheduler, "mix_decode_with_prefill"):  # speculative decode steps stay apart
            self.scheduler.mix_decode_with_prefill = mix_decode_with_prefill and self.speculator is None
        self._next_seq_id = 0

    # ------------------------------------------------------------------ public API
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in prompt order. A prompt is a str or a list of token ids."""
        requests = self._add_requests(prompts, params)
        progress = self._progress(len(requests), use_tqdm)
        done = sum(1 for r in requests if r["error"])
        for _ in self._run_until_done():
            finished = sum(1 for r in requests if r["error"] or all(s.is_finished for s in r["seqs"]))
            if progress is not None and finished > done:
                progress.update(finished - done)
            done = finished
        if progress is not None:
            progress.close()
        return [self._request_output(i, r) for i, r in enumerate(requests)]

    def chat(self, messages, params: SamplingParams | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """messages: one conversation [{"role", "content"}, ...] or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode(self.tokenizer.apply_chat_template(c)) for c in conversations]
        return self.generate(prompts, params, use_tqdm=use_tqdm)

    def stream(self, prompts, params=None) -> Iterator[StreamEvent]:
        """Yield a StreamEvent per generated token of every sequence, as soon as it exists."""
        self._add_requests(prompts, params)
        for events in self._run_until_done():
            yield from events

    # ------------------------------------------------------------------ requests
    def _add_requests(self, prompts, params) -> list[dict]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        return [self._add_request(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params_list))]

    def _add_request(self, index: int, prompt, params: SamplingParams) -> dict:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params for prompt {index} must be a SamplingParams, got {type(params).__name__}")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        request = {"prompt": prompt if isinstance(prompt, str) else None, "ids": ids, "seqs": [], "error": None}
        try:
            check_prompt(ids, self.max_seq_len, self.config.vocab_size)
        except ValueError as exc:
            request["error"] = f"prompt {index}: {exc}"
            return request
        now = time.perf_counter()
        for j in range(params.n):
            seed = None if params.seed is None else params.seed + j
            seq = Sequence(self._next_seq_id, index, j, list(ids), params, arrival_time=now,
                           generator=make_generator(seed, self.device), decoder=StreamDecoder(self.tokenizer))
            self._next_seq_id += 1
            request["seqs"].append(seq)
        first = request["seqs"][0]
        first.siblings = request["seqs"][1:]  # forked from `first` after its prefill (shared prompt blocks)
        for sibling in first.siblings:
            sibling.status = Status.RUNNING  # not waiting: it joins when `first` is prefilled
        self.scheduler.add(first)
        return request

    # ------------------------------------------------------------------ the loop
    def _run_until_done(self) -> Iterator[list[StreamEvent]]:
        while self.scheduler.has_unfinished():
            yield self.step()

    def step(self) -> list[StreamEvent]:
        """One engine iteration (`engine_step`, or the `step` hook): schedule, run one packed
        forward pass, sample, retire."""
        return (self.hooks.step or engine_step)(self)

    def drop_unschedulable(self) -> None:
        """Nothing could be scheduled: if nothing runs either, the first waiting request cannot
        fit even alone (e.g. a custom allocator with too few blocks); finish it so the loop ends."""
        if not self.scheduler.running and self.scheduler.waiting:
            seq = self.scheduler.waiting.popleft()
            seq.status, seq.finish_reason = Status.FINISHED, "length"

    def start_siblings(self, seq: Sequence, logits: torch.Tensor) -> list[StreamEvent]:
        """After `seq`'s prefill: its n > 1 siblings share the prompt's blocks (copy-on-write),
        join the running sequences and sample their first tokens from the same logits [V]."""
        events = []
        for sibling in seq.siblings:
            sibling.block_table = self.allocator.fork(seq.block_table)
            sibling.num_computed_tokens, sibling.status = seq.num_computed_tokens, Status.RUNNING
            sibling.draft_computed_tokens = seq.draft_computed_tokens
            self.scheduler.running.append(sibling)
            events.append(self.append_token(sibling, self.choose_token(sibling, logits)))
        seq.siblings = []
        return events

    def plain_decode(self, seqs: list[Sequence]) -> list[StreamEvent]:
        """One token for every sequence."""
        logits = self.forward(seqs)
        return [self.append_token(seq, self.choose_token(seq, row)) for seq, row in zip(seqs, logits)]

    def forward(self, seqs: list[Sequence]) -> torch.Tensor:
        """Feed every scheduled sequence's uncomputed tokens in one pass -> last-token logits [B, V]."""
        items = [(seq.token_ids[seq.num_computed_tokens:], seq.num_computed_tokens, seq.block_table) for seq in seqs]
        logits = self.packed_forward(self.model, self.store, items)
        if self.speculator is not None:  # the draft model keeps its own cache of the same tokens
            self.speculator.prefill(seqs, items)
        for seq in seqs:
            seq.num_computed_tokens = len(seq)
        return torch.stack(logits)

    @torch.inference_mode()
    def packed_forward(self, model, store: PagedKVStore, items, all_logits: bool = False) -> list[torch.Tensor]:
        """One forward pass of `model` over several sequences' new tokens laid end to end.

        items: (new token ids, position of the first, block table) per sequence. Returns per
        item the logits of its last token [V], or of all its new tokens [T, V] (all_logits).
        """
        self.apply_copy_on_write()
        ids, positions, slots, slices, wanted = [], [], [], [], []
        block_size = store.block_size
        for tokens, start, table in items:
            end = start + len(tokens)
            slices.append(SequenceSlice(len(ids), len(tokens), end, table))
            wanted += range(len(ids), len(ids) + len(tokens)) if all_logits else [len(ids) + len(tokens) - 1]
            ids += tokens
            positions += range(start, end)
            slots += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        device = self.device
        batch = PagedBatch(store, slices, torch.tensor(slots, device=device), model.config.sliding_window)
        logits = model(torch.tensor([ids], device=device), positions=torch.tensor(positions, device=device),
                       kv_cache=batch, logits_indices=torch.tensor(wanted, device=device))[0]
        if not all_logits:
            return list(logits)
        sizes = [len(tokens) for tokens, _, _ in items]
        return list(torch.split(logits, sizes))

    def apply_copy_on_write(self) -> None:
        """Copy the blocks the allocator duplicated, in every KV store (target and draft)."""
        for src, dst in self.allocator.copy_on_write_log:
            self.store.copy_block(src, dst)
            if self.speculator is not None:
                self.speculator.store.copy_block(src, dst)
        self.allocator.copy_on_write_log.clear()

    def choose_token(self, seq: Sequence, logits: torch.Tensor) -> int:
        params = seq.params
        if params.repetition_penalty != 1:
            history = torch.tensor(seq.token_ids, device=logits.device)
            logits = apply_repetition_penalty(logits, history, params.repetition_penalty)
        return int(self.hooks.sample(logits, params, seq.generator))

    def append_token(self, seq: Sequence, token_id: int) -> StreamEvent:
        """Add a sampled token; finish the sequence on a stop token, stop string or length."""
        now = time.perf_counter()
        seq.first_token_time = seq.first_token_time or now
        seq.output_token_ids.append(token_id)
        params = seq.params
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.tokenizer.stop_token_ids())
        before = len(seq.text)
        seq.text += seq.decoder.push(token_id)
        reason = "stop" if token_id in stop_ids else None
        cut = min((i for i in (seq.text.find(s) for s in params.stop) if i >= 0), default=-1)
        if cut >= 0:
            seq.text, reason = seq.text[:cut], "stop"
        elif reason is None and (len(seq.output_token_ids) >= params.max_tokens or len(seq) >= self.max_seq_len):
            reason = "length"
        if reason is not None:
            if cut < 0:
                seq.text += seq.decoder.flush()
            seq.finish_time = now
            self.scheduler.finish(seq, reason)
        return StreamEvent(seq.request_index, seq.sample_index, token_id, seq.text[before:], reason is not None)

    # ------------------------------------------------------------------ outputs
    def _request_output(self, index: int, request: dict) -> RequestOutput:
        if request["error"]:
            return RequestOutput(index, request["prompt"], request["ids"],
                                 [CompletionOutput(0, "", [], "error")], error=request["error"])
        outputs = [CompletionOutput(s.sample_index, s.text, list(s.output_token_ids), s.finish_reason)
                   for s in request["seqs"]]
        first = request["seqs"][0]
        metrics = {"ttft_s": (first.first_token_time or first.arrival_time) - first.arrival_time,
                   "latency_s": max((s.finish_time or s.arrival_time) for s in request["seqs"]) - first.arrival_time,
                   "preemptions": sum(s.num_preemptions for s in request["seqs"])}
        return RequestOutput(index, request["prompt"], request["ids"], outputs, metrics=metrics)

    @staticmethod
    def _progress(total: int, use_tqdm: bool):
        if not use_tqdm or total < 2 or os.environ.get("NBGRADER_EXECUTION"):
            return None
        from tqdm.auto import tqdm
        return tqdm(total=total, desc="generating", unit="req")
