"""Model loading: any Hugging Face model (a local directory or a hub id), LoRA adapters, and the arrival check's probe. The built-in tiny model and its warm starts are the demo's (tidal.demo)."""
