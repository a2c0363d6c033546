"""Helpers to run real servers for tests and benchmarks (SeaweedFS as S3). Not used by the daemon."""
