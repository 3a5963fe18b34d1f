"""EAGLE3 draft heads: module, checkpoint I/O (SGLang / vLLM / SpecForge layout)."""
