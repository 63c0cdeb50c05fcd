"""The CUDA platform (``platform.CudaPlatform``): CUDA graphs, and the flash-attention and DeepEP adapters."""
