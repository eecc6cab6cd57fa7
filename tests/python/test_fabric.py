"""ZeroFabricStrategy against Fabric's own DDP: 2 processes on gloo, same seed and data, fp32, 20 steps.

The model is a plain ``nn.Module`` built from torch's ``nn.TransformerEncoderLayer`` (stage 3 wraps each layer), with
an embedding tied to the head; the loop is a user's Fabric loop (``fabric.setup``, ``fabric.backward``,
``no_backward_sync``, ``fabric.clip_gradients``, ``fabric.save``/``fabric.load``). Losses on each rank and the final
parameters must agree within 1e-5.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from launch import run_ranks
from lightning.fabric.strategies import STRATEGY_REGISTRY
from tiny_lm import TinyLM

import zeroshard
from zeroshard.consolidate import iter_parameters

SCRIPT = Path(__file__).parent / "scripts" / "fabric_runs.py"
RTOL, ATOL = 1e-5, 1e-6
ZERO = {"strategy": "zeroshard"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fabric")
    runs = [{"name": "ddp", "strategy": "ddp"}]
    runs += [{"name": f"stage{s}", **ZERO, "stage": s} for s in (1, 2, 3)]
    runs += [{"name": f"stage{s}_offload", **ZERO, "stage": s, "offload": True} for s in (1, 2, 3)]
    runs += [
        {"name": "stage2_separate_setup", **ZERO, "stage": 2, "setup": "separate"},
        {"name": "registered_name", "strategy": "zeroshard_stage_3_offload", "model": "tiny"},
        {"name": "ddp_tiny", "strategy": "ddp", "model": "tiny"},
        {"name": "stage3_meta", **ZERO, "stage": 3, "model": "tiny", "meta": True},
        {"name": "stage2_meta", **ZERO, "stage": 2, "model": "tiny", "meta": True},
        {"name": "ddp_accumulate_clip", "strategy": "ddp", "accumulate": 2, "clip": 0.5},
        {"name": "stage2_accumulate_clip", **ZERO, "stage": 2, "accumulate": 2, "clip": 0.5},
        {"name": "stage3_accumulate_clip", **ZERO, "stage": 3, "accumulate": 2, "clip": 0.5, "offload": True},
        {"name": "ddp_two", "strategy": "ddp", "two_optimizers": True},
        {"name": "stage3_two", **ZERO, "stage": 3, "two_optimizers": True},
        {"name": "stage1_two_offload", **ZERO, "stage": 1, "two_optimizers": True, "offload": True},
        # save after 10 of 20 steps; resume at another stage (and world layout of shards) for the last 10
        {"name": "save_stage2", **ZERO, "stage": 2, "save_at": 10},
        {"name": "resume_stage3", **ZERO, "stage": 3, "resume_from": "save_stage2"},
        {"name": "loaded_stage1", **ZERO, "stage": 1, "resume_from": "save_stage2", "steps": 10},
        {"name": "save_two_offload", **ZERO, "stage": 3, "two_optimizers": True, "offload": True, "save_at": 10},
        {"name": "resume_two_offload", **ZERO, "stage": 1, "two_optimizers": True, "offload": True}
        | {"resume_from": "save_two_offload"},
        {"name": "save_full", **ZERO, "stage": 3, "state_dict_type": "full", "save_at": 10},
        {"name": "resume_full", **ZERO, "stage": 2, "state_dict_type": "full", "resume_from": "save_full"},
        {"name": "ddp_bf16", "strategy": "ddp", "precision": "bf16-mixed"},
        {"name": "stage3_bf16", **ZERO, "stage": 3, "precision": "bf16-mixed"},
    ]
    run_ranks(SCRIPT, [str(out), json.dumps(runs)])
    return out


def _losses(out: Path, name: str, rank: int) -> torch.Tensor:
    return torch.tensor(json.loads((out / f"{name}_rank{rank}.json").read_text())["losses"], dtype=torch.float64)


def _assert_same(out: Path, ref: str, other: str, last: int | None = None) -> None:
    """Same losses on every rank (the last ``last`` of ``ref``'s when ``other`` resumed midway) and parameters."""
    for rank in range(2):
        a, b = _losses(out, ref, rank), _losses(out, other, rank)
        a = a if last is None else a[-last:]
        assert len(a) == len(b) > 0, (ref, other, len(a), len(b))
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL, msg=lambda m, r=rank: f"{other} vs {ref}, rank {r}: {m}")
    pa, pb = torch.load(out / f"{ref}.pt"), torch.load(out / f"{other}.pt")
    assert pa.keys() == pb.keys()
    for k in pa:
        torch.testing.assert_close(pb[k], pa[k], rtol=RTOL, atol=ATOL, msg=lambda m, k=k: f"{other} vs {ref}, {k}: {m}")


def test_stages_with_and_without_offload_match_fabric_ddp(runs):
    for name in ("stage1", "stage2", "stage3", "stage1_offload", "stage2_offload", "stage3_offload"):
        _assert_same(runs, "ddp", name)
    _assert_same(runs, "ddp", "stage2_separate_setup")  # fabric.setup_module, then fabric.setup_optimizers
    assert _losses(runs, "ddp", 0)[-3:].mean() < _losses(runs, "ddp", 0)[:3].mean() - 1.0  # it trained


def test_registered_name_and_meta_init_match_ddp(runs):
    """``Fabric(strategy="zeroshard_stage_3_offload")``; ``fabric.init_module(empty_init=True)`` builds on the meta
    device and setup materialises the same values as DDP's eager build."""
    for name in ("registered_name", "stage3_meta", "stage2_meta"):
        _assert_same(runs, "ddp_tiny", name)


def test_accumulation_and_clipping_match_ddp(runs):
    """2 micro-batches under ``no_backward_sync``, then ``fabric.clip_gradients(max_norm=0.5)`` (the global norm)."""
    for name in ("stage2_accumulate_clip", "stage3_accumulate_clip"):
        _assert_same(runs, "ddp_accumulate_clip", name)


def test_two_optimizers_match_ddp(runs):
    """``fabric.setup(model, adamw, sgd)``: one engine, each optimizer stepping its own master shards."""
    for name in ("stage3_two", "stage1_two_offload"):
        _assert_same(runs, "ddp_two", name)


def test_save_load_round_trip(runs):
    """``fabric.save`` after 10 steps, ``fabric.load`` into a model and optimizers initialised differently, at another
    stage: the last 10 steps equal the uninterrupted run's (sharded, sharded with two offloaded optimizers, full)."""
    _assert_same(runs, "save_stage2", "resume_stage3", last=10)
    _assert_same(runs, "save_two_offload", "resume_two_offload", last=10)
    _assert_same(runs, "save_full", "resume_full", last=10)


def test_fabric_writes_the_trainers_sharded_format(runs):
    """The directory holds what the Trainer writes (index, one safetensors file per rank, trainer state), and the
    consolidation tool reads from it the parameters that ``fabric.load`` restored."""
    ckpt = runs / "save_stage2.ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["LATEST", "v00001"]
    assert sorted(p.name for p in (ckpt / "v00001").iterdir()) == [
        "index.json",
        "manifest.json",
        "rank00000.safetensors",
        "rank00001.safetensors",
        "trainer.json",
        "trainer.safetensors",
    ]
    assert zeroshard.checkpoint.sharded_checkpoint.is_sharded_checkpoint(ckpt)
    loaded = torch.load(runs / "loaded_stage1.pt")  # after fabric.load and zero further steps
    consolidated = dict(iter_parameters(ckpt))
    assert set(consolidated) <= set(loaded) and "embed.weight" in consolidated
    for k, v in consolidated.items():
        torch.testing.assert_close(v.float(), loaded[k], rtol=0, atol=0, msg=k)


def test_bf16_mixed_within_bf16_tolerance_of_ddp(runs):
    """bf16 parameters and compute, fp32 masters, against Fabric's DDP with autocast over fp32 parameters."""
    for rank in range(2):
        ref, got = _losses(runs, "ddp_bf16", rank), _losses(runs, "stage3_bf16", rank)
        torch.testing.assert_close(got, ref, rtol=3e-2, atol=5e-2)
    dtypes = json.loads((runs / "stage3_bf16_meta.json").read_text())["dtypes"]
    assert set(dtypes.values()) == {"torch.bfloat16"}, dtypes


def test_names_are_registered_for_fabric():
    for name in (
        "zeroshard_stage_1",
        "zeroshard_stage_2",
        "zeroshard_stage_3_offload",
        "zeroshard_stage_3_offload_params",
    ):
        assert STRATEGY_REGISTRY[name]["strategy"] is zeroshard.ZeroFabricStrategy
    strategy = STRATEGY_REGISTRY.get("zeroshard_stage_3_offload")
    assert strategy._core.config.offload_optimizer and not strategy._core.config.offload_params


def test_unsupported_fabric_precision_fails_when_fabric_is_built():
    with pytest.raises(ValueError, match=r"HalfPrecision \(precision='bf16-true'\).*'bf16-mixed'"):
        L.Fabric(accelerator="cpu", devices=2, strategy="zeroshard_stage_2", precision="bf16-true")


def test_trainer_init_module_gives_no_warning_and_builds_as_asked():
    """Lightning warns in ``trainer.init_module`` for strategies that override ``model_sharded_context``; ZeroStrategy
    fully supports it. ``empty_init=True`` builds on meta; ``configure_model`` builds on meta at stage 3 only."""
    strategy = zeroshard.ZeroStrategy(stage=3)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_progress_bar=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with trainer.init_module(empty_init=True):
            meta = TinyLM()
        with trainer.init_module():
            eager = TinyLM()
    assert not [w for w in caught if "init_module" in str(w.message)], [str(w.message) for w in caught]
    assert all(p.is_meta for p in meta.parameters()) and not any(p.is_meta for p in eager.parameters())
    with strategy.tensor_init_context():  # how Lightning calls it around configure_model
        assert torch.empty(1).is_meta
    stage2 = L.Trainer(accelerator="cpu", devices=2, strategy=zeroshard.ZeroStrategy(stage=2), logger=False).strategy
    with stage2.tensor_init_context():
        assert not torch.empty(1).is_meta


def test_ops_is_imported_with_the_package():
    p, g = torch.ones(8), torch.full((8,), 0.5)
    m, v = torch.zeros(8), torch.zeros(8)
    hyper = {"lr": 0.1, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}
    zeroshard.ops.adam_step(p, g, m, v, step=1, adamw_mode=True, bias_correction=True, **hyper)
    torch.testing.assert_close(p, torch.full((8,), 0.9))  # the first bias-corrected Adam step moves by lr
