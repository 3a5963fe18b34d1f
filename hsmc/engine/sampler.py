"""The one sampler: the law each row's tokens follow, its log-probabilities, and Gumbel-max draws from it.

A row's law is softmax(ℓ/T) cut to the top_k most likely tokens, then to the fewest of those whose probability
reaches top_p, renormalized (temperature, then top-k, then top-p on what top-k left, as Hugging Face's and vLLM's
samplers apply them); T = 0 is greedy, the argmax with log-probability 0. The cut is a floor on the raw logits (the
smallest one kept), so one comparison applies it in any precision and at any power of the law. Each level holds
the law of its rows (`RowLaws`): its configured temperature, and for the top level each request's parameters.

A draw is argmax(ℓ·s + g) over the kept tokens, g ~ Gumbel(0, 1) from the row's key (`random_streams`): exact, no
host sync, no `torch.multinomial`, and the log-probability comes from the same scaled logits, so the value a level
reports upward is the one it sampled from. The draw runs through the stack's backend: one pass over the logits in
Triton (`hsmc.ops.vocab.gumbel_max`), or torch ops (`TorchBackend`, the reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hsmc.engine.graphs import GraphParts, HostField
from hsmc.engine.host_io import upload
from hsmc.ops.backend import Backend, TorchBackend


@dataclass
class Law:
    """The law of a batch of rows, with what the host knows of it (the shape of a step may depend on it)."""

    temperature: torch.Tensor  # float32 [R]
    top_k: torch.Tensor  # int64 [R], 0 = every token
    top_p: torch.Tensor  # float32 [R], 1 = every token
    greedy: bool  # every row has T = 0
    some_greedy: bool  # some row has T = 0
    truncates: bool  # some row has top_k or top_p
    backend: Backend  # whose Gumbel-max pass draws

    def scale(self, power: float = 1.0) -> torch.Tensor:
        """power / T per row (float32 [R]); 0 for a greedy row."""
        t = self.temperature
        return torch.where(t > 0, power / t.clamp_min(1e-30), 0.0)

    def floors(self, logits: torch.Tensor) -> torch.Tensor:
        """The smallest raw logit each row (and position) keeps: float32 [R, ...] for logits [R, ..., V]; -inf where
        the law cuts nothing."""
        shape = logits.shape[:-1]
        if not self.truncates:
            return torch.full(shape, float("-inf"), device=logits.device)
        extra = (1,) * (logits.dim() - 2)
        values, _ = logits.float().sort(-1, descending=True)
        columns = torch.arange(values.shape[-1], device=logits.device)
        k = self.top_k.view(-1, *extra, 1)
        in_k = (k == 0) | (columns < k)
        probs = torch.softmax(torch.where(in_k, values * self.scale().view(-1, *extra, 1), float("-inf")), -1)
        before = probs.cumsum(-1) - probs  # the mass of the more likely tokens
        kept = in_k & (before < self.top_p.view(-1, *extra, 1))  # a prefix of the sorted tokens
        floor = values.gather(-1, (kept.sum(-1, keepdim=True) - 1).clamp_min(0)).squeeze(-1)
        cuts = ((self.top_k > 0) | (self.top_p < 1)) & (self.temperature > 0)
        return torch.where(cuts.view(-1, *extra), floor, float("-inf"))

    def log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """log p'(v) for logits [R, ..., V] (float32): -inf outside a row's cut; a greedy row is one-hot."""
        extra = (1,) * (logits.dim() - 2)
        x = logits.float()
        scaled = x * self.scale().view(-1, *extra, 1)
        if self.truncates:
            scaled = torch.where(x >= self.floors(logits)[..., None], scaled, float("-inf"))
        out = torch.log_softmax(scaled, -1)
        if self.some_greedy:
            columns = torch.arange(x.shape[-1], device=x.device)
            one_hot = torch.where(columns == x.argmax(-1, keepdim=True), 0.0, float("-inf"))
            out = torch.where((self.temperature == 0).view(-1, *extra, 1), one_hot, out)
        return out

    def sample(self, logits: torch.Tensor, keys: torch.Tensor, power: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """One draw per row of logits [R, V] from p'^power (normalized; power > 0) with noise keyed by `keys` [R]:
        (tokens int64 [R], log-probabilities of the drawn tokens under p'^power, float32 [R]); a greedy row gives
        its argmax and 0."""
        return self.backend.gumbel_max(logits, self.scale(power), self.floors(logits), keys)


class RowLaws:
    """The law of every row of one level: its configured temperature, or what the driver assigned to a request's
    rows (the top level's). The host keeps what it assigned, so a step knows whether any row truncates or samples
    without reading the device."""

    def __init__(self, temperature: float, max_rows: int, device: torch.device, backend: Backend | None = None) -> None:
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        self.backend = backend or TorchBackend()  # the stack's: its draws run as its other device steps
        self.default = temperature
        self.temperature = torch.full((max_rows + 1,), temperature, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(max_rows + 1, dtype=torch.int64, device=device)
        self.top_p = torch.ones(max_rows + 1, dtype=torch.float32, device=device)
        self.assigned: dict[int, tuple[float, int, float]] = {}
        self._counts = [0, 0, 0]  # assigned rows: greedy, sampling, cut
        self._flags()

    def assign(self, rows: list[int], laws: list[tuple[float, int, float]]) -> None:
        """Row rows[i] follows laws[i] = (temperature, top_k, top_p) until it is cleared."""
        device = self.temperature.device
        index = upload(torch.tensor(rows, dtype=torch.int64), device)
        self.temperature[index] = upload(torch.tensor([t for t, _, _ in laws], dtype=torch.float32), device)
        self.top_k[index] = upload(torch.tensor([k for _, k, _ in laws], dtype=torch.int64), device)
        self.top_p[index] = upload(torch.tensor([p for _, _, p in laws], dtype=torch.float32), device)
        for row, law in zip(rows, laws):
            self._count(self.assigned.get(row), -1)
            self._count(law, 1)
            self.assigned[row] = law
        self._flags()

    def clear(self, rows: list[int]) -> None:
        for row in rows:
            self._count(self.assigned.pop(row, None), -1)
        self._flags()

    def at(self, rows: torch.Tensor) -> Law:
        return Law(self.temperature[rows], self.top_k[rows], self.top_p[rows], self.greedy, self.some_greedy,
                   self.truncates, self.backend)  # fmt: skip

    def graph_parts(self) -> GraphParts:
        """Its host facts are keys of a captured round: what the round's code branches on."""
        return GraphParts(host=[HostField(self, name) for name in ("greedy", "some_greedy", "truncates")])

    def _count(self, law: tuple[float, int, float] | None, sign: int) -> None:
        if law is not None:
            t, k, p = law
            self._counts[0] += sign * (t == 0)
            self._counts[1] += sign * (t > 0)
            self._counts[2] += sign * (t > 0 and (k > 0 or p < 1))

    def _flags(self) -> None:
        """Host facts over the assigned rows and the configured law (which the other rows keep): graph keys."""
        greedy, sampling, cut = self._counts
        self.greedy = self.default == 0 and sampling == 0
        self.some_greedy = self.default == 0 or greedy > 0
        self.truncates = cut > 0
