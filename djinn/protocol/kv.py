"""What client and appliance agree a KV cache is a function of (pure).

A KV cache built only by plain forward calls of integer token ids is a function of the
model and those ids: the appliance drops such a cache under memory pressure and rebuilds
it from its recorded ids (Note [kv recompute], appliance/recompute.py), and a recovering
client rebuilds a lost one with a prefill of them (Note [kv prefill replay],
djinn/runtime/kv_replay.py). Both sides must mean the same calls by "plain", so the
keyword arguments such a call may have are defined once, here: no attention mask,
positions or embeddings, which a record of the ids would not reproduce.
"""

from __future__ import annotations

# forward() arguments that leave a cache a function of its token ids alone
SAFE_KWARGS = frozenset(
    {
        "input_ids",
        "past_key_values",
        "use_cache",
        "return_dict",
        "output_attentions",
        "output_hidden_states",
        "logits_to_keep",
    }
)
