"""Model loading: the built-in tiny model (built from a config, warm-started locally) or any HF model."""
