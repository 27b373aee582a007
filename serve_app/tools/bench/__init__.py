"""Benchmarks of specserve, run as ``python -m serve_app.tools.bench <command>``."""
