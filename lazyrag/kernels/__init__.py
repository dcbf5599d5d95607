"""Attention kernels with deferred RoPE (Triton) and their PyTorch reference."""
