"""CUDA path for batched steps: cascade attention through fused kernels (``fused_kernels``), decode
steps captured as CUDA graphs (``CudaGraphCapture``)."""
from prefixcache.model.cuda.attention import FusedKernels, fused_kernels
from prefixcache.model.cuda.graphs import CudaGraphCapture

__all__ = ["CudaGraphCapture", "FusedKernels", "fused_kernels"]
