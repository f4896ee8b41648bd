"""The trainer role: the consumer loop, accumulation, optimizer, checkpoints."""
