"""The decoding engine: Llama-family models over kvstore's tiered KV cache."""

from engine.llm import LLM, AsyncLLM
from engine.request import QueueFull, RequestOutput
from engine.sampler import InvalidRequest, SamplingParams

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutput", "InvalidRequest", "QueueFull"]
