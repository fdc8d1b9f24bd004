"""Memory formulas, against the papers' numbers and hand-computed values."""

from __future__ import annotations

import pytest

from cost_models.errors import PartitionerError
from cost_models.memory import (
    DDP_BUCKET_BYTES,
    ModelStateBytes,
    chunk_inflight,
    inflight_microbatches,
    model_state_bytes,
    process_fixed_bytes,
    temporary_buffer_bytes,
    transformer_activation_bytes,
)

GB = 1e9


# --- model state: ZeRO paper (Rajbhandari et al. 2020), Figure 1 -------------------
@pytest.mark.parametrize("stage,paper_gb,exact_gb", [(0, 120.0, 120.0), (1, 31.4, 31.40625),
                                                     (2, 16.6, 16.640625), (3, 1.9, 1.875)])
def test_zero_paper_7_5B_on_64_devices(stage, paper_gb, exact_gb):
    s = model_state_bytes(7.5e9, precision="bf16-mixed", optimizer="adam",
                          zero_stage=stage, dp=64)
    assert s.total / GB == pytest.approx(exact_gb)
    assert round(s.total / GB, 1) == paper_gb


def test_zero_stage_2_components():
    s = model_state_bytes(7.5e9, precision="fp16-mixed", optimizer="adam", zero_stage=2, dp=64)
    assert s == ModelStateBytes(params=15e9, grads=15e9 / 64, optimizer=90e9 / 64)


@pytest.mark.parametrize("precision,optimizer,per_param", [
    ("fp32", "adam", 16), ("fp32", "sgd", 8), ("fp32", "sgd-momentum", 12),
    ("bf16-mixed", "adam", 16), ("bf16-mixed", "sgd", 8), ("bf16-mixed", "sgd-momentum", 12)])
def test_bytes_per_parameter_without_zero(precision, optimizer, per_param):
    s = model_state_bytes(1000, precision=precision, optimizer=optimizer, zero_stage=0, dp=8)
    assert s.total == 1000 * per_param


def test_fp32_adam_zero_3_shards_everything():
    s = model_state_bytes(1e9, precision="fp32", optimizer="adam", zero_stage=3, dp=4)
    assert (s.params, s.grads, s.optimizer) == (1e9, 1e9, 2e9)


@pytest.mark.parametrize("kw,match", [
    ({"precision": "fp8"}, r"precision='fp8'.*'fp32', 'bf16-mixed', 'fp16-mixed'"),
    ({"optimizer": "lamb"}, r"optimizer='lamb'.*'adam', 'sgd', 'sgd-momentum'"),
    ({"zero_stage": 4}, r"zero_stage=4.*\[0, 1, 2, 3\]"),
    ({"dp": 0}, r"dp=0")])
def test_model_state_bad_input_names_the_field(kw, match):
    args = dict(precision="bf16-mixed", optimizer="adam", zero_stage=1, dp=8) | kw
    with pytest.raises(PartitionerError, match=match):
        model_state_bytes(1e9, **args)


# --- activations: Korthikanti et al. 2022, GPT-3 175B ---------------------------
GPT3 = dict(s=2048, b=1, h=12288, a=96)
SBH = 2048 * 12288  # 25_165_824; 5as/h = 80 for GPT-3


@pytest.mark.parametrize("kw,expected", [
    ({}, 114 * SBH),                                                  # 34 + 80: 2.87 GB
    ({"t": 8}, (10 + 24 / 8 + 80 / 8) * SBH),                         # 23 sbh
    ({"t": 8, "sequence_parallel": True}, 114 / 8 * SBH),             # 358_612_992
    ({"recompute": "selective"}, 34 * SBH),
    ({"t": 8, "recompute": "selective"}, 13 * SBH),
    ({"t": 8, "recompute": "selective", "sequence_parallel": True}, 34 / 8 * SBH),
    ({"recompute": "full"}, 2 * SBH),
    ({"t": 8, "recompute": "full"}, 2 * SBH),
    ({"t": 8, "recompute": "full", "sequence_parallel": True}, 2 / 8 * SBH)])
def test_gpt3_activation_bytes_per_layer(kw, expected):
    assert transformer_activation_bytes(**GPT3, **kw) == pytest.approx(expected)


def test_gpt3_by_hand_and_the_papers_eq():
    assert transformer_activation_bytes(**GPT3) == pytest.approx(2_868_903_936)
    # Their sequence-parallel form: 34 sbh/t + 5 a s^2 b / t
    sp = 34 * SBH / 8 + 5 * 96 * 2048**2 * 1 / 8
    assert sp == 358_612_992
    assert transformer_activation_bytes(**GPT3, t=8, sequence_parallel=True) == pytest.approx(sp)


def test_selective_recompute_saves_70_percent_for_gpt3():
    # The paper: selective recomputation cuts GPT-3's activation memory by ~70 %.
    full = transformer_activation_bytes(**GPT3)
    sel = transformer_activation_bytes(**GPT3, recompute="selective")
    assert 1 - sel / full == pytest.approx(0.70, abs=0.01)  # the paper states "~70 %", rounded to 1 %


def test_activation_bad_input():
    with pytest.raises(PartitionerError, match=r"recompute='some'.*'none', 'selective', 'full'"):
        transformer_activation_bytes(**GPT3, recompute="some")
    with pytest.raises(PartitionerError, match="t=0"):
        transformer_activation_bytes(**GPT3, t=0)


# --- in-flight microbatches ------------------------------------------------------
def test_gpipe_holds_all_microbatches():
    assert [inflight_microbatches("gpipe", pp=4, stage=i, num_microbatches=8)
            for i in range(4)] == [8, 8, 8, 8]


def test_1f1b_holds_pp_minus_stage():
    assert [inflight_microbatches("1f1b", pp=4, stage=i, num_microbatches=8)
            for i in range(4)] == [4, 3, 2, 1]
    assert inflight_microbatches("1f1b", pp=4, stage=0, num_microbatches=2) == 2


def test_interleaved_1f1b_megatron_warmup():
    # stage i: (pp - i - 1) * 2 + (v - 1) * pp + 1, chunk-microbatches
    got = [inflight_microbatches("interleaved-1f1b", pp=4, stage=i, num_microbatches=8,
                                 interleave=2) for i in range(4)]
    assert got == [11, 9, 7, 5]
    # In stage-microbatches, stage 0 holds pp * (1 + (pp - 1) / (pp v)) = 5.5 (Narayanan 2021).
    assert got[0] / 2 == pytest.approx(4 * (1 + 3 / (4 * 2)))
    # Capped at m * v when there are few microbatches.
    assert inflight_microbatches("interleaved-1f1b", pp=4, stage=0, num_microbatches=1,
                                 interleave=2) == 2


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_per_chunk_counts_are_the_schedules(pp, v):
    """chunk_inflight's closed walk equals what the schedule the runtime executes holds per virtual stage,
    and its chunks add up to at least the rank's Megatron count (the chunks' peaks need not coincide)."""
    from partitioner.planner.schedule import build_schedule, peak_inflight

    for m in (pp, 2 * pp, 3 * pp, 4 * pp, 9 * pp):  # the schedule takes multiples of pp
        per_stage = peak_inflight(build_schedule("interleaved-1f1b", pp=pp, num_microbatches=m, interleave=v))
        for rank in range(pp):
            got = chunk_inflight(pp=pp, stage=rank, num_microbatches=m, interleave=v)
            assert got == tuple(per_stage[c * pp + rank] for c in range(v)), (m, rank)
            assert sum(got) >= inflight_microbatches("interleaved-1f1b", pp=pp, stage=rank, num_microbatches=m,
                                                     interleave=v)


@pytest.mark.parametrize("args,match", [
    (("zigzag", 4, 0, 8, 1), r"schedule='zigzag'.*'gpipe', '1f1b', 'interleaved-1f1b', 'zb-h1'"),
    (("1f1b", 4, 4, 8, 1), r"stage=4.*0\.\.3"),
    (("1f1b", 4, 0, 8, 2), r"interleave=2 applies only"),
    (("interleaved-1f1b", 4, 0, 8, 1), r"interleave >= 2"),
    (("gpipe", 4, 0, 0, 1), r"num_microbatches=0")])
def test_inflight_bad_input(args, match):
    schedule, pp, stage, m, v = args
    with pytest.raises(PartitionerError, match=match):
        inflight_microbatches(schedule, pp=pp, stage=stage, num_microbatches=m, interleave=v)


# --- temporary buffers ----------------------------------------------------------
def test_temporary_buffers():
    assert DDP_BUCKET_BYTES == 26_214_400
    none = temporary_buffer_bytes()
    assert none.total == 0.0
    t = temporary_buffer_bytes(dp=8, zero_stage=3, largest_block_param_bytes=1e8,
                               b=1, s=2048, vocab=50304)
    assert t.dp_bucket == 26_214_400
    assert t.gathered_params == 2e8                   # two blocks with prefetch
    assert t.logits == 1 * 2048 * 50304 * 4           # 412_090_368
    assert t.total == 26_214_400 + 2e8 + 412_090_368
    assert temporary_buffer_bytes(dp=8, zero_stage=3, largest_block_param_bytes=1e8,
                                  prefetch=False).gathered_params == 1e8
    assert temporary_buffer_bytes(dp=8, zero_stage=2,
                                  largest_block_param_bytes=1e8).gathered_params == 0.0


def test_temporary_buffers_bad_input():
    with pytest.raises(PartitionerError, match="vocab=-1"):
        temporary_buffer_bytes(vocab=-1)
    with pytest.raises(PartitionerError, match="zero_stage=5"):
        temporary_buffer_bytes(zero_stage=5)


# --- fixed per process ----------------------------------------------------------
def test_process_fixed_bytes_is_the_context_plus_a_communicator_per_group():
    assert process_fixed_bytes(process_bytes=100, comm_buffer_bytes=10, communicators=3) == 130
    assert process_fixed_bytes(process_bytes=100, comm_buffer_bytes=10, communicators=0) == 100
    with pytest.raises(PartitionerError, match="communicators"):
        process_fixed_bytes(process_bytes=100, comm_buffer_bytes=10, communicators=-1)


def test_gpu_presets_carry_the_cuda_context_and_nccl_buffers():
    from cost_models.devices import get_device
    a100, cpu = get_device("A100-80GB"), get_device("CPU")
    # NCCL src/init.cc: Simple 4 MiB + LL128 120*640*8*8 B + LL 8*512*8*16 B per connection, 32 channels
    assert a100.comm_buffer_bytes == 32 * (4 * 2**20 + 4_915_200 + 524_288)
    assert a100.process_bytes == 723 * 2**20  # a process after torch.randn(1).cuda() (see devices.py)
    assert cpu.process_bytes == cpu.comm_buffer_bytes == 0  # Gloo on CPU: per-call buffers, RSS not budgeted


def test_plan_memory_counts_the_fixed_process_memory(meta_gpt_graph):
    from cost_models.devices import get_device
    from partitioner import compile
    g = meta_gpt_graph
    one = compile(g, "1x4xA100-80GB", global_batch_size=8, dp=4, zero_stage=0)
    two = compile(g, "1x4xA100-80GB", global_batch_size=8, dp=2, tp=2, zero_stage=0)
    a100 = get_device("A100-80GB")
    assert one.predicted.memory.buffers >= a100.process_bytes + a100.comm_buffer_bytes  # one group: dp
    assert two.predicted.memory.buffers >= a100.process_bytes + 2 * a100.comm_buffer_bytes  # dp and tp
