"""Issue 18, cases 6-8: restored optimizer state is checked before any state changes.

6. A re-sealed param group with ``lr: NaN`` (or another non-finite, out-of-range or wrong-typed value) is refused,
   naming the file, the group, the key and the value, and the engine is left as it was.
7. ``"params": []`` (and a parameter moved to another group) is refused the same way.
8. AdamW state loaded into SGD is refused by default (by the recorded class, and by the keys for checkpoints that do
   not record it, and for torch-format state dicts); with ``optimizer_state="reset"`` the weights load, SGD starts
   fresh with its own hyperparameters, and a warning says exactly what was dropped.

One process (a gloo group of one) with sharded checkpoints edited and re-sealed as a hostile tester would
(``ckpt_tools``); one 2-rank gloo run resumes through ``Trainer.fit`` (scripts/optim_restore_runs.py).
"""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from ckpt_tools import edit_index, version_dir
from launch import run_ranks
from tiny_lm import SEQ, VOCAB, TinyLM

from zeroshard import ZeroConfig, ZeroEngine, ZeroFabricStrategy, ZeroStrategy
from zeroshard.checkpoint.sharded_checkpoint import load_sharded, save_sharded

SCRIPTS = Path(__file__).parent / "scripts"


def _engine(optimizer: str = "adamw", seed: int = 0, **config) -> ZeroEngine:
    torch.manual_seed(seed)
    model = TinyLM(optimizer=optimizer)
    return ZeroEngine(model, model.configure_optimizers(), ZeroConfig(stage=2, **config), local_world_size=1)


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def _loss(model, batch) -> torch.Tensor:
    return F.cross_entropy(model(batch[:, :-1]).reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


def _step(engine: ZeroEngine, seed: int) -> None:
    engine.begin_step()
    _loss(engine.module, _batch(seed)).backward()
    engine.finish_backward()
    engine.optimizer.step()
    engine.after_step()


def _snapshot(engine: ZeroEngine) -> dict:
    groups = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
    return {"params": engine.full_state_dict(), "optim": engine.optimizer_state_dict(), "groups": copy.deepcopy(groups)}


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(_same, a, b))
    if torch.is_tensor(a):
        return torch.equal(a, b)
    return a == b


@pytest.fixture(scope="module")
def saved(group, tmp_path_factory):
    """An AdamW checkpoint after two steps, and the state it holds."""
    engine = _engine()
    _step(engine, 1)
    _step(engine, 2)
    path = tmp_path_factory.mktemp("ck") / "ck"
    save_sharded(engine, path, {"tag": "A"})
    return path, _snapshot(engine)


def _copy(saved, tmp_path):
    shutil.copytree(saved[0], tmp_path / "ck", symlinks=True)
    return tmp_path / "ck"


def _refused(path, pattern: str, optimizer: str = "adamw", **config) -> str:
    """Loading ``path`` into a fresh engine raises a ValueError matching ``pattern``; the engine is unchanged."""
    engine = _engine(optimizer, seed=5, **config)
    before = _snapshot(engine)
    with pytest.raises(ValueError, match=pattern) as info:
        load_sharded(engine, path)
    assert _same(_snapshot(engine), before), "state changed before the error"
    return str(info.value)


# -- 6. non-finite, out-of-range and wrong-typed hyperparameters ------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("lr", float("nan"), "not a finite number"),
        ("lr", float("inf"), "not a finite number"),
        ("lr", -0.01, "must be >= 0"),
        ("lr", "0.01", "holds a float"),
        ("betas", [1.5, 0.999], r"each beta must be in \[0, 1\)"),
        ("betas", [0.9], "holds a tuple"),
        ("eps", 0.0, "must be > 0"),
        ("weight_decay", -1.0, "must be >= 0"),
        ("amsgrad", 1, "holds a bool"),
    ],
)
def test_bad_hyperparameter_in_resealed_index_is_refused(saved, tmp_path, key, value, problem):
    path = _copy(saved, tmp_path)
    edit_index(path, lambda index: index["optimizer"]["param_groups"][1].__setitem__(key, value), seal=True)
    text = _refused(path, problem)
    index_file = version_dir(path) / "index.json"
    assert f"sharded checkpoint {index_file}: optimizer param group 1, key {key!r} = {value!r}" in text, text
    assert "Fix: restore an unedited checkpoint" in text and "optimizer_state='reset'" in text


def test_nan_step_in_resealed_index_is_refused(saved, tmp_path):
    path = _copy(saved, tmp_path)
    edit_index(path, lambda index: index["optimizer"]["scalar_state"]["1"].__setitem__("step", float("nan")), seal=True)
    _refused(path, r"scalar optimizer state of flat parameter 1, key 'step' = nan: must be a finite number >= 0")


def test_nan_lr_would_have_made_every_weight_nan(saved, tmp_path):
    """What the refusal prevents (the issue's report): with the check bypassed, one step makes the weights NaN."""
    engine = _engine(seed=5)
    load_sharded(engine, saved[0])
    for group in engine.optimizer.param_groups:
        group["lr"] = math.nan
    _step(engine, 3)
    assert all(torch.isnan(v).all() for k, v in engine.full_state_dict().items() if "frozen" not in k)


# -- 7. the parameters of each group ----------------------------------------------------------------------------------


def test_empty_params_in_resealed_index_is_refused(saved, tmp_path):
    path = _copy(saved, tmp_path)
    edit_index(path, lambda index: index["optimizer"]["param_groups"][0].__setitem__("params", []), seal=True)
    text = _refused(path, r"optimizer param group 0, key 'params' = \[\]: a sharded checkpoint's groups list no")
    assert str(version_dir(path) / "index.json") in text


def test_parameter_moved_to_another_group_is_refused(saved, tmp_path):
    path = _copy(saved, tmp_path)

    def move(index):
        entry = next(e for e in index["flat_params"] if e.get("group") == 0)
        entry["group"] = 1

    edit_index(path, move, seal=True)
    _refused(path, r"parameter '.*', key 'group' = 1: this run puts it in param group 0")


def test_empty_params_in_torch_state_dict_is_refused(saved, group):
    engine = _engine(seed=5)
    state = copy.deepcopy(saved[1]["optim"])
    state["param_groups"][0]["params"] = []
    before = _snapshot(engine)
    with pytest.raises(ValueError, match=r"ckpt\.pt: optimizer param group 0, key 'params' = \[\]: the checkpoint has "
                       r"0 parameters here, this optimizer \d+"):  # fmt: skip
        engine.load_optimizer_state_dict(state, source="ckpt.pt")
    assert _same(_snapshot(engine), before)


# -- 8. another optimizer ---------------------------------------------------------------------------------------------


def test_adamw_checkpoint_into_sgd_is_refused_by_class(saved, tmp_path):
    text = _refused(saved[0], r"optimizer 0, key 'classes' = 'torch.optim.AdamW': this run's optimizer 0 is "
                    r"torch.optim.SGD", optimizer="sgd")  # fmt: skip
    assert "build torch.optim.AdamW as the saving run did" in text and "optimizer_state='reset'" in text


def test_adamw_checkpoint_without_recorded_class_into_sgd_is_refused_by_keys(saved, tmp_path):
    path = _copy(saved, tmp_path)
    edit_index(path, lambda index: index["optimizer"].pop("classes", None), seal=True)  # as saved before this version
    text = _refused(path, r"optimizer param group 0, key 'betas' = \[0\.9, 0\.999\]: the group has keys "
                    r"torch.optim.SGD does not take \(betas, eps\) and lacks keys it needs \(dampening, momentum, "
                    r"nesterov\)", optimizer="sgd")  # fmt: skip
    assert "saved by another optimizer class" in text


def test_adamw_state_dict_into_sgd_is_refused(saved, group):
    engine = _engine("sgd", seed=5)
    before = _snapshot(engine)
    with pytest.raises(ValueError, match=r"optimizer param group 0, key 'betas' = \(0\.9, 0\.999\): the group has "
                       r"keys torch.optim.SGD does not take"):  # fmt: skip
        engine.load_optimizer_state_dict(copy.deepcopy(saved[1]["optim"]))
    assert _same(_snapshot(engine), before)


def test_reset_loads_the_weights_and_starts_sgd_fresh(saved, recwarn):
    """optimizer_state='reset': the saved weights, SGD's own hyperparameters and no AdamW state; one step then equals
    torch's SGD from the same weights."""
    engine = _engine("sgd", seed=5, optimizer_state="reset")
    own_groups = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
    assert load_sharded(engine, saved[0])["tag"] == "A"
    got = _snapshot(engine)
    assert _same(got["params"], saved[1]["params"])
    assert got["groups"] == own_groups and "betas" not in got["groups"][0]
    assert got["optim"]["state"] == {}
    warning = next(str(w.message) for w in recwarn if "optimizer_state='reset'" in str(w.message))
    assert "saved by torch.optim.AdamW" in warning
    assert "per-parameter state exp_avg, exp_avg_sq, step" in warning
    assert "group 0 {weight_decay: 0.1, lr: 0.01, betas: [0.9, 0.999], eps: 1e-08, amsgrad: False" in warning
    assert "torch.optim.SGD starts fresh" in warning

    torch.manual_seed(0)
    ref = TinyLM(optimizer="sgd")
    ref.load_state_dict(saved[1]["params"])
    ref_opt = ref.configure_optimizers()
    _loss(ref, _batch(9)).backward()
    ref_opt.step()
    _step(engine, 9)
    ours = engine.full_state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(ours[k], v, rtol=1e-5, atol=1e-6, msg=k)
    assert set(engine.optimizer_state_dict()["state"][0]) == {"momentum_buffer"}


def test_reset_drops_a_torch_state_dict_too(saved, recwarn):
    engine = _engine("sgd", seed=5, optimizer_state="reset")
    groups = copy.deepcopy(engine.optimizer.param_groups[0]["lr"])
    engine.load_optimizer_state_dict(copy.deepcopy(saved[1]["optim"]), source="ckpt.pt")
    assert engine.optimizer.param_groups[0]["lr"] == groups and not engine.optimizer.state
    assert any("ckpt.pt: optimizer_state='reset': dropped" in str(w.message) for w in recwarn)


def test_same_optimizer_still_resumes_exactly(saved, tmp_path):
    engine = _engine(seed=5)
    load_sharded(engine, saved[0])
    assert _same(_snapshot(engine), saved[1])
    engine = _engine(seed=6)
    engine.load_optimizer_state_dict(copy.deepcopy(saved[1]["optim"]))
    assert _same(_snapshot(engine)["optim"], saved[1]["optim"])


def test_offloaded_adam_checkpoint_resumes_into_adamw_and_back(group, tmp_path):
    """CPUAdam (offload_optimizer=True) counts as the AdamW it replaces: its groups' own flags (adamw_mode,
    bias_correction) are not AdamW's, yet the state moves both ways."""
    offloaded = _engine(offload_optimizer=True)
    _step(offloaded, 1)
    save_sharded(offloaded, tmp_path / "a", {})
    plain = _engine(seed=5)
    load_sharded(plain, tmp_path / "a")
    assert _same(_snapshot(plain)["params"], _snapshot(offloaded)["params"])
    save_sharded(plain, tmp_path / "b", {})
    again = _engine(seed=6, offload_optimizer=True)
    load_sharded(again, tmp_path / "b")
    torch.testing.assert_close(_snapshot(again)["optim"], _snapshot(offloaded)["optim"], rtol=0, atol=0)


def test_optimizer_state_is_a_strategy_setting():
    assert ZeroStrategy(optimizer_state="reset").zero_config.optimizer_state == "reset"
    assert ZeroFabricStrategy(optimizer_state="reset")._core.config.optimizer_state == "reset"
    assert ZeroStrategy().zero_config.optimizer_state == "strict"
    with pytest.raises(ValueError, match=r"optimizer_state='drop'\) must be 'strict' .* or 'reset'"):
        ZeroStrategy(optimizer_state="drop")


def _two_optimizer_engine(first: str, seed: int) -> ZeroEngine:
    torch.manual_seed(seed)
    model = TinyLM()
    blocks = list(model.blocks.parameters())
    rest = [p for n, p in model.named_parameters() if p.requires_grad and not n.startswith("blocks.")]
    opt0 = torch.optim.Adam(blocks, lr=1e-3) if first == "adam" else torch.optim.SGD(blocks, lr=1e-3, momentum=0.5)
    opt1 = torch.optim.AdamW(rest, lr=2e-3)
    return ZeroEngine(model, [opt0, opt1], ZeroConfig(stage=2), local_world_size=1)


def test_two_optimizers_are_checked_each_by_its_class(group, tmp_path):
    engine = _two_optimizer_engine("adam", 0)
    engine.begin_step()
    _loss(engine.module, _batch(1)).backward()
    engine.finish_backward()
    for opt in engine.optimizers:
        opt.step()
        engine.after_step(opt)
    save_sharded(engine, tmp_path / "ck", {})
    same = _two_optimizer_engine("adam", 5)
    load_sharded(same, tmp_path / "ck")
    for oi, opt in enumerate(engine.optimizers):
        assert _same(same.optimizer_state_dict(same.optimizers[oi]), engine.optimizer_state_dict(opt))
    with pytest.raises(ValueError, match=r"optimizer 0, key 'classes' = 'torch.optim.Adam': this run's optimizer 0 "
                       r"is torch.optim.SGD"):  # fmt: skip
        load_sharded(_two_optimizer_engine("sgd", 5), tmp_path / "ck")


def test_trainer_resume_with_sgd_is_refused_then_reset_on_two_ranks(tmp_path):
    """Through ``Trainer.fit(ckpt_path=...)`` on 2 gloo ranks, sharded and full checkpoints: AdamW state into SGD is
    refused on every rank before the weights load; ``ZeroStrategy(optimizer_state="reset")`` resumes the weights with
    SGD's own groups, and SGD then builds its own momentum buffers."""
    outputs = run_ranks(SCRIPTS / "optim_restore_runs.py", [str(tmp_path)], timeout=300)
    for fmt, pattern in (
        ("sharded", r"sharded checkpoint \S+/sharded/v00001/index\.json: optimizer 0, key 'classes' = "
         r"'torch\.optim\.AdamW': this run's optimizer 0 is torch\.optim\.SGD\. Fix: build torch\.optim\.AdamW"),
        ("full", r"checkpoint \S+/full, optimizer_states\[0\]: optimizer param group 0, key 'betas' = "
         r"\(0\.9, 0\.999\)"),
    ):  # fmt: skip
        for out in outputs:
            assert re.search(f"^REFUSED {fmt} {pattern}", out, re.M), out[-3000:]
            assert f"UNCHANGED {fmt} True" in out, out[-3000:]
        reset = json.loads(re.search(f"^RESET {fmt} (.*)$", outputs[0], re.M).group(1))
        assert reset["same"] and reset["state_keys"] == ["momentum_buffer"], reset
        assert [g["momentum"] for g in reset["groups"]] == [0.9, 0.9] and "betas" not in reset["groups"][0], reset
        assert [g["weight_decay"] for g in reset["groups"]] == [0.1, 0.0], reset
