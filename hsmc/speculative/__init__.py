"""Speculative verification as pure tensor functions: the exact acceptance rules of draft trees."""
