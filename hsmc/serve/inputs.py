"""From an OpenAI request to what the driver takes: prompt token ids and one `SamplingParams` per choice.

Choice k (prompt k // n, sample k % n) decodes with the stream `derive_seed(seed, k)`, as prompt k of
`decoder.generate(prompts, seed=seed)` does, so a seeded request reproduces `generate` exactly.
"""

from __future__ import annotations

from typing import Any

from hsmc.config import GenerationConfig
from hsmc.errors import PromptError, RequestError
from hsmc.models.tokenizer import encode_prompt
from hsmc.requests import SamplingParams, derive_seed, fresh_seed
from hsmc.serve.errors import bad_request, from_request_error
from hsmc.serve.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest


def completion_prompts(tokenizer: Any | None, request: CompletionRequest) -> list[list[int]]:
    """Token ids of each prompt, as given: no chat template (that is what /v1/chat/completions is for)."""
    try:
        return [encode_prompt(tokenizer, prompt, chat_template=False) for prompt in request.prompts]
    except PromptError as e:
        raise bad_request(str(e), "prompt") from None


def chat_prompt(tokenizer: Any | None, request: ChatCompletionRequest) -> list[int]:
    """The messages through the tokenizer's chat template, with the assistant's turn opened."""
    if tokenizer is None or not tokenizer.chat_template:
        raise bad_request("this model's tokenizer has no chat template: send a prompt to /v1/completions", "messages")
    messages = [m.for_template() for m in request.messages]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # the template's own checks (roles, order) or messages it cannot render
        raise bad_request(f"the chat template refused them: {e}", "messages") from None
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def choice_params(
    request: SamplingRequest, prompts: list[list[int]], generation: GenerationConfig, vocab: int
) -> tuple[list[list[int]], list[SamplingParams]]:
    """(prompt, params) of every choice: each prompt n times. Unset fields take the config's `generation.stop`
    and `ignore_eos`, as in `generate`; the driver fills in the rest."""
    unsupported = request.unsupported()
    if unsupported is not None:
        raise bad_request(f"{unsupported} is not supported by hsmc serve", unsupported)
    for ids in prompts:
        outside = next((t for t in ids if not 0 <= t < vocab), None)
        if outside is not None:
            raise bad_request(f"token id {outside} is outside the vocabulary (0..{vocab - 1})", "prompt")
    stop = request.stop if request.stop is not None else list(generation.stop)
    seed = request.seed if request.seed is not None else fresh_seed()
    limit_field, limit = request.token_limit
    choices = [ids for ids in prompts for _ in range(request.n)]
    try:
        params = [
            SamplingParams(
                max_tokens=limit,
                stop=(stop,) if isinstance(stop, str) else tuple(stop),
                seed=derive_seed(seed, k),
                temperature=request.temperature,
                top_p=1.0 if request.top_p is None else request.top_p,
                top_k=0 if request.top_k is None else request.top_k,
                particles=request.particles,
                ignore_eos=generation.ignore_eos if request.ignore_eos is None else request.ignore_eos,
            )
            for k in range(len(choices))
        ]
    except RequestError as e:
        raise from_request_error(e, limit_field) from None
    return choices, params
