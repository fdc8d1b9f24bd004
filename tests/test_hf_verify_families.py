"""More Hugging Face families under pipeline, tensor and sequence parallelism, checked by plan.verify.

Each family in examples.hf_families.MORE_FAMILIES lays out attention or the residual stream its own way
(fused qkv per head or in groups, multi-query attention, parallel residuals, partial or interleaved rotary,
norms on q and k, soft-capping, sliding windows, experts). plan.verify runs every rank's generated program in
this process and compares outputs, loss and every gradient with the module (fp32, rtol 1e-5), so a split that
would train wrong fails here, without spawning ranks. The multi-process runs of other families are in
test_hf_families.py.
"""

from __future__ import annotations

import functools

import pytest
import torch

from cost_models.errors import DeclarationError
from examples.hf_families import MORE_FAMILIES
from examples.training import hf_loss, hf_model_loss
from partitioner import compile, trace
from runtime.launch.local import check_sendable

VOCAB, SEQ = 512, 16
NO_SP = {"opt": "the blocks' input is not split along the tokens",  # OPT flattens (b, s) inside each layer
         # its indexer runs in a no_grad region on the hidden state, where the sequence split does not follow
         "glm_moe_dsa": "sequence split does not follow into it",
         # its hyper-connections mix four streams of each token before every block: no row-parallel output splits them
         "hy_v4": "the blocks' input is not split along the tokens"}
# A torch.autograd.Function with its own backward in the forward: generated code would differentiate its forward's
# ops instead, so pipeline and tensor plans are refused, naming it (sparsemixer's gradient estimator for the router)
OWN_BACKWARD = {"phimoe": "PhimoeMultiplier"}


def _refused_for_its_own_backward(family: str, g, **pins) -> bool:
    """Where the family applies a Function with its own backward: the plan is refused, naming it (True)."""
    if family not in OWN_BACKWARD:
        return False
    with pytest.raises(DeclarationError, match=rf"applies \S*{OWN_BACKWARD[family]} .*own backward"):
        compile(g, f"local:{pins.get('pp', 1) * pins.get('tp', 1)}", global_batch_size=2, microbatch_size=2,
                precision="fp32", dp=1, **pins)
    return True


def _batch():
    g = torch.Generator().manual_seed(3)
    return torch.randint(1, VOCAB, (2, SEQ), generator=g), torch.randint(1, VOCAB, (2, SEQ), generator=g)


@functools.cache
def _graph(family: str):
    return trace(MORE_FAMILIES[family](), (_batch()[0],))


@pytest.mark.parametrize("family", list(MORE_FAMILIES))
def test_pipeline_and_tensor_parallel_programs_compute_the_module(family):
    if _refused_for_its_own_backward(family, _graph(family), pp=2, tp=2, sp=False):
        return
    plan = compile(_graph(family), "local:4", global_batch_size=2, microbatch_size=2, precision="fp32", pp=2, tp=2,
                   dp=1, sp=False)
    x, y = _batch()
    report = plan.verify(MORE_FAMILIES[family], (x,), hf_loss, targets=y)
    assert "pp2 tp2" in str(report)


@pytest.mark.parametrize("family", list(MORE_FAMILIES))
def test_zero_bubble_v_programs_compute_the_module(family):
    """Two virtual stages a rank in a V (stage 0 and 3 on rank 0): each family's blocks cut four ways, its embedding
    and LM head on one rank, and the backward split into input and weight gradients."""
    if _refused_for_its_own_backward(family, _graph(family), pp=2):
        return
    plan = compile(_graph(family), "local:2", global_batch_size=2, microbatch_size=1, precision="fp32", pp=2, dp=1,
                   schedule="zb-v", interleave=2)
    x, y = _batch()
    report = plan.verify(MORE_FAMILIES[family], (x,), hf_loss, targets=y)
    assert "4 stages" in str(report)


@pytest.mark.parametrize("family", list(MORE_FAMILIES))
def test_sequence_parallel_programs_compute_the_module(family):
    if _refused_for_its_own_backward(family, _graph(family), tp=2, sp=True):
        return
    if family in NO_SP:  # refused before anything runs, saying why
        with pytest.raises(DeclarationError, match=NO_SP[family]):
            compile(_graph(family), "local:2", global_batch_size=2, precision="fp32", tp=2, sp=True)
        return
    plan = compile(_graph(family), "local:2", global_batch_size=2, microbatch_size=2, precision="fp32", tp=2, sp=True)
    assert plan.config.sp
    x, y = _batch()
    plan.verify(MORE_FAMILIES[family], (x,), hf_loss, targets=y)


def test_each_builder_can_be_sent_to_spawned_ranks():
    """launch_local sends model_fn to processes it spawns: the builders are partials of a module-level function
    (three of them trained like one process on 2-4 ranks: gpt_neox pp2 tp2, mixtral tp2+sp, codegen pp2 tp2+sp)."""
    for name, build in MORE_FAMILIES.items():
        check_sendable(f"MORE_FAMILIES[{name!r}]", build)


def _padded():
    """A left-padded batch (row 1: 5 pads) with labels -100 on the pads, as fine-tuning data comes."""
    x, _ = _batch()
    mask = torch.ones_like(x)
    mask[1, :5] = 0
    return dict(input_ids=x, attention_mask=mask, labels=x.masked_fill(mask == 0, -100))


@pytest.mark.parametrize("family", list(MORE_FAMILIES))
def test_left_padded_batches_with_the_models_own_loss_compute_the_module(family):
    """The masks the model makes from the padding are computed again from the inputs by each block that reads
    them (these plans were refused: more than the hidden state left the prefix); blocks whose masks differ (a
    sliding window beside full attention) stay different kinds."""
    batch = _padded()
    g = trace(MORE_FAMILIES[family](), (), batch)
    assert [b.kind for b in g.blocks] == [b.kind for b in _graph(family).blocks]  # as without the padding
    if _refused_for_its_own_backward(family, g, pp=2, tp=2, sp=False):
        return
    plan = compile(g, "local:4", global_batch_size=2, microbatch_size=2, precision="fp32", pp=2, tp=2, dp=1, sp=False)
    plan.verify(MORE_FAMILIES[family], batch, hf_model_loss)
