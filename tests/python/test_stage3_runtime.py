"""ZeRO stage 3 outside a training step: forwards gather and free, freed parameters read as values or fail loudly
(never NaN), writes land in the shards, and Lightning loops that touch the model between steps (fit then test on the
best checkpoint, EMA and SWA callbacks, generate in validation) behave as under ``ddp``.

References: an unsharded copy of the model with the same values, and the same runs under Lightning's ``ddp``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from launch import run_ranks

SCRIPT = Path(__file__).parent / "scripts" / "stage3_runtime.py"


def _ranks(tmp_path: Path, part: str) -> list[dict]:
    return [json.loads((tmp_path / f"{part}_rank{r}.json").read_text()) for r in range(2)]


def test_parameters_outside_a_step(tmp_path):
    run_ranks(SCRIPT, [str(tmp_path), "direct"], timeout=300)
    for r in _ranks(tmp_path, "direct"):
        # forwards outside a step gather every unit (the root too) and free them after: the unsharded copy's values
        assert r["no_grad_forward"] and r["grad_forward"] and r["freed_after_forward"], r
        # a freed parameter is a placeholder of the right shape that is still an nn.Parameter, names unchanged
        assert r["placeholder"] == "ShardedParameter" and r["is_parameter"] and r["names"], r
        # read on every rank: the gathered values; with autograd: an error naming the parameter and the fix
        assert r["read"] and r["read_norm"], r
        assert "'blocks.0.up.weight'" in r["grad_read_error"] and "torch.no_grad()" in r["grad_read_error"]
        # writes (p.data.copy_, p.data = x, load_state_dict, inside gathered_parameters) land in the shards and fp32
        # masters; writeback=False discards; .numpy() inside gathered_parameters keeps its values, leaving works
        assert r["after_writes"] == [] and r["after_load_state_dict"] == [] and r["after_gathered"] == [], r
        assert r["numpy_kept"] and r["forward_after_numpy"], r
        # the next optimizer step starts from the written values (masters are separate here: optimizer offload), with
        # a block output modified in place by its caller
        assert r["after_step"] == [], r
    # repr on one rank only reads nothing (no collective, so no hang) and says what to do
    assert "gathered_parameters" in _ranks(tmp_path, "direct")[0]["repr"]


@pytest.fixture(scope="module")
def loops(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("loops")
    run_ranks(SCRIPT, [str(out), "loops"], timeout=900)
    return _ranks(out, "loops")


def _close(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        torch.testing.assert_close(
            torch.tensor(b[k]), torch.tensor(a[k]), rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{what}, {k}: {m}"
        )


def _rank_state(state: dict, rank: int) -> dict:
    """Parameters, and on rank 0 the batch-norm statistics too: ddp broadcasts rank 0's buffers before every forward,
    zeroshard (like FSDP) keeps each rank's own, so only rank 0's are the same."""
    return {k: v for k, v in state.items() if rank == 0 or ("running" not in k and "num_batches" not in k)}


def test_fit_then_test_on_the_best_checkpoint(loops):
    """Lightning's test_fit_test_synchronization at stage 3: ModelCheckpoint(monitor=val_loss) during fit, then
    trainer.test(ckpt_path="best") loads the best (sharded) checkpoint: same checkpoint and test loss as ddp. A fresh
    Trainer's validate on the same model (still sharded) then sees those weights."""
    for r in loops:
        ddp, zero = r["ddp_fit_test"], r["zero_fit_test"]
        assert zero["best_exists"] and zero["best"] == ddp["best"], (ddp, zero)
        assert zero["test_loss"] == pytest.approx(ddp["test_loss"], rel=1e-5)
        # then a fresh Trainer validates the model, still sharded by the first one: same weights, same data
        assert zero["val_loss_fresh_trainer"] == pytest.approx(zero["test_loss"], rel=1e-6)
        assert ddp["val_loss_fresh_trainer"] == pytest.approx(ddp["test_loss"], rel=1e-6)


def test_ema_callback(loops):
    """Lightning's WeightAveraging (EMA) at stage 3: it reads every parameter after each step, swaps the averaged
    weights in and out around validation (param.data.copy_ on freed parameters) and copies them in at the end; the
    final parameters equal ddp's."""
    for rank, r in enumerate(loops):
        ddp, zero = r["ddp_ema"], r["zero_ema"]
        assert zero["swaps"] == ddp["swaps"] == 8 and zero["copies"] == ddp["copies"] == 1  # 4 validations
        assert zero["n_averaged"] == ddp["n_averaged"] == 16  # 4 epochs of 4 steps
        _close(*(_rank_state(x["params"], rank) for x in (ddp, zero)), "ema")


def test_ema_resume_after_a_crash(loops):
    """Lightning's test_ema_resume_ddp at stage 3: a crash in epoch 2, then fit(ckpt_path=...) resumes the averaged
    and the current model; the result equals the uninterrupted run."""
    for rank, r in enumerate(loops):
        assert r["zero_ema_crash"]["crashed"] and r["zero_ema_crash"]["ckpt"], r["zero_ema_crash"]
        resumed = r["zero_ema_resumed"]
        assert resumed["copies"] == 1 and resumed["n_averaged"] == 16, resumed
        # (a checkpoint holds rank 0's batch-norm statistics: after a resume, every rank continues from those)
        _close(*(_rank_state(x["params"], rank) for x in (r["zero_ema"], resumed)), "ema resumed")


def test_swa_callback(loops):
    """Lightning's test_swa_callback_ddp_cpu at stage 3: StochasticWeightAveraging with SWALR, gradient
    accumulation and the extra batch-norm epoch without backward (whose optimizer step reuses the last gradients,
    as under ddp); parameters equal ddp's."""
    for rank, r in enumerate(loops):
        ddp, zero = r["ddp_swa"], r["zero_swa"]
        assert zero["n_averaged"] == ddp["n_averaged"] == 4 and zero["epochs"] == ddp["epochs"] == 6
        _close(*(_rank_state(x["params"], rank) for x in (ddp, zero)), "swa")
