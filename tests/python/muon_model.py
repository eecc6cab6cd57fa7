"""The Muon tests' model, data and single-process references (imported by ``scripts/muon_runs.py`` on every rank
and by ``test_muon.py``, which computes the references in its own process, apart from the ranks' engines).

Muon on the hidden 2-D weights + AdamW on the rest (Moonlight's recipe). The reference trains single-process with
``torch.optim.Muon`` + ``torch.optim.AdamW`` on the whole global batch (accumulated micro-batches as one batch of 4x);
the row-block variant runs Newton-Schulz on each of ``world`` row blocks of every matrix, what a shard-local Muon gives
(FSDP2's ``Shard(0)``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

VOCAB, DIM, SEQ, GLOBAL = 29, 20, 6, 6  # GLOBAL: sequences per micro-batch over all ranks (2 and 3 divide it)


class Block(nn.Module):
    """Odd widths, so matrices straddle shard boundaries at 2 and 3 ranks."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, hidden)
        self.down = nn.Linear(hidden, DIM, bias=False)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class MuonNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.Sequential(Block(37), Block(43))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(idx)))


class LlamaLM(nn.Module):
    """A Hugging Face ``LlamaForCausalLM`` built from a config (no hub), returning logits; odd widths (24 hidden, 40
    MLP, grouped-query attention: k/v projections 12 x 24)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB, hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=16, bos_token_id=0, eos_token_id=1, pad_token_id=None,
            attn_implementation="eager",
        )  # fmt: skip
        self.model = LlamaForCausalLM(config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx).logits


def make_model(kind: str = "net") -> nn.Module:
    """``"net"``: :class:`MuonNet`; ``"llama"``: :class:`LlamaLM`."""
    return LlamaLM() if kind == "llama" else MuonNet()


def wrap_block(kind: str = "net") -> type[nn.Module]:
    """The stage-3 unit class of each model."""
    if kind == "llama":
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        return LlamaDecoderLayer
    return Block


def is_hidden_matrix(name: str, p: torch.Tensor) -> bool:
    """Muon's parameters: the 2-D weights inside the blocks / decoder layers (not embeddings, head or norms)."""
    return p.ndim == 2 and (name.startswith("blocks.") or ".layers." in name)


def split_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Muon: the hidden 2-D weights; AdamW: embedding, head, norms, biases (Moonlight's recipe)."""
    muon = [p for n, p in model.named_parameters() if is_hidden_matrix(n, p)]
    ids = {id(p) for p in muon}
    return muon, [p for p in model.parameters() if id(p) not in ids]


def make_optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    muon, rest = split_params(model)
    return [torch.optim.Muon(muon, lr=0.02, weight_decay=0.1), torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.01)]


def global_batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same at every world size, so runs at 2 and 3 ranks (and a 2 -> 3 resume) share one reference."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    tokens = torch.randint(0, VOCAB, (GLOBAL, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


class RowBlockMuon(torch.optim.Optimizer):
    """Muon with each matrix's Newton-Schulz run on each of ``world`` row blocks separately (each rank's local shard
    under FSDP2's ``Shard(0)``), the rest as torch's Muon: the wrong answer a shard-local Muon gives."""

    def __init__(self, params, world: int, lr: float = 0.02, weight_decay: float = 0.1, momentum: float = 0.95):
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "momentum": momentum})
        self.world = world

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
                buf.lerp_(p.grad, 1 - g["momentum"])
                update = p.grad.lerp(buf, g["momentum"])
                rows = -(-p.shape[0] // self.world)
                ortho = torch.cat([_zeropower_via_newtonschulz(u, (3.4445, -4.7750, 2.0315), 5, 1e-7)
                                   for u in update.split(rows)])  # fmt: skip
                p.mul_(1 - g["lr"] * g["weight_decay"])
                p.add_(ortho, alpha=-_adjust_lr(g["lr"], None, p.shape))


def train_reference(
    run: dict, world: int, row_blocks: bool, chunks: int = 1, per_micro_batch: bool = False
) -> dict[str, torch.Tensor]:
    """10 (``run["steps"]``) steps single-process; ``chunks`` > 1 takes each step's batch as that many backward
    passes of equal slices (the same gradient, summed in another order: the reference's own rounding noise).
    ``per_micro_batch``: Muon steps on each micro-batch's gradient (Newton-Schulz once per micro-batch instead of once
    per optimizer step: DeepSpeed issue 8443's failure under gradient accumulation), AdamW once per step."""
    torch.manual_seed(7)
    model = make_model(run.get("model", "net"))
    muon, rest = split_params(model)
    opt_m = RowBlockMuon(muon, world) if row_blocks else torch.optim.Muon(muon, lr=0.02, weight_decay=0.1)
    opt_a = torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.01)
    accumulate = run.get("accumulate", 1)
    clip = run.get("clip")
    for step in range(run.get("steps", 10)):
        batches = [global_batch(step, micro) for micro in range(accumulate)]
        if per_micro_batch:
            for x, y in batches:
                (loss_of(model, x, y) / accumulate).backward()
                if clip:
                    torch.nn.utils.clip_grad_norm_(muon, clip)
                opt_m.step()
                opt_m.zero_grad()
        else:
            x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
            for xc, yc in zip(x.chunk(chunks), y.chunk(chunks)):
                (loss_of(model, xc, yc) / chunks).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(muon, clip)
            opt_m.step()
            opt_m.zero_grad()
        if clip:
            torch.nn.utils.clip_grad_norm_(rest, clip)
        opt_a.step()
        opt_a.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].float() - b[k].float()).norm() / b[k].float().norm()) for k in b)
