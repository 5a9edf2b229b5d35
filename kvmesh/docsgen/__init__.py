"""The docs site's generated parts: reference pages built from the code, benchmark blocks
built from ``docs/bench/*.json``, so neither can drift from what they describe.

``python -m kvmesh.docsgen`` writes them (``make docs`` runs it before ``mkdocs build
--strict``); ``python -m kvmesh.docsgen --check`` exits 1 naming every page that differs
from what the code and the JSONs produce now (``tests/unit/test_docs.py`` asserts the same).
Whole pages live under ``docs/reference/``; the benchmark pages and the README are written by
hand except for the blocks between ``<!-- generated: NAME -->`` and ``<!-- end generated -->``.
"""
