"""``python -m shmreduce doctor | cleanup [--yes]``: diagnose and tidy shared memory.

The same commands as the ``shmreduce`` console script (``shmreduce.doctor:main``).
"""

from __future__ import annotations

import sys

from shmreduce.doctor import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="python -m shmreduce"))
