"""Real models: the shipped SmolLM2-135M and Gemma-3-270M driven through ``RingKVCache``.

Modules (transformers is imported only here, never by the core):

- ``load``: find the GGUF files, check their sha256, cache float32 copies, load offline.
- ``text``: the shipped evaluation text and its tokens.
- ``drive``: the ring decode path, plugged into Hugging Face's attention interface.
- ``reference``: the independent references (band-mask full recompute, HF's own forward).
- ``equivalence``: ring decode vs reference, logits at every position (``python -m ringviz
  equivalence``).
- ``perplexity``: full attention vs windows vs windows with sinks (``python -m ringviz
  perplexity``).
- ``bugs``: the classic ring-cache bugs, run on a real model, next to the correct version.
"""
