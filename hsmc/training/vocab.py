"""Draft vocabulary: the most frequent target tokens of the training responses (DESIGN §4)."""

from __future__ import annotations

import torch


def build_vocab_mapping(token_counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [draft], t2d bool [vocab]): kept ids sorted ascending, target_id = draft_id + d2t[draft_id].

    Ties are broken by the lower token id, so the mapping is deterministic.
    """
    vocab = token_counts.numel()
    if not 0 < draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} must lie in [1, {vocab}]")
    order = torch.argsort(token_counts, descending=True, stable=True)
    kept = torch.sort(order[:draft_vocab_size]).values
    d2t = kept - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    return d2t.to(torch.int64), t2d
