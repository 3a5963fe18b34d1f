"""The tensor operations the models are made of: the forward batch they read, KV storage, and the
attention backends (torch reference, Triton). Below the models; the engine's runner sits above them."""
