"""Context parallelism: attention over a sequence split across the ranks of a cp group.

Owns the kernels a context-parallel program calls, each autograd-correct over a process group and
counted by the collectives shim (`runtime.comm.collectives`):
- `sequence`: the causal load-balanced split (rank r holds chunks r and 2*cp-1-r of 2*cp), its inverse,
  and the global positions of a rank's tokens;
- `ring_attention`: k/v blocks passed round the ring, online-softmax merge, ring backward;
- `ulysses`: DeepSpeed-Ulysses, all-to-all from a sequence split to a head split and back.
- `program`: what a context-parallel program's generated code calls (`cp_attention`, `cp_positions`), and
  its group context `CPContext`; `partitioner.codegen.segment_cp` writes those calls.
"""

from runtime.context.ring_attention import ring_attention
from runtime.context.sequence import positions, shard_sequence, unshard_sequence
from runtime.context.ulysses import ulysses_attention

__all__ = ["positions", "ring_attention", "shard_sequence", "ulysses_attention", "unshard_sequence"]
