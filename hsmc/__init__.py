"""hsmc: hierarchical speculative decoding (EAGLE3 drafting, lossless rejection sampling, SMC-SD).

The public names load on first use, so `import hsmc` (and `hsmc --help`) does not import torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"
_EXPORTS = {
    "ConfigError": "hsmc.errors",
    "HsmcError": "hsmc.errors",
    "HierarchicalDecoder": "hsmc.decoder",
    "GenerationInterrupted": "hsmc.decoder",
    "Result": "hsmc.decoder",
    "HsmcConfig": "hsmc.config",
    "load_config": "hsmc.config",
    "load_model": "hsmc.models.loading",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hsmc' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
