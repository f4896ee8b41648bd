"""Tidal on Kubernetes: KFP components and pipeline, the PyTorchJob trainer, submission.

Everything here needs the ``kube`` extra (``pip install 'tidal[kube]'``). The
names shared with ``manifests/`` (PVC, Secrets, Services) live in
:mod:`tidal.kube.cluster`, so the pipeline and the manifests cannot drift apart
unnoticed: ``tests/test_kube_manifests.py`` checks one against the other.
"""
