"""``python -m ascend_dualpath <command>``; see :mod:`ascend_dualpath.cli`."""

from ascend_dualpath.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
