"""Benchmarks: they print numbers and never fail a test run."""
