"""Single-process pipeline parallelism over the GPUs of one machine (RamTorch's Pipeline API)."""
