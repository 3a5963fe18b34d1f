"""`model` level: ancestral sampling from one model (the bottom of a stack)."""

from __future__ import annotations

import torch

from hsmc.engine.sampler import sample
from hsmc.levels.base import Proposal, SequenceState, StepOutput


class ModelLevel:
    feature_layers: tuple[int, ...] = ()  # ancestral sampling reads no verifier features

    def __init__(self, state: SequenceState, temperature: float, generator: torch.Generator) -> None:
        self.state = state
        self.temperature = temperature
        self.generator = generator

    def load_prompts(self, rows: torch.Tensor, prompts: list[list[int]]) -> None:
        self.state.load_prompts(rows, prompts)

    def prefill(self, rows: torch.Tensor, features: StepOutput | None = None) -> None:
        """Process the prompt but its last token, which stays pending for the first step."""
        self.state.forward(rows, self.state.seq_len[rows] - 1)

    def propose(self, rows: torch.Tensor, k: int) -> Proposal:
        tokens, logq, logprobs = [], [], []
        for _ in range(k):
            last = self.state.forward(rows).last(1)[:, 0]
            tok, lp = sample(last, self.temperature, self.generator)
            self.state.append(rows, tok[:, None])
            tokens.append(tok)
            logq.append(lp)
            if self.temperature > 0:
                logprobs.append(torch.log_softmax(last.float() / self.temperature, -1))
        return Proposal(
            tokens=torch.stack(tokens, 1),
            logq=torch.stack(logq, 1),
            logprobs=torch.stack(logprobs, 1) if logprobs else None,
        )

    def commit(self, rows: torch.Tensor, n: int) -> None:
        """Nothing to do: a model level never proposes more than it was asked for."""

    def accept(
        self, rows: torch.Tensor, keep_len: torch.Tensor, next_token: torch.Tensor, features: StepOutput | None = None
    ) -> None:
        self.state.truncate(rows, keep_len, next_token)

    def fork(self, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
        self.state.fork(src_rows, dst_rows)

    def release(self, rows: torch.Tensor) -> None:
        self.state.release(rows)

    def reset_stats(self) -> None:
        self.state.forward_seconds = 0.0

    def stats(self) -> dict[str, float]:
        return {"forward_seconds": self.state.forward_seconds}
