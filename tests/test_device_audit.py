"""Every program kind puts its tensors on its rank's device (issue 19), proven on CPU by the device audit.

On CPU every tensor is on `cpu`, so a factory without `device=` or a batch never moved is right by accident
here and wrong on a GPU. `runtime.device.audit` tracks what the runtime placed and fails on any op that mixes
a placed tensor with one never placed (or hands a collective an unplaced one), naming the op and the line.
Here: one run of each program kind (DDP, ZeRO-1/2/3, pipeline, tensor parallel, 3D, compression, async SGD)
under the audit, each still training like one process; a deliberately misplaced tensor in a program is caught
by name. The whole equivalence suite runs under the audit with PARTITIONER_DEVICE_AUDIT=1 (launch_local
reads it): `PARTITIONER_DEVICE_AUDIT=1 python -m pytest tests/test_dp_equivalence.py tests/test_3d_equivalence.py`.
"""

from __future__ import annotations

import pytest
import torch

from examples.training import adamw, gpt_4l_seeded, gpt_loss, hf_llama_seeded, hf_loss, train_one_process
from partitioner import compile
from runtime import launch_local
from runtime.device import place, place_module
from runtime.device.audit import DeviceAuditError, device_audit
from runtime.launch.env import LaunchError
from ranks import assert_trains_like

VOCAB, SEQ, BATCH, STEPS = 512, 16, 8, 2
MODELS = {"gpt": (gpt_4l_seeded, gpt_loss), "llama": (hf_llama_seeded, hf_loss)}


def _batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(1, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
            for _ in range(steps)]


def _plan(name: str, **pins):
    model_fn, _ = MODELS[name]
    world = pins.get("pp", 1) * pins.get("dp", 1) * pins.get("tp", 1)
    return compile(model_fn(), f"local:{world}", example_inputs=(torch.randint(0, VOCAB, (2, SEQ)),),
                   global_batch_size=BATCH, precision="fp32", alternatives=0, **pins)


# ---- in one process: what the audit catches and what it lets through --------------------------------


def test_the_audit_passes_placed_training_and_catches_what_was_never_placed():
    model = torch.nn.Linear(4, 4)
    with device_audit():
        place_module(model)
        x = place(torch.randn(2, 4))
        y = model(x) * torch.tensor(2.0)  # a 0-dim CPU scalar is legal beside CUDA tensors
        y = y + torch.zeros(2, 4, device=y.device)  # a factory given its inputs' device
        y.sum().backward()
        torch.optim.AdamW(model.parameters()).step()
        with pytest.raises(DeviceAuditError, match=r"aten\.add\.Tensor at test_device_audit\.py:\d+ .*an input, of "
                                                   r"shape \(2, 4\)"):
            y + torch.ones(y.shape)
        with pytest.raises(DeviceAuditError, match=r"aten\.addmm\.default .*never put on the rank's device"):
            model(torch.randn(2, 4))  # a batch not moved
        total = torch.zeros((), dtype=torch.float64)
        with pytest.raises(DeviceAuditError, match=r"aten\.add_\.Tensor .*the output it writes into"):
            total += y.sum().double()  # a CPU accumulator cannot take a CUDA tensor in place


# ---- every program kind, as real Gloo ranks under the audit ------------------------------------------

CASES = [  # id, model, pins
    ("ddp", "gpt", dict(dp=2, zero_stage=0)),
    ("zero1", "gpt", dict(dp=2, zero_stage=1)),
    ("zero2", "gpt", dict(dp=2, zero_stage=2, microbatch_size=2)),
    ("zero3", "gpt", dict(dp=2, zero_stage=3)),
    ("pp2", "gpt", dict(pp=2, schedule="1f1b", microbatch_size=2)),
    ("tp2-llama", "llama", dict(tp=2, microbatch_size=4)),
    ("3d-pp2-dp2-zero3", "gpt", dict(pp=2, dp=2, zero_stage=3, microbatch_size=2)),
    ("int8", "gpt", dict(dp=2, zero_stage=0, compression="int8")),
    ("zero3-int8", "gpt", dict(dp=2, zero_stage=3, compression="int8")),  # int8 weight gathers too
    ("powersgd", "gpt", dict(dp=2, zero_stage=0, compression="powersgd")),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,pins", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_every_program_kind_places_everything_on_its_device(name, pins):
    model_fn, loss_fn = MODELS[name]
    pins = {"pp": 1, "tp": 1, "dp": 1, **pins}
    data = _batches()
    out = launch_local(_plan(name, **pins), model_fn, adamw, loss_fn, data, timeout_s=120, device_audit=True)
    if pins.get("compression", "none") == "none":
        want = train_one_process(model_fn, adamw, loss_fn, data)
        assert_trains_like(out, want.losses, want.model.state_dict(), adam_steps=STEPS)


@pytest.mark.slow
def test_async_sgd_places_everything_on_its_device():
    plan = _plan("gpt", dp=2, pp=1, tp=1, async_sgd={"every": 1})
    out = launch_local(plan, gpt_4l_seeded, adamw, gpt_loss, _batches(), timeout_s=120, device_audit=True)
    assert len(out.losses) == STEPS


@pytest.mark.slow
def test_a_misplaced_tensor_in_a_program_is_caught_with_its_op_and_line():
    """A segment that adds torch.ones(x.shape) (no device=): on a GPU a CPU tensor beside CUDA ones."""
    plan = _plan("gpt", dp=2, pp=1, tp=1, zero_stage=0)
    line = "torch.ops.aten.add.Tensor(embedding, embedding_1)"
    sources = {r: plan.program(r).source for r in range(2)}
    assert all(line in s for s in sources.values())
    bad = {r: s.replace(line, "torch.ops.aten.add.Tensor(embedding, torch.ones(embedding.shape))")
           for r, s in sources.items()}
    with pytest.raises(LaunchError, match=r"DeviceAuditError: aten\.add\.Tensor at rank_\d\.py:\d+ in prefix"):
        launch_local(plan, gpt_4l_seeded, adamw, gpt_loss, _batches(1), programs=bad, timeout_s=60,
                     device_audit=True, verify=False)
