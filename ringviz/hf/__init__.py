"""The ring inside Hugging Face's ``generate()``: :class:`RingCache` and :func:`generate`.

``RingCache(model)`` is a real ``transformers.Cache``. Its sliding layers are rings
(:class:`ringviz.cache.RingKVCache`: slot ``pos % W``, stored positions, one slot written per
token, never a copy of the window); its full-attention layers keep every token in storage that
grows geometrically, so no step copies their history. The data path of one layer::

    mask hook (once per forward): plan = positions, per kind: key positions -> mask
    q, k, v (RoPE at absolute positions, by HF) -> attention hook: the layer's step
        -> ring write at slot pos % W -> attention with the plan's mask

Hugging Face's stock masks assume key ``i`` holds position ``kv_offset + i`` (keys in temporal
order); a ring's slots break that as soon as it wraps, is not full, takes a chunk or a padded row.
So the masks come from ringviz: a mask function registered in ``AttentionMaskInterface`` under
:data:`ATTN_NAME` (transformers calls it once per layer type and forward) reads the ring's stored
positions, and an attention function registered in ``AttentionInterface`` under the same name
applies them. :func:`generate` holds the model under that name for the call (restored however
it ends, once no other call holds it), and the two functions decide per forward: the ring for
the forwards of the calling thread's ring call, the model's own mask and attention for every
other forward of the model meanwhile (a logits processor's plain call, classifier-free
guidance's unconditional pass, another thread's call): Hugging Face's, bit for bit. The cache a
call serves travels in the calling thread's slot, never in a module global; ring calls on one
model may run at once, each with its own cache.
Plain ``model.generate(cache=RingCache(model))`` keeps the stock masks, so the first cache write
raises an error that names :func:`generate`; it is never silently wrong.

Modules: ``config`` (``read_layout``: the one reader of a model's config), ``rotary`` (the
model's own RoPE, and the check that the cache convention can turn it), ``cache``
(``RingCache``, its layers ``RingLayer`` and ``FullLayer``, and ``ForwardPlan``: what one
forward needs, computed once), ``attention`` (the mask and attention hooks, ``ring_active``,
the eval-mode and no-grad checks), ``generation`` (:func:`generate` and what a call may ask of
a cache it is handed: settings, a conversation's continuation, mask holes, drafts).

Real use: a conversation passes the returned cache back with the whole conversation as
``input_ids`` (only the new tokens are prefilled); ``copy.deepcopy`` of a RingCache is an
independent cache for the same model; beam search gathers the ring's rows.

Attention sinks: ``RingCache(model, sinks=S, sink_convention="absolute" | "cache")`` (and the
same arguments of :func:`generate`) keep each row's first ``S`` tokens in every ring: the
sliding masks add the sink rule, and with ``"cache"`` (StreamingLLM's positions inside the
cache) the attention scores the sink keys turned by ``p - min(p, S + W - 1)``, the core's own
sink attention. Full layers unchanged. :class:`ringviz.models.drive.RingRunner` drives the
same RingCache, teacher-forced.

Positions: a row's token at absolute position ``p`` is the ``p``-th real token of that row
(``attention_mask.cumsum(-1) - 1``, what ``generate`` feeds RoPE); padding is ``-1`` and never
takes a slot.
"""

from ringviz.hf.attention import ATTN_NAME, register, ring_active, serving_cache
from ringviz.hf.cache import ForwardPlan, FullLayer, RingCache, RingLayer, check_model
from ringviz.hf.config import layer_windows, read_layout
from ringviz.hf.generation import PREFILL_CHUNK, generate

__all__ = ["ATTN_NAME", "PREFILL_CHUNK", "ForwardPlan", "FullLayer", "RingCache", "RingLayer",
           "check_model", "generate", "layer_windows", "read_layout", "register", "ring_active",
           "serving_cache"]
