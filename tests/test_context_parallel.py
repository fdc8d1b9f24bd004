"""Context parallelism (runtime.context): the load-balanced split, ring attention and Ulysses against SDPA.

- the split: shard/unshard round-trip, positions, the errors; the ring's block plan gives every rank the
  same work at every step and covers exactly the causal (query, key) pairs; the ring's algebra in one
  process, on both block bodies (CPU flash and matmuls): blocks merged by log-sum-exp give SDPA's output,
  their backward shares from the final out and lse sum to its gradients (no processes);
- real Gloo worlds of 2 and 4 ranks (slow): the output and dq, dk, dv of ring attention and Ulysses, causal
  and not, with and without GQA, and on cp subgroups of a world of 4, match
  `F.scaled_dot_product_attention` on the full sequence in one process (fp32, 1e-5), and the counting shim saw the ring's sends and Ulysses' all-to-alls, in number and
  bytes;
- group None is plain SDPA; the errors name the fix.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ranks import gloo_group
from runtime.comm.collectives import Collectives
from runtime.context import positions, ring_attention, shard_sequence, ulysses_attention, unshard_sequence
from runtime.context.ring_attention import _block_plan

B, H, S, D = 2, 4, 16, 8
KERNELS = {"ring": ring_attention, "ulysses": ulysses_attention}
CASES = [(kernel, causal, h_kv) for kernel in KERNELS for causal in (True, False) for h_kv in (H, 2)]


def _inputs(h_kv: int) -> tuple[torch.Tensor, ...]:
    """q, k, v and the output's gradient of the full sequence."""
    g = torch.Generator().manual_seed(h_kv)
    return (torch.randn(B, H, S, D, generator=g), torch.randn(B, h_kv, S, D, generator=g),
            torch.randn(B, h_kv, S, D, generator=g), torch.randn(B, H, S, D, generator=g))


def _reference(causal: bool, h_kv: int) -> tuple[torch.Tensor, ...]:
    """out, dq, dk, dv of one process's SDPA on the whole sequence."""
    q, k, v, grad = _inputs(h_kv)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=h_kv < H)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


# ---------------------------------------------------------------- the split, no processes

@pytest.mark.parametrize("seq,cp", [(8, 1), (8, 2), (12, 3), (16, 4), (32, 4)])
def test_shard_and_unshard_round_trip_and_positions_name_the_tokens(seq, cp):
    x = torch.arange(2 * seq).view(2, seq)
    shards = [shard_sequence(x, 1, r, cp) for r in range(cp)]
    assert all(s.shape == (2, seq // cp) for s in shards)
    assert torch.equal(unshard_sequence(shards, 1), x)
    for r, s in enumerate(shards):
        assert torch.equal(s[0], positions(seq, r, cp))
    held = torch.cat([positions(seq, r, cp) for r in range(cp)])
    assert torch.equal(held.sort().values, torch.arange(seq))       # every token on exactly one rank


def test_the_split_gives_rank_r_chunks_r_and_2cp_minus_1_minus_r():
    assert positions(16, 0, 4).tolist() == [0, 1, 14, 15]
    assert positions(16, 3, 4).tolist() == [6, 7, 8, 9]


def test_split_errors_name_the_fix():
    with pytest.raises(ValueError, match=r"18 is not divisible by 2 \* cp = 4.*pad the sequence to 20"):
        shard_sequence(torch.zeros(18), 0, 0, 2)
    with pytest.raises(ValueError, match="not divisible by 2 \\* cp = 8"):
        positions(12, 0, 4)
    with pytest.raises(ValueError, match="rank 2 is outside 0..1"):
        shard_sequence(torch.zeros(8), 0, 2, 2)
    with pytest.raises(ValueError, match="no shards given"):
        unshard_sequence([], 0)
    with pytest.raises(ValueError, match="differ in shape"):
        unshard_sequence([torch.zeros(4), torch.zeros(2)], 0)


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_the_causal_ring_gives_every_rank_the_same_work_and_covers_each_causal_pair_once(cp):
    """The block plan skips the future and trims to the rows and columns that see something: in the
    load-balanced layout every rank computes the same number of scores at every step, and the blocks'
    unmasked pairs are exactly the pairs (i, j) with j <= i."""
    seq = 4 * cp
    covered = torch.zeros(seq, seq, dtype=torch.int64)
    for step in range(cp):
        work = set()
        for r in range(cp):
            src = (r - step) % cp
            q_pos, k_pos = positions(seq, r, cp), positions(seq, src, cp)
            plan = _block_plan(q_pos, k_pos)
            assert plan is not None, "in the load-balanced layout no block is wholly in the future"
            rows, cols, mask = plan
            qi, kj = q_pos[rows], k_pos[cols]
            seen = torch.ones(len(qi), len(kj), dtype=torch.bool) if mask is None else mask
            assert mask is None or step == 0, "only the own block needs a mask"
            work.add(seen.numel())
            ii, jj = torch.meshgrid(qi, kj, indexing="ij")
            covered.index_put_((ii[seen], jj[seen]), torch.ones(int(seen.sum()), dtype=torch.int64), accumulate=True)
        assert len(work) == 1, f"step {step}: unequal work per rank {work}"
    assert torch.equal(covered, torch.ones(seq, seq, dtype=torch.int64).tril())


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("causal", [True, False])
def test_group_none_is_plain_sdpa(kernel, causal):
    q, k, v, _ = _inputs(2)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    torch.testing.assert_close(KERNELS[kernel](q, k, v, None, Collectives(), causal=causal), want)


@pytest.mark.parametrize("kernel", KERNELS)
def test_shape_errors_name_the_fix(kernel):
    q, k, v, _ = _inputs(H)
    with pytest.raises(ValueError, match="4 query heads cannot share 3 key/value heads"):
        KERNELS[kernel](q, k[:, :3], v[:, :3], None, Collectives())
    with pytest.raises(ValueError, match=r"shape \(B, H, S, D\).*transpose\(1, 2\)"):
        KERNELS[kernel](q[0], k[0], v[0], None, Collectives())


# ---------------------------------------------------------------- real Gloo worlds

def _worker(rank, world, store_path, out_dir):
    with gloo_group(rank, world, store_path):
        group = dist.group.WORLD
        results = {}
        for kernel, causal, h_kv in CASES:
            q, k, v, grad = (shard_sequence(t, 2, rank, world) for t in _inputs(h_kv))
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            coll = Collectives()
            out = KERNELS[kernel](q, k, v, group, coll, causal=causal)
            out.backward(grad)
            results[kernel, causal, h_kv] = {"grads": (out.detach(), q.grad, k.grad, v.grad),
                                             "counts": dict(coll.counts), "bytes": dict(coll.bytes)}
        if world == 4:  # cp groups {0, 2} and {1, 3}: group ranks differ from global ranks
            groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
            pair, cp_rank = groups[rank % 2], rank // 2
            for kernel in KERNELS:
                q, k, v, grad = (shard_sequence(t, 2, cp_rank, 2) for t in _inputs(2))
                q, k, v = (t.requires_grad_() for t in (q, k, v))
                KERNELS[kernel](q, k, v, pair, Collectives()).backward(grad)
                results["subgroup", kernel] = (None, q.grad, k.grad, v.grad)
        errors = {}
        q, k, v, _ = _inputs(H)
        try:                                                  # H = 4 heads, cp = 4: fine; 3 heads over cp = 2 or 4
            ulysses_attention(q[:, :3, :S // world], k[:, :3, :S // world], v[:, :3, :S // world], group,
                              Collectives())
        except ValueError as e:
            errors["ulysses_heads"] = str(e)
        try:
            ring_attention(q[:, :, :3], k[:, :, :3], v[:, :, :3], group, Collectives())
        except ValueError as e:
            errors["odd_shard"] = str(e)
        results["errors"] = errors
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kernel,causal,h_kv", CASES)
def test_context_parallel_attention_matches_sdpa_on_the_full_sequence(spawned, world, kernel, causal, h_kv):
    ranks = spawned(_worker, world)
    got = [unshard_sequence([r[kernel, causal, h_kv]["grads"][i] for r in ranks], 2) for i in range(4)]
    for name, g, want in zip(("out", "dq", "dk", "dv"), got, _reference(causal, h_kv)):
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("kernel", KERNELS)
def test_a_cp_subgroup_whose_ranks_are_not_the_global_ranks(spawned, kernel):
    """World 4 as two cp groups {0, 2} and {1, 3}: the ring's peers are named by global rank."""
    ranks = spawned(_worker, 4)
    want = _reference(True, 2)
    for members in ([0, 2], [1, 3]):
        for i, name in ((1, "dq"), (2, "dk"), (3, "dv")):
            got = unshard_sequence([ranks[m]["subgroup", kernel][i] for m in members], 2)
            torch.testing.assert_close(got, want[i], rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_the_shim_counts_the_ring_and_the_all_to_alls(spawned, world):
    """Ring: cp - 1 k/v blocks sent forward; backward cp - 1 k/v blocks and cp dk/dv accumulators, each
    block (2, B, H_kv, S/cp, D) fp32. Ulysses: q, k, v and out all-to-all'd forward, their gradients back."""
    for r in spawned(_worker, world):
        for h_kv in (H, 2):
            block = 2 * B * h_kv * (S // world) * D * 4
            ring = r["ring", True, h_kv]
            sends = 3 * world - 2
            assert ring["counts"] == {"send": sends, "recv": sends}
            assert ring["bytes"] == {"send": sends * block, "recv": sends * block}
            assert r["ulysses", True, h_kv]["counts"] == {"all_to_all": 8}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_errors_on_a_group_name_the_fix(spawned, world):
    for r in spawned(_worker, world):
        assert f"3 query heads do not divide by cp={world}" in r["errors"]["ulysses_heads"]
        assert "or use ring_attention" in r["errors"]["ulysses_heads"]
        assert f"not divisible by 2 * cp = {2 * world}" in r["errors"]["odd_shard"]


@pytest.mark.parametrize("fused", [True, False], ids=["cpu-flash", "matmuls"])
@pytest.mark.parametrize("causal", [True, False])
def test_blocks_merged_by_lse_and_their_backward_shares_sum_to_sdpa(fused, causal):
    """The ring's algebra in one process, on both block bodies: a load-balanced cp=3 split of S=192 (blocks of
    64, past the flash kernel's tiles, sliced as views), every (query shard, key shard) block merged by the
    online softmax gives SDPA's output, and the blocks' backward shares from the final out and lse sum to
    SDPA's dq, dk, dv."""
    from runtime.context.ring_attention import block_backward, block_forward

    cp, seq = 3, 192
    g = torch.Generator().manual_seed(1)
    q, k, v, grad = (torch.randn(1, 2, seq, 16, generator=g) for _ in range(4))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    want = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
    want.backward(grad)
    scale = 16 ** -0.5
    shard = [[shard_sequence(t, 2, r, cp) for r in range(cp)] for t in (q, k, v, grad)]
    outs, lses, plans = [], [], {}
    for r in range(cp):
        out = torch.zeros_like(shard[0][r])
        lse = torch.full(out.shape[:3], float("-inf"))
        for src in range(cp):
            plan = _block_plan(positions(seq, r, cp), positions(seq, src, cp)) if causal else \
                (slice(None), slice(None), None)
            if plan is None:
                continue
            plans[r, src] = rows, cols, mask = plan
            o_b, l_b = block_forward(shard[0][r][:, :, rows], shard[1][src][:, :, cols], shard[2][src][:, :, cols],
                                     scale, mask, fused=fused)
            new = torch.logaddexp(lse[:, :, rows], l_b)
            out[:, :, rows] = (out[:, :, rows] * (lse[:, :, rows] - new).exp().unsqueeze(-1)
                               + o_b * (l_b - new).exp().unsqueeze(-1))
            lse[:, :, rows] = new
        outs.append(out)
        lses.append(lse)
    torch.testing.assert_close(unshard_sequence(outs, 2), want.detach(), rtol=1e-5, atol=1e-5)
    dq, dk, dv = ([torch.zeros_like(s) for s in shard[0]] for _ in range(3))
    for (r, src), (rows, cols, mask) in plans.items():
        a, b, c = block_backward(shard[3][r][:, :, rows], shard[0][r][:, :, rows], shard[1][src][:, :, cols],
                                 shard[2][src][:, :, cols], outs[r][:, :, rows], lses[r][:, :, rows], scale, mask,
                                 fused=fused)
        dq[r][:, :, rows] += a
        dk[src][:, :, cols] += b
        dv[src][:, :, cols] += c
    for name, got, ref in (("dq", dq, qr.grad), ("dk", dk, kr.grad), ("dv", dv, vr.grad)):
        torch.testing.assert_close(unshard_sequence(got, 2), ref, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
