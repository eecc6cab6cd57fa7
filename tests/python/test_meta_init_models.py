"""Meta-device init follows each model's own code (issue 16): built under ``init_meta_context`` and materialised, a
model equals its eager build with the same seed bit for bit, or materialisation fails naming the module and tensor.

The styles covered are the ones models no one here wrote use: a torchvision-style constructor loop over
``self.modules()``, timm-style ``named_apply(init_weights)``, a buffer assigned in ``reset_parameters`` (LitGPT's
rotary cache), peft LoRA injected into a Hugging Face model after its ``post_init``, and LitGPT's ``GPT`` whose
``_init_weights`` nothing calls on construction. The reference is always the eager build, independent of zeroshard.
"""

from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path

import pytest
import torch
from init_styles import Rope, TimmStyle, TimmStyleComputed, VisionNet
from launch import run_ranks
from torch import nn

from zeroshard.meta_init import check_no_meta, init_meta_context, materialize_module_


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    out = dict(model.named_parameters(remove_duplicate=False))
    out.update(model.named_buffers(remove_duplicate=False))
    return out


def _equal_count(model: nn.Module, ref: nn.Module) -> tuple[int, int, list[str]]:
    a, b = _tensors(model), _tensors(ref)
    assert a.keys() == b.keys()
    differ = [k for k in a if not (a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]))]
    return len(a) - len(differ), len(a), differ


def _meta_and_eager(build, seed: int = 0, *, empty_init: bool = False):
    torch.manual_seed(seed)
    ref = build()
    with init_meta_context(empty_init=empty_init):
        model = build()
    torch.manual_seed(seed)
    materialize_module_(model, "cpu")
    check_no_meta(model)
    return model, ref


def _assert_bit_equal(model: nn.Module, ref: nn.Module) -> None:
    equal, total, differ = _equal_count(model, ref)
    assert not differ, f"{equal}/{total} tensors equal; differ: {differ}"
    # and the random stream ends where the eager build left it (dropout in the first step depends on it)
    assert torch.equal(torch.rand(4), _after_eager_state)


_after_eager_state = torch.empty(0)


def _check(build, seed: int = 0) -> None:
    global _after_eager_state
    torch.manual_seed(seed)
    ref = build()
    _after_eager_state = torch.rand(4)
    with init_meta_context():
        model = build()
    torch.manual_seed(seed)
    materialize_module_(model, "cpu")
    check_no_meta(model)
    _assert_bit_equal(model, ref)


# -- torchvision style: the constructor initialises in a loop over self.modules() ------------------------------------


def test_torchvision_style_constructor_loop_equals_eager():
    _check(VisionNet, seed=3)


# -- timm style: named_apply(init_weights) from the constructor ------------------------------------------------------


def test_timm_style_computed_values_are_refused_by_name():
    with init_meta_context():
        model = TimmStyleComputed()
    # Block.gamma (1e-5 * ones) and pos_embed (randn * 0.02) are computed: no initialiser of theirs can be replayed
    with pytest.raises(RuntimeError) as err:
        materialize_module_(model, "cpu")
    msg = str(err.value)
    assert "'<root>' (TimmStyleComputed) for pos_embed" in msg and "'blocks.0' (Block) for blocks.0.gamma" in msg
    assert "param_init_fn" in msg and "eagerly" in msg
    assert all(t.is_meta for t in model.parameters())  # nothing allocated


def test_timm_style_with_in_place_inits_equals_eager():
    _check(TimmStyle, seed=5)


# -- a buffer assigned in reset_parameters (LitGPT's rotary cache) ---------------------------------------------------


@pytest.mark.parametrize("empty_init", [False, True])
def test_buffer_assigned_in_reset_parameters_survives(empty_init):
    model, ref = _meta_and_eager(Rope, seed=2, empty_init=empty_init)
    equal, total, differ = _equal_count(model, ref)
    assert not differ and total == 6, differ
    assert not model.cos.is_meta and torch.equal(model.sin, ref.sin)


# -- a value that cannot be reproduced: named, nothing allocated -----------------------------------------------------

_OUTSIDE = torch.linspace(0, 1, 6)


class CopiesFromOutside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 3)
        self.table = nn.Parameter(torch.empty(6))
        with torch.no_grad():
            self.table.copy_(_OUTSIDE)  # values from a tensor made outside the meta context


def test_unreproducible_init_is_named_with_both_ways_out():
    with init_meta_context():
        model = CopiesFromOutside()
    with pytest.raises(RuntimeError) as err:
        materialize_module_(model, "cpu")
    msg = str(err.value)
    assert "'<root>' (CopiesFromOutside) for table" in msg
    assert "param_init_fn" in msg and "eagerly" in msg and "lin" not in msg.split("for table")[0][-40:]
    assert all(t.is_meta for t in model.parameters())
    # way out 1: param_init_fn

    def init(m: nn.Module) -> None:
        if isinstance(m, CopiesFromOutside):
            m.table.copy_(_OUTSIDE)
        elif isinstance(m, nn.Linear):
            m.reset_parameters()

    materialize_module_(model, "cpu", param_init_fn=init)
    assert torch.equal(model.table, _OUTSIDE)
    # way out 2: the eager build
    assert torch.equal(CopiesFromOutside().table, _OUTSIDE)


# -- peft LoRA built on the meta device (Qwen2 and Llama) ------------------------------------------------------------


def _hf(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False))
    return LlamaForCausalLM(LlamaConfig(**common))


def _lora(kind: str):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    return get_peft_model(_hf(kind), cfg)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_peft_lora_built_on_meta_equals_eager(kind):
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    _check(partial(_lora, kind), seed=11)
    # the check above is not vacuous: LoRA B starts at zero and A is not HF's std-0.02 normal
    with init_meta_context():
        model = _lora(kind)
    torch.manual_seed(11)
    materialize_module_(model, "cpu")
    b = [p for n, p in model.named_parameters() if "lora_B" in n]
    a = [p for n, p in model.named_parameters() if "lora_A" in n]
    assert len(b) == 6 and all(torch.count_nonzero(p) == 0 for p in b)
    assert all(p.abs().max() > 0.1 for p in a)  # kaiming-uniform(a=sqrt 5) on fan_in 32/64: bound 0.18/0.125


# -- 2 gloo ranks: built on meta, set up in LitGPT's order, trained against DDP's eager build ------------------------

SCRIPT = Path(__file__).parent / "scripts" / "init_models_runs.py"
ZERO = {"strategy": "zeroshard"}
# (reference, zeroshard runs): DDP builds eagerly (LitGPT's flow: Lightning's empty init, then its initialize_weights)
RUNS = {
    "litgpt": [
        {"name": "ddp_litgpt", "strategy": "ddp", "model": "litgpt", "build": "empty_init"},
        {"name": "litgpt_stage2", **ZERO, "stage": 2, "model": "litgpt", "build": "empty_init"},
        {"name": "litgpt_stage3", **ZERO, "stage": 3, "model": "litgpt", "build": "empty_init"},
        # weight decay on matrices only: the groups split every unit, so the set-up model is re-sharded by them
        {"name": "ddp_litgpt_groups", "strategy": "ddp", "model": "litgpt", "build": "empty_init", "groups": True},
        {"name": "litgpt_stage3_groups", **ZERO, "model": "litgpt", "build": "empty_init", "groups": True},
        # the optimizer adopted by the engine is then swapped for the fused CPU Adam of the offload pipeline
        {"name": "litgpt_stage3_offload", **ZERO, "model": "litgpt", "build": "empty_init", "offload": True},
    ],
    "lora_qwen2": [
        {"name": "ddp_lora_qwen2", "strategy": "ddp", "model": "lora_qwen2"},
        {"name": "lora_qwen2_stage3", **ZERO, "model": "lora_qwen2", "build": "meta"},
    ],
    "lora_llama": [
        {"name": "ddp_lora_llama", "strategy": "ddp", "model": "lora_llama"},
        {"name": "lora_llama_stage3", **ZERO, "model": "lora_llama", "build": "meta", "setup": "joint"},
    ],
    "vision": [
        {"name": "ddp_vision", "strategy": "ddp", "model": "vision"},
        {"name": "vision_stage3", **ZERO, "model": "vision", "build": "meta"},
    ],
    "timm": [
        {"name": "ddp_timm", "strategy": "ddp", "model": "timm"},
        {"name": "timm_stage3", **ZERO, "model": "timm", "build": "meta", "setup": "joint", "gathered": True},
    ],
    "rope": [
        {"name": "ddp_rope", "strategy": "ddp", "model": "rope"},
        {"name": "rope_stage3", **ZERO, "model": "rope", "build": "empty_init"},
    ],
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> Path:
    pytest.importorskip("litgpt")
    out = tmp_path_factory.mktemp("init_models")
    run_ranks(SCRIPT, [str(out), json.dumps([run for runs in RUNS.values() for run in runs])])
    return out


def _assert_same_as_ddp(out: Path, ref: str, name: str, final_atol: float = 1e-6) -> None:
    """Initial tensors bit for bit, losses within 1e-5 relative on both ranks, final tensors within 1e-5 relative
    (+ ``final_atol``)."""
    a, b = torch.load(out / f"{ref}_init.pt"), torch.load(out / f"{name}_init.pt")
    assert a.keys() == b.keys(), set(a) ^ set(b)
    differ = [k for k in a if not (a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]))]
    assert not differ, (
        f"{name}: {len(a) - len(differ)}/{len(a)} initial tensors equal the eager build; differ: {differ}"
    )
    for rank in range(2):
        la = json.loads((out / f"{ref}_rank{rank}.json").read_text())["losses"]
        lb = json.loads((out / f"{name}_rank{rank}.json").read_text())["losses"]
        assert len(la) == len(lb) == 5 and all(math.isfinite(x) for x in la)
        torch.testing.assert_close(torch.tensor(lb), torch.tensor(la), rtol=1e-5, atol=0, msg=f"{name} rank {rank}")
    fa, fb = torch.load(out / f"{ref}.pt"), torch.load(out / f"{name}.pt")
    for k in fa:
        torch.testing.assert_close(fb[k], fa[k], rtol=1e-5, atol=final_atol, msg=f"{name}: {k}")
    assert any(not torch.equal(fa[k], a[k]) for k in fa), f"{ref}: nothing trained"


def test_litgpt_own_loop_at_stages_2_and_3_equals_ddp(ranks):
    """LitGPT's ``GPT`` built under ``fabric.init_module(empty_init=True)``, initialised by LitGPT's own
    ``pretrain.initialize_weights`` (which overrides ``reset_parameters`` on the meta model), then
    ``fabric.setup(model)``, the optimizer over the set-up model's parameters and ``fabric.setup_optimizers``."""
    _assert_same_as_ddp(ranks, "ddp_litgpt", "litgpt_stage2")
    _assert_same_as_ddp(ranks, "ddp_litgpt", "litgpt_stage3")
    _assert_same_as_ddp(ranks, "ddp_litgpt_groups", "litgpt_stage3_groups")
    # CPUAdam rounds differently from torch's AdamW; Adam's normalisation turns that into O(lr) steps on elements whose
    # gradient is ~0 (measured: 1e-3 at most after 5 steps of lr 1e-2), so final tensors get an lr-sized tolerance
    _assert_same_as_ddp(ranks, "ddp_litgpt", "litgpt_stage3_offload", final_atol=1e-2)


@pytest.mark.parametrize("kind", ["lora_qwen2", "lora_llama"])
def test_peft_lora_built_on_meta_at_stage_3_equals_ddp(ranks, kind):
    """``get_peft_model`` under ``init_meta_context()``: adapters start as peft makes them (B zero, A kaiming)."""
    _assert_same_as_ddp(ranks, f"ddp_{kind}", f"{kind}_stage3")
    init = torch.load(ranks / f"{kind}_stage3_init.pt")
    assert all(torch.count_nonzero(v) == 0 for k, v in init.items() if "lora_B" in k)


@pytest.mark.parametrize("kind", ["vision", "timm", "rope"])
def test_constructor_styles_on_meta_at_stage_3_equal_ddp(ranks, kind):
    """torchvision's init loop, timm's ``named_apply`` (with ``gathered_parameters`` between forward and backward),
    and a rotary cache assigned in ``reset_parameters`` (``fabric.init_module(empty_init=True)``)."""
    _assert_same_as_ddp(ranks, f"ddp_{kind}", f"{kind}_stage3")
