"""``kvmesh epp``: kvmesh's routing as a Gateway API Inference Extension endpoint picker.

An Envoy ext_proc server (:mod:`~kvmesh.epp.protocol`, :mod:`~kvmesh.epp.server`) around
the router's scoring (:mod:`~kvmesh.epp.scoring` reuses its pool, index, picker and
tokenizer), with static or Kubernetes endpoint discovery (:mod:`~kvmesh.epp.discovery`) and
a local Envoy configuration for tests and benchmarks (:mod:`~kvmesh.harness.envoy`). grpc and the
Envoy protos (``kvmesh[epp]``) are imported by those modules only, not by this package.
"""
