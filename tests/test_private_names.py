"""The libraries' private names we override or patch (sft/safety/private_names.py): every one is what we expect on
the installed versions (a release that moves one fails here, not in a user's run), and one that is not stops with
one error line naming the library and its version, before any model loads."""

from __future__ import annotations

import importlib.util

import pytest

from conftest import REPO
from sft.errors import LibraryMismatch
from sft.safety.private_names import PRIVATE_NAMES, PrivateName, expect, installed_version, problem


@pytest.mark.parametrize("row", PRIVATE_NAMES, ids=lambda row: row.name)
def test_every_private_name_is_what_we_expect_on_the_installed_libraries(row):
    if importlib.util.find_spec(row.module.split(".")[0]) is None:
        pytest.skip(f"{row.library} is not installed")
    _, differs = problem(row)  # (the object itself may be None: a module's global, unset until used)
    assert differs is None, f"{row.library} {installed_version(row.library)}: {differs}"


def test_a_name_that_moved_changed_or_left_the_tested_versions_is_one_error_line(monkeypatch):
    base = dict(library="transformers", module="transformers.trainer", why="the test")
    moved = PrivateName(attribute="Trainer._clip_grad_norm_renamed", parameters=("self", "model"),
                        versions=">=5,<6", **base)
    changed = PrivateName(attribute="Trainer._clip_grad_norm", parameters=("self", "model", "max_norm"),
                          versions=">=5,<6", **base)
    newer = PrivateName(attribute="Trainer._clip_grad_norm", parameters=("self", "model"), versions=">=4,<5", **base)
    version = installed_version("transformers")
    for row, what in ((moved, "does not exist"), (changed, "takes ('self', 'model'), not"),
                      (newer, f"version {version} is outside the tested >=4,<5")):
        with pytest.raises(LibraryMismatch) as caught:
            expect(row)
        message = str(caught.value)
        assert message.startswith(f"transformers {version}: ") and what in message and "\n" not in message
        assert "the test" in message and "constraints.txt" in message


def test_a_changed_trainer_method_stops_the_run_before_any_model_loads(tmp_path, monkeypatch, capsys):
    """transformers renaming Trainer._get_grad_norm would switch the NaN guard off in silence: the run stops first."""
    from transformers import Trainer

    from sft.train import main

    def get_grad_norm(self, model, norm=None):  # a parameter renamed, as a release might
        return norm

    monkeypatch.setattr(Trainer, "_get_grad_norm", get_grad_norm)
    loaded = []
    rc = main(["--dataset", str(REPO / "data" / "alpaca_demo.json"), "--output_dir", str(tmp_path / "out"),
               "--max_steps", "1", "--report_to", "none", "--dataset_cache_dir", str(tmp_path / "cache")],
              model_factory=lambda *a, **k: loaded.append(1))
    err = capsys.readouterr().err
    assert rc == 2 and not loaded, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Trainer._get_grad_norm" in lines[0] and "transformers" in lines[0], err
    assert "NaN guard" in lines[0] and "Traceback" not in err


def test_sft_trainer_overrides_only_names_in_the_table():
    """Each private Trainer method SFTTrainer (and TensorParallelTrainer) defines is a checked row."""
    from transformers import Trainer

    from sft.parallel.tensor_parallel import TensorParallelTrainer
    from sft.trainer import SFTTrainer

    for cls in (SFTTrainer, TensorParallelTrainer):
        checked = {row.attribute.split(".", 1)[1] for row in cls.overridden}
        private = {name for name in vars(cls) if name.startswith("_") and not name.startswith("__")
                   and hasattr(Trainer, name)}
        assert private <= checked, f"{cls.__name__} overrides {private - checked} without a row"
