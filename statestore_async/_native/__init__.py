"""Compiled twins of ``statestore_async._ref``, built from ``_ext/*.pyx`` by setup.py."""
