"""The pipeline at compile time: the KFP components, the pipeline built from them, its parameters, and the
checks of the compiled IR against what the KFP driver resolves and parses."""
