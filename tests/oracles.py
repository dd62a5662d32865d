"""Helpers shared by the tests: small random models (`random_model`, the library's `random_llama`)
and the greedy near-tie rule."""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Callable, Sequence

import torch

from decodelab.model.toy import random_llama

NEAR_TIE = 1e-4  # two top logits closer than this may swap between two correct implementations

# Many tests build their model by this name; it is the library's one builder (decodelab.model.toy).
random_model = random_llama


def random_ids(n: int, vocab: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


def top2(logits: torch.Tensor) -> tuple[set[int], float]:
    values, ids = torch.topk(logits.float(), 2)
    return {int(ids[0]), int(ids[1])}, float(values[0] - values[1])


def check_greedy_agreement(
    prompt_ids: Sequence[int],
    ours: Sequence[int],
    ref: Sequence[int],
    next_logits: Sequence[Callable[[list[int]], torch.Tensor]],
    tol: float = NEAR_TIE,
) -> int:
    """Assert two greedy continuations agree, except for a swap at a genuine near-tie.

    At the first step where they differ, every model in `next_logits` (ids -> logits [V] for
    the next token) must rank exactly the two chosen tokens on top with a margin below
    `tol`; after that step the sequences legitimately part ways. Returns the number of
    tokens that agree. Without a divergence the two must have the same length.
    """
    ours, ref = [int(t) for t in ours], [int(t) for t in ref]
    for step, (a, b) in enumerate(zip(ours, ref)):
        if a == b:
            continue
        prefix = list(prompt_ids) + ours[:step]
        for fn in next_logits:
            best, margin = top2(fn(prefix))
            assert best == {a, b} and margin < tol, (
                f"greedy outputs differ at step {step} ({a} vs {b}) but this is no near-tie: "
                f"top-2 there {sorted(best)}, margin {margin:.3g} (allowed < {tol})"
            )
        return step
    assert len(ours) == len(ref), f"same tokens but different lengths: {len(ours)} vs {len(ref)}"
    return len(ours)


def hf_greedy(hf_model, prompt_ids: Sequence[int], max_new_tokens: int, eos_token_id: int | None) -> list[int]:
    """transformers' greedy generate (its own KV cache), new tokens only."""
    x = torch.tensor([list(prompt_ids)])
    with torch.no_grad():
        out = hf_model.generate(
            x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_id,
            pad_token_id=eos_token_id if eos_token_id is not None else 0,
            top_p=None,
            top_k=None,
            temperature=None,
        )
    return out[0, x.shape[1] :].tolist()


def last_logits_fn(model) -> Callable[[list[int]], torch.Tensor]:
    """ids -> next-token logits [V] from a full forward pass (ours or transformers')."""

    @torch.no_grad()
    def fn(ids):
        out = model(torch.tensor([list(ids)]))
        return (out.logits if hasattr(out, "logits") else out)[0, -1].float()

    return fn


@contextlib.contextmanager
def quiet_transformers():
    """No progress bars, info logs or warnings from transformers while loading."""
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    patches = []
    try:  # the GGUF loader uses tqdm directly, outside transformers' own switch
        import transformers.modeling_gguf_pytorch_utils as gguf_utils

        patches.append((gguf_utils, "tqdm", gguf_utils.tqdm))
        gguf_utils.tqdm = functools.partial(gguf_utils.tqdm, disable=True)
    except (ImportError, AttributeError):
        pass
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield transformers
    finally:
        for module, name, original in patches:
            setattr(module, name, original)


_GGUF_READERS: dict = {}


@contextlib.contextmanager
def memoized_gguf_reading():
    """transformers parses a GGUF file twice (config, then weights) and rebuilds gguf's
    tensor-name map once per tensor: ~3/4 of its 30 s load on two cores. Within this block
    both are memoized (pure functions of their arguments); what is computed is unchanged."""
    try:
        import gguf
    except ImportError:
        yield
        return
    original_reader, original_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers = _GGUF_READERS  # kept for the session: the model and tokenizer fixtures share them

    def reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original_reader(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(original_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_map


def load_fixture(name: str):
    """The kept-bug module tests/fixtures/<name>.py (loaded by path: tests/ is no package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent / "fixtures" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"decodelab_tests_{name.replace('/', '_')}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def expect_bug_caught(checks, bugs: dict, bug: str, min_message: int = 40) -> str:
    """Run the check a kept bug names on the buggy function: it must fail with a message long
    enough to say what went wrong (input, expected, got). Returns the message."""
    import pytest

    fn, check_name, what = bugs[bug]
    with pytest.raises(AssertionError) as info:
        getattr(checks, check_name)(fn)
    message = str(info.value)
    assert len(message) > min_message, f"{bug} ({what}): message too terse: {message}"
    return message
