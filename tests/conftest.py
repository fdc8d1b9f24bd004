"""Session-wide settings, applied before any test module imports torch or triton."""

import os

# Triton kernels run in the interpreter on CPU tensors (TORCH-NOTES). It is read when triton is first
# imported, and some test modules import triton indirectly (torch, transformers) before test_quantize
# does: so it is set here, once, for the whole session. A GPU run sets TRITON_INTERPRET=0 to test the
# compiled kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")
