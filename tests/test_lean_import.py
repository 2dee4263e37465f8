"""Importing the package touches no device, loads no compiled code and needs neither torch_npu nor torch."""

import subprocess
import sys

CHECK = """
import sys
import ascend_dualpath
from ascend_dualpath import Backend, get_backend, errors
from ascend_dualpath.backends import emulator
assert "torch" not in sys.modules, "import pulled torch"
assert "torch_npu" not in sys.modules, "import pulled torch_npu"
assert "ascend_dualpath._C" not in sys.modules, "import loaded the extension"
import torch
assert not torch.cuda.is_initialized()
print("lean")
"""


def test_import_is_lean():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "lean"


def test_resolving_the_emulator_initializes_no_device():
    code = (
        "import torch, ascend_dualpath as adp\n"
        "assert adp.get_backend('emulator') is adp.Backend.EMULATOR\n"
        "assert not torch.cuda.is_initialized()\n"
        "import sys; assert 'torch_npu' not in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_main_entry_points_are_named_at_the_top_and_imported_on_first_access():
    code = (
        "import sys, ascend_dualpath as adp\n"
        "assert 'ascend_dualpath.moe' not in sys.modules and 'ascend_dualpath.transport' not in sys.modules\n"
        "assert {'Buffer', 'create_engine', 'LocalBlockStore', 'DualPathConnector'} <= set(dir(adp))\n"
        "from ascend_dualpath.moe import Buffer\n"
        "assert adp.Buffer is Buffer and adp.ReadQueue is __import__('ascend_dualpath.kv').kv.ReadQueue\n"
        "assert adp.create_engine is __import__('ascend_dualpath.transport').transport.create_engine\n"
        "assert 'ascend_dualpath._C' not in sys.modules, 'naming an entry point loaded the extension'\n"
        "try:\n"
        "    adp.NoSuchThing\n"
        "except AttributeError as exc:\n"
        "    assert 'NoSuchThing' in str(exc)\n"
        "else:\n"
        "    raise SystemExit('an unknown name did not raise')\n"
        "print('lazy')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "lazy"
