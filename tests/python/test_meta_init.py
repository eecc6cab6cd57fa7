"""Meta-device init (zeroshard.meta_init): a 45B skeleton without memory, bit parity with eager builds, unit-by-unit
materialisation, tied parameters, buffers, errors. CPU only, a few seconds."""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from gpt import GPT, GPTConfig  # noqa: E402
from zeroshard.meta_init import check_no_meta, init_meta_context, materialize_, materialize_module_  # noqa: E402

SMALL = GPTConfig(n_layer=3, n_head=4, n_embd=32, block_size=16, vocab_size=64, dropout=0.1)


def _assert_same_tensors(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(keep_vars=True), b.state_dict(keep_vars=True)
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].device == sb[k].device and sa[k].dtype == sb[k].dtype and sa[k].shape == sb[k].shape, k
        assert torch.equal(sa[k], sb[k]), f"{k} differs"
    na = [(n, t.requires_grad, type(t)) for n, t in a.named_parameters(remove_duplicate=False)]
    nb = [(n, t.requires_grad, type(t)) for n, t in b.named_parameters(remove_duplicate=False)]
    assert na == nb
    ba = dict(a.named_buffers(remove_duplicate=False))
    bb = dict(b.named_buffers(remove_duplicate=False))
    assert list(ba) == list(bb)
    for k in ba:  # non-persistent buffers too (not in state_dict)
        assert torch.equal(ba[k], bb[k]), f"buffer {k} differs"


def _eager(build, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build()


def _meta(build) -> nn.Module:
    with init_meta_context():
        m = build()
    assert all(t.is_meta for t in m.parameters()) and all(t.is_meta for t in m.buffers())
    return m


# --------------------------------------------------------------------------------------------- the 45B skeleton


def test_45b_gpt_skeleton_builds_on_meta_in_under_a_second_without_memory():
    cfg = GPTConfig(n_layer=56, n_head=16, n_embd=8192, block_size=1024, vocab_size=256)
    with init_meta_context():  # warm-up: one-time lazy imports and dispatcher caches, not part of the contract
        GPT(GPTConfig(n_layer=1, n_head=16, n_embd=8192, block_size=1024))
    gc.collect()
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    t0 = time.perf_counter()
    with init_meta_context():
        model = GPT(cfg)
    elapsed = time.perf_counter() - t0
    rss_growth = proc.memory_info().rss - rss0

    C, L, V, T = cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.block_size
    # per block: 2 LayerNorms (2C each), qkv (3C^2 + 3C), attn proj (C^2 + C), fc (4C^2 + 4C), mlp proj (4C^2 + C)
    per_block = 2 * 2 * C + (3 * C * C + 3 * C) + (C * C + C) + (4 * C * C + 4 * C) + (4 * C * C + C)
    expected = L * per_block + V * C + T * C + 2 * C  # + wte (tied with lm_head, counted once), wpe, ln_f
    assert model.num_params() == expected
    assert abs(expected - 45e9) / 45e9 < 0.01  # 45.11e9
    assert all(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.wte.weight
    print(f"\n45B skeleton on meta: {elapsed * 1e3:.0f} ms, RSS growth {rss_growth / 2**20:.1f} MiB")
    assert elapsed < 1.0, f"building the 45B skeleton on meta took {elapsed:.2f} s"
    assert rss_growth < 200 * 2**20, f"RSS grew by {rss_growth / 2**20:.0f} MiB"


def test_meta_context_patches_nothing_and_is_scoped():
    init_before = nn.Module.__init__
    with init_meta_context():
        assert torch.empty(2).is_meta
        assert nn.Module.__init__ is init_before
        t = torch.empty(3)
        assert nn.init.normal_(t) is t and t.is_meta  # initialisers on meta are no-ops
        assert not torch.empty(2, device="cpu").is_meta  # explicit devices are honoured
    assert not torch.empty(2).is_meta
    # the skipped initialisers consume no random numbers, exactly like meta tensors themselves
    torch.manual_seed(3)
    with init_meta_context():
        nn.Linear(4, 4)
    after_meta = torch.rand(1)
    torch.manual_seed(3)
    assert torch.equal(torch.rand(1), after_meta)


# ------------------------------------------------------------------------------------------ parity with eager


def test_gpt_meta_then_materialize_is_bit_identical_to_eager():
    ref = _eager(lambda: GPT(SMALL), seed=7)
    model = _meta(lambda: GPT(SMALL))
    torch.manual_seed(7)
    assert materialize_module_(model, "cpu") is model
    check_no_meta(model)
    _assert_same_tensors(model, ref)
    assert model.lm_head.weight is model.wte.weight
    assert len(list(model.parameters())) == len(list(ref.parameters()))
    # the result is a working model: same logits and gradients as the eager one
    idx = torch.randint(0, SMALL.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    model.eval(), ref.eval()
    out, out_ref = model(idx), ref(idx)
    assert torch.equal(out, out_ref)
    out.square().mean().backward()
    out_ref.square().mean().backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_materialization_order_matters_negative_control():
    """The parity above is not vacuous: initialising blocks out of modules() order gives different parameters."""
    ref = _eager(lambda: GPT(SMALL), seed=7)
    model = _meta(lambda: GPT(SMALL))
    mods = list(model.modules())
    first, second = list(model.blocks[0].modules()), list(model.blocks[1].modules())
    rest = [m for m in mods if not any(m is x for x in first + second)]
    head = rest[: rest.index(model.blocks)]
    torch.manual_seed(7)
    materialize_(head + second + first + rest[len(head) :], "cpu", root=model)
    check_no_meta(model)
    assert torch.equal(model.wte.weight, ref.wte.weight)  # before the swap: same
    assert not torch.equal(model.blocks[0].attn.c_attn.weight, ref.blocks[0].attn.c_attn.weight)


@pytest.mark.parametrize("with_root", [True, False])
@pytest.mark.parametrize("unit_size", [1, 4, 9])
def test_unit_by_unit_materialization_matches_one_call(with_root, unit_size):
    ref = _eager(lambda: GPT(SMALL), seed=11)
    model = _meta(lambda: GPT(SMALL))
    mods = list(model.modules())
    units = [mods[i : i + unit_size] for i in range(0, len(mods), unit_size)]
    assert len(units) > 1
    torch.manual_seed(11)
    for i, unit in enumerate(units):
        materialize_(unit, "cpu", root=model if with_root else None)
        if i == 0 and any(m is model.wte for m in unit) and not any(m is model.lm_head for m in unit):
            # the tie: with root, every slot gets the new Parameter at once; without, the head's slot is filled
            # when the head's own unit comes
            assert (model.lm_head.weight is model.wte.weight) == with_root
            assert model.lm_head.weight.is_meta != with_root
    check_no_meta(model)
    _assert_same_tensors(model, ref)
    assert model.lm_head.weight is model.wte.weight


def test_materialize_twice_initialises_nothing_twice():
    model = _meta(lambda: GPT(SMALL))
    torch.manual_seed(0)
    materialize_module_(model, "cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params_before = [id(p) for p in model.parameters()]
    assert materialize_(list(model.modules()), "cpu", root=model) == []
    assert [id(p) for p in model.parameters()] == params_before
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


# --------------------------------------------------------------------------- a custom model: ties and buffers

V, D = 10, 6


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(V, D))
        self.weight.no_weight_decay = True  # a user tag on the Parameter object
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)


class Stats(nn.Module):
    """A frozen parameter, a random persistent buffer, an int buffer and a non-persistent computed buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(D), requires_grad=False)
        self.register_buffer("noise", torch.empty(D))
        self.register_buffer("count", torch.empty((), dtype=torch.int64))
        self.register_buffer("inv_freq", torch.empty(D // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.scale, 0.5, 1.5)
        nn.init.normal_(self.noise)
        self.count.fill_(3)
        with torch.no_grad():  # computed, e.g. a RoPE table: must be (re)computed here for meta init
            self.inv_freq.copy_(1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)))


class Head(nn.Module):
    """Owns a bias; its weight gets tied to the embedding after construction. Its reset_parameters initialises both,
    so after the tie the shared weight must keep the embedding's values (initialised once)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(V, D))
        self.bias = nn.Parameter(torch.empty(V))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=3.0)
        nn.init.uniform_(self.bias)


class TiedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = Embed()
        self.body = nn.Sequential(nn.Linear(D, D), Stats(), nn.BatchNorm1d(D))
        self.head = Head()
        self.head.weight = self.embed.weight  # tied after construction (HF-style tie_weights)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed.weight[idx]
        lin, stats, bn = self.body
        x = bn(lin(x) * stats.scale + stats.noise)
        return x @ self.head.weight.t() + self.head.bias


def test_custom_tied_model_with_buffers_is_bit_identical_to_eager():
    ref = _eager(TiedNet, seed=5)
    model = _meta(TiedNet)
    assert model.head.weight is model.embed.weight
    torch.manual_seed(5)
    materialize_module_(model, "cpu")
    check_no_meta(model)
    _assert_same_tensors(model, ref)
    assert model.head.weight is model.embed.weight
    assert isinstance(model.embed.weight, nn.Parameter) and model.embed.weight.requires_grad
    assert getattr(model.embed.weight, "no_weight_decay", False)
    stats = model.body[1]
    assert isinstance(stats.scale, nn.Parameter) and not stats.scale.requires_grad
    assert stats.count.dtype == torch.int64 and stats.count.item() == 3
    assert "body.1.inv_freq" not in model.state_dict() and "body.1.inv_freq" in dict(model.named_buffers())
    assert model.body[2].running_var.eq(1).all() and model.body[2].num_batches_tracked.dtype == torch.int64
    # independent check of the tie rule: the shared weight has the embedding's N(0, 1) values, not the head's
    # N(0, 3) ones (the head's reset_parameters ran, for the RNG stream and its bias, but was undone on the tie)
    assert model.embed.weight.std() < 2.0
    model.train()
    model(torch.tensor([1, 2, 3])).sum().backward()
    assert model.embed.weight.grad is not None and model.head.weight.grad is model.embed.weight.grad


def test_custom_model_unit_by_unit_without_root():
    ref = _eager(TiedNet, seed=2)
    model = _meta(TiedNet)
    mods = list(model.modules())
    torch.manual_seed(2)
    for m in mods:
        materialize_([m], "cpu")
    check_no_meta(model)
    _assert_same_tensors(model, ref)
    assert model.head.weight is model.embed.weight


def test_param_init_fn_replaces_reset_parameters_once_per_owner_in_order():
    model = _meta(lambda: GPT(SMALL))
    seen: list[nn.Module] = []

    def init(m: nn.Module) -> None:
        seen.append(m)
        for i, t in enumerate(list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))):
            t.fill_(len(seen) + i / 10)

    materialize_module_(model, "cpu", param_init_fn=init)
    check_no_meta(model)
    expected = [
        m for m in model.modules() if any(True for _ in m.parameters(recurse=False)) and m is not model.lm_head
    ]  # the head only holds the tied weight, already initialised by wte
    assert [id(m) for m in seen] == [id(m) for m in expected]
    assert torch.all(model.wte.weight == 1.0) and model.lm_head.weight is model.wte.weight
    assert torch.all(model.blocks[0].ln_1.bias == seen.index(model.blocks[0].ln_1) + 1 + 0.1)


# ---------------------------------------------------------------------------------------------------- errors


class NoReset(nn.Module):
    """Its value is computed from another tensor (not replayable on meta) and it has no reset_parameters()."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(3))
        with torch.no_grad():
            self.w.copy_(torch.arange(3.0) * 2)


class NeedsInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(3, 3)
        self.blocks = nn.ModuleList([nn.Linear(3, 3), NoReset()])
        self.register_buffer("mask", torch.ones(3, 3).tril())  # computed; the root has no reset_parameters either


def test_module_without_reset_parameters_is_named_and_nothing_is_allocated():
    model = _meta(NeedsInit)
    with pytest.raises(RuntimeError) as err:
        materialize_module_(model, "cpu")
    msg = str(err.value)
    assert "'blocks.1' (NoReset)" in msg and "'<root>' (NeedsInit)" in msg
    assert "reset_parameters" in msg and "param_init_fn" in msg
    assert "'first'" not in msg and "'blocks.0'" not in msg
    assert all(t.is_meta for t in model.parameters()) and model.mask.is_meta  # failed before allocating anything

    with pytest.raises(RuntimeError, match=r"'my.name' \(NoReset\)"):
        materialize_([model.blocks[1]], "cpu", names={model.blocks[1]: "my.name"})
    with pytest.raises(RuntimeError, match=r"NoReset"):
        materialize_([model.blocks[1]], "cpu")

    # the fix named in the message: a param_init_fn
    materialize_module_(model, "cpu", param_init_fn=lambda m: [t.fill_(2.0) for t in m.parameters(recurse=False)])
    check_no_meta(model)
    assert torch.all(model.blocks[1].w == 2.0)


def test_materialize_rejects_a_bare_module():
    model = _meta(lambda: GPT(SMALL))
    with pytest.raises(TypeError, match="materialize_module_"):
        materialize_(model.blocks, "cpu")  # a ModuleList is iterable: ambiguous
    with pytest.raises(TypeError, match="nn.Module items"):
        materialize_([model.wte, "x"], "cpu")


def test_check_no_meta_names_every_leftover_slot():
    model = _meta(lambda: GPT(SMALL))
    mods = list(model.modules())
    k = mods.index(model.blocks[1])
    materialize_(mods[:k], "cpu")  # without root: the head's tied slot stays meta
    with pytest.raises(RuntimeError) as err:
        check_no_meta(model)
    msg = str(err.value)
    expected_left = [n for n, p in model.named_parameters(remove_duplicate=False) if n.startswith("blocks.1.")]
    expected_left += [n for n, p in model.named_parameters(remove_duplicate=False) if n.startswith("blocks.2.")]
    expected_left += ["ln_f.weight", "ln_f.bias", "lm_head.weight"]
    assert msg.startswith(f"{len(expected_left)} parameters/buffers")
    for n in expected_left:
        assert n in msg
    assert "wte.weight" not in msg and "blocks.0." not in msg

    net = _meta(TiedNet)
    with pytest.raises(RuntimeError, match=r"body\.1\.inv_freq") as err:
        check_no_meta(net)
    assert "body.2.num_batches_tracked" in str(err.value)
    torch.manual_seed(0)
    materialize_module_(net, "cpu")
    assert check_no_meta(net) is None
