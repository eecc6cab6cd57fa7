"""Activation checkpointing (zeroshard.strategies.activation_checkpointing) on the example GPT: same loss and gradients,
same names, real recomputation, CPU offload of the kept inputs, policy errors, idempotence. CPU only, a few seconds."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from gpt import GPT, MLP, Block, GPTConfig  # noqa: E402
from zeroshard.strategies.activation_checkpointing import apply_activation_checkpointing, is_checkpointed  # noqa: E402

CFG = GPTConfig(n_layer=3, n_head=4, n_embd=32, block_size=16, vocab_size=64, dropout=0.1)
BLOCK_NAMES = ["blocks.0", "blocks.1", "blocks.2"]


def _models(dropout: float = 0.1) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    ref = GPT(GPTConfig(**{**CFG.__dict__, "dropout": dropout}))
    return ref, copy.deepcopy(ref)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, CFG.vocab_size, (2, CFG.block_size), generator=g)
    return idx, torch.roll(idx, -1, dims=1)


def _loss_and_grads(model: nn.Module, seed: int = 3) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    idx, tgt = _batch()
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # dropout masks
    logits = model(idx)
    loss = nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), tgt.view(-1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("offload_to_cpu", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_loss_and_gradients_equal_those_without_checkpointing(offload_to_cpu, dropout):
    ref, model = _models(dropout)
    assert apply_activation_checkpointing(model, Block, offload_to_cpu=offload_to_cpu) == BLOCK_NAMES
    loss_ref, grads_ref = _loss_and_grads(ref)
    loss, grads = _loss_and_grads(model)
    assert torch.equal(loss, loss_ref)
    assert list(grads) == list(grads_ref)
    for n in grads:
        torch.testing.assert_close(grads[n], grads_ref[n], rtol=0, atol=1e-6, msg=n)
    # a different dropout draw does change the loss (so the equality above is not vacuous)
    if dropout > 0:
        assert not torch.equal(_loss_and_grads(ref, seed=4)[0], loss_ref)


def test_names_and_state_dict_keys_unchanged():
    ref, model = _models()
    names_before = [(n, id(p)) for n, p in model.named_parameters()]
    modules_before = [(n, id(m)) for n, m in model.named_modules()]
    apply_activation_checkpointing(model, Block)
    assert list(model.state_dict()) == list(ref.state_dict())
    assert [(n, id(p)) for n, p in model.named_parameters()] == names_before
    assert [(n, id(m)) for n, m in model.named_modules()] == modules_before
    assert all(type(m) is Block for m in model.blocks)  # no class swapped
    assert "forward" not in Block.__dict__ or Block.__dict__["forward"] is Block.forward
    model.load_state_dict(ref.state_dict())  # strict load still works


def test_blocks_are_recomputed_in_backward(monkeypatch):
    calls: list[int] = []
    original = Block.forward

    def counting_forward(self, x):
        calls.append(id(self))
        return original(self, x)

    monkeypatch.setattr(Block, "forward", counting_forward)
    ref, model = _models()
    _loss_and_grads(ref)
    assert len(calls) == CFG.n_layer  # once each without checkpointing
    calls.clear()
    apply_activation_checkpointing(model, Block)
    hook_calls: list[str] = []
    model.blocks[0].register_forward_pre_hook(lambda m, a: hook_calls.append("pre"))
    idx, _ = _batch()
    model(idx).sum().backward()
    assert len(calls) == 2 * CFG.n_layer  # forward + recomputation in backward
    assert [calls.count(id(b)) for b in model.blocks] == [2] * CFG.n_layer
    assert hook_calls == ["pre"]  # the module's own hooks stay outside the region: not re-run by the recomputation


def test_checkpointed_blocks_keep_only_their_inputs():
    """Count what autograd keeps across forward -> backward: checkpointing must drop the blocks' activations."""

    def saved_numel(model: nn.Module) -> int:
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            total += t.numel()
            return t

        idx, _ = _batch()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(idx).sum()
        return total

    ref, model = _models(dropout=0.0)
    apply_activation_checkpointing(model, Block)
    without, with_ckpt = saved_numel(ref), saved_numel(model)
    # with checkpointing, per block only its (B, T, C) input is kept (by the checkpoint, through these hooks)
    assert with_ckpt < without / 3, (with_ckpt, without)


def test_offload_to_cpu_moves_each_block_input_through_save_on_cpu(monkeypatch):
    entered: list[bool] = []
    packed_shapes: list[tuple[int, ...]] = []
    real = torch.autograd.graph.save_on_cpu

    class Recording(real):
        def __init__(self, pin_memory: bool = False, device_type: str = "cuda") -> None:
            super().__init__(pin_memory=pin_memory, device_type=device_type)
            entered.append(pin_memory)
            inner = self.pack_hook

            def pack(t):
                if t.numel():  # torch 2.11's checkpoint also saves an empty placeholder here: no bytes to offload
                    packed_shapes.append(tuple(t.shape))
                return inner(t)

            self.pack_hook = pack

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", Recording)
    _, model = _models()
    apply_activation_checkpointing(model, Block, offload_to_cpu=True)
    idx, _ = _batch()
    model(idx).sum().backward()
    assert entered == [torch.cuda.is_available()] * CFG.n_layer
    assert packed_shapes == [(2, CFG.block_size, CFG.n_embd)] * CFG.n_layer

    entered.clear()
    _, plain = _models()
    apply_activation_checkpointing(plain, Block)
    plain(idx).sum().backward()
    assert entered == []


def test_tuple_and_callable_policies_and_no_nesting():
    _, model = _models()
    assert apply_activation_checkpointing(model, (MLP, nn.LayerNorm)) == [
        name for name, m in model.named_modules() if isinstance(m, (MLP, nn.LayerNorm))
    ]
    _, model = _models()
    # a callable matching blocks and everything inside them: only the outer blocks are checkpointed
    names = apply_activation_checkpointing(model, lambda name, m: name.startswith("blocks."))
    assert names == BLOCK_NAMES
    assert not any(is_checkpointed(m) for b in model.blocks for m in b.modules() if m is not b)

    _, model = _models()
    assert apply_activation_checkpointing(model, lambda name, m: name == "") == [""]  # the root itself
    ref, _ = _models()
    torch.testing.assert_close(_loss_and_grads(model)[0], _loss_and_grads(ref)[0], rtol=0, atol=0)


def test_keyword_arguments_pass_through():
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, *, scale: float = 1.0, preserve_rng_state: bool = False):  # a name checkpoint uses
            return self.lin(x).tanh() * scale + float(preserve_rng_state)

    torch.manual_seed(0)
    m = Scaled()
    x = torch.randn(3, 4, requires_grad=True)
    expected = m(x, scale=3.0, preserve_rng_state=True)
    apply_activation_checkpointing(m, Scaled)
    out = m(x, scale=3.0, preserve_rng_state=True)
    assert torch.equal(out, expected)
    out.sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize("bad", ["Block", 42, int, (), (Block, "MLP"), [Block], None])
def test_bad_policy_raises_type_error_naming_it(bad):
    _, model = _models()
    with pytest.raises(TypeError, match="policy") as err:
        apply_activation_checkpointing(model, bad)
    assert repr(bad) in str(err.value)
    assert not any(is_checkpointed(m) for m in model.modules())


def test_callable_policy_must_return_bool():
    _, model = _models()
    with pytest.raises(TypeError, match="must return a bool"):
        apply_activation_checkpointing(model, lambda name, m: name)


def test_idempotent_and_double_wrapping_detected(monkeypatch):
    _, model = _models()
    assert apply_activation_checkpointing(model, Block) == BLOCK_NAMES
    wrappers = [m.__dict__["forward"] for m in model.blocks]
    assert apply_activation_checkpointing(model, Block) == BLOCK_NAMES  # no-op
    assert [m.__dict__["forward"] for m in model.blocks] == wrappers
    assert all(w.inner is None for w in wrappers)  # not wrapped around a previous wrapper

    calls: list[int] = []
    original = Block.forward
    monkeypatch.setattr(Block, "forward", lambda self, x: calls.append(1) or original(self, x))
    idx, _ = _batch()
    model(idx).sum().backward()
    assert len(calls) == 2 * CFG.n_layer  # still one recomputation, not two

    with pytest.raises(ValueError, match="offload_to_cpu"):
        apply_activation_checkpointing(model, Block, offload_to_cpu=True)
    _, model = _models()
    apply_activation_checkpointing(model, MLP)
    with pytest.raises(ValueError, match=r"'blocks.0'.*blocks.0.mlp"):
        apply_activation_checkpointing(model, Block)
    assert not any(is_checkpointed(b) for b in model.blocks)  # checked before changing anything


def test_deepcopy_of_checkpointed_model_is_bound_to_the_copy():
    ref, model = _models()
    apply_activation_checkpointing(model, Block)
    clone = copy.deepcopy(model)
    assert all(is_checkpointed(b) for b in clone.blocks)
    assert all(b.__dict__["forward"].module is b for b in clone.blocks)
    loss_ref, grads_ref = _loss_and_grads(ref)
    loss, grads = _loss_and_grads(clone)
    assert torch.equal(loss, loss_ref)
    assert all(p.grad is None for p in model.parameters())  # the original got no gradients from the copy's backward


def test_applies_to_a_meta_model_before_materialisation():
    """The ZeRO-3 flow: build on meta, checkpoint the blocks, then materialise; same numbers as an eager build."""
    from zeroshard.meta_init import init_meta_context, materialize_module_

    ref, _ = _models()
    with init_meta_context():
        model = GPT(CFG)
    assert apply_activation_checkpointing(model, Block) == BLOCK_NAMES
    torch.manual_seed(0)  # the seed _models() built ref with
    materialize_module_(model, "cpu")
    loss_ref, grads_ref = _loss_and_grads(ref)
    loss, grads = _loss_and_grads(model)
    assert torch.equal(loss, loss_ref)
    for n in grads:
        torch.testing.assert_close(grads[n], grads_ref[n], rtol=0, atol=1e-6, msg=n)
