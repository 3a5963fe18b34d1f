"""EAGLE3 training: data from the verifier, vocab mapping, training-time-test loss, trainer."""
