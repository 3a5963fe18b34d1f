"""hsmc: hierarchical speculative decoding (EAGLE3 drafting, lossless rejection sampling, SMC-SD)."""

from hsmc.config import HsmcConfig, load_config
from hsmc.decoder import HierarchicalDecoder, Result
from hsmc.errors import ConfigError, HsmcError
from hsmc.models.loading import load_model

__all__ = ["ConfigError", "HsmcError", "HierarchicalDecoder", "HsmcConfig", "Result", "load_config", "load_model"]
__version__ = "0.1.0"
