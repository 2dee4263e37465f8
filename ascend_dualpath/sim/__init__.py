"""Discrete-event cluster simulator for DualPath and its trace generators/loaders.

``models`` (hardware and model configs), ``traces`` (Table-2 generator, Mooncake loader), ``cluster``
(the simulator), ``experiments`` (offline/online runs, ablation, figures), ``online`` (online capacity at steady state).
"""

from __future__ import annotations
