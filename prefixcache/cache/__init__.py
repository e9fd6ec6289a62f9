"""Bytes and trees: block hashing, the prefix trie, eviction policy, runs and the KV store.

No model code and no ``transformers`` here: snapshots are opaque ``[L, 2, H, n, D]`` tensors.
"""
