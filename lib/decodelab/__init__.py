"""Decode Lab: a small, readable LLM inference engine that the course builds step by step.

from decodelab import LLM, SamplingParams
llm = LLM(model="smollm2")
print(llm.generate("What is gravity?", SamplingParams(max_tokens=32))[0].outputs[0].text)
"""

import os as _os

# OpenMP threads that spin while waiting made decode ~5-10x slower on a busy 2-core machine;
# passive waiting holds up under load. Only effective if torch is not imported yet.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from decodelab.config import ModelConfig  # noqa: E402
from decodelab.params import SamplingParams  # noqa: E402

__version__ = "0.2.0"  # the one place the version is written: pyproject.toml reads it, releases record it
__all__ = [
    "LLM",
    "SamplingParams",
    "ModelConfig",
    "EngineArgs",
    "EngineHooks",
    "RequestOutput",
    "CompletionOutput",
    "load",
    "__version__",
]

_LAZY = {
    "LLM": "engine.llm",
    "EngineArgs": "engine.args",
    "EngineHooks": "engine.hooks",
    "RequestOutput": "engine.llm",
    "CompletionOutput": "engine.llm",
    "load": "model.registry",
}


def __getattr__(name):
    """Import the engine (and torch) only when it is first used: `import decodelab` stays quick."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'decodelab' has no attribute {name!r}")
