"""The tree core below training, tuning and decoding: candidate trees and their tree-attention buffers
(:mod:`~medusa_train.tree.buffers`, :mod:`~medusa_train.tree.dynamic`), the composite tree's budget split
(:mod:`~medusa_train.tree.composite`), the verifier's acceptance rules (:mod:`~medusa_train.tree.acceptance`,
over :mod:`~medusa_train.tree.sampling`'s logits processing) and the KV cache's tree surgery
(:mod:`~medusa_train.tree.kv_cache`). It imports nothing of ``inference``: the decoders, proposers and the tree
tuner (``inference``) build on it.
"""
