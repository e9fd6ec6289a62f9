"""CUDA path for batched steps: cascade attention through fused kernels, behind ``fused_kernels``."""
from prefixcache.model.cuda.attention import FusedKernels, fused_kernels

__all__ = ["FusedKernels", "fused_kernels"]
