"""Decode Lab: a small, readable LLM inference engine that the course builds step by step."""
from .config import ModelConfig
from .params import SamplingParams

__version__ = "0.1.0"
__all__ = ["ModelConfig", "SamplingParams", "__version__"]
