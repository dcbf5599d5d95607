"""Adapters for LlamaIndex and LangChain."""
