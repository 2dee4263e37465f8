"""DualPath control plane: the two-level scheduler, traffic classes/QoS and the bandwidth model.

Submodules are imported on use (``ascend_dualpath.dualpath.scheduler`` etc.); none touches a device.
"""

from __future__ import annotations
