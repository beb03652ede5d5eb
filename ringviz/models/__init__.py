"""Real models: the shipped SmolLM2-135M and Gemma-3-270M, driven through ``ringviz.hf``.

Modules (transformers is imported here and in ``ringviz.hf``, never by the core):

- ``load``: find the GGUF files, check their sha256, cache float32 copies, load offline.
- ``text``: the shipped evaluation text and its tokens.
- ``drive``: ``RingRunner``, the teacher-forced driver over ``ringviz.hf``.
- ``reference``: the independent references (band-mask full recompute, HF's own forward).
- ``equivalence``: ring decode vs reference, logits at every position (``python -m ringviz
  equivalence``).
- ``perplexity``: full attention vs windows vs windows with sinks (``python -m ringviz
  perplexity``).
- ``sinks``: StreamingLLM itself, the reference for the ring's sinks.
- ``streaming``: perplexity with sinks in both conventions (``python -m ringviz streaming``).
- ``speculative``: ``DraftRunner`` and greedy speculative decoding (chapter 13).
- ``bugs``: the catalogue's pitfalls (``ringviz.conformance.pitfalls``) run on a real model
  through the seam, next to the correct ring (chapters 4, 10).
- ``chat``: ``Conversation``, turn after turn through one RingCache (``python -m ringviz
  generate`` and ``python -m ringviz chat``).
"""
