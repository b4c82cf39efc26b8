"""Triton kernels, one op per module, each with a plain PyTorch reference of the same signature.

The ops:

* ``chain_verification`` — ``rejection_sample``: verification of K draft tokens per request.
* ``tree_verification`` — ``tree_verify``: verification of candidate trees.
* ``mlp_proposal`` — ``mlp_speculator_propose`` / ``_topk``: IBM MLP-speculator drafts.
* ``medusa_proposal`` — ``medusa_propose``: the Medusa heads' top-k.
* ``fused_linear_divergence`` — the distillation loss, without [T, V] logits.
* ``tree`` — candidate trees (PyTorch only): Medusa choices, MLP expansions, masks, KV compaction.

What they share: ``triton_utils`` (the one guarded triton import and the dispatch rule),
``sampling`` (counter-based randomness, top-k / top-p thresholds), ``row_stats`` (the
verification ops' pass over the logits), ``lm_head_topk`` (the proposal ops' fused head + top-k).
"""
