"""shoal: an SGLang-style LLM serving engine with an OpenAI-compatible API."""

__version__ = "0.1.0"
