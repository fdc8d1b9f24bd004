"""Gradient compression: the kernels and the compressed reductions the data-parallel engine runs.

- `grad_compression.py` (read first): `GradientReducer`, what a data-parallel group's reduction does under
  the plan's compressor, flat or hierarchical (intra-node, then across nodes);
- `compressed_reduce.py`: int8 / int4 all-reduce as all-to-all + all-gather of blockwise codes, with error
  feedback; `quantized_gather.py`: ZeRO-3 parameter all-gather in int8;
- `quantize.py` / `quantize_triton.py`: blockwise quantisation, in torch and as fused Triton kernels;
- `powersgd.py` / `powersgd_triton.py`: low-rank PowerSGD, its prologue and epilogue fused in Triton.
"""
