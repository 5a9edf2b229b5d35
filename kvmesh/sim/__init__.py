"""``kvmesh sim``: a trace-driven discrete-event fleet simulator running the router's own scorers."""

from kvmesh.sim.cost import PROFILES, CostProfile
from kvmesh.sim.fleet import Fleet, FleetConfig, Record
from kvmesh.sim.run import simulate, summarize
from kvmesh.sim.workload import SimRequest, Workload, generate, load_trace

__all__ = [
    "PROFILES",
    "CostProfile",
    "Fleet",
    "FleetConfig",
    "Record",
    "SimRequest",
    "Workload",
    "generate",
    "load_trace",
    "simulate",
    "summarize",
]
