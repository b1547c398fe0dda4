"""jaxserve: LLM inference on JAX/XLA. Public API only."""

from jaxserve.async_llm import AsyncLLM
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine import LLMEngine
from jaxserve.llm import LLM
from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "AsyncLLM",
    "LLMEngine",
    "SamplingParams",
    "EngineConfig",
    "ModelConfig",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
]
__version__ = "0.1.0"
