"""Autotune trials as cluster jobs: each trial one torchrun or srun job of `python -m runtime.run` (runtime/launch/cluster.py).

>>> launcher = cluster_launcher("srun", Topology.parse("2x8xH100-80GB"), {})
>>> launcher.nodes, launcher.ntasks_per_node
(2, 8)
>>> cluster_launcher("torchrun", Topology.parse("local:2"), {}).rdzv_endpoint is None   # 127.0.0.1, a free port
True

A trial writes the plan and its per-rank programs to its own directory
(`trial_dir`/KEY/, on a file system every node shares), runs warm-up + 1 +
measured steps with the step after the warm-up probed for memory, and reads
the ranks' reports back; the directory keeps the command's stdout.log and
stderr.log for a failed trial. The ranks import the model (and --data,
--optimizer, --loss) by name, so those are spec strings here, never Python
callables.
"""

from __future__ import annotations

import dataclasses
import shlex
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cost_models.errors import DeclarationError
from cost_models.topology import Topology
from runtime.launch.cluster import ClusterResult, Srun, Torchrun, launch_cluster, run_args

__all__ = ["LAUNCHERS", "ClusterTrials", "cluster_launcher", "cluster_trials", "rank_spec"]

LAUNCHERS = ("local", "torchrun", "srun")
# launcher_args each launcher takes (besides trial_dir); nnodes/nproc_per_node name srun's counts too
_ARGS = {"torchrun": {"nnodes", "nproc_per_node", "rdzv_endpoint", "wrapper", "executable", "extra"},
         "srun": {"nnodes", "nproc_per_node", "nodes", "ntasks_per_node", "master_port", "executable", "python",
                  "extra"}}


def cluster_launcher(name: str, topo: Topology, args: Mapping[str, Any]) -> Torchrun | Srun:
    """The launcher `name` for `topo`'s nodes and devices; counts given in `args` must agree with the topology."""
    if name not in _ARGS:
        raise DeclarationError(f"launcher={name!r}: expected one of {', '.join(map(repr, LAUNCHERS))}")
    args = {k: v for k, v in args.items() if k != "trial_dir"}
    unknown = sorted(set(args) - _ARGS[name])
    if unknown:
        raise DeclarationError(f"launcher_args {unknown}: not options of launcher={name!r}; it takes "
                               f"{sorted(_ARGS[name] | {'trial_dir'})}")
    nodes, nnodes = args.pop("nodes", None), args.pop("nnodes", None)
    procs, nproc = args.pop("ntasks_per_node", None), args.pop("nproc_per_node", None)
    nodes, procs = nodes or nnodes, procs or nproc
    for what, given, want in (("nodes", nodes, topo.nodes), ("processes per node", procs, topo.devices_per_node)):
        if given is not None and given != want:
            raise DeclarationError(f"launcher {name}: {given} {what}, but the topology {topo} has {want}: the trials' "
                                   f"plans are compiled for the topology, so the job must match it; drop the count "
                                   f"or pass a topology of {nodes or topo.nodes} nodes x "
                                   f"{procs or topo.devices_per_node} devices")
    for k in ("wrapper", "extra"):
        if k in args:
            args[k] = _argv(args[k])
    if "executable" in args:
        args["executable"] = _argv(args["executable"]) if name == "torchrun" else str(args["executable"])
    if name == "torchrun":
        return Torchrun(nnodes=topo.nodes, nproc_per_node=topo.devices_per_node, **args)
    return Srun(nodes=topo.nodes, ntasks_per_node=topo.devices_per_node, **args)


def _argv(v: str | Any) -> tuple[str, ...]:
    """A command line as given ("srun --ntasks-per-node=1") or as a list, as a tuple of arguments."""
    return tuple(shlex.split(v)) if isinstance(v, str) else tuple(str(a) for a in v)


def rank_spec(spec: Any, what: str, launcher: str) -> str | None:
    """A spec string the ranks can import from any directory ("FILE.py:NAME" made absolute), or None for None."""
    if spec is None:
        return None
    if not isinstance(spec, str):
        raise DeclarationError(f"{what}={spec!r}: launcher={launcher!r} starts the ranks as new processes (on other "
                               f"machines too) that import it by name: pass it as \"FILE.py:NAME\" or "
                               f"\"pkg.module:NAME\" (e.g. \"examples/gpt.py:gpt_tiny\"), not a Python object")
    where, sep, name = spec.rpartition(":")
    if not sep:
        raise DeclarationError(f"{what}={spec!r}: expected FILE.py:NAME or pkg.module:NAME")
    if where.endswith(".py") or "/" in where:
        path = Path(where)
        if not path.is_file():
            raise DeclarationError(f"{what}={spec!r}: file {where} does not exist")
        return f"{path.resolve()}:{name}"
    return spec


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterTrials:
    """How the tuner runs a trial as a job: the launcher, what the ranks import, where trials are written."""

    launcher: Torchrun | Srun
    model: str
    data: str | None = None
    optimizer: str | None = None
    loss: str | None = None
    trial_dir: Path
    timeout_s: float
    cwd: Path

    def run(self, plan: Any, *, key: str, steps: int, probe_step: int, memory_limit_bytes: float) -> ClusterResult:
        d = self.trial_dir / key[:16]
        shutil.rmtree(d, ignore_errors=True)  # a re-run of a trial the database has no result for
        plan.write_programs(d)
        run = run_args(d / "plan.json", model=self.model, steps=steps, report=d / "reports", probe_step=probe_step,
                       memory_limit_bytes=memory_limit_bytes, timeout_s=self.timeout_s, data=self.data,
                       optimizer=self.optimizer, loss=self.loss)
        return launch_cluster(self.launcher, run, report_dir=d / "reports", log_dir=d, timeout_s=self.timeout_s,
                              run_id=f"autotune-{key[:12]}", cwd=self.cwd)


def cluster_trials(name: str, topo: Topology, launcher_args: Mapping[str, Any], *, model: Any, data: Any,
                   optimizer: Any, loss: Any, timeout_s: float, db: Path) -> ClusterTrials:
    """autotune's arguments checked for launcher `name`: specs the ranks can import, counts that match `topo`."""
    from runtime.launch.loading import load_callable

    trials = ClusterTrials(launcher=cluster_launcher(name, topo, launcher_args), model=rank_spec(model, "model", name),
                           data=rank_spec(data, "data", name), optimizer=rank_spec(optimizer, "optimizer_fn", name),
                           loss=rank_spec(loss, "loss_fn", name), timeout_s=timeout_s, cwd=Path.cwd(),
                           trial_dir=Path(launcher_args.get("trial_dir") or db.with_suffix(".trials")).resolve())
    for spec, what in ((trials.data, "data"), (trials.optimizer, "optimizer_fn"), (trials.loss, "loss_fn")):
        if spec is not None:
            load_callable(spec, what)  # a typo fails here, not in every rank of every trial
    return trials
