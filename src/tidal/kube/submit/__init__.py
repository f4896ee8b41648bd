"""The client side: ``tidal compile``, ``tidal submit`` (KFP's API, the CI gate) and ``tidal run --via kfp-local``."""
