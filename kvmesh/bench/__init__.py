"""Benchmarks: each runs kvmesh beside its peers or physical limits in one run and writes
JSON and a PNG plot."""
