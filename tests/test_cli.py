"""The `partitioner` command line, run as users run it (`python -m partitioner ...` in a subprocess): exit
codes, pure JSON on stdout with --json, one-line errors on stderr (a traceback only with --debug).

Each process spends about 2 s importing torch and the planner, so independent commands run concurrently
(`cli_all`)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = "examples/gpt.py:gpt_tiny"


def _argv(args) -> list[str]:
    return [sys.executable, "-m", "partitioner", *map(str, args)]


def cli(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(_argv(args), capture_output=True, text=True, cwd=ROOT, timeout=timeout, check=False)


def cli_all(cases: dict[str, tuple], timeout=120) -> dict[str, subprocess.CompletedProcess]:
    """Run each case's command concurrently; name -> its finished process."""
    procs = {name: subprocess.Popen(_argv(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for name, args in cases.items()}
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=timeout)
        out[name] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    return out


def error_line(r) -> str:
    """The one-line error the CLI promises, without a traceback."""
    lines = r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr and len(lines) == 1, r.stderr
    return lines[0]


@pytest.fixture(scope="module")
def plan2(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "plan.json"
    r = cli("compile", TINY, "--topology", "local:2", "--global-batch-size", "8", "-o", path)
    assert r.returncode == 0, r.stderr
    assert "dp2" in r.stdout and f"plan written to {path}" in r.stdout
    return path


def test_help_of_every_subcommand_shows_examples_and_exit_codes():
    runs = cli_all({cmd: ([cmd] if cmd else []) + ["--help"]
                    for cmd in ("", "trace", "compile", "show", "run", "autotune")})
    for cmd, r in runs.items():
        assert r.returncode == 0, (cmd, r.stderr)
        assert "examples:" in r.stdout and f"  partitioner {cmd}" in r.stdout, cmd
        assert "130  interrupted" in r.stdout and ("--json" in r.stdout or not cmd), cmd
    assert "--db" in runs["autotune"].stdout  # autotune itself is tested with partitioner.tune.autotune


def test_trace_json_is_the_block_table_as_rows():
    r = cli("trace", TINY, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["rows"][0]["segment"] == "prefix" and doc["rows"][-1]["segment"] == "suffix"
    assert doc["flops"] == pytest.approx(sum(row["forward_flops"] + row["backward_flops"] for row in doc["rows"]))
    assert doc["trace_time_s"] > 0 and doc["num_params"] > 0


def test_show_prints_the_plan_its_json_and_a_rank_program(plan2):
    runs = cli_all({"text": ("show", plan2), "json": ("show", plan2, "--json"),
                    "rank": ("show", plan2, "--rank", 1), "rank json": ("show", plan2, "--rank", 1, "--json")})
    assert all(r.returncode == 0 for r in runs.values()), {k: r.stderr for k, r in runs.items()}
    assert "dp2" in runs["text"].stdout
    plan = json.loads(runs["json"].stdout)
    assert plan["world_size"] == 2 and plan["model_source"] == TINY  # compile recorded it for `run`
    assert "rank 1 of 2" in runs["rank"].stdout and "def build" in runs["rank"].stdout
    assert json.loads(runs["rank json"].stdout) == {"rank": 1, "source": runs["rank"].stdout}


def test_errors_are_one_line_with_a_meaningful_exit_code(plan2, tmp_path):
    older = json.loads(plan2.read_text())
    del older["model_source"]  # as plans written before the field existed
    (tmp_path / "old.json").write_text(json.dumps(older))
    (tmp_path / "models.py").write_text("def broken():\n    raise RuntimeError('boom')\n\n"
                                        "def interrupted():\n    raise KeyboardInterrupt\n")
    cases = {  # name: (command, exit code, the error line's text after "partitioner CMD: ")
        "bad topology": (("compile", TINY, "--topology", "local:x", "--global-batch-size", 8), 2,
                         "error: topology 'local:x': local:x: the process count must be a whole number"),
        "no model file": (("compile", "examples/nope.py:gpt", "--topology", "local:2", "--global-batch-size", 8), 2,
                          "error: model 'examples/nope.py:gpt': file examples/nope.py does not exist"),
        "no plan file": (("show", "no/such/plan.json"), 2, "error: plan file no/such/plan.json does not exist"),
        "bad rank": (("show", plan2, "--rank", 99), 2, f"error: --rank 99: {plan2} has ranks 0..1 (world size 2)"),
        "older plan": (("run", tmp_path / "old.json"), 2, "pass --model FILE.py:FACTORY"),
        "infeasible": (("compile", "examples/gpt.py:gpt2_xl", "--device", "meta", "--topology", "local:2",
                        "--global-batch-size", 8), 3, "error: no plan fits"),
        "internal": (("trace", tmp_path / "models.py:broken"), 1,
                     "internal error: RuntimeError: boom (run with --debug for the traceback)"),
        "ctrl-c": (("trace", tmp_path / "models.py:interrupted"), 130, "interrupted"),
    }
    runs = cli_all({name: (*args, "--json") for name, (args, _, _) in cases.items()})
    for name, (args, code, text) in cases.items():
        r = runs[name]
        assert (r.returncode, r.stdout) == (code, ""), (name, r.stderr)
        line = error_line(r)
        assert line.startswith(f"partitioner {args[0]}: ") and text in line, (name, line)


def test_debug_adds_the_traceback_and_usage_errors_exit_2(plan2):
    runs = cli_all({"debug": ("show", plan2, "--rank", 99, "--debug"), "usage": ("compile", TINY)})
    debug = runs["debug"]
    assert debug.returncode == 2 and debug.stderr.startswith("Traceback")
    assert debug.stderr.strip().splitlines()[-1].startswith("partitioner show: error: --rank 99")
    assert runs["usage"].returncode == 2 and "--topology" in runs["usage"].stderr


@pytest.mark.slow
def test_run_trains_a_local_plan_one_line_per_step(plan2):
    r = cli("run", plan2, "--steps", 2)
    assert r.returncode == 0, r.stderr
    steps = [line for line in r.stdout.splitlines() if line.startswith("step ")]
    assert [s.split(" loss ")[0] for s in steps] == ["step 1/2", "step 2/2"]
    r = cli("run", plan2, "--steps", 1, "--model", TINY, "--json", "--scheduler", "examples.training:warmup_cosine",
            "--eval-every", 1, "--eval-batches", 2)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert len(doc["losses"]) == len(doc["step_times_s"]) == 1 and doc["world_size"] == 2
    assert [k for k, _ in doc["eval_losses"]] == [1]  # held-out example batches, in eval mode


@pytest.mark.slow
def test_a_failed_run_exits_4_with_one_line(plan2, tmp_path):
    for r in range(2):  # --programs DIR holding every rank's program runs those instead of the plan's
        (tmp_path / f"rank_{r}.py").write_text("def build(model_fn, optimizer_fn, loss_fn):\n"
                                               "    raise RuntimeError('broken program')\n")
    # --no-verify: the check before launch would refuse these programs (no make_stage) with exit 2
    r = cli("run", plan2, "--steps", 1, "--programs", tmp_path, "--no-verify")
    assert r.returncode == 4 and r.stdout == "" and "Traceback" not in r.stderr
    line = r.stderr.strip().splitlines()[-1]  # after the "training 1 steps ..." info line
    assert line.startswith("partitioner run: error: the run failed: rank ") and "broken program" in line, line
    assert line.endswith("(run with --debug for the details)")  # the rank's traceback


def test_run_of_a_cluster_plan_prints_the_torchrun_command(tmp_path):
    path = tmp_path / "big.json"
    pins = ("--dp", 16, "--zero-stage", 1, "--recompute", "none", "--microbatch-size", 4)  # a short search
    r = cli("compile", TINY, "--topology", "2x8xA100-80GB", "--global-batch-size", 64, *pins, "-o", path)
    assert r.returncode == 0, r.stderr
    r = cli("run", path, "--steps", 5, "--scheduler", "examples.training:warmup_cosine", "--eval-every", 2)
    assert r.returncode == 0, r.stderr
    assert "torchrun --nnodes 2 --nproc-per-node 8" in r.stdout and "srun --nodes 2" in r.stdout
    assert f"-m runtime.run {path} --programs {tmp_path / 'big.programs'} --model {TINY} --steps 5" in r.stdout
    assert "--scheduler examples.training:warmup_cosine" in r.stdout
    assert "--eval-every 2 --eval-batches 1" in r.stdout
    assert {"plan.json", "rank_0.py", "rank_15.py"} <= {p.name for p in (tmp_path / "big.programs").iterdir()}


def test_compile_verify_checks_the_chosen_plan_also_from_meta():
    """--verify runs the plan's generated code against the model (plan.verify); a model built on meta is
    built again on the CPU from its factory for the check."""
    runs = cli_all({on: ("compile", TINY, "--topology", "local:4", "--global-batch-size", "8", "--pp", "2", "--tp", "2",
                         "--precision", "fp32", "--verify", *(("--device", "meta") if on == "meta" else ()))
                    for on in ("cpu", "meta")})
    for on, r in runs.items():
        assert r.returncode == 0, (on, r.stderr)
        assert "verified pp2 tp2" in r.stdout + r.stderr, (on, r.stdout, r.stderr)
