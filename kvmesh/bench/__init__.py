"""Benchmarks: each suite (a package here, with ``bench.py`` and ``cli.py``) runs kvmesh
beside its peers or physical limits in one run and writes JSON and a PNG plot through the
shared runner (:mod:`kvmesh.bench.runner`); ``common/`` holds what several suites share."""
