"""The runnable examples at the top of the main entry points' docstrings run as written (doctest)."""

from __future__ import annotations

import doctest
import importlib.util

import pytest


def _run(obj) -> None:
    finder, runner = doctest.DocTestFinder(recurse=False), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = finder.find(obj)
    assert tests and tests[0].examples, f"{obj.__qualname__} has no example"
    for test in tests:
        runner.run(test)
    assert runner.failures == 0, f"{runner.failures} example(s) of {obj.__qualname__} failed (see the output above)"


def test_transfer_engine_example():
    from ascend_dualpath.transport import TransferEngine

    _run(TransferEngine)


def test_moe_buffer_example():
    from ascend_dualpath.moe import Buffer

    _run(Buffer)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the connector module imports vLLM")
def test_dualpath_connector_example():
    from ascend_dualpath.integrations.vllm.connector import DualPathConnector

    _run(DualPathConnector)
