"""CPU fast path for batched steps (MKL-packed linears, a fused Llama step), behind ``build_step_forward``."""
from prefixcache.model.cpu.step import KINDS, StepForward, build_step_forward

__all__ = ["KINDS", "StepForward", "build_step_forward"]
