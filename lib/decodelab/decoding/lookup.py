"""Prompt lookup: a drafter with no model at all (Saxena 2023; vLLM's "ngram" speculator).

Outputs often repeat their input: code edits, summaries that quote, answers that reuse a
name. So look for the last few tokens earlier in the text, and guess that what followed
them then follows them again:

    ... def area(self): return self.w * self.h ... def area(self):  -> " return self.w"

The guesses are deterministic, so the speculative loop treats q as one-hot: a guess is
accepted with probability p(guess) (always, when it is the target's greedy choice).
Use it as a drafter: ``stream_speculative(target, propose_from_prompt, ...)``, or
``functools.partial(propose_from_prompt, max_ngram=4)``.
"""

from __future__ import annotations

from decodelab.validation import check_int


def propose_from_prompt(token_ids: list[int], k: int, max_ngram: int = 3) -> list[int]:
    """Up to k guesses for what follows token_ids (the prompt plus the output so far).

    For n = max_ngram down to 1: find the latest earlier occurrence of the last n tokens and
    return the (up to) k tokens that followed it. [] when no n-gram occurs earlier.
    """
    check_int("k", k, minimum=0)
    check_int("max_ngram", max_ngram, minimum=1)
    token_ids = list(token_ids)
    length = len(token_ids)
    if k == 0:
        return []
    for n in range(min(max_ngram, length - 1), 0, -1):
        suffix = token_ids[-n:]
        # Candidate starts, latest first; start + n < length keeps the suffix itself out and
        # leaves at least one token to propose.
        for start in range(length - n - 1, -1, -1):
            if token_ids[start : start + n] == suffix:
                return token_ids[start + n : start + n + k]
    return []
