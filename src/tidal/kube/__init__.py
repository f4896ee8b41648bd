"""Tidal on Kubernetes, in rooms by where the code runs:

- :mod:`tidal.kube.pipeline`: compile time (the KFP components, the pipeline, checks of the compiled IR);
- :mod:`tidal.kube.steps`: inside the pipeline's step pods (prepare, the rounds' bookkeeping, finalize);
- :mod:`tidal.kube.trainer`: a round's trainer as a TrainJob (default) or PyTorchJob, and its launcher;
- :mod:`tidal.kube.pool`: the rollout workers, a fixed pool or an elastic one (Deployment + KEDA);
- :mod:`tidal.kube.submit`: the client (``tidal compile``, ``tidal submit``, ``tidal run --via kfp-local``).

Everything here needs the ``kube`` extra (``pip install 'tidal[kube]'``). The names shared with
``manifests/`` (PVC, Secrets, Services) live in :mod:`tidal.kube.cluster`, so the pipeline and the
manifests cannot drift apart unnoticed: ``tests/test_kube_manifests.py`` checks one against the other.
``tests/test_layering.py`` keeps the rooms' import rules.
"""
