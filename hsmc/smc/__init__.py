"""SMC-SD's pure tensor functions: weight increments, ESS, resampling ancestors, final selection."""
