"""CPU fast path for batched steps (MKL-packed linears, a fused Llama step), behind ``build_step_forward``."""
