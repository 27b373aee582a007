"""Cluster-scale simulation of specserve: the project's policy and ControlLoop against N
simulated replicas whose speed comes from measured engine curves. See docs/simulation.md."""

from .curves import PRESETS, Curve, load_curve
from .sim import ClosedLoop, SimOptions, Simulation
from .traces import Trace, make_trace

__all__ = ["PRESETS", "ClosedLoop", "Curve", "SimOptions", "Simulation", "Trace", "load_curve", "make_trace"]
