"""Triton kernels for CUDA (run in Triton's interpreter on a CPU for the tests): the fused tree
attention, the int8 weight-only matmul, and the batch-invariant mode's linear, norm and attention."""
