"""``python -m shmreduce doctor | cleanup [--yes]``: diagnose and tidy shared memory."""

from __future__ import annotations

import sys

from shmreduce.doctor import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
