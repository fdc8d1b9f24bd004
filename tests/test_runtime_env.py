"""runtime.launch.env: the launch environment from torchrun, Open MPI, MPICH/PMI and SLURM variables."""

import pytest

from runtime.launch.env import DistEnv, LaunchError, backend, discover, expand_nodelist


def test_no_launcher_is_one_process_on_loopback():
    assert discover({}) == DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1,
                                   master_addr="127.0.0.1", master_port=29500, launcher="none")


def test_torchrun():
    env = discover({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                    "MASTER_ADDR": "node07", "MASTER_PORT": "29400"})
    assert env == DistEnv(rank=5, world_size=8, local_rank=1, local_world_size=4, master_addr="node07",
                          master_port=29400, launcher="torchrun")


def test_open_mpi_single_node_defaults_to_loopback():
    env = discover({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "3",
                    "OMPI_COMM_WORLD_LOCAL_SIZE": "4"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 3, 4)
    assert (env.master_addr, env.master_port, env.launcher) == ("127.0.0.1", 29500, "mpirun")


def test_open_mpi_over_nodes_needs_master_addr():
    environ = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
               "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    with pytest.raises(LaunchError, match="MASTER_ADDR is not set"):
        discover(environ)
    env = discover({**environ, "MASTER_ADDR": "10.0.0.1"})
    assert (env.rank, env.local_rank, env.master_addr) == (5, 1, "10.0.0.1")


def test_mpich_pmi():
    env = discover({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1",
                    "MASTER_ADDR": "h0"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.launcher) == (2, 4, 0, 1, "mpirun")


def test_slurm_master_is_first_host_of_the_node_list():
    env = discover({"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_NTASKS_PER_NODE": "4",
                    "SLURM_JOB_NODELIST": "gpu[07-08]"})
    assert env == DistEnv(rank=6, world_size=8, local_rank=2, local_world_size=4, master_addr="gpu07",
                          master_port=29500, launcher="slurm")


def test_slurm_tasks_per_node_and_single_node_loopback():
    env = discover({"SLURM_PROCID": "4", "SLURM_NTASKS": "5", "SLURM_LOCALID": "0", "SLURM_NODEID": "2",
                    "SLURM_TASKS_PER_NODE": "2(x2),1", "SLURM_NODELIST": "a[1-3]"})
    assert (env.local_world_size, env.master_addr) == (1, "a1")
    one = discover({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "n5"})
    assert (one.master_addr, one.local_world_size) == ("127.0.0.1", 2)


def test_master_env_overrides_the_launcher():
    env = discover({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "a,b",
                    "MASTER_ADDR": "c", "MASTER_PORT": "1234"})
    assert (env.master_addr, env.master_port) == ("c", 1234)


def test_precedence_mpi_over_inherited_slurm_and_torchrun_over_all():
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    assert discover({**slurm, "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}).launcher == "mpirun"
    assert discover({**slurm, "RANK": "1", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0",
                     "OMPI_COMM_WORLD_SIZE": "1"}).launcher == "torchrun"


@pytest.mark.parametrize("environ, match", [
    ({"RANK": "4", "WORLD_SIZE": "4"}, "RANK=4 is not below WORLD_SIZE=4"),
    ({"RANK": "x", "WORLD_SIZE": "4"}, "RANK='x' is not an integer"),
    ({"RANK": "0"}, "RANK='0' is set but WORLD_SIZE is not"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0 is below 1"),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=2 is not below"),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}, "4 processes on this node"),
    ({"SLURM_PROCID": "2", "SLURM_NTASKS": "two"}, "SLURM_NTASKS='two' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "a[1-"}, "unclosed"),
])
def test_inconsistent_environments_name_the_variable(environ, match):
    with pytest.raises(LaunchError, match=match):
        discover(environ)


def test_launch_error_is_a_value_error():
    assert issubclass(LaunchError, ValueError)


@pytest.mark.parametrize("nodelist, hosts", [
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("a", ["a"]),
    ("a,b,c", ["a", "b", "c"]),
    ("rack[1-2]-n[8-9]", ["rack1-n8", "rack1-n9", "rack2-n8", "rack2-n9"]),
    ("n[9-11]", ["n9", "n10", "n11"]),
    ("n[098-100]", ["n098", "n099", "n100"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_expand_nodelist_rejects_backward_ranges():
    with pytest.raises(LaunchError, match="runs backwards"):
        expand_nodelist("n[5-3]")


def test_backend_on_this_machine():
    import torch

    assert backend() == ("nccl" if torch.cuda.is_available() else "gloo")


# ---- the rank's device (runtime.device, issue 19) ------------------------------------------------------------


def test_the_device_is_cpu_over_gloo_by_default_and_cuda_local_rank_over_nccl():
    import torch

    from runtime.launch.env import choose_device

    assert choose_device("cpu", local_rank=3) == ("gloo", torch.device("cpu"))
    if torch.cuda.is_available():
        assert choose_device(None, local_rank=0) == ("nccl", torch.device("cuda", 0))
    else:
        assert choose_device(None, local_rank=5) == ("gloo", torch.device("cpu"))


@pytest.mark.parametrize("asked,match", [
    ("mps", "the runtime trains on cpu .Gloo. or cuda .NCCL., not mps"),
    ("gpu:0", "is not a device name"),
])
def test_a_device_the_runtime_cannot_train_on_is_refused_by_name(asked, match):
    from runtime.launch.env import choose_device

    with pytest.raises(LaunchError, match=match):
        choose_device(asked, local_rank=0)


def test_runtime_run_asked_for_cuda_without_cuda_stops_at_start_up_with_one_line(tmp_path):
    """Before the plan is read or a process group is joined: one line on stderr, exit status 2."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    # no CUDA device visible to the child, so the case holds on a GPU machine too
    env = {**os.environ, "PYTHONPATH": str(root), "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
           "LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "runtime.run", str(tmp_path / "plan.json"), "--model",
                           "examples/gpt.py:gpt_tiny", "--device", "cuda"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "Warning" not in line]
    assert lines == [lines[0]] and lines[0].startswith("runtime.run: error: device cuda:1 was asked for, but this "
                                                       "machine has no CUDA"), proc.stderr
