"""zeroshard: ZeRO stage 1/2/3 sharding, CPU offload and a fused CPU Adam for PyTorch Lightning."""

import torch  # noqa: F401  (loads libtorch before the extension)

from zeroshard import _C  # noqa: F401

__version__ = "0.1.0"
