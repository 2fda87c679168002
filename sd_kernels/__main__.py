"""``python -m sd_kernels ...``: the ``sd-kernels`` command line."""

import sys

from sd_kernels.apps.cli import main

if __name__ == "__main__":
    sys.exit(main())
