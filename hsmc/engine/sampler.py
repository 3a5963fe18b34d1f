"""Gumbel-max sampling with the drawn token's log-probability.

argmax(l/T + g), g ~ Gumbel(0, 1), is an exact draw from softmax(l/T) with no host sync and
no `torch.multinomial`; the log-prob comes from the same scaled logits, so the value a
level reports upward is the one it sampled from. All noise comes from a seeded generator. On
CUDA the draw is one pass over the logits in Triton (`hsmc.ops.vocab.gumbel_max`: Philox noise
keyed by a seed the generator draws on the device); on the CPU, torch ops (the reference).
"""

from __future__ import annotations

import torch


def gumbel_noise(
    shape: torch.Size | tuple[int, ...], generator: torch.Generator | None, device: torch.device
) -> torch.Tensor:
    """Standard Gumbel noise -log(-log U) in fp32, from `generator`."""
    uniform = torch.rand(shape, generator=generator, device=device)
    return -torch.log(-torch.log(uniform.clamp_min(torch.finfo(torch.float32).tiny)))


def sample(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of `logits` [..., V]; returns (tokens int64 [...], logprobs fp32 [...]).

    Temperature 0 is greedy: the argmax, with log-prob 0 (a point mass).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, torch.zeros(tokens.shape, dtype=torch.float32, device=logits.device)
    if logits.is_cuda:  # one pass over the logits (`hsmc.ops.vocab`), Philox noise keyed from the generator
        from hsmc.ops.vocab import gumbel_max

        seed = torch.randint(2**62, (1,), generator=generator, device=logits.device)
        tokens, logprobs = gumbel_max(logits.reshape(-1, logits.shape[-1]), temperature, seed)
        return tokens.view(logits.shape[:-1]), logprobs.view(logits.shape[:-1])
    return gumbel_max_reference(logits, temperature, generator)


def gumbel_max_reference(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The draw of `sample` at temperature > 0 in torch ops: the CPU path, and the reference of the CUDA kernel."""
    scaled = logits.float() / temperature
    tokens = (scaled + gumbel_noise(scaled.shape, generator, scaled.device)).argmax(-1)
    logprobs = torch.log_softmax(scaled, -1).gather(-1, tokens[..., None]).squeeze(-1)
    return tokens, logprobs
