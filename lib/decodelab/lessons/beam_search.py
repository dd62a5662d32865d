"""Beam search (notebook 02): the search a sampler does not do, with one KV cache row per beam.

A sampler commits to one token per step. Beam search keeps the `num_beams` best partial texts
(beams) by their total log-probability, and at every step extends all of them at once, so a token
that looked worse now can win later. It is what Hugging Face's
`generate(num_beams=B, do_sample=False, length_penalty=L, early_stopping=True)` does, step by step:

1. one forward pass over the newest token of every beam, [b, 1], each beam with its own cache row;
2. every beam's log-probabilities plus the beam's running total, flattened to [b * V]; the best
   2B of those candidates, best first (2B, so that B candidates that do not end always remain);
3. a candidate that ends (the EOS token, or the last allowed step) and ranks among the first B
   becomes a finished hypothesis, scored sum_logprob / length ** length_penalty, length = the
   new tokens including the EOS (the prompt never counts); the best B hypotheses are kept;
4. the first B candidates that do not end are the next beams; their cache rows are their
   parents' (`KVCache.reorder`, one `index_select` on the batch dimension);
5. stop once B hypotheses are finished (early stopping) or after max_new_tokens steps; the best
   hypothesis wins. Only finished hypotheses carry the length penalty: running beams are ranked
   by their plain total.

The engine never uses it (it serves sampled and greedy requests); the notebook sets it beside greedy
decoding. `sequence_logprob` scores any continuation with one forward pass, without a cache.

Shapes: b running beams (1 before the first step), V vocabulary.
"""

from __future__ import annotations

import torch

from decodelab.decoding.generate import PromptTooLongError, check_prompt
from decodelab.lessons.perplexity import token_nlls
from decodelab.model.kv_cache import KVCache
from decodelab.validation import check_int


@torch.inference_mode()
def beam_search(
    model,
    prompt_ids: list[int],
    num_beams: int,
    max_new_tokens: int,
    eos_token_id: int | None = None,
    length_penalty: float = 1.0,
) -> tuple[list[int], float]:
    """The best continuation of prompt_ids by beam search, and its score.

    Returns (new ids, the EOS included when it ended with one; its score sum_logprob / len ** length_penalty,
    len = the number of new ids). Keeps num_beams running beams, each with its own row of one KVCache
    (rows follow their parents through `cache.reorder`), expands them by the best 2 * num_beams
    candidates overall, stops once num_beams hypotheses are finished or after max_new_tokens steps.
    Raises ValueError for num_beams < 1, 2 * num_beams > V, max_new_tokens < 1 or a bad prompt.
    """
    check_int("num_beams", num_beams, minimum=1)
    check_int("max_new_tokens", max_new_tokens, minimum=1)
    config, device = model.config, model.device
    check_prompt(prompt_ids, config.max_position_embeddings, config.vocab_size)
    if 2 * num_beams > config.vocab_size:
        raise ValueError(
            f"beam search keeps 2 x num_beams candidates: num_beams={num_beams} needs a vocabulary "
            f"of at least {2 * num_beams} tokens, the model has {config.vocab_size}"
        )
    if len(prompt_ids) + max_new_tokens > config.max_position_embeddings:
        raise PromptTooLongError(
            f"{len(prompt_ids)} prompt + {max_new_tokens} new tokens exceed the model's "
            f"context of {config.max_position_embeddings} tokens"
        )
    cache = KVCache(config, 1, len(prompt_ids) + max_new_tokens, device=device, dtype=model.dtype)
    inputs = torch.tensor([prompt_ids], device=device)  # [1, P]: one beam until the first step
    beams, totals = [[]], torch.zeros(1, device=device)  # new ids per beam; their summed log-probs [b]
    finished: list[tuple[float, list[int]]] = []  # (score, ids), best first, at most num_beams
    for step in range(max_new_tokens):
        logits = model(inputs, kv_cache=cache, last_only=True)[:, -1].float()  # [b, V]
        candidates = (logits.log_softmax(dim=-1) + totals[:, None]).flatten()  # [b * V]
        top_totals, top_index = candidates.topk(2 * num_beams)  # best first
        parents, tokens = top_index // config.vocab_size, top_index % config.vocab_size
        last_step, running = step == max_new_tokens - 1, []
        for rank, (total, parent, token) in enumerate(zip(top_totals.tolist(), parents.tolist(), tokens.tolist())):
            ids = beams[parent] + [token]
            if token == eos_token_id or last_step:
                if rank < num_beams:  # a hypothesis only from the best num_beams candidates
                    finished.append((total / len(ids) ** length_penalty, ids))
            elif len(running) < num_beams:
                running.append((parent, ids, total))
        finished = sorted(finished, key=lambda hypothesis: hypothesis[0], reverse=True)[:num_beams]
        if len(finished) == num_beams or last_step:
            break
        cache.reorder(torch.tensor([parent for parent, _, _ in running], device=device))  # rows follow parents
        beams = [ids for _, ids, _ in running]
        totals = torch.tensor([total for _, _, total in running], device=device)  # [B]
        inputs = torch.tensor([[ids[-1]] for ids in beams], device=device)  # [B, 1]
    score, ids = finished[0]
    return ids, score


@torch.inference_mode()
def sequence_logprob(model, prompt_ids: list[int], new_ids: list[int]) -> float:
    """Total log-probability (nats) of new_ids after prompt_ids, from one forward pass without a cache."""
    nlls = token_nlls(model, list(prompt_ids) + list(new_ids))  # [P + N - 1]: token i + 1 given tokens 0..i
    return -float(nlls[len(prompt_ids) - 1 :].double().sum())
