"""`python -m rollstream ...` is the `rollstream` command (launchers such as torchrun take a module)."""

import sys

from rollstream.cli import main

if __name__ == "__main__":
    sys.exit(main())
