"""The tracer: a PyTorch module -> an `OpGraph` (stage 1 of trace -> OpGraph -> Plan -> RankProgram -> runtime).

In: a module and example inputs (on any device, meta included). Out: the `OpGraph`: one node per ATen op
with symbolic shapes and FLOP / byte costs, the parameters, and the repeated blocks (layers) grouped by
kind; plus the `torch.export` program the code generator cuts into stage code.

Read first: `trace.py` (`trace()`, the whole stage in one function). Then:
- `capture.py`: torch.export of the model with its first blocks, sizes made symbolic (B, S);
- `attention.py`, `pointwise.py`: eager attention and activations spelled as elementwise ops, rewritten to fused ops;
- `blocks.py`, `block_kinds.py`: which sub-modules are the repeated blocks, which of them compute alike;
- `op_rules.py`: the cost of each ATen op; `symbolic.py`: polynomials in B and S;
- `opgraph.py` (the data), `opgraph_table.py` (as text), `cache.py` (a trace saved by source hash);
- `batch_statistics.py`: values the model's forward computes that a split batch cannot reproduce.

Imports nothing above it: the planner, code generator and presentations read its output.
"""
