"""NPU host path and kernel launchers through torch_npu (``csrc/npu``). Not yet run on hardware.

Available only in builds made where CANN and torch_npu exist (``_C.npu_transfer``); importing this
module needs neither.
"""

from __future__ import annotations

from ascend_dualpath import _ext
from ascend_dualpath import errors as E


def native():
    """The ``_C.npu_transfer`` submodule; BackendUnavailable in builds without CANN."""
    module = getattr(_ext.load(), "npu_transfer", None)
    if module is None:
        raise E.BackendUnavailable(
            "this build has no NPU transfer launchers: rebuild where CANN and torch_npu are "
            "installed (ADP_WITH_NPU=1 python3 setup.py build_ext --inplace)"
        )
    return module


def hccl_comm_handle(process_group, rank: int) -> int:
    """The ``HcclComm`` handle behind a torch_npu process group (for ``batch_put``)."""
    import torch

    return int(process_group._get_backend(torch.device("npu")).get_hccl_comm(rank))


def batch_put(process_group, rank: int, remote_rank: int, pieces) -> None:
    """HcclBatchPut of ``pieces`` (WirePiece list) to ``remote_rank`` on the current NPU stream."""
    import torch

    descs = torch.tensor([[p.local_addr, p.remote_addr, p.nbytes] for p in pieces], dtype=torch.int64)
    native().batch_put(hccl_comm_handle(process_group, rank), remote_rank, descs)
