"""The substitution of ``tests/peer/zeroshard_peer.py`` (the plugin ``make peer-test`` runs Lightning's own tests
with): every form of DDP a test can ask for becomes zeroshard at the configured stage, with the launcher's start method
and the settings both strategies share kept. Builds Trainers and Fabrics only (no fit), so it needs no Lightning
sources and no processes."""

from __future__ import annotations

import importlib.util
from datetime import timedelta
from pathlib import Path

import pytest
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy as FabricDDP
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy

from zeroshard import ZeroFabricStrategy, ZeroStrategy

_PLUGIN = Path(__file__).parents[1] / "peer" / "zeroshard_peer.py"
_spec = importlib.util.spec_from_file_location("zeroshard_peer", _PLUGIN)
peer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peer)


@pytest.fixture
def substituted(request):
    originals = peer.substitute(request.param)
    yield request.param
    peer.restore(originals)


def _trainer(strategy):
    return Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False, enable_checkpointing=False)


@pytest.mark.parametrize("substituted", [2, 3], indirect=True)
@pytest.mark.parametrize(
    "strategy, start_method",
    [
        ("ddp", "popen"),
        ("ddp_spawn", "spawn"),
        ("ddp_fork", "fork"),
        ("ddp_notebook", "fork"),
        ("ddp_find_unused_parameters_true", "popen"),
        ("auto", "popen"),  # several CPU devices: Lightning picks ddp
    ],
)
def test_trainer_strings(substituted, strategy, start_method):
    built = _trainer(strategy).strategy
    assert type(built) is ZeroStrategy
    assert built._start_method == start_method
    assert built.zero_config.stage == substituted
    assert built.num_processes == 2


@pytest.mark.parametrize("substituted", [3], indirect=True)
def test_trainer_instance_keeps_shared_settings(substituted):
    ddp = DDPStrategy(
        start_method="spawn", process_group_backend="gloo", timeout=timedelta(seconds=77), static_graph=True
    )
    built = _trainer(ddp).strategy
    assert type(built) is ZeroStrategy and built._start_method == "spawn"
    assert built._process_group_backend == "gloo" and built._timeout == timedelta(seconds=77)


@pytest.mark.parametrize("substituted", [2], indirect=True)
def test_trainer_subclass_of_ddp_is_left_alone(substituted):
    class OwnDDP(DDPStrategy):  # a test of DDP itself
        pass

    assert type(_trainer(OwnDDP()).strategy) is OwnDDP


@pytest.mark.parametrize("substituted", [2, 3], indirect=True)
@pytest.mark.parametrize("strategy, start_method", [("ddp", "popen"), ("ddp_spawn", "spawn"), ("ddp_fork", "fork")])
def test_fabric(substituted, strategy, start_method):
    built = Fabric(strategy=strategy, accelerator="cpu", devices=2).strategy
    assert type(built) is ZeroFabricStrategy
    assert built._start_method == start_method
    assert built._core.config.stage == substituted


@pytest.mark.parametrize("substituted", [3], indirect=True)
def test_fabric_instance(substituted):
    built = Fabric(strategy=FabricDDP(start_method="fork"), accelerator="cpu", devices=2).strategy
    assert type(built) is ZeroFabricStrategy and built._start_method == "fork"


@pytest.mark.parametrize("stage", [None, "ddp"])
def test_baseline_substitutes_nothing(monkeypatch, stage):
    if stage is None:
        monkeypatch.delenv(peer.STAGE_ENV, raising=False)
    else:
        monkeypatch.setenv(peer.STAGE_ENV, stage)
    monkeypatch.delenv(peer.RECORD_ENV, raising=False)
    peer.pytest_configure(config=None)
    assert type(_trainer("ddp").strategy) is DDPStrategy
    assert type(Fabric(strategy="ddp_spawn", accelerator="cpu", devices=2).strategy) is FabricDDP


def test_stage_from_env(monkeypatch):
    monkeypatch.setenv(peer.STAGE_ENV, "3")
    assert peer.stage_from_env() == 3
    monkeypatch.setenv(peer.STAGE_ENV, "4")
    with pytest.raises(ValueError, match="ddp, 1, 2 or 3"):
        peer.stage_from_env()


def test_error_line_prefers_the_rank_error():
    message = "ProcessRaisedException: \n\n-- Process 1 terminated:\nTraceback ...\n  File x\nValueError: the cause"
    assert peer.error_line(message) == "ValueError: the cause"
    assert peer.error_line("assert 1 == 2\n +  where ...") == "assert 1 == 2"
