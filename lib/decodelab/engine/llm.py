"""`LLM`: the serving engine, with vLLM's public shape.

    from decodelab import LLM, SamplingParams
    llm = LLM(model="smollm2")
    outputs = llm.generate(["What is gravity?", "Name three colours."], SamplingParams(max_tokens=32))
    print(outputs[0].outputs[0].text)

The keyword arguments are `EngineArgs` fields (`decodelab.engine.args`, where each is described):
`LLM.from_args(EngineArgs(model="smollm2", max_num_seqs=8))` builds the same engine from one
object, and `llm.args` says how an engine was built.

Inside: a `BlockAllocator` (paged KV with prefix caching), a `Scheduler` (continuous
batching with preemption), a `PagedKVStore`, and one packed forward pass per step. By default
(`mix_decode_with_prefill=True`) the running sequences decode in the same pass that prefills
newly admitted ones, as vLLM's scheduler does, instead of pausing for it. With
`chunked_prefill=True` a long prompt is prefilled in slices of at most `max_num_batched_tokens`
tokens per step (decodes included), so it no longer stalls the running sequences for a whole
prefill; a sequence samples its first token in the step that completes its prompt.

Where things live: this module is the front (`LLM`: requests in, outputs out) and the step
(`engine_step`); `engine.model_runner.ModelRunner` runs the model (the packed forward pass over the
paged KV store, copy-on-write of shared blocks); `engine.hooks.EngineHooks` names the stages a
learner's function can replace, e.g. `LLM(model="smollm2", hooks=EngineHooks(sample=my_sample))`.
Each step samples every sequence's token at once (`decoding.sampling.sample_batch`: the
batch's logits processors in vLLM's order, each row with its own settings and generator), or row
by row through a learner's `sample` / `repetition_penalty` hook.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

from decodelab.decoding.generate import check_prompt, encode_prompt, first_stop_string, make_generator, stop_token_set
from decodelab.decoding.sampling import sample_batch
from decodelab.engine.args import DEFAULT_KV_CACHE_BYTES, EngineArgs
from decodelab.engine.block_allocator import blocks_needed
from decodelab.engine.hooks import EngineHooks, sample_one
from decodelab.engine.inputs import as_prompt_list, checked_prompt, params_per_prompt
from decodelab.engine.model_runner import ModelRunner
from decodelab.engine.paged_attention import PagedKVStore
from decodelab.engine.scheduler import scheduler_state
from decodelab.engine.sequence import Request, Sequence, Status
from decodelab.model.mamba import refuse_state_space
from decodelab.model.packed_linear import can_prepack, prepack_linear_layers, prepacked_copy
from decodelab.model.registry import load
from decodelab.model.tokenizer import StreamDecoder
from decodelab.params import SamplingParams

__all__ = [
    "LLM",
    "EngineHooks",
    "engine_step",
    "kv_blocks_for_memory",
    "CompletionOutput",
    "RequestOutput",
    "StreamEvent",
    "sample_one",
]  # EngineHooks and sample_one live in engine.hooks


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
        raise ValueError(
            f"{memory_bytes:,} bytes hold no KV block: one block of {block_size} tokens needs {per_block:,} bytes"
        )
    return blocks


def engine_step(engine: "LLM") -> list[StreamEvent]:
    """One iteration of the serving loop; returns a StreamEvent per token it produced.

    1. Ask the scheduler which sequences run: new requests to prefill, or every running
       sequence for one decode step (the engine's scheduler mixes both: the running sequences
       decode in the steps that prefill, and is_prefill says the step prefills something). If
       nothing can run, let the engine clear the way (`engine.drop_unschedulable()`: it preempts
       the newest of prompts stalled mid-prefill on a full pool, or ends a request that can never
       fit) and return [].
    2. Decode steps with a draft model go to `engine.speculator.step(seqs)` (draft, verify,
       accept), which returns the events itself.
    3. Otherwise run one packed forward pass, `engine.forward(seqs)` -> logits [len(seqs), V].
    4. For each sequence and its logits row: skip a sequence that still has uncomputed tokens
       (`seq.num_new_tokens > 0` after the pass: a chunked prefill fed only a slice of its
       prompt, and it samples once the prompt is complete); after a prefill, start its n > 1 siblings
       (`engine.start_siblings(seq, row)`, which returns their first events); then choose a
       token (`engine.choose_token`) and append it (`engine.append_token`, which retires the
       sequence when it stops). The library does both for every ready sequence at once in
       `engine.sample_and_append_all` (one batched sampling call), which also retires a sequence
       whose sampling fails (finish_reason "error") while the others go on; its siblings join
       that batch (`engine.fork_siblings`).
    """
    seqs, is_prefill = engine.scheduler.schedule()
    if not seqs:
        engine.drop_unschedulable()
        return []
    if engine.speculator is not None and not is_prefill:
        return engine.speculator.step(seqs)
    logits = engine.forward(seqs)
    ready, rows = [], []
    for i, seq in enumerate(seqs):
        if seq.num_new_tokens:  # a slice of its prompt: no token until the prompt is complete
            continue
        family = engine.fork_siblings(seq) + [seq] if is_prefill else [seq]  # siblings sample from its row
        ready += family
        rows += [i] * len(family)
    return engine.sample_and_append_all(ready, logits[rows])


@dataclass
class CompletionOutput:
    """One sample of a request: its text, its token ids, why it ended ("stop", "length" or "error"),
    and for "error" what went wrong (`error`: its prompt was refused, or its sampling failed), else None."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length" or "error"
    error: str | None = None


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    error: str | None = None  # why the prompt was refused (empty, too long, ids outside the vocabulary)
    metrics: dict = field(default_factory=dict)  # ttft_s, latency_s, preemptions


@dataclass
class StreamEvent:
    request_index: int
    sample_index: int
    token_id: int
    text: str  # new text since the last event of this sequence
    finished: bool


class LLM:
    """The serving engine. Safe to share between threads: a lock lets one call at a time run
    (`generate`, `chat`, `stream`, `add_request`, `step`); a second thread's call waits for it, then
    runs its own requests, so each gets exactly the tokens it would get alone.

    A call that raises part-way (a KeyboardInterrupt included) first aborts every request it
    queued and frees their KV blocks (`abort_since`), so the engine is ready for the next call.
    """

    def __init__(
        self,
        model="smollm2",
        device=None,
        dtype="float32",
        quantization=None,
        kv_block_size: int = 16,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 4096,
        num_kv_blocks: int | None = None,
        kv_cache_memory: int = DEFAULT_KV_CACHE_BYTES,
        enable_prefix_caching: bool = True,
        speculative_model=None,
        num_speculative_tokens: int = 4,
        max_model_len: int | None = None,
        mix_decode_with_prefill: bool = True,
        chunked_prefill: bool = False,
        prepack_weights: bool | None = None,
        compile_decode: bool | None = None,
        hooks: EngineHooks | None = None,
    ):
        """Load the model, build the paged KV cache, its allocator and the scheduler, and with a
        speculative_model the speculator. Every argument is an `EngineArgs` field (documented
        there); `self.args` holds them, and `LLM.from_args(args)` builds the same engine."""
        self.args = EngineArgs(
            model=model,
            device=device,
            dtype=dtype,
            quantization=quantization,
            kv_block_size=kv_block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            num_kv_blocks=num_kv_blocks,
            kv_cache_memory=kv_cache_memory,
            enable_prefix_caching=enable_prefix_caching,
            speculative_model=speculative_model,
            num_speculative_tokens=num_speculative_tokens,
            max_model_len=max_model_len,
            mix_decode_with_prefill=mix_decode_with_prefill,
            chunked_prefill=chunked_prefill,
            prepack_weights=prepack_weights,
            compile_decode=compile_decode,
            hooks=hooks,
        )
        self.model, self.tokenizer = self._load_model(self.args)
        self.config, self.device = self.model.config, self.model.device
        self.hooks = self.args.hooks or EngineHooks()
        self._build_kv_cache(self.args)
        self.runner = ModelRunner(self.model, self.store, self.allocator, self.hooks)
        self._start_speculator(self.args)
        self._next_seq_id = 0
        self._lock = threading.RLock()  # one call at a time; re-entrant: generate runs step

    @classmethod
    def from_args(cls, args: EngineArgs) -> "LLM":
        """The engine `args` describe, as LLM(**fields of args) builds it; its `.args` equals `args`."""
        return cls(**args.as_keywords())

    # ------------------------------------------------------------------ building
    def _load_model(self, args: EngineArgs):
        """-> (model, tokenizer): loaded when args.model names one, else the caller's pair; then
        quantized and prepacked as args ask."""
        model, tokenizer = load(args.model, device=args.device, dtype=args.dtype) if args.loads_model else args.model
        refuse_state_space(model, "the paged engine LLM")
        self.compiles_decode = args.compiles_decode(model)
        if args.quantization == "q4":  # the GGUF's own Q4_1 blocks (args checked: model="smollm2")
            from decodelab.model.q4_linear import use_gguf_q4_weights
            from decodelab.model.registry import smollm2_gguf_path

            use_gguf_q4_weights(model, smollm2_gguf_path())
        elif args.quantization is not None:
            from decodelab.model.quantization import quantize_model

            linear = getattr(args.hooks, "linear", None)  # None: the library's QuantizedLinear
            if self.compiles_decode:  # the same int8 levels; one-row products compiled
                from decodelab.model.fused_int8 import RowCompiledInt8Linear

                linear = RowCompiledInt8Linear.from_linear
            quantize_model(model, bits=8 if args.quantization == "int8" else 4, linear=linear)
        # prepack_weights: None packs where it helps (CPU, bfloat16) and no forward hook reads the
        # weights by name; True insists; False never
        as_named = getattr(args.hooks, "forward", None) is None
        if args.prepack_weights or (
            args.prepack_weights is None and as_named and can_prepack(model.device, model.dtype)
        ):
            if args.loads_model:  # nobody else holds this model: pack it in place
                prepack_linear_layers(model)
            else:  # the caller's model stays as it was
                model = prepacked_copy(model)
        return model, tokenizer

    def _build_kv_cache(self, args: EngineArgs) -> None:
        """Size and build the paged KV store, the block allocator and the scheduler (the hooks'
        classes); sets max_model_len, and max_seq_len: the longest sequence that fits both the
        model's context and the blocks."""
        context = self.config.max_position_embeddings
        if args.max_model_len is not None and args.max_model_len > context:
            raise ValueError(
                f"max_model_len must be at most the model's context of {context} tokens "
                f"(max_position_embeddings), got {args.max_model_len}"
            )
        self.max_model_len = context if args.max_model_len is None else args.max_model_len
        num_kv_blocks, block_size = args.num_kv_blocks, args.kv_block_size
        if num_kv_blocks is None:  # the memory budget, but no more than max_num_seqs full contexts
            enough = args.max_num_seqs * blocks_needed(self.max_model_len, block_size)
            num_kv_blocks = min(
                kv_blocks_for_memory(self.config, args.kv_cache_memory, block_size, self.model.dtype), enough
            )
        self.store = PagedKVStore(self.config, num_kv_blocks, block_size, self.device, self.model.dtype)
        self.allocator = self.hooks.allocator(num_kv_blocks, block_size, args.enable_prefix_caching)
        self.scheduler = self.hooks.scheduler(self.allocator, args.max_num_seqs, args.max_num_batched_tokens)
        self.max_seq_len = min(self.max_model_len, num_kv_blocks * block_size)

    def _start_speculator(self, args: EngineArgs) -> None:
        """With a speculative_model, a `BatchSpeculator` drafts and verifies every decode step."""
        self.speculator = None
        if args.speculative_model is not None:
            from decodelab.engine.speculative import make_speculator

            self.speculator = make_speculator(self, args.speculative_model, args.num_speculative_tokens)
        self.runner.speculator = self.speculator
        if hasattr(self.scheduler, "mix_decode_with_prefill"):  # speculative decode steps stay apart
            self.scheduler.mix_decode_with_prefill = args.mix_decode_with_prefill and self.speculator is None
        if args.chunked_prefill and not hasattr(self.scheduler, "schedule_chunked"):
            raise ValueError(
                f"chunked_prefill=True needs a scheduler with schedule_chunked; "
                f"{type(self.scheduler).__name__} has none"
            )
        if hasattr(self.scheduler, "chunked_prefill"):  # EngineArgs refused it with a speculative_model
            self.scheduler.chunked_prefill = args.chunked_prefill

    # ------------------------------------------------------------------ public API
    def generate(
        self, prompts, params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in prompt order. A prompt is a str or a list of token ids.

        Every prompt and SamplingParams is checked before any request is queued (a TypeError or
        ValueError naming the prompt's index). A prompt that cannot run (empty, too long) comes back
        with `.error` set; a sample whose sampling fails ends with finish_reason "error" and its
        `.error` set; the other requests run on. If the call raises part-way (a KeyboardInterrupt
        included), its requests are aborted and their KV blocks freed first. One call runs at a time
        (the engine's lock): a call from another thread waits for this one.
        """
        with self._lock, self._aborted_on_failure():
            requests = self._add_requests(prompts, params)
            self._run_with_progress(requests, use_tqdm)
            return [self._request_output(i, request) for i, request in enumerate(requests)]

    def chat(self, messages, params: SamplingParams | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """messages: one conversation [{"role", "content"}, ...] or a list of them. Runs as `generate`
        does (checked first, aborted on failure, one call at a time)."""
        if not isinstance(messages, (list, tuple)):
            raise TypeError(
                f"chat takes a conversation (a list of {{'role', 'content'}} dicts) or a list of them, "
                f"got {type(messages).__name__}; a plain prompt goes to generate"
            )
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [encode_prompt(self.tokenizer, c, chat=True) for c in conversations]
        return self.generate(prompts, params, use_tqdm=use_tqdm)

    def stream(self, prompts, params=None) -> Iterator[StreamEvent]:
        """Yield a StreamEvent per generated token of every sequence, as soon as it exists.

        Holds the engine's lock from the first event until the stream ends: another thread's call
        waits for it. Closing the stream early (`break`, `.close()`), or an exception in it, aborts
        its requests and frees their blocks. A sample whose sampling fails ends without an event."""
        with self._lock, self._aborted_on_failure():
            self._add_requests(prompts, params)
            for events in self._run_until_done():
                yield from events

    def add_request(self, prompt, params: SamplingParams | None = None, index: int = 0) -> Request:
        """Queue one prompt (text or token ids) while the engine runs, as a request arriving
        mid-stream: the next `step()` may schedule it. `index` is the request_index of its
        StreamEvents. -> its Request (sequences whose output_token_ids grow as steps run;
        .error set if the prompt was refused). Raises TypeError / ValueError for a prompt or
        params of the wrong kind, before anything is queued."""
        with self._lock:
            [params] = params_per_prompt(params, 1)
            return self._add_request(index, checked_prompt(index, prompt), params)

    def abort_since(self, first_seq_id: int) -> None:
        """Abort every waiting or running sequence whose seq_id >= first_seq_id (ids only grow, so
        these are the ones queued since then): each leaves the scheduler, finished with
        finish_reason "abort", its blocks back in the pool. A block holding tokens whose K/V was
        never written (the interrupted step had just allocated it) also loses its prefix-cache name
        (`forget_uncomputed`, where the allocator has it), so no later prompt reuses it."""
        scheduler = self.scheduler
        for seq in [s for s in (*scheduler.waiting, *scheduler.running) if s.seq_id >= first_seq_id]:
            self._abort_sequence(seq)

    def abort(self, request: Request) -> None:
        """Abort one request that `add_request` queued (a client gone away): each of its sequences
        not yet finished leaves the scheduler, finished with finish_reason "abort", its blocks back in
        the pool (as `abort_since` does); n > 1 siblings not yet forked never start. A finished or
        refused request is left as it is, so aborting twice is harmless."""
        with self._lock:
            for seq in request.seqs:
                if not seq.is_finished:
                    self._abort_sequence(seq)
            if request.seqs:
                request.seqs[0].siblings = []

    def _abort_sequence(self, seq: Sequence) -> None:
        """Take seq out of the scheduler, finished with "abort", and free its blocks; blocks whose
        K/V was never written lose their prefix-cache name first (`forget_uncomputed`, where the
        allocator has it)."""
        scheduler = self.scheduler
        if seq in scheduler.waiting:
            scheduler.waiting.remove(seq)
        forget_uncomputed = getattr(self.allocator, "forget_uncomputed", None)  # a learner's allocator may lack it
        if forget_uncomputed is not None:
            forget_uncomputed(seq.block_table, seq.num_computed_tokens)
        scheduler.finish(seq, "abort")

    @contextmanager
    def _aborted_on_failure(self):
        """Run one call; if it raises anything (KeyboardInterrupt, GeneratorExit included), abort the
        sequences it queued (`abort_since`) before the exception goes on."""
        first_seq_id = self._next_seq_id
        try:
            yield
        except BaseException:
            self.abort_since(first_seq_id)
            raise

    # ------------------------------------------------------------------ requests
    def _add_requests(self, prompts, params) -> list[Request]:
        """Check every prompt and its params (`engine.inputs`), then queue them all -> their Requests."""
        prompts = as_prompt_list(prompts)
        params_list = params_per_prompt(params, len(prompts))
        prompts = [checked_prompt(i, prompt) for i, prompt in enumerate(prompts)]
        return [self._add_request(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params_list))]

    def _add_request(self, index: int, prompt: str | list[int], params: SamplingParams) -> Request:
        """Admit prompt `index` (text, or token ids as a list of ints; both checked): its n sequences,
        the first one scheduled. A prompt that cannot run (empty, too long, ids outside the
        vocabulary) becomes a Request with an error."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        request = Request(prompt if isinstance(prompt, str) else None, ids)
        try:
            check_prompt(ids, self.max_seq_len, self.config.vocab_size)
        except ValueError as exc:
            request.error = f"prompt {index}: {exc}"
            return request
        now = time.perf_counter()
        stop_ids = frozenset(stop_token_set(params, self.tokenizer.stop_token_ids()))  # once, not per token
        for j in range(params.n):
            seed = None if params.seed is None else params.seed + j
            seq = Sequence(
                self._next_seq_id,
                index,
                j,
                list(ids),
                params,
                arrival_time=now,
                generator=make_generator(seed, self.device),
                decoder=StreamDecoder(self.tokenizer),
                stop_token_ids=stop_ids,
            )
            self._next_seq_id += 1
            request.seqs.append(seq)
        first = request.seqs[0]
        first.siblings = request.seqs[1:]  # forked from `first` after its prefill (shared prompt blocks)
        for sibling in first.siblings:
            sibling.status = Status.RUNNING  # not waiting: it joins when `first` is prefilled
        self.scheduler.add(first)
        return request

    # ------------------------------------------------------------------ the loop
    def _run_until_done(self) -> Iterator[list[StreamEvent]]:
        while self.scheduler.has_unfinished():
            yield self.checked_step()

    def _run_with_progress(self, requests: list[Request], use_tqdm: bool) -> None:
        """Step until nothing is unfinished, a progress bar counting `requests` as they finish."""
        progress = self._progress(len(requests), use_tqdm)
        done = sum(1 for request in requests if request.error is not None)
        try:
            for _ in self._run_until_done():
                finished = sum(1 for request in requests if request.is_done)
                if progress is not None and finished > done:
                    progress.update(finished - done)
                done = finished
        finally:
            if progress is not None:
                progress.close()

    def step(self) -> list[StreamEvent]:
        """One engine iteration (`engine_step`, or the `step` hook): schedule, run one packed
        forward pass, sample, retire."""
        with self._lock:
            return (self.hooks.step or engine_step)(self)

    def checked_step(self) -> list[StreamEvent]:
        """`step()`, raising RuntimeError when the step made no progress (no token, and every waiting
        or running sequence as it was: a scheduler or step hook that schedules nothing), instead of
        letting a loop over steps spin forever. `generate`, `stream` and the server step this way."""
        with self._lock:
            before = scheduler_state(self.scheduler)
            events = self.step()
            if not events and self.scheduler.has_unfinished() and scheduler_state(self.scheduler) == before:
                raise RuntimeError(
                    "the engine step made no progress: no token, and every waiting or running sequence as it was"
                )
            return events

    def drop_unschedulable(self) -> None:
        """Nothing could be scheduled: free the pool for whatever can go on, so the loop cannot spin.

        * Sequences run, but none could take a step: every one is a prompt stalled part-way through
          its chunked prefill on a full pool (each holds blocks the others need; a decoding sequence
          would have preempted). Preempt the newest, so the older ones go on; it is recomputed later.
          A lone stalled sequence can never fit: it ends with finish_reason "error".
        * Nothing runs and the first waiting request cannot fit even alone (a custom allocator with
          too few blocks): it ends with finish_reason "error", saying so.
        """
        scheduler = self.scheduler
        if len(scheduler.running) > 1:
            scheduler.preempt(scheduler.running[-1])
            return
        stuck = scheduler.running[0] if scheduler.running else scheduler.waiting[0] if scheduler.waiting else None
        if stuck is None:
            return
        if stuck in scheduler.waiting:
            scheduler.waiting.remove(stuck)
        block_size = self.args.kv_block_size
        self.fail_sequence(
            stuck,
            f"its {len(stuck)} tokens need {blocks_needed(len(stuck), block_size)} KV blocks of {block_size} "
            f"tokens and the pool cannot give them ({self.allocator.num_blocks} blocks in all)",
        )

    def fork_siblings(self, seq: Sequence) -> list[Sequence]:
        """After `seq`'s prefill: its n > 1 siblings share the prompt's blocks (copy-on-write) and
        join the running sequences -> the siblings, to sample their first tokens from seq's logits."""
        siblings, seq.siblings = seq.siblings, []
        for sibling in siblings:
            sibling.block_table = self.allocator.fork(seq.block_table)
            sibling.num_computed_tokens, sibling.status = seq.num_computed_tokens, Status.RUNNING
            sibling.draft_computed_tokens = seq.draft_computed_tokens
            if self.speculator is not None:
                self.speculator.fork(seq, sibling)
            self.scheduler.running.append(sibling)
        return siblings

    def start_siblings(self, seq: Sequence, logits: torch.Tensor) -> list[StreamEvent]:
        """After `seq`'s prefill: fork its n > 1 siblings (`fork_siblings`) and sample their first
        tokens from the same logits [V] -> their StreamEvents."""
        siblings = self.fork_siblings(seq)
        return self.sample_and_append_all(siblings, logits.expand(len(siblings), -1)) if siblings else []

    def plain_decode(self, seqs: list[Sequence]) -> list[StreamEvent]:
        """One token for every sequence."""
        return self.sample_and_append_all(seqs, self.forward(seqs))

    def forward(self, seqs: list[Sequence]) -> torch.Tensor:
        """Feed every scheduled sequence's tokens for this step in one packed pass (all its uncomputed
        ones, or the slice a chunking scheduler chose: `seq.num_tokens_this_step`) -> the logits
        of each one's last fed token [B, V]. The model runner's (`ModelRunner.forward`)."""
        return self.runner.forward(seqs)

    def choose_token(self, seq: Sequence, logits: torch.Tensor) -> int:
        """The sequence's next token from its logits [V]: the repetition penalty over its history,
        then the sampling rule (both hooks). Raises whatever they raise."""
        params = seq.params
        if params.repetition_penalty != 1:
            history = torch.tensor(seq.token_ids, device=logits.device)
            logits = self.hooks.repetition_penalty(logits, history, params.repetition_penalty)
        return int(self.hooks.sample(logits, params, seq.generator))

    def sample_and_append(self, seq: Sequence, logits: torch.Tensor) -> list[StreamEvent]:
        """Choose seq's next token from its logits [V] and append it -> [its StreamEvent], or []
        if its sampling failed (`sample_and_append_all` for one sequence)."""
        return self.sample_and_append_all([seq], logits[None])

    def sample_and_append_all(self, seqs: list[Sequence], logits: torch.Tensor) -> list[StreamEvent]:
        """Choose every sequence's next token, row i of logits [B, V] for seqs[i], and append them
        -> their StreamEvents, in the order of seqs.

        With the library's sampling (no learner's `sample` / `repetition_penalty` hook) one batched
        call chooses them all (`sample_batch`: each row its own settings and generator, so the
        tokens equal `choose_token` row by row); otherwise `choose_token` runs row by row.
        If the library's sampling fails for a sequence (a ValueError, or torch's RuntimeError such
        as "probability tensor contains either inf, nan or element < 0": its numbers, not the
        code), that sequence alone is retired (`fail_sequence`, no event): the batch is retried
        row by row, which `sample_batch` allows by checking every row before drawing any.
        Running out of memory still raises, and so does an error in a learner's sample or
        repetition_penalty hook: a bug in their code, which they (and `course.parts`, which falls
        back to the reference) must see."""
        if not seqs:
            return []
        library = self.hooks.samples_with_library_code
        if library:
            try:
                tokens = sample_batch(
                    logits,
                    [seq.params for seq in seqs],
                    [seq.generator for seq in seqs],
                    [seq.token_ids for seq in seqs],
                ).tolist()
            except (RuntimeError, ValueError) as exc:
                if isinstance(exc, torch.cuda.OutOfMemoryError):
                    raise
            else:
                return [self.append_token(seq, token) for seq, token in zip(seqs, tokens)]
        events = []
        for seq, row in zip(seqs, logits):
            try:
                token = self.choose_token(seq, row)
            except (RuntimeError, ValueError) as exc:
                if isinstance(exc, torch.cuda.OutOfMemoryError) or not library:
                    raise
                self._fail_sampling(seq, exc)
                continue
            events.append(self.append_token(seq, token))
        return events

    def _fail_sampling(self, seq: Sequence, exc: Exception) -> None:
        params = seq.params
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        self.fail_sequence(
            seq,
            f"sampling failed ({reason}) with temperature={params.temperature}, "
            f"top_k={params.top_k}, top_p={params.top_p}, "
            f"repetition_penalty={params.repetition_penalty}",
        )

    def fail_sequence(self, seq: Sequence, message: str) -> None:
        """Retire seq with finish_reason "error" and `message` as its error; its blocks go back to the pool."""
        seq.error, seq.finish_time = message, time.perf_counter()
        self.scheduler.finish(seq, "error")

    def append_token(self, seq: Sequence, token_id: int) -> StreamEvent:
        """Add a sampled token; finish the sequence on a stop token, stop string or length."""
        now = time.perf_counter()
        seq.first_token_time = seq.first_token_time or now
        seq.output_token_ids.append(token_id)
        params = seq.params
        before = len(seq.text)
        seq.text += seq.decoder.push(token_id)
        reason = "stop" if token_id in seq.stop_token_ids else None
        cut = first_stop_string(seq.text, params.stop)
        if cut is not None:
            seq.text, reason = seq.text[:cut], "stop"
        elif reason is None and (len(seq.output_token_ids) >= params.max_tokens or len(seq) >= self.max_seq_len):
            reason = "length"
        if reason is not None:
            if cut is None:
                seq.text += seq.decoder.flush()
            seq.finish_time = now
            self.scheduler.finish(seq, reason)
        return StreamEvent(seq.request_index, seq.sample_index, token_id, seq.text[before:], reason is not None)

    # ------------------------------------------------------------------ outputs
    def _request_output(self, index: int, request: Request) -> RequestOutput:
        if request.error is not None:
            return RequestOutput(
                index,
                request.prompt,
                request.prompt_token_ids,
                [CompletionOutput(0, "", [], "error", request.error)],
                error=request.error,
            )
        outputs = [
            CompletionOutput(s.sample_index, s.text, list(s.output_token_ids), s.finish_reason, s.error)
            for s in request.seqs
        ]
        first = request.seqs[0]
        metrics = {
            "ttft_s": (first.first_token_time or first.arrival_time) - first.arrival_time,
            "latency_s": max((s.finish_time or s.arrival_time) for s in request.seqs) - first.arrival_time,
            "preemptions": sum(s.num_preemptions for s in request.seqs),
        }
        return RequestOutput(index, request.prompt, request.prompt_token_ids, outputs, metrics=metrics)

    @staticmethod
    def _progress(total: int, use_tqdm: bool):
        if not use_tqdm or total < 2 or os.environ.get("NBGRADER_EXECUTION"):
            return None
        from tqdm.auto import tqdm

        return tqdm(total=total, desc="generating", unit="req")
