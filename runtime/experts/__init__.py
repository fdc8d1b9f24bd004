"""Expert parallelism: a mixture-of-experts layer whose experts are divided over the ranks of an ep group.

Owns the kernels an expert-parallel program calls, autograd-correct over a process group and counted by
the collectives shim (`runtime.comm.collectives`):
- `dispatch`: token routing as plain tensor functions: which experts a rank holds, the permutation that
  sorts (token, choice) pairs by expert, its inverse, the counts per expert and per destination rank; the
  policy (no token dropping: capacity is unbounded);
- `grouped_experts`: a rank's experts run on tokens grouped by expert, from batched `[E, ...]` weights (as
  Hugging Face's MoE classes keep them) or from a list of expert modules;
- `expert_parallel`: `ep_moe`, permute, all-to-all of counts, all-to-all of tokens with variable split
  sizes, the local experts, all-to-all back, un-permute and weight; the backward through the same path.
- `aux_loss`: the router's load-balancing loss (Switch Transformer, as Hugging Face computes it) from each
  rank's tokens, equal to the one-process value; `pipeline_aux`: under pp > 1, each stage's sums carried to
  the last stage with the activations, their gradient back with the activations' gradients.
- `program`: what generated code calls (`ep_experts` per MoE layer, `ep_aux_loss`, `EPContext`), the
  code generator (`partitioner.codegen.segment_ep`) rewriting each MoE layer's experts into it;
- `engine`: `ExpertParallel`, the rank's expert slices beside the data-parallel engine, their gradients
  reduced over the ranks holding the same experts.
The planner plans and costs ep (`partitioner.planner.expert_split`); generated programs for ep > 1 call these.
"""

from runtime.experts.aux_loss import load_balancing_loss
from runtime.experts.dispatch import Routing, experts_per_rank, local_experts, route
from runtime.experts.expert_parallel import all_to_all_splits, ep_moe
from runtime.experts.grouped_experts import batched_experts, module_experts

__all__ = ["Routing", "all_to_all_splits", "batched_experts", "ep_moe", "experts_per_rank", "load_balancing_loss",
           "local_experts", "module_experts", "route"]
