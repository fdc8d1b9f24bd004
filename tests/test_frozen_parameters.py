"""Parameters that train nothing (requires_grad=False): read like buffers by every stage, never tied or
stepped; under ZeRO held whole on every replica, outside the flat buffers and units (no gradient to reduce, no
state to shard), in the compute dtype.

RoFormer computes its sinusoidal position table once, from a frozen embedding, and hands it to every layer: the
prefix used to hand two values to the blocks, so every pipeline and tensor-parallel plan was refused."""

from __future__ import annotations

import functools

import pytest
import torch

from examples.hf_families import from_config
from examples.training import adamw, hf_loss, train_one_process
from partitioner import compile, trace
from ranks import assert_trains_like
from runtime import launch_local

ROFORMER = functools.partial(from_config, "RoFormerConfig", "RoFormerForMaskedLM", embedding_size=64,
                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
TABLE = "roformer.encoder.embed_positions.weight"
VOCAB, SEQ, BATCH = 512, 16, 8


@pytest.fixture(scope="module")
def graph():
    return trace(ROFORMER(), (torch.randint(5, VOCAB, (2, SEQ)),))


def test_the_tracer_records_which_parameters_train(graph):
    trainable = {p.name: p.trainable for p in graph.params}
    assert trainable[TABLE] is False and sum(not t for t in trainable.values()) == 1


@pytest.mark.parametrize("pins", [dict(pp=2, tp=1), dict(pp=1, tp=2), dict(pp=2, tp=2), dict(pp=4, tp=1)])
def test_every_stage_computes_the_position_table_from_its_own_copy(graph, pins):
    """pp and tp programs verify against the module; the frozen table is held by each stage that reads it and is
    not tied (no gradient to sum), while the word embedding and LM head stay tied."""
    world = pins["pp"] * pins["tp"]
    plan = compile(graph, f"local:{world}", global_batch_size=2, microbatch_size=2, precision="fp32", dp=1, **pins)
    assert TABLE in plan.code.frozen
    plan.verify(ROFORMER, (torch.randint(5, VOCAB, (2, SEQ)),))
    if pins["pp"] > 1:
        ns = plan.program(plan.world_size - 1).namespace()
        assert TABLE not in ns["TIED"] and "roformer.embeddings.word_embeddings.weight" in ns["TIED"]


def test_zero_keeps_the_frozen_parameters_whole(graph):
    """ZeRO-1/2/3 and the distributed optimizer are planned for a model with a frozen parameter (the engine keeps
    it whole on every replica), and the ZeRO-3 hand baseline runs."""
    for pins in (dict(zero_stage=3), dict(zero_stage=1), dict(optimizer_layout="distributed")):
        plan = compile(graph, "local:2", global_batch_size=8, precision="bf16-mixed", dp=2, **pins)
        assert plan.config.zero_stage == pins.get("zero_stage", 1)
    plan = compile(graph, "local:2", global_batch_size=8, precision="fp32", dp=2)
    assert {b.name: b for b in plan.baselines}["ZeRO-3 only"].fits


@pytest.mark.slow
@pytest.mark.parametrize("pins", [dict(pp=4, dp=1, tp=1), dict(pp=2, dp=2, tp=1, zero_stage=3)])
def test_roformer_pipelines_train_like_one_process(graph, pins):
    """AdamW with weight decay, 3 steps: a frozen table stepped with a zero gradient would decay; it must not."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(5, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
            for _ in range(3)]
    world = pins["pp"] * pins["dp"] * pins["tp"]
    plan = compile(graph, f"local:{world}", global_batch_size=BATCH, precision="fp32", microbatch_size=2, **pins)
    out = launch_local(plan, ROFORMER, adamw, hf_loss, data, timeout_s=180)
    ref = train_one_process(ROFORMER, adamw, hf_loss, data)
    assert sorted(out.state_dict) == sorted(ref.model.state_dict())
    assert_trains_like(out, ref.losses, ref.model.state_dict(), adam_steps=3)
    torch.testing.assert_close(out.state_dict[TABLE], ROFORMER().state_dict()[TABLE])  # untouched


def test_lora_costs_the_adapters_state_only():
    """A frozen Llama with LoRA adapters: every parameter held, gradients and Adam state for the adapters
    alone (fp32: 4 + 8 bytes each), as the data-parallel engine keeps them; ZeRO-3 shards the adapters alone
    (their parameters, gradients and state over the 2 replicas), and gathers and reduces nothing else."""
    from examples.lora import lora_llama_seeded

    model = lora_llama_seeded()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    every = sum(p.numel() for p in model.parameters())
    g = trace(model, (torch.randint(1, VOCAB, (2, SEQ)),))
    kw = dict(global_batch_size=4, microbatch_size=2, precision="fp32", dp=2)
    m = compile(g, "local:2", zero_stage=0, **kw).predicted.memory
    assert (m.params, m.grads, m.optimizer) == (4 * every, 4 * trainable, 8 * trainable)
    z3 = compile(g, "local:2", zero_stage=3, **kw).predicted
    frozen = every - trainable
    assert (z3.memory.params, z3.memory.optimizer) == (4 * frozen + 4 * trainable / 2, 8 * trainable / 2)
    assert z3.memory.grads <= 4 * trainable  # (none at this plan's peak, the loss's moment)
    # what crosses the link per step: the adapters' 3 passes (gather, gather, reduce-scatter), half each way
    assert z3.bytes_per_link["intra_node"] == pytest.approx(3 * 4 * trainable / 2)


def test_a_lora_model_that_fits_is_not_refused():
    """16 layers at hidden 4096 (3.5B frozen parameters) on 8 A100-40GB: 7 GB of bf16 weights per replica
    and the adapters' state; counted as 16-18 bytes per parameter it was refused (51.9 GiB per rank at least,
    with ZeRO-3 suggested, which such a model cannot run)."""
    from examples.lora import lora_llama_seeded

    with torch.device("meta"):
        model = lora_llama_seeded(layers=16, hidden=4096, rank=8)
    g = trace(model, (torch.zeros(1, 64, dtype=torch.long, device="meta"),))
    plan = compile(g, "1x8xA100-40GB", global_batch_size=8, dp=8)
    assert plan.predicted.memory.optimizer < 2**30 and plan.predicted.peak_memory_bytes < 0.9 * 40 * 2**30


@pytest.mark.slow
@pytest.mark.parametrize("pins", [dict(pp=1, dp=2, tp=1, zero_stage=0), dict(pp=1, dp=2, tp=1, zero_stage=3),
                                  dict(pp=1, dp=2, tp=1, zero_stage=3, zero3_unit="module"),
                                  dict(pp=1, dp=2, tp=1, zero_stage=2), dict(pp=2, dp=1, tp=1),
                                  dict(pp=1, dp=1, tp=2)])
def test_lora_trains_like_one_process(pins):
    """Only the adapters train (AdamW, weight decay): the frozen weights come back untouched on every plan."""
    from examples.lora import lora_llama_seeded

    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(1, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
            for _ in range(3)]
    world = pins["pp"] * pins["dp"] * pins["tp"]
    graph = trace(lora_llama_seeded(), (data[0][0][:2],))
    plan = compile(graph, f"local:{world}", global_batch_size=BATCH, precision="fp32", microbatch_size=2, **pins)
    out = launch_local(plan, lora_llama_seeded, adamw, hf_loss, data, timeout_s=180)
    ref = train_one_process(lora_llama_seeded, adamw, hf_loss, data)
    assert_trains_like(out, ref.losses, ref.model.state_dict(), adam_steps=3)
    start = lora_llama_seeded().state_dict()
    base = "model.layers.0.self_attn.q_proj.base.weight"
    torch.testing.assert_close(out.state_dict[base], start[base])
    adapter = "model.layers.0.self_attn.q_proj.lora_b"
    assert not torch.equal(out.state_dict[adapter], start[adapter])


@pytest.mark.slow
def test_a_lora_checkpoint_under_zero3_resumes_under_another_plan(tmp_path):
    """LoRA at dp2 ZeRO-3 checkpoints after 2 steps; dp2 ZeRO-1 resumes from it and steps 3-4 match one process
    training 4: the frozen weights are saved whole (from every replica, one copy kept) and carry no optimizer
    state, which the resume neither reads nor makes."""
    from examples.lora import lora_llama_seeded

    g = torch.Generator().manual_seed(2)
    data = [(torch.randint(1, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
            for _ in range(4)]
    graph = trace(lora_llama_seeded(), (data[0][0][:2],))
    kw = dict(global_batch_size=BATCH, precision="fp32", microbatch_size=2, pp=1, dp=2, tp=1)
    first = compile(graph, "local:2", zero_stage=3, **kw)
    launch_local(first, lora_llama_seeded, adamw, hf_loss, data[:2], save_dir=tmp_path, save_every=2, timeout_s=180)
    then = compile(graph, "local:2", zero_stage=1, **kw)
    out = launch_local(then, lora_llama_seeded, adamw, hf_loss, data, resume_from=tmp_path, timeout_s=180)
    ref = train_one_process(lora_llama_seeded, adamw, hf_loss, data)
    assert out.start_step == 2
    assert_trains_like(out, ref.losses[2:], ref.model.state_dict(), adam_steps=4)
