"""The CPU platform (``platform.CpuPlatform``): C kernels, packed weights, the shared-memory exchange, process
tuning."""
