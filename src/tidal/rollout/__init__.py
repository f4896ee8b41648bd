"""Rollout engines behind one interface, and the worker loop."""
