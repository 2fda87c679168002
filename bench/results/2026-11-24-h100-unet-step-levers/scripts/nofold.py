"""bench.unet_kernels with the ResnetBlock2D bias + temb fold off (session 15's A/B in one call)."""

import importlib
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
gn = importlib.import_module("sd_kernels.patches.group_norm")
gn._folds_into_norm2 = lambda *_: False
from bench.unet_kernels import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
