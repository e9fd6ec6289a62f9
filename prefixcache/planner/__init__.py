"""Capacity planning: replay a request log or a public trace through the real cache code.

``trace`` reads prefixcache request logs and Mooncake-format traces into one compact,
time-ordered form; ``replay`` drives the real trie, policy and store (byte sizes, no
tensors) for one budget and TTL; ``grid`` runs every budget and TTL; ``report`` writes
markdown, JSON and a plot; ``request_log`` is the proxy's privacy-safe request log;
``synth`` generates large synthetic traces for measurements.
"""
