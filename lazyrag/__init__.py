"""lazyrag: RAG with reusable, position-free KV caches."""
