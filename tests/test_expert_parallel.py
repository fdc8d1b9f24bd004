"""Expert parallelism (runtime.experts): token routing, ep_moe over real Gloo worlds, a real Hugging Face MoE block.

- routing, no processes: sorting the (token, choice) pairs by expert and its inverse round-trip, the counts
  per expert sum to T*k and per destination rank to the experts each rank holds, the errors name the fix;
  group None is the dense one-process MoE (batched and module experts), forward and gradients;
- real Gloo worlds of 2 and 4 ranks (slow): ep_moe's output and the gradients of x, topk_weight and every
  expert parameter (each rank's experts against the same slice of one process's) equal a dense one-process
  MoE (a loop over experts), fp32 rtol 1e-5, with random routing, and with uneven routing (experts and whole
  ranks that receive no token, a rank with no tokens at all), for batched `[E, ...]` and module experts, and
  on ep subgroups {0, 2} and {1, 3} of a world of 4;
  the counting shim sees 3 all-to-alls forward and 2 backward, with the bytes each rank sent;
- the router's load-balancing loss from each rank's logits (one rank with none), on 2 and 4 ranks, equals
  Hugging Face's `load_balancing_loss_func` on every token in one process, value and gradient, after one
  all-reduce;
- Hugging Face's Qwen3-MoE and Mixtral sparse MoE blocks (small configs) on 2 ranks: their router on each
  rank's tokens and their expert weights divided over the ranks give the block's output and the gradients
  of its input, router and experts, the load-balancing loss included in the loss.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ranks import gloo_group
from runtime.comm.collectives import Collectives
from runtime.experts import (batched_experts, ep_moe, experts_per_rank, load_balancing_loss, local_experts,
                             module_experts, route)

E, K, H, I = 4, 2, 8, 6
WORLDS = (2, 4)
# Each rank of a Hugging Face world imports transformers' modeling code (about 4 s of CPU a process): the
# block is compared on 2 ranks, and 4-rank expert parallelism is covered by the dense comparison
HF_WORLDS = (2,)
CASES = [(routing, body) for routing in ("random", "skewed") for body in ("batched", "modules")]
FAMILIES = ("qwen3_moe", "mixtral")
TOL = dict(rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- inputs and the dense reference

def _weights() -> tuple[torch.Tensor, torch.Tensor]:
    """Batched expert weights as Hugging Face keeps them: gate_up (E, 2I, H), down (E, H, I)."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(E, 2 * I, H, generator=g) * 0.5, torch.randn(E, H, I, generator=g) * 0.5


def _mlps() -> nn.ModuleList:
    torch.manual_seed(2)
    return nn.ModuleList(nn.Sequential(nn.Linear(H, I), nn.SiLU(), nn.Linear(I, H)) for _ in range(E))


def _choose(experts: list[int], t: int, g: torch.Generator) -> torch.Tensor:
    """(t, K) distinct experts per token, drawn from `experts`."""
    pick = torch.stack([torch.randperm(len(experts), generator=g)[:K] for _ in range(t)]) if t else \
        torch.zeros(0, K, dtype=torch.long)
    return torch.tensor(experts)[pick]


def _tokens(routing: str, world: int) -> list[tuple[torch.Tensor, ...]]:
    """Per rank: x (T, H), topk_idx (T, K), topk_weight (T, K), the output's gradient (T, H).

    random: T = 3 + rank tokens routed at random. skewed: rank 0 routes only to experts 0 and 1, the middle
    ranks to 1 and 2, the last rank has no tokens: experts 3 (and 2 on 2 ranks) and the last rank receive
    nothing, and some experts get nothing from some ranks."""
    g = torch.Generator().manual_seed(world)
    out = []
    for r in range(world):
        if routing == "random":
            t, idx = 3 + r, None
        else:
            t = 0 if r == world - 1 else 4
            idx = _choose([0, 1] if r == 0 else [1, 2], t, g)
        if idx is None:
            idx = torch.randn(t, E, generator=g).topk(K).indices
        out.append((torch.randn(t, H, generator=g), idx, torch.rand(t, K, generator=g), torch.randn(t, H, generator=g)))
    return out


def _dense(x, topk_idx, topk_weight, experts) -> torch.Tensor:
    """The MoE in one process, expert by expert: each expert on the tokens that chose it, weighted, summed."""
    y = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        tok, choice = torch.where(topk_idx == e)
        y = y.index_add(0, tok, expert(x[tok]) * topk_weight[tok, choice].unsqueeze(-1))
    return y


def _batched_callables(gate_up, down) -> list:
    def expert(e):
        def run(rows):
            gate, up = F.linear(rows, gate_up[e]).chunk(2, dim=-1)
            return F.linear(F.silu(gate) * up, down[e])
        return run
    return [expert(e) for e in range(E)]


def _reference(routing: str, body: str, world: int) -> dict:
    """y, dx, dw (all tokens, rank order) and the gradients of every expert parameter, in one process."""
    parts = _tokens(routing, world)
    x, idx, w, grad = (torch.cat([p[i] for p in parts]) for i in range(4))
    x, w = x.requires_grad_(), w.requires_grad_()
    if body == "batched":
        params = [p.requires_grad_() for p in _weights()]
        experts = _batched_callables(*params)
    else:
        mlps = _mlps()
        params, experts = list(mlps.parameters()), list(mlps)
    y = _dense(x, idx, w, experts)
    y.backward(grad)
    return dict(y=y.detach(), dx=x.grad, dw=w.grad, dparams=[p.grad for p in params], params=params, mlps=body)


# ---------------------------------------------------------------- routing, no processes

@pytest.mark.parametrize("t,k,e,ep", [(6, 2, 4, 2), (5, 1, 8, 4), (7, 3, 6, 3), (0, 2, 4, 2), (4, 2, 4, 1)])
def test_route_sorts_pairs_by_expert_and_its_inverse_undoes_it(t, k, e, ep):
    g = torch.Generator().manual_seed(t + k)
    idx = torch.randn(t, e, generator=g).topk(k).indices if t else torch.zeros(0, k, dtype=torch.long)
    r = route(idx, e, ep)
    flat = idx.reshape(-1)
    assert torch.equal(flat[r.order].sort().values, flat[r.order])            # grouped by expert
    assert torch.equal(flat[r.order][r.inverse], flat)                        # permute then inverse = identity
    x = torch.randn(t, 3)
    assert torch.equal(x[r.order // k][r.inverse].view(t, k, 3), x.unsqueeze(1).expand(t, k, 3))
    assert int(r.expert_counts.sum()) == int(r.send_counts.sum()) == t * k
    blocks = torch.split(flat[r.order], r.send_counts.tolist())
    for rank, block in enumerate(blocks):                                    # rank j's block: its experts only
        assert set(block.tolist()) <= set(local_experts(rank, ep, e))


def test_route_errors_name_the_fix():
    with pytest.raises(ValueError, match="ep must divide the number of experts; choose ep among"):
        route(torch.zeros(3, 2, dtype=torch.long), num_experts=6, ep=4)
    with pytest.raises(ValueError, match="outside 0 .. 3"):
        route(torch.tensor([[0, 4]]), num_experts=4, ep=2)
    with pytest.raises(ValueError, match="flatten batch and sequence"):
        route(torch.zeros(2, 3, 2, dtype=torch.long), num_experts=4, ep=2)
    with pytest.raises(ValueError, match="ranks are 0 .. 1"):
        local_experts(rank=2, ep=2, num_experts=4)
    assert experts_per_rank(8, 4) == 2 and list(local_experts(3, 4, 8)) == [6, 7]
    with pytest.raises(ValueError, match=r"gate_up_proj \(E, 2I, H\)"):
        batched_experts(torch.zeros(2, 6, 4), torch.zeros(2, 4, 4))
    with pytest.raises(ValueError, match="one count per local expert"):
        batched_experts(*_weights())(torch.zeros(3, H), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"both be \(T, k\)"):
        ep_moe(torch.zeros(3, H), torch.zeros(3, K, dtype=torch.long), torch.zeros(2, K),
               batched_experts(*_weights()), E, None, Collectives())


@pytest.mark.parametrize("routing,body", CASES)
def test_group_none_is_the_dense_moe(routing, body):
    """One rank holds every expert: ep_moe is the dense MoE, forward and backward, and issues no collective."""
    ref = _reference(routing, body, world=2)
    parts = _tokens(routing, 2)
    x, idx, w, grad = (torch.cat([p[i] for p in parts]) for i in range(4))
    x, w = x.requires_grad_(), w.requires_grad_()
    if body == "batched":
        params = [p.requires_grad_() for p in _weights()]
        fn = batched_experts(*params)
    else:
        mlps = _mlps()
        params, fn = list(mlps.parameters()), module_experts(mlps)
    coll = Collectives()
    y = ep_moe(x, idx, w, fn, E, None, coll)
    y.backward(grad)
    torch.testing.assert_close(y, ref["y"], **TOL)
    torch.testing.assert_close(x.grad, ref["dx"], **TOL)
    torch.testing.assert_close(w.grad, ref["dw"], **TOL)
    for p, want in zip(params, ref["dparams"]):
        torch.testing.assert_close(p.grad, want, **TOL)
    assert not coll.counts


# ---------------------------------------------------------------- real Gloo worlds

def _run_case(rank: int, world: int, routing: str, body: str, group=None) -> dict:
    """This rank's share of a case on `group` (the world when None), `rank` and `world` its place in it."""
    coll = Collectives()
    x, idx, w, grad = _tokens(routing, world)[rank]
    x, w = x.requires_grad_(), w.requires_grad_()
    mine = local_experts(rank, world, E)
    if body == "batched":
        params = [p[mine.start:mine.stop].clone().requires_grad_() for p in _weights()]  # this rank's experts only
        fn = batched_experts(*params)
    else:
        modules = [_mlps()[e] for e in mine]
        params, fn = [p for m in modules for p in m.parameters()], module_experts(modules)
    y = ep_moe(x, idx, w, fn, E, dist.group.WORLD if group is None else group, coll)
    forward = (dict(coll.counts), dict(coll.bytes))
    y.backward(grad)
    return dict(y=y.detach(), dx=x.grad, dw=w.grad, dparams=[p.grad for p in params], forward=forward,
                total=(dict(coll.counts), dict(coll.bytes)))


def _split_errors(world: int) -> list[str]:
    coll, out = Collectives(), []
    for in_splits, out_splits in (([1] * (world + 1), [1] * world), ([2] * world, [1] * world)):
        try:
            coll.all_to_all_single(torch.zeros(world, 2), torch.zeros(world, 2), out_splits, in_splits)
        except ValueError as e:
            out.append(str(e))
    return out


def _worker(rank, world, store_path, out_dir):
    with gloo_group(rank, world, store_path):
        result = {case: _run_case(rank, world, *case) for case in CASES}
        result["split_errors"] = _split_errors(world)
        result["aux"] = _aux_rank(rank, world)
        if world == 4:  # ep=2 inside each of the subgroups {0, 2} and {1, 3}, as beside a data-parallel axis
            groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
            result["subgroup"] = _run_case(rank // 2, 2, "random", "batched", groups[rank % 2])
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.slow
@pytest.mark.parametrize("routing,body", CASES)
@pytest.mark.parametrize("world", WORLDS)
def test_ep_moe_matches_the_dense_moe_in_one_process(spawned, world, routing, body):
    ranks = spawned(_worker, world)
    ref = _reference(routing, body, world)
    got = [r[routing, body] for r in ranks]
    torch.testing.assert_close(torch.cat([g["y"] for g in got]), ref["y"], **TOL)
    torch.testing.assert_close(torch.cat([g["dx"] for g in got]), ref["dx"], **TOL)
    torch.testing.assert_close(torch.cat([g["dw"] for g in got]), ref["dw"], **TOL)
    n_local = E // world
    for rank, g in enumerate(got):
        if body == "batched":   # each rank's [E/ep, ...] slice of the full batched weights' gradient
            want = [d[rank * n_local:(rank + 1) * n_local] for d in ref["dparams"]]
        else:                   # the parameters of modules rank*n_local .. in ModuleList order
            per = len(ref["dparams"]) // E
            want = ref["dparams"][rank * n_local * per:(rank + 1) * n_local * per]
        assert len(g["dparams"]) == len(want)
        for a, b in zip(g["dparams"], want):
            torch.testing.assert_close(a, b, **TOL)


@pytest.mark.slow
def test_ep_on_subgroups_whose_ranks_are_not_the_global_ranks(spawned):
    """World 4, ep=2 on {0, 2} and on {1, 3}: each subgroup is the 2-rank MoE (group ranks 0 and 1)."""
    ref = _reference("random", "batched", 2)
    ranks = [r["subgroup"] for r in spawned(_worker, 4)]
    for members in ((0, 2), (1, 3)):
        got = [ranks[m] for m in members]
        torch.testing.assert_close(torch.cat([g["y"] for g in got]), ref["y"], **TOL)
        torch.testing.assert_close(torch.cat([g["dx"] for g in got]), ref["dx"], **TOL)
        for rank, g in enumerate(got):
            for a, b in zip(g["dparams"], ref["dparams"]):
                torch.testing.assert_close(a, b[rank * 2:(rank + 1) * 2], **TOL)


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_uneven_routing_leaves_ranks_and_experts_without_tokens(spawned, world):
    """The skewed case: the last rank neither sends nor receives a token, yet takes part in every all-to-all,
    and its experts' gradient is zero as in one process."""
    ranks = spawned(_worker, world)
    last = ranks[-1]["skewed", "batched"]
    assert last["y"].shape == (0, H) and last["dx"].shape == (0, H)
    assert last["forward"][1]["all_to_all"] == E * 8        # only the counts: no token out, none back
    assert all(float(d.abs().sum()) == 0 for d in last["dparams"])


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_the_shim_counts_the_all_to_alls(spawned, world):
    """3 all-to-alls forward (counts, tokens out, results back), 2 backward; bytes: the E counts (int64),
    the T*k token rows this rank sends, the rows it received and sends back."""
    for routing, body in CASES:
        parts = _tokens(routing, world)
        received = [0] * world
        for _, idx, _, _ in parts:
            for r, n in enumerate(route(idx, E, world).send_counts.tolist()):
                received[r] += n
        for rank, r in enumerate(spawned(_worker, world)):
            res, t = r[routing, body], parts[rank][0].shape[0]
            assert res["forward"][0] == {"all_to_all": 3}
            assert res["forward"][1] == {"all_to_all": E * 8 + (t * K + received[rank]) * H * 4}
            assert res["total"][0] == {"all_to_all": 5}
            assert res["total"][1] == {"all_to_all": E * 8 + 2 * (t * K + received[rank]) * H * 4}


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_split_size_errors_name_the_fix(spawned, world):
    errors = spawned(_worker, world)[0]["split_errors"]
    assert len(errors) == 2
    assert f"for a group of {world} ranks: give one size per rank" in errors[0]
    assert "the splits must sum to the rows of their tensor" in errors[1]


# ---------------------------------------------------------------- a real Hugging Face MoE block

def _hf_block(family: str) -> nn.Module:
    import transformers

    if family == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
        cfg = transformers.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E,
                                          num_experts_per_tok=K, norm_topk_prob=True)
    else:
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
        cfg = transformers.MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E,
                                         num_experts_per_tok=K, router_jitter_noise=0.0)
    torch.manual_seed(3)
    block = Block(cfg)
    with torch.no_grad():  # a bare block is left to the model's _init_weights: its router starts at zero
        for p in block.parameters():
            p.normal_(0.0, 0.5)
    return block


def _hf_input() -> tuple[torch.Tensor, torch.Tensor]:
    """hidden states (1, 11, H): 11 tokens, split unevenly over 2 or 4 ranks; the output's gradient."""
    g = torch.Generator().manual_seed(4)
    return torch.randn(1, 11, H, generator=g), torch.randn(1, 11, H, generator=g)


def _hf_load_balancing_loss(family: str):
    if family == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    else:
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    return load_balancing_loss_func


def _hf_reference(family: str) -> dict:
    """The block on all 11 tokens in one process, plus HF's load-balancing loss on its router's logits."""
    block = _hf_block(family)
    x, grad = _hf_input()
    x.requires_grad_()
    y = block(x)
    aux = _hf_load_balancing_loss(family)((block.gate(x.view(-1, H))[0],), E, K)
    ((y * grad).sum() + aux).backward()
    return dict(y=y.detach().view(-1, H), aux=aux.detach(), dx=x.grad.view(-1, H),
                grads={n: p.grad for n, p in block.named_parameters()})


def _hf_rank(rank: int, world: int, family: str) -> dict:
    block, coll = _hf_block(family), Collectives()
    x_all, grad_all = (t.view(-1, H) for t in _hf_input())
    x = torch.tensor_split(x_all, world)[rank].clone().requires_grad_()
    grad = torch.tensor_split(grad_all, world)[rank]
    logits, topk_weight, topk_idx = block.gate(x)                 # the block's own router, on this rank's tokens
    mine = local_experts(rank, world, E)
    fn = batched_experts(block.experts.gate_up_proj[mine.start:mine.stop],
                         block.experts.down_proj[mine.start:mine.stop])
    y = ep_moe(x, topk_idx, topk_weight, fn, E, dist.group.WORLD, coll)
    aux = load_balancing_loss(logits, E, K, dist.group.WORLD, coll)
    ((y * grad).sum() + aux).backward()
    return dict(y=y.detach(), aux=aux.detach(), dx=x.grad, grads={n: p.grad for n, p in block.named_parameters()})


def _hf_worker(rank, world, store_path, out_dir):
    with gloo_group(rank, world, store_path):
        torch.save({f: _hf_rank(rank, world, f) for f in FAMILIES}, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("world", HF_WORLDS)
def test_ep_matches_a_hugging_face_moe_block(spawned, world, family):
    """Output, input gradient, router gradient (summed over ranks: each has its tokens' share) and each
    rank's slice of the batched expert gradients equal the HF block's on all tokens in one process; the
    load-balancing loss included in the loss."""
    ranks = [r[family] for r in spawned(_hf_worker, world)]
    ref = _hf_reference(family)
    torch.testing.assert_close(torch.cat([r["y"] for r in ranks]), ref["y"], **TOL)
    torch.testing.assert_close(torch.cat([r["dx"] for r in ranks]), ref["dx"], **TOL)
    torch.testing.assert_close(sum(r["grads"]["gate.weight"] for r in ranks), ref["grads"]["gate.weight"], **TOL)
    n_local = E // world
    for name in ("experts.gate_up_proj", "experts.down_proj"):
        for rank, r in enumerate(ranks):
            mine = slice(rank * n_local, (rank + 1) * n_local)
            torch.testing.assert_close(r["grads"][name][mine], ref["grads"][name][mine], **TOL)
            others = torch.ones(E, dtype=torch.bool)
            others[mine] = False
            assert float(r["grads"][name][others].abs().sum()) == 0   # no rank touches experts it does not hold


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("world", HF_WORLDS)
def test_the_hugging_face_blocks_load_balancing_loss_summed_over_ranks(spawned, world, family):
    ranks = [r[family] for r in spawned(_hf_worker, world)]
    ref = _hf_reference(family)
    for r in ranks:
        torch.testing.assert_close(r["aux"], ref["aux"], **TOL)


def _router_logits(world: int) -> list[torch.Tensor]:
    """Per rank: two layers' router logits (T, E) for the skewed case's token counts (the last rank: none)."""
    g = torch.Generator().manual_seed(6)
    return [torch.randn(2, p[0].shape[0], E, generator=g) for p in _tokens("skewed", world)]


def _aux_rank(rank: int, world: int) -> dict:
    logits = _router_logits(world)[rank].requires_grad_()                 # (layers, T, E)
    coll = Collectives()
    aux = load_balancing_loss(list(logits), E, K, dist.group.WORLD, coll)
    (grad,) = torch.autograd.grad(aux, logits)
    return dict(aux=aux.detach(), grad=grad, counts=dict(coll.counts))


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_the_load_balancing_loss_summed_over_ranks_is_hugging_faces(spawned, world):
    """Each rank's logits (one rank has none): the loss on every rank and the gradient of each rank's logits
    equal `load_balancing_loss_func` on every token in one process, after one all-reduce."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    ranks = [r["aux"] for r in spawned(_worker, world)]
    parts = [p.requires_grad_() for p in _router_logits(world)]
    full = torch.cat(parts, dim=1)                                      # (layers, all tokens, E)
    theirs = load_balancing_loss_func(tuple(full), E, K)
    grads = torch.autograd.grad(theirs, parts)
    for r, want in zip(ranks, grads):
        torch.testing.assert_close(r["aux"], theirs.detach(), **TOL)
        torch.testing.assert_close(r["grad"], want, **TOL)
        assert r["counts"] == {"all_reduce": 1}


def test_the_load_balancing_loss_of_one_rank_is_hugging_faces():
    """Group None over several layers' logits: HF's function, value and gradient."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    g = torch.Generator().manual_seed(5)
    logits = [torch.randn(7, E, generator=g).requires_grad_() for _ in range(2)]
    mine = load_balancing_loss(logits, E, K, None, Collectives())
    theirs = load_balancing_loss_func(tuple(logits), E, K)
    torch.testing.assert_close(mine, theirs, **TOL)
    for a, b in zip(torch.autograd.grad(mine, logits), torch.autograd.grad(theirs, logits)):
        torch.testing.assert_close(a, b, **TOL)
