"""Measurement scripts (never imported by the library or the tests' oracles).

Run every script as a module from the repository root, e.g.
`python -m benchmarks.decode --help`: that puts the root on `sys.path`, so
the scripts import each other as `benchmarks.<name>` and the library as
`jaxsample` (installed or not), with no `sys.path` edits. Shared pieces:
`benchmarks/common.py` (environment, peak memory, the worker protocol,
tables); the engines a cell runs: `benchmarks/peers/`.
"""
