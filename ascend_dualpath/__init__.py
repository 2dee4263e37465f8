"""ascend_dualpath: DualPath KV loading, AIV-direct RDMA and DeepEP-style MoE for Ascend NPUs.

Importing the package touches no device, loads no compiled code and needs no torch_npu: backends,
the compiled ``_C`` module and torch_npu are loaded lazily, on first use.
"""

from ascend_dualpath.backends import Backend, get_backend
from ascend_dualpath.version import __version__

__all__ = ["Backend", "get_backend", "__version__"]
