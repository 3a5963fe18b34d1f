"""Block-scaled FP8 weights: the layout of Qwen's (and DeepSeek's) FP8 releases, and the reference Linear on them.

A weight [N, K] is stored as float8_e4m3fn with one fp32 `weight_scale_inv` per block of bn x bk entries
([ceil(N/bn), ceil(K/bk)]); the real weight is `weight * weight_scale_inv` broadcast over each block, as
config.json's `quantization_config` says. Activations stay in the model's dtype (weight-only: decode is bound by
reading weights, and halving their bytes is the speed-up), unless `engine.fp8_activations` quantizes them per row
and block of columns (`quantize_activations`) for the FP8 tensor cores. Calling an `Fp8Linear` is the reference:
the dequantized matmul, the oracle of the kernels the router picks (`linear_router.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hsmc.errors import ModelLoadError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
QWEN_BLOCK = (128, 128)


@dataclass(frozen=True)
class Fp8Format:
    """What a checkpoint's `quantization_config` promises: block-scaled e4m3 weights, dynamic activations.

    Which modules are FP8 (`modules_to_not_convert` lists the others) the loader reads from the weights
    themselves: a Linear is FP8 exactly where the checkpoint has its `weight_scale_inv`.
    """

    block: tuple[int, int]

    @classmethod
    def from_config(cls, config: dict[str, Any], source: str) -> Fp8Format | None:
        """None for an unquantized checkpoint; a one-line ModelLoadError for a quantization hsmc cannot run."""
        q = config.get("quantization_config")
        if not q:
            return None
        method = q.get("quant_method")
        if method != "fp8":
            raise ModelLoadError(
                f"{source}: quantization_config.quant_method={method!r} is not supported "
                "(hsmc reads block-scaled fp8 checkpoints, or quantizes bf16 ones with dtype: fp8)"
            )
        block = q.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise ModelLoadError(
                f"{source}: quantization_config.weight_block_size={block!r}: hsmc reads block-scaled fp8 "
                "(e.g. [128, 128]); per-tensor or per-channel fp8 checkpoints are not supported"
            )
        if q.get("activation_scheme", "dynamic") != "dynamic":
            raise ModelLoadError(
                f"{source}: quantization_config.activation_scheme={q['activation_scheme']!r} is not supported "
                "(hsmc keeps activations unquantized: only 'dynamic' checkpoints carry no activation scales)"
            )
        return cls((block[0], block[1]))


def _expand(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """Per-block scales [N/bn, K/bk] broadcast to every entry of an [N, K] weight."""
    return scale.repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, : shape[1]]


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, fp32 scale per block) with each block's largest magnitude mapped to e4m3's 448."""
    n, k = weight.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    padded = F.pad(weight.float(), (0, kb * bk - k, 0, nb * bn - n))
    amax = padded.view(nb, bn, kb, bk).abs().amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = (weight.float() / _expand(scale, block, weight.shape)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """The real weight: weight * scale in fp32, rounded once to `dtype` (the oracle's definition)."""
    if weight.is_cuda:
        from hsmc.ops.fp8_gemm import dequantize_fp8_triton

        return dequantize_fp8_triton(weight, scale, block, dtype)
    return (weight.float() * _expand(scale, block, weight.shape)).to(dtype)


def quantize_activations(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as the FP8 GEMM sees it: each row's blocks of `group` columns scaled so that their largest magnitude
    is e4m3's 448, rounded to e4m3 and scaled back (fp32 arithmetic, the result in x's dtype)."""
    k = x.shape[-1]
    blocks = -(-k // group)
    padded = F.pad(x.float(), (0, blocks * group - k)).unflatten(-1, (blocks, group))
    scale = (padded.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = (padded / scale).to(FP8_DTYPE).float() * scale
    return q.flatten(-2)[..., :k].to(x.dtype)


class Fp8Linear(nn.Module):
    """A Linear with a block-scaled FP8 weight; `parts` (as in `FusedLinear`) when it stands for several.

    A fused weight concatenates its parts' rows, and its scales their scale rows, which is exact only if
    every part but the last ends on a scale-block boundary (`check_parts`).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        block: tuple[int, int],
        parts: list[tuple[str, int]] | None = None,
        bias_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block, self.parts = in_features, out_features, block, parts
        nb, kb = -(-out_features // block[0]), -(-in_features // block[1])
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(nb, kb, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=bias_dtype), requires_grad=False) if bias else None
        self.dynamic_activations = False  # the engine's `fp8_activations`: set when a stack is built

    @classmethod
    def of(
        cls, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dynamic_activations: bool = False
    ) -> Fp8Linear:
        """The Linear of an already quantized weight [N, K] and its block scales (no bias)."""
        linear = cls(weight.shape[1], weight.shape[0], False, block)
        linear.weight = nn.Parameter(weight, requires_grad=False)
        linear.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
        linear.dynamic_activations = dynamic_activations
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ dequant(weight)^T [+ bias]; with `dynamic_activations`, x quantized first when it has two or more
        rows (one row, batch-1 decode, stays weight-only: it is bound by the weight read)."""
        if self.dynamic_activations and x.numel() > x.shape[-1]:
            x = quantize_activations(x, self.block[1])
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8(self.weight, self.weight_scale_inv, self.block, dtype)

    def split_sizes(self, kind: str) -> list[int]:
        """Rows of each part in the fused `kind` tensor (scale rows for `weight_scale_inv`)."""
        sizes = [n for _, n in self.parts or []]
        if kind != "weight_scale_inv":
            return sizes
        return [-(-n // self.block[0]) for n in sizes]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}, fp8"


def swap_for_fp8(model: nn.Module, name: str, block: tuple[int, int], where: str) -> Fp8Linear:
    """Replace the Linear (or FusedLinear) `name` of `model` by an uninitialised (meta) Fp8Linear of its shape."""
    module = model.get_submodule(name)
    parts = getattr(module, "parts", None)
    if parts:
        check_parts(parts, block, f"{where}: {name}")
    with torch.device("meta"):
        bias_dtype = module.bias.dtype if module.bias is not None else None
        fp8 = Fp8Linear(module.in_features, module.out_features, module.bias is not None, block, parts, bias_dtype)
    owner, _, child = name.rpartition(".")
    model.get_submodule(owner).add_module(child, fp8)
    return fp8


def layer_linears(model: nn.Module) -> list[str]:
    """Names of the decoder layers' Linears: what FP8 checkpoints quantize (not embeddings, head or norms)."""
    return [n for n, m in model.model.layers.named_modules(prefix="model.layers") if isinstance(m, nn.Linear)]


def check_parts(parts: list[tuple[str, int]], block: tuple[int, int], where: str) -> None:
    """Fused FP8 parts must meet at scale-block boundaries (Qwen3's head and MLP sizes are multiples of 128)."""
    for name, n in parts[:-1]:
        if n % block[0]:
            raise ModelLoadError(
                f"{where}: {name} has {n} output rows, not a multiple of the fp8 block {block[0]}: "
                "its scales cannot be fused with the next part's"
            )
