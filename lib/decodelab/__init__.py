"""Decode Lab: a small, readable LLM inference engine that the course builds step by step."""
import os as _os

# OpenMP threads that spin while waiting made decode ~5-10x slower on a busy 2-core machine;
# passive waiting holds up under load. Only effective if torch is not imported yet.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .config import ModelConfig  # noqa: E402
from .params import SamplingParams  # noqa: E402

__version__ = "0.1.0"
__all__ = ["ModelConfig", "SamplingParams", "__version__"]
