"""`FILE.py:NAME` specs load each file as one module, the one spawned workers can import by name."""

from __future__ import annotations

import sys

import pytest

from cost_models.errors import PartitionerError
from partitioner.loading import load_model
from runtime.launch.loading import load_callable, load_object


def test_a_file_in_a_package_loads_as_the_packages_module_once(tmp_path, monkeypatch):
    pkg = tmp_path / "mypkg_for_loading"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "models.py").write_text("import torch\n\ndef net():\n    return torch.nn.Linear(2, 2)\n\n"
                                   "def example_inputs(model, batch_size):\n    return (torch.zeros(batch_size, 2),)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    fn = load_callable("mypkg_for_loading/models.py:net", "--model")
    assert fn.__module__ == "mypkg_for_loading.models"  # what a spawned worker unpickles it by
    module, name, _ = load_object("mypkg_for_loading/models.py:net", "--data")
    model, inputs, same = load_model("mypkg_for_loading/models.py:net")
    assert module is same is sys.modules["mypkg_for_loading.models"] and name == "net"
    assert inputs[0].shape == (2, 2) and model.weight.shape == (2, 2)


def test_a_loose_file_loads_by_its_stem(tmp_path, monkeypatch):
    (tmp_path / "toy_for_loading.py").write_text("def loss(a, b):\n    return a - b\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert load_callable("toy_for_loading.py:loss", "--loss").__module__ == "toy_for_loading"


@pytest.mark.parametrize("spec, says", [
    ("no_colon.py", "expected path/to/file.py:NAME"),
    ("missing_file.py:f", "does not exist"),
    ("torch.nn.functional:no_such_fn", "has no 'no_such_fn'"),
    ("no_such_package_xyz:f", "cannot import no_such_package_xyz"),
])
def test_bad_specs_name_what_is_wrong(spec, says):
    with pytest.raises(PartitionerError, match=says):
        load_callable(spec, "--model")
