"""A draft TREE verified in one target pass, greedy: notebook 09's exercise `verify_tree`, a
drafter that proposes such a tree, and the loop that measures it against a chain.

The engine's tree (`decodelab.decoding.draft_tree`) has depth 1: w candidates for the next
token. Here any tree: node i holds a token and its parent's index (-1 for the pending token,
the root). Flattened as [pending, node 0, ..., node n-1], the target judges every path at once:

    positions   start + depth (the pending token at start, a node one past its parent)
    mask        row a sees column b when b is a or one of a's ancestors (and the whole prefix)

Row a of the logits is then what the target would say after the path from the root to a, as
if that path had been run alone. At temperature 0 the step follows the target's argmax down the
tree as far as a child carries it, emits that path's tokens and the argmax at its end, and keeps
only the path's K/V rows (moved next to the pending token's). Shapes: n nodes, V vocab_size.
"""

from __future__ import annotations

import torch

from decodelab.decoding.draft_tree import TreeMaskedCache
from decodelab.model.kv_cache import KVCache


def tree_layout(parents: list[int], start: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """parents [n] (parents[i] < i, -1 for the root) -> (mask bool [n+1, n+1], positions [n+1])
    of the flattened [pending, node 0 .. node n-1], pending at position `start`."""
    n = len(parents)
    mask = torch.eye(n + 1, dtype=torch.bool, device=device)
    depth = [0] * (n + 1)
    for node, parent in enumerate(parents):
        if not -1 <= parent < node:
            raise ValueError(f"node {node} has parent {parent}: a parent comes before its child (-1 is the root)")
        row, up = node + 1, parent + 1
        depth[row] = depth[up] + 1
        mask[row] |= mask[up]  # a node sees what its parent sees, and itself
    return mask, start + torch.tensor(depth, device=device)


def greedy_path(choice: list[int], tree_tokens: list[int], parents: list[int]) -> list[int]:
    """The accepted path at temperature 0: from the root (row 0), step to the child whose token is
    the target's choice at the current row, while there is one -> the path's rows (1-based)."""
    path, row = [], 0
    while True:
        child = next(
            (node + 1 for node, parent in enumerate(parents) if parent + 1 == row and tree_tokens[node] == choice[row]),
            None,
        )
        if child is None:
            return path
        path.append(child)
        row = child


def keep_path(cache: KVCache, start: int, path: list[int]) -> None:
    """After a tree pass that began at row `start`: keep the pending token's row and the path's,
    moved to start + 1 .. start + len(path); forget the rest."""
    if path:
        source = torch.tensor(path, device=cache.keys.device) + start
        cache.keys[:, :, :, start + 1 : start + 1 + len(path)] = cache.keys[:, :, :, source]
        cache.values[:, :, :, start + 1 : start + 1 + len(path)] = cache.values[:, :, :, source]
    cache.truncate(start + 1 + len(path))


def verify_tree(target, cache: KVCache, pending: int, tree_tokens: list[int], parents: list[int]) -> torch.Tensor:
    """Greedy verification of a draft tree in ONE target pass -> the emitted tokens, LongTensor [m+1].

    cache holds the text but its last token, `pending` (start = cache.seq_len positions).
    tree_tokens [n], parents [n]: node i's token and its parent's index (-1: the pending token),
    parents[i] < i, siblings with different tokens. The pass: target(tokens [1, n+1], positions
    [n+1], kv_cache=TreeMaskedCache(cache, mask [n+1, n+1])), laid out as the module docstring
    shows. Emits the deepest path whose every token is the target's argmax after its parent,
    then the argmax after the path; the cache keeps start + 1 + m rows (pending's and the path's).
    """
    start, device = cache.seq_len, target.device
    mask, positions = tree_layout(parents, start, device)
    tokens = torch.tensor([[pending, *tree_tokens]], device=device)  # [1, n+1]
    logits = target(tokens, positions=positions, kv_cache=TreeMaskedCache(cache, mask))[0]  # [n+1, V]
    choice = logits.argmax(dim=-1).tolist()
    path = greedy_path(choice, tree_tokens, parents)
    keep_path(cache, start, path)
    last = path[-1] if path else 0
    return torch.tensor([tree_tokens[row - 1] for row in path] + [choice[last]], device=device)


@torch.inference_mode()
def propose_tree(draft, draft_cache: KVCache, ids: list[int], depth: int, width: int) -> tuple[list[int], list[int]]:
    """The draft's top-`width` tokens after ids, each continued greedily to `depth` tokens: a tree
    of width branches (width 1: a chain) -> (tree_tokens, parents), flattened level by level.
    draft_cache holds a prefix of ids; it is fed the rest and ends holding all of ids (each
    branch's guesses are truncated away after it)."""
    unseen = torch.tensor([ids[draft_cache.seq_len :]], device=draft.device)  # [1, >= 1]
    logits = draft(unseen, kv_cache=draft_cache, last_only=True)[0, -1]  # [V]
    branches = []
    for first in logits.topk(width).indices.tolist():
        branch = [first]
        for _ in range(depth - 1):
            step = draft(torch.tensor([branch[-1:]], device=draft.device), kv_cache=draft_cache, last_only=True)
            branch.append(int(step[0, -1].argmax()))
        draft_cache.truncate(len(ids))
        branches.append(branch)
    tree_tokens, parents = [], []
    for level in range(depth):
        for branch in branches:
            parents.append(-1 if level == 0 else len(tree_tokens) - width)
            tree_tokens.append(branch[level])
    return tree_tokens, parents


@torch.inference_mode()
def tree_generate(
    target, draft, ids: list[int], max_tokens: int, depth: int, width: int, verify=verify_tree
) -> tuple[list[int], int]:
    """Greedy decoding with a draft tree per step (`propose_tree`, judged by `verify`) ->
    (the first max_tokens generated tokens, the target's forward passes, prefill excluded)."""
    room = len(ids) + max_tokens + depth * width + 1
    cache = KVCache(target.config, 1, room, device=target.device)
    draft_cache = KVCache(draft.config, 1, room, device=draft.device)
    if len(ids) > 1:
        target(torch.tensor([ids[:-1]], device=target.device), kv_cache=cache)
    out, calls = [], 0
    while len(out) < max_tokens:
        text = ids + out
        tree_tokens, parents = propose_tree(draft, draft_cache, text, depth, width)
        out += [int(t) for t in verify(target, cache, text[-1], tree_tokens, parents)]
        calls += 1
    return out[:max_tokens], calls
