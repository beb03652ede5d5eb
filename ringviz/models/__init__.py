"""Real models: the shipped SmolLM2-135M and Gemma-3-270M, driven through ``ringviz.hf``.

transformers is imported here and in ``ringviz.hf``, never by the core. ``README.md`` in this
folder lists the modules: loading, the teacher-forced driver ``RingRunner``, the independent
references, and the experiments behind ``python -m ringviz equivalence | perplexity |
streaming | generate | chat``.
"""
