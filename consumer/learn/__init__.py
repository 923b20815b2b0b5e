"""Learning from a batch: advantages, losses, token tensors, training strategies, ranks and checkpoints."""
