"""What `LLM.generate` takes, checked before any request is queued: prompts and their SamplingParams.

A prompt is a text or a list of token ids; `prompts` is one prompt or a list of them. A bad one
(an int among texts, a float among token ids, a dict) is a TypeError naming its index, raised
before the engine holds a block for the call, so a typo in prompt 7 leaves nothing behind.

A prompt of the right type that cannot run (empty, too long for the context, ids outside the
vocabulary) is not an exception: the engine refuses that request alone, and its RequestOutput
says why (`decodelab.decoding.generate.check_prompt`).
"""

from __future__ import annotations

from decodelab.params import SamplingParams
from decodelab.validation import as_integer


def as_prompt_list(prompts) -> list:
    """generate's `prompts` -> a list of prompts. One text, or one list of token ids (a list or
    tuple whose first item is an integer), is a single prompt; a list or tuple of them is several.
    Raises TypeError for anything else."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a str, a list of token ids or a list of those, got {type(prompts).__name__}")
    if prompts and as_integer(prompts[0]) is not None:
        return [list(prompts)]
    return list(prompts)


def checked_prompt(index: int, prompt) -> str | list[int]:
    """Prompt `index` as the engine takes it: a str as it is; token ids (a list or tuple of integers,
    or a 1-D integer tensor or array) as a list of Python ints. Raises TypeError naming the index,
    and for token ids the position of the first that is not an integer."""
    if isinstance(prompt, str):
        return prompt
    if getattr(prompt, "ndim", None) == 1 and hasattr(prompt, "tolist"):  # a 1-D tensor or array
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise TypeError(
            f"prompt {index} must be a str or a list of token ids, got {type(prompt).__name__} {_short(prompt)}"
        )
    ids = [as_integer(token) for token in prompt]
    if None in ids:
        position = ids.index(None)
        raise TypeError(
            f"prompt {index}: token ids must be integers, got {_short(prompt[position])} at position {position}"
        )
    return ids


def params_per_prompt(params, num_prompts: int) -> list[SamplingParams]:
    """One SamplingParams per prompt: None -> the defaults for every prompt; one SamplingParams ->
    that one for every prompt; a list (or tuple) -> one each, num_prompts of them. Each is checked
    again (`validate`): a field may have been changed since it was made. Raises ValueError for a
    count that does not match or a value out of range, TypeError for an item that is not a
    SamplingParams, naming the prompt's index."""
    if isinstance(params, (list, tuple)):
        if len(params) != num_prompts:
            raise ValueError(f"got {len(params)} SamplingParams for {num_prompts} prompts")
        params_list = list(params)
    else:
        params_list = [SamplingParams() if params is None else params] * num_prompts
    for index, sp in enumerate(params_list):
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"params for prompt {index} must be a SamplingParams, got {type(sp).__name__}")
        try:
            sp.validate()
        except ValueError as exc:
            raise ValueError(f"params for prompt {index}: {exc}") from None
    return params_list


def _short(value, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters for an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
