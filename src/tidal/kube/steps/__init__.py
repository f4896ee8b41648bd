"""What runs inside the pipeline's step pods: prepare, the rounds' bookkeeping, register_model and finalize, and
what they share (the run's NATS state, its records in ``RUN_DIR/kube/``, MLflow, the ``tidal`` CLI verbs)."""
