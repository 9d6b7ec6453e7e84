"""``python -m gradpress.train`` and ``torchrun --nproc-per-node N -m gradpress.train``."""

import sys

from gradpress.train.cli import main

if __name__ == "__main__":
    sys.exit(main())
