"""Meta-device init follows each model's own code (issue 16): built under ``init_meta_context`` and materialised, a
model equals its eager build with the same seed bit for bit, or materialisation fails naming the module and tensor.

The styles covered are the ones models no one here wrote use: a torchvision-style constructor loop over
``self.modules()``, timm-style ``named_apply(init_weights)``, a buffer assigned in ``reset_parameters`` (LitGPT's
rotary cache), peft LoRA injected into a Hugging Face model after its ``post_init``, and LitGPT's ``GPT`` whose
``_init_weights`` nothing calls on construction. The reference is always the eager build, independent of zeroshard.
"""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
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


class VisionNet(nn.Module):
    """As torchvision's ResNet / VGG constructors do: build, then loop over ``self.modules()`` with ``nn.init``."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.GroupNorm(2, 8)
        )
        self.fc = nn.Linear(8, 10)
        self.embed = nn.Embedding(12, 8, padding_idx=0)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if m.bias is not None:
                    nn.init.constant_(m.bias, 0)
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.constant_(m.bias, 0.5)
        with torch.no_grad():
            self.embed.weight.mul_(0.5)  # an in-place edit after the init, replayed too
            self.embed.weight[0].zero_()  # a write into part of a tensor


def test_torchvision_style_constructor_loop_equals_eager():
    _check(VisionNet, seed=3)


# -- timm style: named_apply(init_weights) from the constructor ------------------------------------------------------


def named_apply(fn, module: nn.Module, name: str = "", depth_first: bool = True) -> nn.Module:
    """timm.models._manipulate.named_apply, written again here (timm needs torchvision)."""
    if not depth_first:
        fn(module=module, name=name)
    for child_name, child in module.named_children():
        named_apply(fn, child, ".".join((name, child_name)) if name else child_name, depth_first)
    if depth_first:
        fn(module=module, name=name)
    return module


def init_weights_vit(module: nn.Module, name: str = "", head_bias: float = 0.0) -> None:
    """timm's ``init_weights_vit_jax``-like rule: trunc-normal Linear, zero head, a learned token."""
    if isinstance(module, nn.Linear):
        if name.startswith("head"):
            nn.init.zeros_(module.weight)
            nn.init.constant_(module.bias, head_bias)
        else:
            nn.init.trunc_normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.normal_(module.bias, std=1e-6)
    elif hasattr(module, "init_weights"):
        module.init_weights()


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.gamma = nn.Parameter(1e-5 * torch.ones(d))  # layer scale: a value computed from a factory


class TimmStyle(nn.Module):
    def __init__(self, d: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embed = nn.Parameter(torch.randn(1, 5, d) * 0.02)
        self.blocks = nn.Sequential(*[Block(d) for _ in range(depth)])
        self.head = nn.Linear(d, 4)
        nn.init.normal_(self.cls_token, std=1e-6)
        named_apply(partial(init_weights_vit, head_bias=-math.log(4)), self)


def test_timm_style_named_apply_init_equals_eager():
    with init_meta_context():
        model = TimmStyle()
    # Block.gamma (1e-5 * ones) and pos_embed (randn * 0.02) are computed: no initialiser of theirs can be replayed
    with pytest.raises(RuntimeError) as err:
        materialize_module_(model, "cpu")
    msg = str(err.value)
    assert "'<root>' (TimmStyle) for pos_embed" in msg and "'blocks.0' (Block) for blocks.0.gamma" in msg
    assert "param_init_fn" in msg and "eagerly" in msg
    assert all(t.is_meta for t in model.parameters())  # nothing allocated


class TimmStyleReset(TimmStyle):
    """The same with the computed tensors initialised in place (how timm itself writes them: ``trunc_normal_``)."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        d = 16
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embed = nn.Parameter(torch.zeros(1, 5, d))
        self.blocks = nn.Sequential(*[Block(d) for _ in range(2)])
        for b in self.blocks:
            b.gamma = nn.Parameter(torch.full((d,), 1e-5))
        self.head = nn.Linear(d, 4)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        named_apply(partial(init_weights_vit, head_bias=-math.log(4)), self)


def test_timm_style_with_in_place_inits_equals_eager():
    _check(TimmStyleReset, seed=5)


# -- a buffer assigned in reset_parameters (LitGPT's rotary cache) ---------------------------------------------------


class Rope(nn.Module):
    def __init__(self, n: int = 8, d: int = 4) -> None:
        super().__init__()
        self.n, self.d = n, d
        self.proj = nn.Linear(d, d)
        cos, sin = self.cache()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def cache(self, device=None):
        theta = 1.0 / (10000 ** (torch.arange(0, self.d, 2, device=device).float() / self.d))
        idx = torch.outer(torch.arange(self.n, device=device).float(), theta)
        return torch.cos(idx), torch.sin(idx)

    def reset_parameters(self) -> None:
        self.cos, self.sin = self.cache(device=self.cos.device)  # assigned, not written in place


@pytest.mark.parametrize("empty_init", [False, True])
def test_buffer_assigned_in_reset_parameters_survives(empty_init):
    model, ref = _meta_and_eager(Rope, seed=2, empty_init=empty_init)
    equal, total, differ = _equal_count(model, ref)
    assert not differ and total == 4, differ
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
