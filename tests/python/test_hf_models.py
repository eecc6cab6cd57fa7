"""Hugging Face models (tiny GPT-2 and Llama built from configs, no hub) under zeroshard: meta-device init by their own
rules, parity with Lightning's ``ddp``, LoRA at stage 3, torch.compile.

References are independent of zeroshard: an eager HF build (its own ``post_init``), Lightning's ``ddp`` strategy
(torch's DistributedDataParallel) on the same data and seed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_lm import build
from launch import run_ranks
from torch import nn

from zeroshard.meta_init import check_no_meta, init_meta_context, materialize_module_

SCRIPTS = Path(__file__).parent / "scripts"

# -- meta-device init ---------------------------------------------------------------------------------------------


def _eager_and_meta(kind: str, seed: int, hidden: int = 32, *, record: bool = True):
    torch.manual_seed(seed)
    ref = build(kind, hidden)
    # init_meta_context records the constructors' random draws; a plain torch.device("meta") does not
    with init_meta_context() if record else torch.device("meta"):
        model = build(kind, hidden)
    assert all(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    torch.manual_seed(seed)
    materialize_module_(model, "cpu")
    check_no_meta(model)
    return ref, model


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_meta_init_equals_the_eager_build_bit_for_bit(kind):
    """Built under init_meta_context and materialised with the same seed: every parameter and buffer equals the eager
    build's (the constructors' draws are replayed, then _init_weights runs in post_init's order)."""
    ref, model = _eager_and_meta(kind, seed=3)
    names = [n for n, _ in ref.named_parameters()]
    assert names == [n for n, _ in model.named_parameters()]
    for (n, a), b in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(a, b), n
    for (n, a), b in zip(ref.named_buffers(), model.buffers()):
        assert torch.equal(a, b), n
    if kind == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight  # the tie survives
    x = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(model(input_ids=x).logits, ref(input_ids=x).logits, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_meta_init_without_recorded_draws_has_hf_statistics(kind):
    """Built under a plain torch.device("meta") (nothing recorded, so values cannot match an eager build): every
    tensor still follows HF's own rules. Per tensor, mean and std against an eager build (hidden 64), including
    GPT-2's depth-scaled c_proj (std 0.02/sqrt(2 * n_layer) = 0.01, not 0.02); deterministic buffers exactly."""
    ref, model = _eager_and_meta(kind, seed=1, hidden=64, record=False)
    for (n, a), b in zip(ref.named_parameters(), model.parameters()):
        if a.std() == 0:  # zeros and ones (biases, norms): exact
            assert torch.equal(a, b), n
            continue
        assert not torch.equal(a, b), n  # a different draw, not a copy
        se = a.std().item() / a.numel() ** 0.5
        assert abs(b.mean().item() - a.mean().item()) < 6 * se + 1e-4, (n, a.mean().item(), b.mean().item())
        assert b.std().item() == pytest.approx(a.std().item(), rel=0.1), (n, a.std().item(), b.std().item())
    if kind == "gpt2":
        for block in model.transformer.h:
            assert block.attn.c_proj.weight.std().item() == pytest.approx(0.01, rel=0.1)
            assert block.mlp.c_proj.weight.std().item() == pytest.approx(0.01, rel=0.1)
            assert block.attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.1)
    buffers = dict(ref.named_buffers())
    assert (kind == "llama") == bool(buffers)  # Llama's rotary inv_freq / original_inv_freq; GPT-2 has none in 5.x
    for (n, a), b in zip(buffers.items(), model.buffers()):
        assert torch.equal(a, b), n


class _NoInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)), persistent=False)

    def forward(self, x):
        return x


class _Composite(nn.Module):
    """An HF model plus modules nobody can initialise: one beside it, one inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = build("llama")
        self.lm.model.layers[1].extra = _NoInit()  # inside the HF model: HF's _init_weights does not know it
        self.side = _NoInit()


def test_uninitialisable_modules_are_all_named_before_any_allocation():
    with init_meta_context():
        model = _Composite()
    with pytest.raises(RuntimeError) as err:
        materialize_module_(model, "cpu")
    msg = str(err.value)
    assert "'lm.model.layers.1.extra' (_NoInit)" in msg and "'side' (_NoInit)" in msg
    assert "mask" in msg and "scale" not in msg  # torch.ones(4) is replayed; a buffer computed from it is not
    assert "reset_parameters" in msg and "param_init_fn" in msg
    assert "q_proj" not in msg and "rotary" not in msg  # what HF initialises is not listed
    assert all(t.is_meta for t in list(model.parameters()) + list(model.buffers()))  # nothing was allocated

    # the fix the message names: a param_init_fn (here: only for the modules HF does not know)
    def init(m: nn.Module) -> None:
        if isinstance(m, _NoInit):
            m.scale.fill_(1.0)
            m.mask.copy_(torch.tril(torch.ones(4, 4)))
        elif hasattr(m, "_init_weights") or any(True for _ in m.parameters(recurse=False)):
            model.lm._init_weights(m)

    with init_meta_context():
        model = _Composite()
    materialize_module_(model, "cpu", param_init_fn=init)
    assert torch.equal(model.side.mask, torch.tril(torch.ones(4, 4)))


def test_stage3_materialises_hf_models_like_the_eager_build_and_setup_errors_come_first(tmp_path):
    """2 ranks. ZeroEngine at stage 3 (decoder blocks as units) materialises meta GPT-2 and Llama unit by unit: the
    gathered parameters and buffers equal the eager build with the same seed. Through the Trainer, a model nobody can
    fully initialise fails in setup with our error naming both modules, before anything is allocated, and the user
    sees no teardown error on top (Lightning moves the module to the CPU on teardown)."""
    run_ranks(SCRIPTS / "hf_meta_ranks.py", [str(tmp_path)], timeout=300)
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for kind in ("gpt2", "llama"):
            assert r[kind]["differ"] == [], (rank, kind, r[kind])
            assert r[kind]["n_params"] > 10
        fail = r["failing_fit"]
        assert fail["type"] == "RuntimeError", fail
        assert "'extra.0' (NoInit)" in fail["message"] and "'extra.1' (NoInit)" in fail["message"], fail["message"]
        assert "Cannot copy out of meta tensor" not in fail["trace"], fail["trace"]
        assert fail["meta"], "setup allocated parameters before failing"


# -- stage 3 outside a training step ------------------------------------------------------------------------------


def test_generate_with_uneven_lengths_at_stage3_does_not_hang(tmp_path):
    """generate(do_sample=True) in validation_step and in on_validation_epoch_end, rank 0 stopping after 2 new tokens
    and rank 1 after 9: the strategy makes transformers see a sharded model, so generate keeps every rank stepping
    (its synced_gpus mode) until all are done. A hang would hit the 180 s deadline."""
    run_ranks(SCRIPTS / "hf_generate.py", [str(tmp_path)], timeout=180)
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["lengths"] == [2, 2, 2] if rank == 0 else [9, 9, 9], r  # 2 validation batches + epoch end
        assert r["finite"] and r["equal"], r  # a plain forward after fit: whole parameters, no NaN


# -- parity with Lightning's ddp ----------------------------------------------------------------------------------

RTOL, ATOL = 1e-5, 1e-6


def _hf_runs(tmp_path: Path, runs: list[dict], timeout: float = 900) -> None:
    run_ranks(SCRIPTS / "hf_runs.py", [str(tmp_path), json.dumps(runs)], timeout=timeout)


def _result(tmp_path: Path, name: str, rank: int) -> dict:
    return json.loads((tmp_path / f"{name}_rank{rank}.json").read_text())


def _assert_same_run(tmp_path: Path, ref: str, other: str, n: int = 20, first: int = 0) -> None:
    """Losses on both ranks (from step ``first`` of ``ref``) and final parameters agree within 1e-5."""
    for rank in range(2):
        a = torch.tensor(_result(tmp_path, ref, rank)["losses"], dtype=torch.float64)[first:]
        b = torch.tensor(_result(tmp_path, other, rank)["losses"], dtype=torch.float64)
        assert len(a) == len(b) == n - first, (ref, other, len(a), len(b))
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL, msg=lambda m, r=rank: f"{other} vs {ref}, rank {r}: {m}")
    pa, pb = torch.load(tmp_path / f"{ref}.pt"), torch.load(tmp_path / f"{other}.pt")
    assert pa.keys() == pb.keys()
    for k in pa:
        torch.testing.assert_close(pb[k], pa[k], rtol=RTOL, atol=ATOL, msg=lambda m, k=k: f"{other} vs {ref}, {k}: {m}")
    losses = _result(tmp_path, ref, 0)["losses"]
    assert sum(losses[-5:]) < sum(losses[:5]), losses  # it trained


def _parity_runs() -> list[dict]:
    runs = []
    for kind in ("gpt2", "llama"):
        runs += [
            {"name": f"{kind}_ddp", "kind": kind, "strategy": "ddp"},
            {"name": f"{kind}_stage2", "kind": kind, "strategy": "zeroshard", "stage": 2},
            {"name": f"{kind}_stage3", "kind": kind, "strategy": "zeroshard", "stage": 3},
            {"name": f"{kind}_stage3_meta", "kind": kind, "strategy": "zeroshard", "stage": 3, "meta": True},
        ]
    return runs


def _lora_runs(out: Path) -> list[dict]:
    runs = []
    for kind in ("gpt2", "llama"):
        half = str(out / f"{kind}_lora_half")
        lora = {"kind": kind, "lora": True, "samples": 80, "max_epochs": 2}  # 10 steps per epoch
        zero = {"strategy": "zeroshard", "stage": 3, **lora}
        runs += [
            {"name": f"{kind}_lora_ddp", "strategy": "ddp", **lora},
            {"name": f"{kind}_lora_stage3", **zero},
            {"name": f"{kind}_lora_half", **zero, "max_epochs": 1, "save_ckpt": half},
            {"name": f"{kind}_lora_resumed", **zero, "resume_from": half},
        ]
    return runs


def _frozen_first_runs() -> list[dict]:
    frozen = {"kind": "tiny_frozen_first", "strategy": "zeroshard"}
    return [
        {"name": "frozen_ddp", "kind": "tiny_frozen_first", "strategy": "ddp"},
        {"name": "frozen_stage2", **frozen, "stage": 2},
        {"name": "frozen_stage3", **frozen, "stage": 3},
    ]


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory) -> Path:
    """One launch of 2 ranks for the parity, LoRA and frozen-first runs (the tests below read its results)."""
    out = tmp_path_factory.mktemp("hf_runs")
    _hf_runs(out, _parity_runs() + _lora_runs(out) + _frozen_first_runs())
    return out


def test_hf_models_at_stages_2_and_3_match_ddp(runs_dir):
    """Tiny GPT-2 and Llama, fp32, 20 steps: ZeRO stages 2 and 3 (decoder blocks as units) against Lightning's ddp;
    at stage 3 also built on the meta device in configure_model (materialised by their own _init_weights, with the
    constructors' draws replayed: the same initial values as ddp's eager build)."""
    for kind in ("gpt2", "llama"):
        for other in ("stage2", "stage3", "stage3_meta"):
            _assert_same_run(runs_dir, f"{kind}_ddp", f"{kind}_{other}")


# -- LoRA and frozen weights at stage 3 ---------------------------------------------------------------------------


def test_lora_at_stage3_matches_ddp_and_resumes(runs_dir):
    """peft LoRA (r=4 on c_attn / q_proj+v_proj) at stage 3 against ddp, fp32, 20 steps. A unit stays gathered until
    its backward is over, frozen base weights included (they pass the gradient on to the adapters below). The base
    weights are bit-unchanged, the optimizer holds state for the adapters only (each rank a shard of it), and a run
    resumed from a sharded checkpoint at step 10 continues exactly."""
    for kind in ("gpt2", "llama"):
        _assert_same_run(runs_dir, f"{kind}_lora_ddp", f"{kind}_lora_stage3")
        _assert_same_run(runs_dir, f"{kind}_lora_stage3", f"{kind}_lora_resumed", first=10)
        init = torch.load(runs_dir / f"{kind}_lora_stage3_init.pt")
        final = torch.load(runs_dir / f"{kind}_lora_stage3.pt")
        base = [k for k in init if "lora_" not in k]
        adapters = [k for k in init if "lora_" in k]
        assert len(adapters) == {"gpt2": 4, "llama": 8}[kind] and len(base) > 10  # A and B, 1 or 2 modules, 2 layers
        for k in base:
            assert torch.equal(final[k], init[k]), f"{kind}: base weight {k} changed"
        assert not any(torch.equal(final[k], init[k]) for k in adapters if "lora_B" in k)  # adapters trained
        ddp_opt = _result(runs_dir, f"{kind}_lora_ddp", 0)["optimizer"]
        assert ddp_opt["held"] == sorted(adapters)
        zero = [_result(runs_dir, f"{kind}_lora_stage3", r)["optimizer"] for r in range(2)]
        for z in zero:
            assert z["held"] == ddp_opt["held"], z  # the adapters' flat parameters only
        # each rank holds its shard: together the adapters' elements (plus alignment padding), not more
        assert ddp_opt["elems"] <= zero[0]["elems"] + zero[1]["elems"] < ddp_opt["elems"] + 2 * 16 * len(adapters)
        assert zero[0]["elems"] == zero[1]["elems"] < ddp_opt["elems"]


def test_units_whose_first_operations_are_frozen_match_ddp(runs_dir):
    """Without peft: every block starts with frozen layers (norm, up projection), so the last trainable gradient of a
    block is known before its frozen weights have passed the gradient on. Stages 2 and 3 against ddp."""
    _assert_same_run(runs_dir, "frozen_ddp", "frozen_stage2")
    _assert_same_run(runs_dir, "frozen_ddp", "frozen_stage3")


# -- torch.compile ------------------------------------------------------------------------------------------------


def test_compiled_blocks_at_stages_2_and_3_match_ddp(tmp_path):
    """GPT-2 with each decoder block compiled (module.compile(), inductor) at stages 2 and 3 against ddp with the same
    compiled blocks; and the whole HF model compiled at stage 3, where dynamo breaks the graph only at zeroshard's
    unit hooks (they run eagerly: torch.compiler.disable) and compiles everything between."""
    runs = [
        {"name": "ddp", "kind": "gpt2", "strategy": "ddp", "compile": True},
        {"name": "stage2", "kind": "gpt2", "strategy": "zeroshard", "stage": 2, "compile": True},
        {"name": "stage3", "kind": "gpt2", "strategy": "zeroshard", "stage": 3, "compile": True},
        {"name": "ddp_whole", "kind": "gpt2", "strategy": "ddp", "compile": "model"},
        {"name": "stage3_whole", "kind": "gpt2", "strategy": "zeroshard", "stage": 3, "compile": "model"},
    ]
    _hf_runs(tmp_path, runs, timeout=900)
    for other in ("stage2", "stage3"):
        _assert_same_run(tmp_path, "ddp", other)
    _assert_same_run(tmp_path, "ddp_whole", "stage3_whole")  # other graphs, other fusions: compared like with like
    for name in ("ddp", "stage2", "stage3", "ddp_whole"):
        report = _result(tmp_path, name, 0)["dynamo"]
        assert report["graphs"] >= 1 and report["breaks"] == [], (name, report)  # the blocks compiled, unbroken
    whole = _result(tmp_path, "stage3_whole", 0)["dynamo"]
    # the only break reason: zeroshard's hooks (RuntimeHook.__call__ is torch.compiler.disable'd; dynamo words it
    # "Skip inlining" for a disabled method of a hook object, "Skip calling" for a disabled function)
    disabled = {f"Skip {verb} `torch.compiler.disable()`d function" for verb in ("calling", "inlining")}
    assert whole["graphs"] > 2 and len(whole["breaks"]) == 1 and set(whole["breaks"]) <= disabled, whole
