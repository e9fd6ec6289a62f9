"""What the model needs to read and write KV: its layout, the one ``transformers`` contact
(``hf_cache``), cascade attention, the private KV pool, and device fast paths (``cpu/``).
"""
