"""Per-GPU kernel tuning as data: what `hsmc tune-kernels` measured on one GPU model with one torch / CUDA / cuBLAS,
read from the JSON files in `hsmc/ops/tuning/` (the schema is `KernelTuning`). A GPU or library version without a
file runs the heuristic defaults (`DEFAULTS`) and says so once in the log: the fastest kernel for a shape depends
on all of them, and a table measured elsewhere is a guess."""

from __future__ import annotations

import ctypes
import json
import logging
from dataclasses import asdict, dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from hsmc.ops.decode_linear import DecodeLinearPlan
from hsmc.ops.few_row_linear import FewRowPlan

SCHEMA_VERSION = 4  # 2: one_row_plans; 3: fp8_flashinfer_version / fp8_flashinfer_gemms; 4: fp8_one_row_plans
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockScaledRows:
    """Where the cuBLASLt block-scaled FP8 GEMM (`torch._scaled_mm`) runs FP8 activations: from `min_rows` rows,
    the rows padded to a multiple of `row_multiple` (cuBLASLt refuses some row counts, e.g. 1 on Hopper)."""

    min_rows: int
    row_multiple: int


@dataclass(frozen=True)
class LibraryGemms:
    """GEMMs (N, K, rows) measured faster in an optional library than in the default route, and the library's version
    they were measured with: with another version, or none, installed they run the default."""

    version: str
    gemms: frozenset[tuple[int, int, int]]


@dataclass(frozen=True)
class Versions:
    torch: str
    cuda: str | None
    cublas: str | None  # None: not recorded (the torch wheel pins its cuBLAS)

    def matches(self, current: Versions) -> bool:
        return (self.torch, self.cuda) == (current.torch, current.cuda) and self.cublas in (None, current.cublas)


@dataclass(frozen=True)
class KernelTuning:
    """The measured choices for one GPU model and library versions. Shapes are (N, K) of a weight [N, K]."""

    device_name: str
    capability: tuple[int, int]
    versions: Versions
    measured: str  # when and how, for the reader
    # (N, K) -> one-row kernel plan of a dense weight, where one beat the default (`plan_decode_linear`)
    one_row_plans: dict[tuple[int, int], DecodeLinearPlan] = field(default_factory=dict)
    # the same for FP8 weights in 128x128 scale blocks
    fp8_one_row_plans: dict[tuple[int, int], DecodeLinearPlan] = field(default_factory=dict)
    # (N, K, row tile 16 or 32) -> few-row kernel plan; a 32-row plan exists only where it beat cuBLAS
    few_row_plans: dict[tuple[int, int, int], FewRowPlan] = field(default_factory=dict)
    cublaslt_gemms: frozenset[tuple[int, int, int]] = frozenset()  # (N, K, rows): dense GEMMs faster in cuBLASLt
    padded_rows: dict[tuple[int, int, int], int] = field(default_factory=dict)  # (N, K, rows) -> rows to run
    fp8_weight_only_max_rows: int = 256  # FP8 weights, bf16 activations: Triton GEMM up to here, then cuBLAS
    fp8_block_scaled: BlockScaledRows | None = None  # None: FP8 activations always run the Triton GEMM
    fp8_flashinfer: LibraryGemms | None = None  # FP8-activation GEMMs faster in flashinfer than in cuBLASLt
    source: str = "defaults"  # the file it was read from

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "device": {"name": self.device_name, "capability": list(self.capability)},
            "versions": asdict(self.versions),
            "measured": self.measured,
            "one_row_plans": [{"n": n, "k": k, **asdict(plan)} for (n, k), plan in self.one_row_plans.items()],
            "fp8_one_row_plans": [{"n": n, "k": k, **asdict(plan)} for (n, k), plan in self.fp8_one_row_plans.items()],
            "few_row_plans": [
                {"n": n, "k": k, "row_tile": tile, **asdict(plan)} for (n, k, tile), plan in self.few_row_plans.items()
            ],
            "cublaslt_gemms": [{"n": n, "k": k, "rows": m} for n, k, m in sorted(self.cublaslt_gemms)],
            "padded_rows": [{"n": n, "k": k, "rows": m, "run_rows": r} for (n, k, m), r in self.padded_rows.items()],
            "fp8_weight_only_max_rows": self.fp8_weight_only_max_rows,
            "fp8_block_scaled": asdict(self.fp8_block_scaled) if self.fp8_block_scaled else None,
            "fp8_flashinfer_version": self.fp8_flashinfer.version if self.fp8_flashinfer else None,
            "fp8_flashinfer_gemms": [
                {"n": n, "k": k, "rows": m}
                for n, k, m in sorted(self.fp8_flashinfer.gemms if self.fp8_flashinfer else ())
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str) -> KernelTuning:
        """The tuning a file holds; ValueError naming the file and the key for anything off-schema."""
        try:
            if data["schema_version"] != SCHEMA_VERSION:
                raise ValueError(
                    f"schema_version {data['schema_version']!r}, this hsmc reads {SCHEMA_VERSION} "
                    "(`hsmc tune-kernels` on that GPU writes it anew)"
                )
            capability = tuple(data["device"]["capability"])
            if len(capability) != 2 or not all(isinstance(c, int) for c in capability):
                raise ValueError(f"device.capability {capability!r} is not [major, minor]")
            scaled = data["fp8_block_scaled"]
            flashinfer = data["fp8_flashinfer_version"]
            flashinfer_gemms = frozenset((e["n"], e["k"], e["rows"]) for e in data["fp8_flashinfer_gemms"])
            if flashinfer_gemms and (flashinfer is None or scaled is None):
                raise ValueError("fp8_flashinfer_gemms need fp8_flashinfer_version and fp8_block_scaled")
            tuning = cls(
                device_name=str(data["device"]["name"]),
                capability=(capability[0], capability[1]),
                versions=Versions(**data["versions"]),
                measured=str(data["measured"]),
                one_row_plans=_read_one_row_plans(data["one_row_plans"]),
                fp8_one_row_plans=_read_one_row_plans(data["fp8_one_row_plans"]),
                few_row_plans={
                    (e["n"], e["k"], e["row_tile"]): FewRowPlan(
                        e["block_n"], e["block_k"], e["split_k"], e["num_warps"], e["num_stages"]
                    )
                    for e in data["few_row_plans"]
                },
                cublaslt_gemms=frozenset((e["n"], e["k"], e["rows"]) for e in data["cublaslt_gemms"]),
                padded_rows={(e["n"], e["k"], e["rows"]): e["run_rows"] for e in data["padded_rows"]},
                fp8_weight_only_max_rows=int(data["fp8_weight_only_max_rows"]),
                fp8_block_scaled=BlockScaledRows(**scaled) if scaled is not None else None,
                fp8_flashinfer=LibraryGemms(str(flashinfer), flashinfer_gemms) if flashinfer is not None else None,
                source=source,
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"{source}: not a kernel tuning file (schema {SCHEMA_VERSION}): {e!r}") from e
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from e
        if any(tile not in (16, 32) for _, _, tile in tuning.few_row_plans):
            raise ValueError(f"{source}: few_row_plans row_tile must be 16 or 32")
        if any(run < m for (_, _, m), run in tuning.padded_rows.items()):
            raise ValueError(f"{source}: padded_rows run_rows must be >= rows")
        return tuning


def _read_one_row_plans(entries: list[dict[str, Any]]) -> dict[tuple[int, int], DecodeLinearPlan]:
    return {
        (e["n"], e["k"]): DecodeLinearPlan(
            e["block_n"], e["block_k"], e["num_warps"], e["num_stages"], e["fuse_prologue"]
        )
        for e in entries
    }


DEFAULTS = KernelTuning("any", (0, 0), Versions("any", None, None), "heuristic defaults")
DEFAULTS_IN_WORDS = (
    "heuristic defaults (one-row kernel plans by weight width, few-row kernel at 2..16 rows with its default plan, "
    "torch's BLAS library at its own rows "
    "for every dense GEMM, FP8 weight-only Triton GEMM up to 256 rows, FP8 activations on the Triton GEMM)"
)


def format_tuning(tuning: KernelTuning, labels: dict[tuple[int, int], str]) -> str:
    """The file's text: one table entry per line, each named by `labels` of its (N, K) where known."""
    lines = []
    for key, value in tuning.to_json().items():
        if isinstance(value, list) and value:
            entries = [{**e, "shape": labels[e["n"], e["k"]]} if (e["n"], e["k"]) in labels else e for e in value]
            value_text = "[\n" + ",\n".join(f"  {json.dumps(e)}" for e in entries) + "\n ]"
        else:
            value_text = json.dumps(value)
        lines.append(f" {json.dumps(key)}: {value_text}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def read_tuning(path: Path | str) -> KernelTuning:
    return KernelTuning.from_json(json.loads(Path(path).read_text()), str(path))


def packaged_tunings() -> list[KernelTuning]:
    """Every tuning file shipped in the package (`hsmc/ops/tuning/*.json`)."""
    folder = resources.files("hsmc.ops") / "tuning"
    return [
        KernelTuning.from_json(json.loads(f.read_text()), f"hsmc/ops/tuning/{f.name}")
        for f in sorted(folder.iterdir(), key=lambda f: f.name)
        if f.name.endswith(".json")
    ]


def cublas_version() -> str | None:
    """The version of the cuBLAS torch loaded (`cublasGetProperty`), or None where it cannot be asked."""
    if torch.version.cuda is None:
        return None
    try:
        get_property = ctypes.CDLL(f"libcublas.so.{torch.version.cuda.split('.')[0]}").cublasGetProperty
    except (OSError, AttributeError):
        return None
    parts = []
    for prop in range(3):  # MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL
        value = ctypes.c_int()
        if get_property(prop, ctypes.byref(value)) != 0:
            return None
        parts.append(str(value.value))
    return ".".join(parts)


@cache
def current_versions() -> Versions:
    return Versions(torch.__version__, torch.version.cuda, cublas_version())


def select_tuning(
    name: str, capability: tuple[int, int], versions: Versions, candidates: list[KernelTuning]
) -> KernelTuning:
    """The candidate measured on this GPU model with these versions; else the defaults, logged once per process."""
    for tuning in candidates:
        if (tuning.device_name, tuning.capability) == (name, capability) and tuning.versions.matches(versions):
            return tuning
    same_gpu = tuple(t.source for t in candidates if (t.device_name, t.capability) == (name, capability))
    _log_fallback(name, capability, versions, same_gpu)
    return DEFAULTS


@cache
def _log_fallback(name: str, capability: tuple[int, int], versions: Versions, same_gpu: tuple[str, ...]) -> None:
    reason = f"{', '.join(same_gpu)} measured other versions" if same_gpu else "no tuning file for this GPU"
    log.warning(
        "kernel tuning: %s (sm_%d%d, torch %s, CUDA %s, cuBLAS %s): %s; running the %s. "
        "`hsmc tune-kernels` measures this GPU.",
        name, *capability, versions.torch, versions.cuda, versions.cublas, reason, DEFAULTS_IN_WORDS,
    )  # fmt: skip


@cache
def tuning_for(device: torch.device) -> KernelTuning:
    """The tuning the kernels on `device` run with (the defaults off CUDA, where no choice is measured)."""
    if device.type != "cuda":
        return DEFAULTS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return select_tuning(
        torch.cuda.get_device_name(index),
        torch.cuda.get_device_capability(index),
        current_versions(),
        packaged_tunings(),
    )
