"""Benchmarks of specserve, run as ``python -m serve_app.bench <command>``."""
