"""``create_engine``: one engine per backend behind the ``Backend`` key."""

import pytest

from ascend_dualpath import errors
from ascend_dualpath.backends import Backend, capabilities
from ascend_dualpath.transport import TransferEngine, create_engine, engine_class


def test_each_backend_names_its_engine():
    names = {
        Backend.EMULATOR: "EmulatedTransferEngine",
        Backend.CUDA: "CudaTransferEngine",
        Backend.NPU: "NpuTransferEngine",
    }
    for backend, name in names.items():
        if not capabilities(backend).available:
            with pytest.raises(errors.BackendUnavailable, match=backend.value):
                engine_class(backend)
            continue
        cls = engine_class(backend)
        assert cls.__name__ == name and issubclass(cls, TransferEngine)


def test_create_engine_builds_the_emulator_engine_with_its_arguments():
    from ascend_dualpath.backends import emulator as emu

    with emu.emulated_devices(1) as (device,):
        comm = emu.init_comm(device)
        try:
            engine = create_engine("emulator", comm, 0, timeout_s=2.0)
            assert type(engine).__name__ == "EmulatedTransferEngine" and engine.timeout_s == 2.0
            engine.close()
        finally:
            comm.close()


def test_the_dualpath_leg_gets_its_engines_from_the_factory(monkeypatch):
    from ascend_dualpath.backends import emulator as emu
    from ascend_dualpath.dualpath.transfer_leg import TransportTransferLeg

    seen = []
    import ascend_dualpath.transport as transport

    real = transport.create_engine

    def spy(backend, *args, **kwargs):
        seen.append(backend)
        return real(backend, *args, **kwargs)

    monkeypatch.setattr(transport, "create_engine", spy)
    with emu.emulated_devices(1) as (device,):
        comm = emu.init_comm(device)
        try:
            leg = TransportTransferLeg(comm, 2.0)
            leg.close()
        finally:
            comm.close()
    assert seen == ["emulator"]
