"""A feature drafter for speculative decoding, after EAGLE (Li et al. 2024, "EAGLE:
Speculative Sampling Requires Rethinking Feature Uncertainty").

A small draft *model* must guess the next token from the tokens alone. This drafter also
reads what the target already computed: its feature f_t at each position, the last hidden
state after the final norm (the vector the target's lm_head turns into logits). From f_t
and the embedding of the token x_{t+1} it predicts f_{t+1}; the target's own lm_head turns
that prediction into draft logits. For a second guess it feeds its prediction back where
the real f_{t+1} would go, so one step costs one small layer plus the lm_head:

    g_t        = fc([n1(embed(x_{t+1})), n2(f_t)])  [E]   (fc: 2E -> E; n1, n2 RMSNorms: the
                                                           embedding is ~14x smaller than f_t)
    f^_{t+1}   = norm(decoder_layer(g_t | g_<t))    [E]   (one layer of the target's shape,
                                                           with its own KV cache)
    q_{t+1}    = softmax(lm_head(f^_{t+1}))         [V]

The embedding and lm_head are the target's (frozen, not stored with the drafter). Trained
offline by `python -m decodelab.training.train_eagle` on SmolLM2's own chat answers; the weights for
SmolLM2 ship as package data (`smollm2-eagle`).

A drafter may propose only part of the vocabulary (`restrict_vocabulary`; `smollm2-eagle`
stores the ~11k token ids of its training text): its lm_head product then reads about a
quarter of the rows, the largest part of a draft step. Other tokens get probability 0 in q,
which the acceptance rule handles like any other zero (the target can still emit them).

Inside `decodelab.decoding.speculative.stream_speculative` the drafter's state for one generation
is a `FeatureDraftSession`, made by its adapter (`decodelab.decoding.speculative.feature_proposers`):
its KV cache, whose entry j holds the pair (f_j, x_{j+1}) from real target features, and the
target features the drafter has not consumed yet.

Shapes: B batch, T positions, E hidden_size, V vocab_size, k drafted tokens.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import torch
from torch import nn

from decodelab.config import ModelConfig
from decodelab.decoding.sampling import draw_draft_token
from decodelab.model.kv_cache import KVCache
from decodelab.model.llama import DecoderLayer, LlamaForCausalLM, RMSNorm
from decodelab.model.packed_linear import PackedLinear, can_prepack
from decodelab.params import SamplingParams
from decodelab.paths import PACKAGE_DATA

NAMED_DRAFTERS = {"smollm2-eagle": "smollm2"}  # drafter name -> the target it was trained for
WEIGHTS_FILE, CONFIG_FILE = "drafter.safetensors", "drafter.json"
VOCAB_TENSOR = "draft_vocab"  # in WEIGHTS_FILE: the token ids a drafter may propose (int32), if restricted
# tests/test_eagle.py: smollm2-eagle's greedy alpha (k = 3) on the first 3 held-out prompts must
# reach this; it measured 0.44 there on this machine (60 of 136 drafts: a small sample, the 16
# held-out prompts give 0.47-0.53 for k = 1..4, data/smollm2-eagle/TRAINING.md); an untrained
# drafter scores 0.0.
TESTED_MIN_ALPHA = 0.38


class FeatureDrafter(nn.Module):
    """Predicts the target's next feature from its current one and the next token.

    Own parameters: two input RMSNorms, fc (2E -> E), one decoder layer of the target's shape,
    an output RMSNorm.
    Borrowed from the target (see `attach`): embed_tokens, lm_head and the RoPE tables.
    """

    def __init__(self, target_config: ModelConfig):
        super().__init__()
        self.config = dataclasses.replace(target_config, num_hidden_layers=1)
        e = target_config.hidden_size
        self.embed_norm = RMSNorm(e, target_config.rms_norm_eps)
        self.feature_norm = RMSNorm(e, target_config.rms_norm_eps)
        self.fc = nn.Linear(2 * e, e, bias=False)
        self.layer = DecoderLayer(self.config, 0)
        self.norm = RMSNorm(e, target_config.rms_norm_eps)
        self._target: tuple[LlamaForCausalLM] | None = None  # a tuple: not registered as a submodule
        self.draft_vocab: torch.Tensor | None = None  # [V_d] token ids it may propose; None: all
        self._head_cache: tuple | None = None  # (which lm_head weight, its rows at draft_vocab [V_d, E])

    def attach(self, target: LlamaForCausalLM) -> "FeatureDrafter":
        """Use `target`'s embedding, lm_head and RoPE tables (shared, not copied)."""
        if target.config.hidden_size != self.config.hidden_size or target.config.vocab_size != self.config.vocab_size:
            raise ValueError(
                f"this drafter was built for hidden_size {self.config.hidden_size} and vocabulary "
                f"{self.config.vocab_size}; the target has {target.config.hidden_size} and "
                f"{target.config.vocab_size}"
            )
        self._target = (target,)
        return self

    @property
    def target(self) -> LlamaForCausalLM:
        if self._target is None:
            raise RuntimeError("FeatureDrafter.attach(target) first: it borrows the target's embedding and lm_head")
        return self._target[0]

    def forward(
        self,
        features: torch.Tensor,
        next_ids: torch.Tensor,
        kv_cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """features [B, T, E] (f_t) and next_ids [B, T] (x_{t+1}) -> predicted features
        [B, T, E] (f^_{t+1}). Entry t attends to the entries before it (in kv_cache, if given)."""
        target = self.target
        t = next_ids.shape[1]
        if positions is None:
            start = kv_cache.seq_len if kv_cache is not None else 0
            positions = torch.arange(start, start + t, device=next_ids.device)
        cos, sin = target.rope_at(positions)
        embedded = self.embed_norm(target.model.embed_tokens(next_ids))  # [B, T, E]
        x = self.fc(torch.cat([embedded, self.feature_norm(features.to(embedded.dtype))], dim=-1))
        return self.norm(self.layer(x, cos, sin, kv_cache))

    def restrict_vocabulary(self, token_ids: torch.Tensor | None) -> "FeatureDrafter":
        """Propose only these token ids (any shape, duplicates ignored); None: the whole vocabulary."""
        if token_ids is not None:
            token_ids = torch.unique(torch.as_tensor(token_ids).long().flatten())
            if token_ids.numel() == 0 or int(token_ids.min()) < 0 or int(token_ids.max()) >= self.config.vocab_size:
                raise ValueError(f"a draft vocabulary needs token ids in 0..{self.config.vocab_size - 1}")
        self.draft_vocab, self._head_cache = token_ids, None
        return self

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., E] -> float32 logits [..., V] through the target's lm_head; with a draft
        vocabulary, only its rows are computed and every other token gets -inf."""
        if self.draft_vocab is None:
            return self.target.lm_head(features).float()
        weight = self._lm_head_weight()  # [V, E]
        key = (weight.data_ptr(), weight.dtype, weight.device)
        if self._head_cache is None or self._head_cache[0] != key:
            vocab = self.draft_vocab.to(weight.device)
            rows = weight.detach()[vocab].contiguous()  # [V_d, E]
            head = PackedLinear(rows) if can_prepack(rows.device, rows.dtype) else (lambda x: x @ rows.T)
            self._head_cache = (key, vocab, head)
        _, vocab, head = self._head_cache
        small = head(features.to(weight.dtype)).float()  # [..., V_d]
        full = small.new_full((*small.shape[:-1], weight.shape[0]), float("-inf"))
        return full.index_copy_(-1, vocab, small)

    def _lm_head_weight(self) -> torch.Tensor:
        """The target's lm_head matrix [V, E]; a packed lm_head (`decodelab.model.packed_linear`) has
        no readable weight, but a tied one is the embedding."""
        target = self.target
        if hasattr(target.lm_head, "weight"):
            return target.lm_head.weight
        if target.config.tie_word_embeddings:
            return target.model.embed_tokens.weight
        raise ValueError(
            "a draft vocabulary needs the rows of the target's lm_head, and this one is packed "
            "(decodelab.model.packed_linear): restrict_vocabulary(None), or do not pack the lm_head"
        )


# ------------------------------------------------------------------------- saving, loading
def save_drafter(drafter: FeatureDrafter, folder: str | Path, target_name: str, extra: dict | None = None) -> None:
    """Write the drafter's own tensors (bf16) and a small json naming its target's shape."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().to(torch.bfloat16).contiguous() for name, tensor in drafter.state_dict().items()}
    if drafter.draft_vocab is not None:
        state[VOCAB_TENSOR] = drafter.draft_vocab.to(torch.int32).cpu()
    save_file(state, str(folder / WEIGHTS_FILE))
    meta = {"target": target_name, "target_config": drafter.config.to_dict(), **(extra or {})}
    (folder / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def resolve_drafter(name_or_folder: str | Path) -> Path:
    if str(name_or_folder) in NAMED_DRAFTERS:
        folder = PACKAGE_DATA / str(name_or_folder)
    else:
        folder = Path(name_or_folder)
    if not (folder / WEIGHTS_FILE).exists() or not (folder / CONFIG_FILE).exists():
        raise ValueError(
            f"no feature drafter at {name_or_folder!r}: expected {WEIGHTS_FILE} and {CONFIG_FILE} "
            f"(named drafters: {', '.join(NAMED_DRAFTERS)})"
        )
    return folder


def load_drafter(target: LlamaForCausalLM, name_or_folder: str | Path = "smollm2-eagle") -> FeatureDrafter:
    """A trained drafter, attached to `target`, on the target's device and dtype, restricted to
    its stored draft vocabulary if it has one."""
    from safetensors.torch import load_file

    folder = resolve_drafter(name_or_folder)
    meta = json.loads((folder / CONFIG_FILE).read_text())
    config = ModelConfig.from_dict(meta["target_config"])
    drafter = FeatureDrafter(config)
    state = load_file(str(folder / WEIGHTS_FILE))
    vocab = state.pop(VOCAB_TENSOR, None)
    drafter.load_state_dict(state)
    drafter.restrict_vocabulary(vocab)
    return drafter.to(device=target.device, dtype=target.dtype).eval().attach(target)


# ------------------------------------------------------------------- one generation's state
class FeatureDraftSession:
    """The drafter's side of one speculative generation.

    Invariant between steps, with `ids` the tokens so far (the last one pending, not yet in
    the target's cache): the target has produced features for positions 0 .. len(ids) - 2;
    the drafter's cache holds entries 0 .. seq_len - 1, entry j made from (f_j, x_{j+1});
    `unfed` [m, E] holds the features f_{seq_len} .. f_{len(ids) - 2} not yet turned into entries.
    """

    def __init__(self, drafter: FeatureDrafter, max_len: int, offset: int = 0):
        target = drafter.target
        self.drafter = drafter
        # offset: the position of the first feature. A session may start after a prefix whose
        # features it never saw (the batched engine's cached prefix); RoPE scores depend on relative
        # positions only, so entries shifted by `offset` attend to each other as they would unshifted.
        self.offset = offset
        self.cache = KVCache(drafter.config, 1, max_len, device=target.device, dtype=target.dtype)
        self.unfed = torch.empty(0, drafter.config.hidden_size, device=target.device, dtype=target.dtype)

    @property
    def next_position(self) -> int:
        """The position whose feature `add_features` takes next."""
        return self.offset + self.cache.seq_len + self.unfed.shape[0]

    def fork(self) -> "FeatureDraftSession":
        """An independent copy (a sibling sample of the same prompt), sharing the drafter."""
        twin = copy.copy(self)
        twin.cache, twin.unfed = copy.deepcopy(self.cache), self.unfed.clone()
        return twin

    def add_features(self, features: torch.Tensor) -> None:
        """features [m, E]: the target's features for the next m positions."""
        self.unfed = torch.cat([self.unfed, features.to(self.unfed.dtype)])

    def catch_up(self, ids: list[int]) -> torch.Tensor:
        """Turn every unfed feature f_j into a cache entry with the token after it, x_{j+1};
        return the drafter's prediction for the pending token's feature, f^_{len(ids)-1} [1, 1, E]."""
        start, m = self.cache.seq_len, self.unfed.shape[0]
        if self.offset + start + m != len(ids) - 1:
            raise RuntimeError(
                f"drafter out of step: {start} entries + {m} unfed features from position "
                f"{self.offset} for {len(ids)} tokens"
            )
        next_ids = torch.tensor([ids[self.offset + start + 1 :]], device=self.unfed.device)  # [1, m]
        feature = self.drafter(self.unfed[None], next_ids, kv_cache=self.cache)[:, -1:]  # [1, 1, E]
        self.unfed = self.unfed[:0]
        return feature

    def propose(
        self, ids: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k >= 1 guesses after ids -> (draft_tokens [k], draft_probs [k, V], or None when greedy).

        `catch_up` makes the first prediction from the target's own features; the k - 1 later
        forwards feed the drafter's predictions, and their entries are dropped from the cache
        afterwards (they did not come from the target). A one-token prompt gives no target
        feature yet, so the first step drafts nothing."""
        if len(ids) < 2:
            empty = torch.empty(0, dtype=torch.long, device=self.unfed.device)
            return empty, None if params.greedy else torch.empty(
                0, self.drafter.config.vocab_size, device=self.unfed.device
            )
        feature = self.catch_up(ids)  # [1, 1, E]
        tokens, dists = [], []
        for i in range(k):
            token, q = draw_draft_token(self.drafter.logits(feature)[0, -1], params, generator)  # [1], [V] | None
            tokens.append(token)
            dists += [q] if q is not None else []
            if i + 1 < k:
                feature = self.drafter(feature, token[None], kv_cache=self.cache)  # [1, 1, E]
        self.cache.truncate(len(ids) - 1 - self.offset)
        return torch.cat(tokens), torch.stack(dists) if dists else None
