"""Requests to tokens: canonicalization, the request state, scheduling, the model runner,
the batching loop, sampling, and the serial engine for what batching cannot reproduce.
"""
