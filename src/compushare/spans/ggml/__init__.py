"""The ggml span runtime: a GGUF model's weights as stored, computed by llama.cpp's
own tensor library the way llama.cpp builds its graphs.

  lib.py       ggml through ggml-python, its misdeclared handle types fixed; the CPU's extra buffer types
  weights.py   tensors in ggml backend buffers as the file stores them (repacked for the CPU where it can be)
  recipe.py    what a family's graph needs of its config, as llama.cpp reads it
  graph.py     one decoder layer as a ggml graph, op for op as llama.cpp builds it
  span.py      GgmlSpan: a span's layers, its sessions' float16 KV caches, graphs kept and reused
  adapter.py   sessions' LoRA adapters on the span: factors in float32 tensors, the last few kept uploaded
  load.py      a stored GGUF model's span onto ggml, a layer at a time
  head.py      the consumer's final norm and LM head on ggml, in the file's own type
"""
