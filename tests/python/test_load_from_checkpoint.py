"""``zeroshard.load_from_checkpoint(cls, path)``: Lightning's ``load_from_checkpoint`` on a sharded checkpoint.

One 2-rank stage-2 fit (``scripts/hparams_fit.py``) writes the directory; every test then loads it in this process,
with no process group.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from hparams_lm import HParamsLM
from launch import run_ranks
from tiny_lm import TinyLM

import zeroshard
from zeroshard.consolidate import consolidate, full_state_dict

SCRIPT = Path(__file__).parent / "scripts" / "hparams_fit.py"


@pytest.fixture(scope="module")
def fitted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hparams_fit")
    run_ranks(SCRIPT, [str(out)])
    return out


def _assert_same_state(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for k in expected:
        assert got[k].dtype == expected[k].dtype, k
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")


def test_a_sharded_directory_loads_with_its_hyperparameters(fitted):
    """The module's state dict is the consolidated one (= the trained module's after fit) and its hyperparameters,
    ``on_load_checkpoint`` and Lightning's version key are those of the saved run."""
    module = zeroshard.load_from_checkpoint(HParamsLM, fitted / "sharded")
    assert isinstance(module, HParamsLM)
    assert dict(module.hparams) == {"lr": 0.02, "tag": "trained", "widths": (3, 4)}
    assert module.lr == 0.02
    assert module.loaded_hparams == {"lr": 0.02, "tag": "trained", "widths": (3, 4)}
    assert "pytorch-lightning_version" in module.loaded_keys and "optimizer_states" not in module.loaded_keys
    _assert_same_state(module.state_dict(), full_state_dict(fitted / "sharded"))
    _assert_same_state(module.state_dict(), torch.load(fitted / "sharded.pt"))


def test_lightning_keyword_arguments_behave_as_lightnings(fitted):
    """Hyperparameter overrides and ``map_location`` pass through; a strict load into another class fails as
    Lightning's does and ``strict=False`` loads what matches."""
    module = zeroshard.load_from_checkpoint(HParamsLM, fitted / "sharded", tag="override", map_location="cpu")
    assert module.hparams.tag == "override" and module.hparams.lr == 0.02
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict"):
        zeroshard.load_from_checkpoint(Smaller, fitted / "sharded")
    with pytest.warns(UserWarning, match=r"Found keys that are not in the model state dict.*'blocks\.1\.up\.weight'"):
        smaller = zeroshard.load_from_checkpoint(Smaller, fitted / "sharded", strict=False)
    torch.testing.assert_close(smaller.embed.weight, full_state_dict(fitted / "sharded")["embed.weight"])


class Smaller(TinyLM):
    """TinyLM without its second block: the checkpoint has keys this class lacks."""

    def __init__(self, **hparams) -> None:
        super().__init__()
        del self.blocks[1]


def test_lightning_itself_fails_on_the_directory_and_files_go_to_lightning(fitted, tmp_path):
    """Lightning's own ``load_from_checkpoint`` on the directory: IsADirectoryError (what the helper is for). Files go
    to Lightning unchanged: ``consolidate --format lightning``'s gives the same module, and so does the one file of
    ``ZeroStrategy(state_dict_type="full")``, which Lightning's own method reads too."""
    with pytest.raises(IsADirectoryError):
        HParamsLM.load_from_checkpoint(fitted / "sharded")
    consolidate(fitted / "sharded", tmp_path / "model.ckpt", fmt="lightning")
    from_file = zeroshard.load_from_checkpoint(HParamsLM, tmp_path / "model.ckpt")
    assert dict(from_file.hparams) == {"lr": 0.02, "tag": "trained", "widths": (3, 4)}
    _assert_same_state(from_file.state_dict(), full_state_dict(fitted / "sharded"))
    for full in (
        zeroshard.load_from_checkpoint(HParamsLM, fitted / "full.ckpt"),
        HParamsLM.load_from_checkpoint(fitted / "full.ckpt"),
    ):
        assert dict(full.hparams) == {"lr": 0.02, "tag": "trained", "widths": (3, 4)}
        _assert_same_state(full.state_dict(), torch.load(fitted / "full.pt"))


def test_bad_paths_name_the_path(tmp_path):
    missing = tmp_path / "no_such_checkpoint"
    with pytest.raises(FileNotFoundError, match=rf"'{re.escape(str(missing))}' does not exist; pass the path given to"):
        zeroshard.load_from_checkpoint(HParamsLM, missing)
    other = tmp_path / "deepspeed_like"
    (other / "checkpoint").mkdir(parents=True)
    with pytest.raises(
        ValueError, match=rf"{re.escape(str(other))} is not a zeroshard sharded checkpoint.*holds \['checkpoint'\]"
    ):
        zeroshard.load_from_checkpoint(HParamsLM, other)
    with pytest.raises(TypeError, match=r"cls must be a LightningModule or LightningDataModule subclass, got 3"):
        zeroshard.load_from_checkpoint(3, missing)


def test_a_directory_without_lightning_trainer_state_is_refused_with_the_way_out(fitted, tmp_path):
    """A sharded directory saved without Lightning's trainer state (as ``fabric.save`` writes) has no hyperparameters:
    the error names it and how to load its weights."""
    from ckpt_tools import reseal, version_dir

    from zeroshard.checkpoint import trainer_state

    ckpt = tmp_path / "no_trainer_state"
    shutil.copytree(fitted / "sharded", ckpt)
    d = version_dir(ckpt)
    for name in (trainer_state.STRUCTURE, trainer_state.TENSORS, trainer_state.PICKLED):
        (d / name).unlink(missing_ok=True)
    trainer_state.save(d, {"step": 6})
    reseal(ckpt)
    with pytest.raises(
        ValueError, match=rf"'{re.escape(str(ckpt))}' holds no Lightning trainer state.*full_state_dict\(path\)"
    ):
        zeroshard.load_from_checkpoint(HParamsLM, ckpt)
