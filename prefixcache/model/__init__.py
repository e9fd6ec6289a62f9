"""What the model needs to read and write KV: its layout, the one ``transformers`` contact
(``hf_cache``), cascade attention, the private KV pool, and the CUDA kernels (``cuda/``).
"""
