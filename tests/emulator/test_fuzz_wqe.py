"""Property-based fuzzing of WQE streams: valid writes land exactly, invalid ones end in an error CQE,
the rest of the stream is flushed, and no byte outside the valid writes ever changes. Then the same for the paths
above the WQEs (the staging and AICPU kernels and the transfer engine's submit), with random segments."""

import json
from functools import partial

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tests.conftest import poll_all

SIZE = 1 << 14
DEPTH = 64
UB = 192 * 1024
KINDS = [
    "valid",
    "valid",
    "valid",
    "bad_rkey",
    "remote_oob",
    "local_oob",
    "bad_lkey",
    "zero_len",
    "no_permission",
    "bad_opcode",
]
EXPECTED = {  # kind -> (status, syndrome)
    "bad_rkey": (0x13, 4),
    "remote_oob": (0x13, 5),
    "local_oob": (0x04, 2),
    "bad_lkey": (0x04, 1),
    "zero_len": (0x01, 7),
    "no_permission": (0x13, 6),
    "bad_opcode": (0x02, 9),
    "wrong_sl": (0x02, 8),
}


@pytest.fixture(scope="module")
def rig():
    from ascend_dualpath import _ext
    from ascend_dualpath.backends import emulator as emu

    C = _ext.load()
    with emu.emulated_devices(2) as (d0, d1):
        src = d0.alloc_region(SIZE, C.MemKind.DEVICE_GM, 4)
        dst = d1.alloc_region(SIZE, C.MemKind.DEVICE_GM, 7)
        read_only = d1.alloc_region(SIZE, C.MemKind.DEVICE_GM, 4)
        cq = d0.create_cq(256)
        qp = d0.create_qp(cq, None, DEPTH, 4)
        yield C, src, dst, read_only, cq, qp


op = st.tuples(st.sampled_from(KINDS), st.integers(0, SIZE - 1), st.integers(0, SIZE - 1), st.integers(1, 2048))


@settings(max_examples=60)
@given(ops=st.lists(op, min_size=1, max_size=DEPTH // 2 - 1), wrong_sl=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_random_wqe_streams(rig, ops, wrong_sl, seed):
    C, src, dst, read_only, cq, qp = rig
    rng = np.random.default_rng(seed)
    views = {name: np.frombuffer(r, dtype=np.uint8) for name, r in (("src", src), ("dst", dst), ("ro", read_only))}
    for v in views.values():
        v[:] = rng.integers(0, 256, SIZE, dtype=np.uint8)
    model = {name: v.copy() for name, v in views.items()}

    requests, expected, failed = [], [], False
    for i, (kind, s_off, d_off, length) in enumerate(ops):
        length = min(length, SIZE - s_off, SIZE - d_off)  # valid ops stay in bounds
        la, ra, lkey, rkey, opcode = src.addr + s_off, dst.addr + d_off, src.lkey, dst.rkey, 3
        if kind == "bad_rkey":
            rkey ^= 0x3
        elif kind == "remote_oob":
            ra = dst.addr + SIZE - length + 1 + (d_off % 64)
        elif kind == "local_oob":
            la = src.addr + SIZE - length + 1
        elif kind == "bad_lkey":
            lkey = 0x7FFFF00
        elif kind == "zero_len":
            length = 0
        elif kind == "no_permission":
            ra, rkey = read_only.addr + d_off, read_only.rkey
        elif kind == "bad_opcode":
            opcode = 6
        requests.append(C.WorkRequest(opcode, la, lkey, length, ra, rkey))
        if failed:
            expected.append((0x05, 16))  # flushed: the QP is in ERROR
        elif wrong_sl and i == 0:
            expected.append(EXPECTED["wrong_sl"])
            failed = True
        elif kind == "valid":
            model["dst"][d_off : d_off + length] = model["src"][s_off : s_off + length]
            expected.append((0, 0))
        else:
            expected.append(EXPECTED[kind])
            failed = True

    qp.post(requests, 0.0, 10.0, sl=5 if wrong_sl else -1)
    completions = poll_all(cq, len(requests))
    assert [(c.status, c.syndrome) for c in completions] == expected
    assert [c.wqe_index for c in completions] == list(
        range(completions[0].wqe_index, completions[0].wqe_index + len(ops))
    )
    for name, v in views.items():
        assert np.array_equal(v, model[name]), f"{name}: stray or missing bytes"
    qp.reset(10.0)
    assert cq.poll(1, 0.0) == []


# ---- the staging and AICPU kernels and the engine's submit, driven with random segments -----------------------
#
# Each path runs PATH_EXAMPLES examples in a child interpreter (a copy through a wild pointer is a SIGSEGV there, and
# the child must exit 0), derandomized and without an example database so that CI runs the same examples every time.
# Every region of both ranks, a heap buffer no region holds and the foreign regions are watched by the rig: after
# each example only the bytes an accepted request may write have changed. A request is either refused where it is
# submitted or delivered exactly; a refusal never comes later.

PATH_EXAMPLES = 2000
PATH_SETTINGS = settings(
    max_examples=PATH_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
ZOO_BYTES = 1 << 14
# what a local range names: "not_in_comm" is a live registration never given to register_local (RDMA accepts it,
# the address-based HCCL calls do not)
LOCAL_KINDS = ["valid"] * 8 + ["unregistered", "out_of_bounds", "freed", "wrong_key", "foreign", "not_in_comm"]
REMOTE_KINDS = ["valid"] * 4 + ["stale_rkey", "past_window", "read_only"]

local_spec = st.tuples(st.sampled_from(LOCAL_KINDS), st.booleans(), st.integers(0, ZOO_BYTES - 1), st.integers(1, 4096))


class Zoo:
    """Memory of every sort a segment may name, on a ``Rig`` with 1 MiB windows, all of it watched.

    ``device`` and ``host`` are registered regions of rank 0 (fabric and communicator), ``not_in_comm`` only on the
    fabric, ``foreign`` a region of the other device, ``stray`` a heap buffer no region holds, ``freed`` the address
    and key of a region closed and unmapped before any use, ``read_only`` a rank-1 region without REMOTE_WRITE or
    LOCAL_WRITE. Allocate any other region before the zoo: one mapped later may land in the freed range.
    """

    def __init__(self, devices):
        from tests.safety.rig import Rig

        self.rig = rig = Rig(devices, window_mb=1)
        C = rig.C
        self.device = rig.source("device", ZOO_BYTES)
        self.host = rig.source("host", ZOO_BYTES, host=True)
        self.not_in_comm = rig.source("not_in_comm", ZOO_BYTES, register=False)
        self.foreign = rig.source("foreign", ZOO_BYTES, device=1)
        self.read_only = devices[1].alloc_region(ZOO_BYTES, C.MemKind.DEVICE_GM, 4)
        rig.watch("read_only", self.read_only)
        self.stray = np.zeros(ZOO_BYTES, np.uint8)
        rig.watch("stray", self.stray)
        freed = devices[0].alloc_region(ZOO_BYTES, C.MemKind.DEVICE_GM, 7)
        self.freed = (freed.addr, freed.lkey)
        freed.close()
        del freed  # the last reference: the region is unmapped

    def local(self, spec, by_address: bool = False) -> tuple[int, int, int, bool, bytes | None]:
        """``(addr, nbytes, lkey, host, data)`` of a local spec; ``data`` is what a read of it yields when valid.

        With ``by_address`` (the path finds the registration by address: AICPU BatchWrite items carry no key) an
        ``out_of_bounds`` range always straddles its region's end, so it is at least 2 bytes long. A range wholly
        past the end is wholly inside the next region whenever the kernel maps the two back to back (each region is
        its own mmap, and consecutive mmaps are often adjacent): a check by address then rightly accepts it.
        """
        kind, host, offset, length = spec
        region, other = (self.host, self.device) if host else (self.device, self.host)
        inside = min(offset, ZOO_BYTES - length)
        if kind == "out_of_bounds" and by_address:  # from inside the region to past it
            length = max(length, 2)
            return region.addr + ZOO_BYTES - length + 1 + offset % (length - 1), length, region.lkey, host, None
        if kind == "out_of_bounds":  # from inside the region (or at its end) to past it: the key names the region
            return region.addr + ZOO_BYTES - length + 1 + offset % length, length, region.lkey, host, None
        if kind == "unregistered":
            return self.stray.ctypes.data + inside, length, 0, host, None
        if kind == "freed":
            return self.freed[0] + inside, length, self.freed[1], False, None
        if kind == "wrong_key":
            return region.addr + inside, length, other.lkey, host, None
        named = {"valid": region, "foreign": self.foreign, "not_in_comm": self.not_in_comm}[kind]
        data = bytes(np.frombuffer(named, np.uint8)[inside : inside + length])
        return named.addr + inside, length, named.lkey, host and kind == "valid", data


def _refused(call) -> None:
    """``call()`` raises one of the errors of a range check (anything else, or no error, fails the example)."""
    from ascend_dualpath import errors

    with pytest.raises((errors.NotRegistered, errors.BoundsError, errors.AccessDenied, errors.InvalidKey)):
        call()


def fuzz_hccl_stage() -> dict:
    """hccl_stage from every sort of source into windows_out, past it, into a read-only or an unregistered buffer."""
    from ascend_dualpath.backends import emulator as emu

    with emu.emulated_devices(2) as devices:
        zoo = Zoo(devices)
        rig, C = zoo.rig, zoo.rig.C
        window = rig.comms[0].windows_out
        counts = {"accepted": 0, "refused": 0}

        @PATH_SETTINGS
        @given(
            src=local_spec,
            dst=st.sampled_from(["valid"] * 3 + ["past_window", "read_only", "unregistered"]),
            dst_offset=st.integers(0, (1 << 20) - 4096),
            cores=st.integers(1, 2),
        )
        def example(src, dst, dst_offset, cores):
            addr, nbytes, lkey, _, data = zoo.local(src)
            dst_addr, dst_lkey = {
                "valid": (window.addr + dst_offset, window.lkey),
                "past_window": (window.addr + window.size - nbytes + 1, window.lkey),
                "read_only": (zoo.read_only.addr, zoo.read_only.lkey),
                "unregistered": (zoo.stray.ctypes.data, 0),
            }[dst]
            launch = partial(C.launch_hccl_stage, devices[0], addr, lkey, dst_addr, dst_lkey, nbytes, cores, 1024, 2)
            if src[0] in ("valid", "not_in_comm") and dst == "valid":
                launch(UB, 5.0).wait(5.0)
                rig.expect("rank0.windows_out", dst_offset, data)
                counts["accepted"] += 1
            else:
                _refused(lambda: launch(UB, 5.0))
                counts["refused"] += 1
            rig.assert_intact()

        example()
        return counts


def fuzz_aicpu_batch_write() -> dict:
    """aicpu_batch_write with items from every sort of local memory to rank 1's window, past it, or unlisted memory."""
    from ascend_dualpath import _ext
    from ascend_dualpath.backends import emulator as emu

    with emu.emulated_devices(2) as devices:
        # scratch the cores write (not watched), mapped before the zoo frees its region: the server finds an item's
        # memory by address, and a "freed" item inside a later registration would rightly be accepted
        items = devices[0].alloc_region(8 * 32, _ext.load().MemKind.DEVICE_GM, 7)
        zoo = Zoo(devices)
        rig, C = zoo.rig, zoo.rig.C
        rig.comms[0].register_local(items)
        window = rig.comms[1].windows_in
        counts = {"accepted": 0, "refused": 0}
        item = st.tuples(
            local_spec.filter(lambda s: s[0] != "wrong_key"),  # items carry no keys
            st.sampled_from(["valid"] * 4 + ["past_window", "unlisted"]),
            st.integers(0, (1 << 20) - 4096),
        ).filter(lambda i: i[1] != "past_window" or i[0][3] > 1)  # straddles the window's end, as in Zoo.local

        @PATH_SETTINGS
        @given(specs=st.lists(item, min_size=1, max_size=4), cores=st.integers(1, 2), faults=st.booleans())
        def example(specs, cores, faults):
            if not faults:
                specs = [(("valid", *local[1:]), "valid", offset) for local, _, offset in specs]
            rows = []
            for local, remote, offset in specs:
                addr, nbytes, _, _, data = zoo.local(local, by_address=True)
                remote_addr = {
                    "valid": window.addr + offset,
                    "past_window": window.addr + window.size - nbytes + 1,
                    "unlisted": zoo.foreign.addr,  # a registration rank 1 never listed with the communicator
                }[remote]
                rows.append((addr, remote_addr, nbytes, data, local[0] == "valid" and remote == "valid", offset))
            arrays = [np.array([r[i] for r in rows], np.uint64) for i in range(3)]
            launch = partial(C.launch_aicpu_batch_write, rig.comms[0], items.addr, *arrays, 1, cores, 2, UB)
            if all(r[4] for r in rows):
                launch(5.0).wait(5.0)
                for *_, data, _, offset in rows:  # the server posts the items in order: a later one wins an overlap
                    rig.expect("rank1.windows_in", offset, data)
                counts["accepted"] += 1
            else:
                _refused(lambda: launch(5.0))
                counts["refused"] += 1
            rig.assert_intact()

        example()
        return counts


def fuzz_engine_submit() -> dict:
    """The engine's public submit with every kind, random segments, remote slots and notify slots."""
    from ascend_dualpath import errors
    from ascend_dualpath.backends import emulator as emu
    from ascend_dualpath.transport import MemoryKind, MemorySegment, RemoteSlot, TransferKind

    with emu.emulated_devices(2) as devices:
        zoo = Zoo(devices)
        rig = zoo.rig
        window = rig.comms[1].windows_in
        counts = {"accepted": 0, "refused": 0}

        @PATH_SETTINGS
        @given(
            specs=st.lists(local_spec, min_size=1, max_size=3),
            kind=st.sampled_from([None, "aiv", "staging", "aicpu", "host"]),
            remote=st.sampled_from(REMOTE_KINDS),
            offset=st.integers(0, (1 << 20) - (1 << 15)),
            notify=st.sampled_from([None, None, 0, 1023, 1024, -1]),
            faults=st.booleans(),
        )
        def example(specs, kind, remote, offset, notify, faults):
            if not faults:
                specs, remote = [("valid", *s[1:]) for s in specs], "valid"
                notify = notify if notify in (None, 0, 1023) else 7
            segments = [zoo.local(s) for s in specs]
            any_host = any(h for *_, h, _ in segments)
            memory = [MemoryKind.HOST if h else MemoryKind.DEVICE for *_, h, _ in segments]
            sources = [MemorySegment(a, n, m, k) for (a, n, k, _, _), m in zip(segments, memory, strict=True)]
            total = sum(s.nbytes for s in sources)
            # a past-the-window range must straddle the window's end: one wholly past it may lie in a neighbouring
            # registration, which the by-address kinds (host, aicpu) rightly accept (as in Zoo.local)
            assume(remote != "past_window" or total > 1)
            effective = TransferKind(kind) if kind else TransferKind.STAGING if any_host else TransferKind.AIV
            keyed = effective in (TransferKind.AIV, TransferKind.STAGING)
            slot = {
                "valid": RemoteSlot(1, window.addr + offset, 1 << 15, window.rkey),
                "stale_rkey": RemoteSlot(1, window.addr + offset, 1 << 15, window.rkey ^ 0x80),
                "past_window": RemoteSlot(1, window.addr + window.size - total + 1, 1 << 15, window.rkey),
                "read_only": RemoteSlot(1, zoo.read_only.addr, ZOO_BYTES, zoo.read_only.rkey),
            }[remote]
            accepted = (
                all(s[0] == "valid" or (s[0] == "not_in_comm" and keyed) for s in specs)
                and (remote == "valid" or (remote == "stale_rkey" and not keyed))
                and notify in (None, 0, 1023, 7)
                and not (effective in (TransferKind.AIV, TransferKind.AICPU) and any_host)
            )
            if not accepted:
                with pytest.raises(errors.AdpError):  # the gate override, a notify slot or a range check
                    rig.engine.submit(sources, slot, notify_slot=notify, kind=kind)
                counts["refused"] += 1
            else:
                result = rig.engine.submit(sources, slot, notify_slot=notify, kind=kind).wait()
                data = b"".join(d for *_, d in segments)
                rig.expect("rank1.windows_in", offset, data)
                if result.kind is TransferKind.STAGING:
                    rig.expect("rank0.windows_out", 0, data)  # the pool is empty: first fit from its start
                if notify is not None:
                    rig.expect("rank1.notify_region", 32 * notify, result.notify_magic.to_bytes(8, "little"))
                counts["accepted"] += 1
            assert rig.engine.staging.num_held == 0
            rig.assert_intact()

        example()
        return counts


FUZZED_PATHS = (fuzz_hccl_stage, fuzz_engine_submit)


def fuzz_every_path() -> None:
    """Each path's examples, one after the other in this process; prints ``{path: {outcome: examples}}`` as JSON."""
    print(json.dumps({path.__name__: path() for path in FUZZED_PATHS}))


def test_random_aicpu_batch_writes_move_nothing_stray():
    """PATH_EXAMPLES examples of the AICPU BatchWrite path in a child process: as for the other paths, it must exit 0,
    every example was refused at the launch or delivered exactly, and both outcomes occurred often. Its out-of-bounds
    items straddle a region's end whatever the memory layout (see ``Zoo.local``), so the examples' outcomes do not
    depend on where the kernel mapped the regions."""
    from tests.safety.rig import run_child

    out = run_child(
        "from tests.emulator.test_fuzz_wqe import fuzz_aicpu_batch_write as f; import json; print(json.dumps(f()))",
        timeout_s=300,
    )
    outcomes = json.loads(out.strip().splitlines()[-1])
    assert outcomes["accepted"] + outcomes["refused"] >= PATH_EXAMPLES, outcomes
    assert min(outcomes.values()) >= PATH_EXAMPLES // 20, outcomes


def test_random_segments_on_every_path_move_nothing_stray():
    """PATH_EXAMPLES examples of each path in one child (one interpreter start for the three): it must exit 0 (no
    signal, no hang); every example was refused at the call or delivered exactly, and both outcomes occurred often."""
    from tests.safety.rig import run_child

    out = run_child("from tests.emulator.test_fuzz_wqe import fuzz_every_path; fuzz_every_path()", timeout_s=300)
    counts = json.loads(out.strip().splitlines()[-1])
    assert sorted(counts) == sorted(path.__name__ for path in FUZZED_PATHS), counts
    for path, outcomes in counts.items():
        assert outcomes["accepted"] + outcomes["refused"] >= PATH_EXAMPLES, (path, outcomes)
        assert min(outcomes.values()) >= PATH_EXAMPLES // 20, (path, outcomes)
