"""The engine's outer loop, written out: requests in, a step at a time, results out in prompt order.

`LLM.generate` does this inside the engine; notebook 10 has the learner write it as a function of
an engine, `generate_all(engine, prompts, params, on_event)`:

1. add every prompt as a request (`engine.add_request(prompt, params, index=i)`), each with its
   n sequences; a prompt the engine refuses (empty, too long) comes back with `.error` set;
2. call `engine.step()` while the scheduler has unfinished sequences. Each step returns a
   `StreamEvent` per token it produced, of any request and any of its samples, in the order the
   engine produced them. A step cap stops a loop that never ends, and a step that produced no
   event and left the scheduler exactly as it was is an engine that is stuck: both raise;
3. route each event to its request (`event.request_index`) and its sample (`event.sample_index`),
   and hand it to the callback, so that a caller can stream text as it is produced;
4. build one `RequestOutput` per prompt, in the prompts' order, whatever order they finished in.

The engine handles stop tokens and stop strings (`LLM.append_token`): a stop string is cut out of
the sequence's text, which may remove characters an earlier event already streamed, so the final
text is the sequence's own (`seq.text`), not the events' text joined.
"""

from __future__ import annotations

from typing import Callable

from decodelab.engine.llm import CompletionOutput, RequestOutput, StreamEvent
from decodelab.engine.scheduler import scheduler_state
from decodelab.params import SamplingParams

DEFAULT_MAX_STEPS = 100_000


def generate_all(
    engine,
    prompts: list,
    params: SamplingParams | list[SamplingParams],
    on_event: Callable[[StreamEvent], None] | None = None,
    max_steps: int = DEFAULT_MAX_STEPS,
) -> list[RequestOutput]:
    """Serve every prompt with `engine` (an idle `LLM`) and return one RequestOutput per prompt, in order.

    prompts: texts or lists of token ids; params: one SamplingParams for all, or one per prompt.
    on_event(event) is called for every StreamEvent, in the order the engine produced them.
    Output i: request_id i, the prompt's text (None for ids) and token ids, and its n
    CompletionOutputs in sample order, each with the token ids its events carried, the
    sequence's final text and its finish_reason. A refused prompt: one CompletionOutput
    (0, "", [], "error") and `.error` set.
    Raises ValueError for mismatched params, max_steps < 1 or an engine with requests already in
    flight; RuntimeError when a step makes no progress or max_steps steps do not finish the work.
    """
    params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(params_list) != len(prompts):
        raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
    if not (isinstance(max_steps, int) and max_steps >= 1):
        raise ValueError(f"max_steps must be an int >= 1, got {max_steps!r}")
    if engine.scheduler.has_unfinished():
        raise ValueError("the engine already has requests in flight; generate_all needs an idle engine")
    requests = [engine.add_request(prompt, sp, index=i) for i, (prompt, sp) in enumerate(zip(prompts, params_list))]
    tokens = [[[] for _ in request.seqs] for request in requests]  # [prompt][sample] -> token ids
    steps = 0
    while engine.scheduler.has_unfinished():
        if steps == max_steps:
            unfinished = sum(not request.is_done for request in requests)
            raise RuntimeError(
                f"{unfinished} of {len(requests)} requests still unfinished after {max_steps} engine steps (max_steps)"
            )
        before = scheduler_state(engine.scheduler)
        events = engine.step()
        steps += 1
        if not events and scheduler_state(engine.scheduler) == before:
            raise RuntimeError(
                f"engine step {steps} made no progress: no token, and every waiting or running sequence as it was"
            )
        for event in events:
            tokens[event.request_index][event.sample_index].append(event.token_id)
            if on_event is not None:
                on_event(event)
    outputs = []
    for i, request in enumerate(requests):
        if request.error is not None:
            completions = [CompletionOutput(0, "", [], "error")]
        else:
            completions = [
                CompletionOutput(j, seq.text, tokens[i][j], seq.finish_reason) for j, seq in enumerate(request.seqs)
            ]
        outputs.append(RequestOutput(i, request.prompt, request.prompt_token_ids, completions, error=request.error))
    return outputs
