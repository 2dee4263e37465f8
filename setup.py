"""Build of ascend_dualpath and its extension ``ascend_dualpath._C``.

Always built: the emulated Ascend device runtime (``csrc/emulator``) and the bindings, as a C++17
torch extension, on any machine with a C++ compiler. Built when CANN and torch_npu are found: the NPU
host code (``csrc/npu``, through torch_npu's ``NpuExtension``) and the AscendC kernels
(``op_kernels/``, through CANN's ``ascendc_library`` CMake function, for ``SOC_VERSION``).

Flags (environment): ``ADP_WITH_NPU=0|1`` (0 skips the NPU part, 1 makes a missing CANN an error),
``ADP_DEBUG=1`` (``-O0 -g``), ``ADP_SANITIZE=1``
(AddressSanitizer + UndefinedBehaviorSanitizer; load it with ``tools/sanitize.sh``), ``SOC_VERSION``
(else read from ``npu-smi``). CANN is looked for in ``ASCEND_HOME_PATH``, ``ASCEND_TOOLKIT_HOME``,
``ASCEND_CANN_PACKAGE_PATH``, then ``/usr/local/Ascend/ascend-toolkit/latest`` and
``/usr/local/Ascend/cann``. Install with ``pip install --no-build-isolation -e .`` so the build uses
the torch already installed (never an isolated, CUDA-sized one).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT / "ascend_dualpath"), str(ROOT / "ascend_dualpath" / "backends")]
import _env  # noqa: E402  (the one module that reads ADP_* variables; importable without the package)
import cann  # noqa: E402  (CANN and SOC_VERSION detection, shared with `info`)

del sys.path[:2]

summary: list[tuple[str, str]] = []
kernel_libraries: list[Path] = []  # shared libraries that _C links and that go beside it


def build_ascendc_kernels(cann_root: Path, soc: str) -> dict[str, str]:
    """Configure and build op_kernels/ (CMake, CANN's ascendc_library); returns what the configure wrote:
    the shared library of the launched kernels and the directory of their aclrtlaunch_*.h."""
    build_dir = ROOT / "build" / "op_kernels"
    subprocess.check_call(cann.kernel_cmake_args(ROOT / "op_kernels", build_dir, cann_root, soc))
    subprocess.check_call(["cmake", "--build", str(build_dir), "-j", str(os.cpu_count() or 2)])
    return cann.read_kernel_build(build_dir)


def extensions():
    if importlib.util.find_spec("torch") is None:
        raise SystemExit(
            "ascend_dualpath builds against an installed torch: run `pip install torch==2.13.0` "
            "(CPU build) first, then `pip install --no-build-isolation -e .`"
        )
    from torch.utils.cpp_extension import CppExtension

    debug = _env.build_flag("DEBUG") is True
    sanitize = _env.build_flag("SANITIZE") is True
    cxx_flags = ["-std=c++17", "-O0", "-g"] if debug else ["-std=c++17", "-O2"]
    # -O1 keeps sanitized runs fast enough while the reports keep their line numbers
    sanitize_flags = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined"]
    if sanitize:
        cxx_flags = ["-std=c++17", "-O1", "-g"] + sanitize_flags
    include_dirs = [str(ROOT / "csrc"), str(ROOT / "op_kernels" / "include"), str(ROOT / "op_kernels" / "emu")]
    # the AscendC kernels also run on the emulator's vector cores, through the headers in op_kernels/emu
    sources = sorted(
        glob.glob("csrc/emulator/*.cpp")
        + glob.glob("csrc/bindings/*.cpp")
        + glob.glob("op_kernels/*/op_kernel/*.cpp")
        # op_kernels/emu/emu_probe.cpp ships too: the emulator's self-test kernel (`_C.launch_emu_probe`: WQE
        # posting modes and the error paths of the vector-core runner, tests/transport/test_kernels.py); it is a
        # few KB and keeps those tests on the same build as everything else
        + glob.glob("op_kernels/emu/*.cpp")
    )
    flavour = "sanitized (ASan + UBSan)" if sanitize else "debug" if debug else "release"
    summary.append(("emulator", f"built ({len(sources)} C++ sources, {flavour})"))

    with_npu = _env.build_flag("WITH_NPU")
    cann_root, cann_origin = cann.find_cann()
    torch_npu_found = importlib.util.find_spec("torch_npu") is not None
    # ADP_EMULATOR: the kernels are also built for the emulator's vector cores (its virtual clock and
    # AscendC stand-ins in op_kernels/emu); the deprecated Hccl calls bisheng warns about fail here.
    define_macros = [("ADP_EMULATOR", "1")]
    libraries, library_dirs, link_args = [], [], ["-lrt", "-lpthread"]
    ext_cls = CppExtension
    if with_npu is False:
        summary.append(("npu", "skipped: ADP_WITH_NPU=0"))
    elif cann_root is None or not torch_npu_found:
        why = f"CANN {cann_origin}" if cann_root is None else "torch_npu is not installed"
        if with_npu:
            raise SystemExit(f"ADP_WITH_NPU=1 but the NPU part cannot be built: {why}")
        summary.append(("npu", f"skipped: {why}"))
    else:
        soc, soc_origin = cann.find_soc_version()
        if soc is None:
            raise SystemExit(
                f"CANN found at {cann_root} but SOC_VERSION is unknown ({soc_origin}); "
                "export SOC_VERSION, e.g. Ascend910B1 (A2) or Ascend910_9391 (A3)"
            )
        from torch_npu.utils.cpp_extension import NpuExtension

        ext_cls = NpuExtension
        sources += sorted(glob.glob("csrc/npu/*.cpp"))
        define_macros.append(("ADP_WITH_NPU", "1"))
        include_dirs += [str(cann_root / "include")]
        kernels = build_ascendc_kernels(cann_root, soc)
        library = Path(kernels["library"])
        include_dirs.append(kernels["include"])  # aclrtlaunch_<kernel>.h of the launched kernels
        libraries.append("adp_kernels")
        library_dirs.append(str(library.parent))
        # BuildWithSummary copies the library beside _C, where $ORIGIN finds it at import
        link_args.append("-Wl,-rpath,$ORIGIN")
        kernel_libraries.append(library)
        define_macros.append(("ADP_WITH_ASCENDC_KERNELS", "1"))
        summary.append(
            (
                "npu",
                f"built for {soc} ({soc_origin}), CANN at {cann_root} ({cann_origin}), "
                f"kernels {kernels['kernels'].replace(';', ', ')} in {library.name}",
            )
        )

    # Nothing CUDA is compiled: the cuda backend's kernels are Triton, compiled at run time (so there is no
    # ADP_WITH_CUDA flag: it had nothing to switch).
    summary.append(("cuda", "no compiled CUDA sources; the cuda backend uses Triton/torch kernels at run time"))

    return [
        ext_cls(
            name="ascend_dualpath._C",
            sources=sources,
            include_dirs=include_dirs,
            define_macros=define_macros,
            libraries=libraries,
            library_dirs=library_dirs,
            extra_compile_args={
                "cxx": cxx_flags + ["-Wall", "-Wno-unused-function", "-Werror=deprecated-declarations"]
            },
            extra_link_args=link_args + (sanitize_flags if sanitize else []),
        )
    ]


def cmdclass():
    from torch.utils.cpp_extension import BuildExtension

    class BuildWithSummary(BuildExtension):
        def run(self):
            super().run()
            package_dir = Path(self.get_ext_fullpath("ascend_dualpath._C")).parent
            for library in kernel_libraries:
                shutil.copy2(library, package_dir / library.name)
                summary.append(("kernels", f"{library.name} copied to {package_dir}"))
            print("\nascend_dualpath build summary:")
            for part, status in summary:
                print(f"  {part:<9} {status}")
            print()

    return {"build_ext": BuildWithSummary.with_options(use_ninja=shutil.which("ninja") is not None)}


setup(
    name="ascend_dualpath",
    version=(ROOT / "ascend_dualpath" / "version.py").read_text().split('"')[1],
    description="DualPath KV loading, AIV-direct RDMA and DeepEP-style MoE for Ascend NPUs, with a CPU emulator",
    packages=find_packages(include=["ascend_dualpath", "ascend_dualpath.*"]),
    package_data={"ascend_dualpath.sim": ["data/*.jsonl.gz", "data/README.md", "data/clusters/*.toml"]},
    python_requires=">=3.10",
    # torch is not pinned here: a range that admits a newer release would pull a CUDA build on a
    # CPU machine. Install torch first (README); any torch >= 2.4 works.
    # msgspec and pyzmq carry the DualPath side channel's typed messages (the core's, not only vLLM's).
    install_requires=["numpy", "rich", "matplotlib", "msgspec", "pyzmq"],
    # mooncake: the Mooncake Transfer Engine's CPU wheel (TCP; CUDA and Ascend have their own wheels, docs/mooncake.md);
    # >= 0.3.12 completes a TCP write only once the peer applied it, which the engine's notify relies on
    extras_require={
        "test": ["pytest", "hypothesis", "radon", "ruff==0.17.6"],
        "mooncake": ["mooncake-transfer-engine-non-cuda>=0.3.12"],
    },
    ext_modules=extensions(),
    cmdclass=cmdclass(),
    entry_points={"console_scripts": ["ascend-dualpath=ascend_dualpath.__main__:main"]},
    zip_safe=False,
)
