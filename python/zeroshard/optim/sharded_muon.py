"""ShardedMuon: ``torch.optim.Muon`` over ZeRO master shards, each matrix's Newton-Schulz on one owner rank.

Muon's step per 2-D parameter (torch's ``_single_tensor_muon``; Jordan 2024, Liu et al. 2025 "Muon is Scalable"):
``B <- lerp(B, G, 1 - mu)``, ``U = lerp(G, B, mu)`` (Nesterov) or ``B``, ``O = NS(U)`` (Newton-Schulz in bf16, on the
whole matrix), ``W <- W (1 - lr wd)``, ``W <- W - adjust_lr(lr, shape) O``. Only ``NS`` needs the whole matrix; every
other operation is element-wise. So:

* the momentum ``B`` stays sharded like SGD's (one fp32 element per parameter element, in the master shard's layout):
  ZeRO's 1/N state memory, no owner imbalance, and checkpoints reshard it as any per-element state;
* each rank computes ``U`` on its shard, rounds it to bf16 (``NS``'s first operation, so exact) and sends each piece
  to the matrix's owner (one all-to-all); the owner runs torch's own ``_zeropower_via_newtonschulz`` on the whole
  matrix and sends each piece of ``O`` (bf16, as torch produces it) back to the rank whose shard holds it (a second
  all-to-all); each rank then applies the element-wise update to its master shard.

Why an all-to-all of shard pieces rather than a reduce of the whole gradient to its owner: the gradient reduce-scatter
runs for every flat parameter anyway (it also feeds clipping and accumulation), so after it each element of a matrix
crosses the wire once, in bf16: rank ``r`` sends ``2 * (elements of other owners' matrices in its shard)`` bytes and
receives ``2 * (elements of its own matrices in other shards)``; over all ranks ``2 * sum_k (numel_k - own_k)`` bytes
per direction (``own_k``: the part of matrix ``k`` in its owner's shard). A reduce to the owner instead of the
reduce-scatter would send every rank's whole fp32 matrix to it: ``4 * (N - 1) * numel_k`` bytes into one rank.
DeepSpeed's design (all-gather on every rank, each rank runs every Newton-Schulz) all-gathers fp32:
``4 * numel_k * (N - 1) / N`` per rank and matrix, and N times the FLOPs.

Owners: :func:`zeroshard.sharding.owner_assignment.assign_owners` (balanced Newton-Schulz FLOPs).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.optim import Optimizer
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz  # torch's own, so the math is torch's

from zeroshard.sharding.flat_param import FlatParam
from zeroshard.sharding.matrix_exchange import AllToAllStats, all_to_all_pieces
from zeroshard.sharding.owner_assignment import Piece, assign_owners, ns_flops, pieces_by_rank


class Matrix(NamedTuple):
    """One 2-D parameter of a flat parameter: its name, shape, master shard, owner rank and piece per rank."""

    name: str
    shape: tuple[int, int]
    master: torch.nn.Parameter
    owner: int
    pieces: list[Piece | None]


class ShardedMuon(Optimizer):
    """``torch.optim.Muon`` stepping this rank's master shards (module docstring for the algorithm and traffic).

    Args:
        muon: the user's ``torch.optim.Muon``, already rewired onto master shards (its param groups, hyperparameters
            and any LR scheduler's entries are copied; its state must be empty).
        flat_params: the flat parameters whose masters ``muon``'s groups hold (every parameter 2-D).
        group: the shard process group (ranks that hold one shard each of those flat parameters).
        stats: where the two all-to-alls are counted (``engine.comm_stats()["groups"]["matrix"]``).

    Attributes:
        matrices: every matrix, in param-group then flat order (the order of every exchange).
        owned: the matrices this rank runs Newton-Schulz for.

    State per master shard: ``momentum_buffer`` (fp32, the shard's shape; padding stays zero).

    Raises:
        ValueError: a parameter that is not 2-D.
    """

    def __init__(
        self,
        muon: Optimizer,
        flat_params: list[FlatParam],
        group: dist.ProcessGroup | None,
        stats: AllToAllStats | None = None,
    ) -> None:
        super().__init__([dict(g) for g in muon.param_groups], dict(muon.defaults))
        self.group = group
        self.stats = stats
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        flat_of = {id(fp.master): fp for fp in flat_params}
        found: list[tuple[str, tuple[int, int], torch.nn.Parameter, list[Piece | None]]] = []
        for g in self.param_groups:
            for master in g["params"]:
                fp = flat_of[id(master)]
                layout = fp.layout
                for name, shape, offset, numel in zip(fp.names, fp.shapes, layout.offsets, layout.numels):
                    if len(shape) != 2:
                        raise ValueError(f"ShardedMuon: {name} has shape {shape}; Muon steps 2-D parameters only")
                    pieces = pieces_by_rank(offset, numel, layout.shard_numel, self.world_size)
                    found.append((name, shape, master, pieces))
        owners = assign_owners([shape for _, shape, _, _ in found], self.world_size)
        self.matrices = [Matrix(n, s, m, o, p) for (n, s, m, p), o in zip(found, owners)]
        self.owned = [m for m in self.matrices if m.owner == self.rank]

    @torch.no_grad()
    def step(self, closure=None):
        """One Muon step of every matrix whose master has a gradient (collective over the shard group).

        Every rank must call it together: which matrices take part is decided by ``master.grad is None``, the same
        on every rank after a synchronised backward.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        hyper = {id(p): g for g in self.param_groups for p in g["params"]}
        updates: dict[int, torch.Tensor] = {}
        for g in self.param_groups:
            for master in g["params"]:
                if master.grad is None:
                    continue
                state = self.state[master]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(master.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(master.grad, 1 - g["momentum"])
                update = master.grad.lerp(buf, g["momentum"]) if g["nesterov"] else buf
                updates[id(master)] = update.bfloat16()  # Newton-Schulz's first operation: exact
        active = [m for m in self.matrices if id(m.master) in updates]
        if not active:
            return loss
        me, world = self.rank, self.world_size
        device = active[0].master.device

        # 1. pieces of U (bf16) to each matrix's owner
        send: list[list[torch.Tensor]] = [[] for _ in range(world)]
        recv_numels = [0] * world
        for m in active:
            piece = m.pieces[me]
            if piece is not None:
                send[m.owner].append(updates[id(m.master)][piece.shard_offset : piece.shard_offset + piece.numel])
            if m.owner == me:
                for r, p in enumerate(m.pieces):
                    recv_numels[r] += p.numel if p is not None else 0
        received = all_to_all_pieces(_cat(send, device), recv_numels, self.group, self.stats)

        # 2. the owner's Newton-Schulz on each whole matrix; pieces of O back to the shard holders
        read = [0] * world
        back: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for m in active:
            if m.owner != me:
                continue
            whole = torch.empty(m.shape[0] * m.shape[1], dtype=torch.bfloat16, device=device)
            for r, p in enumerate(m.pieces):
                if p is not None:
                    whole[p.start : p.start + p.numel] = received[r][read[r] : read[r] + p.numel]
                    read[r] += p.numel
            g = hyper[id(m.master)]
            ortho = _zeropower_via_newtonschulz(whole.view(m.shape), g["ns_coefficients"], g["ns_steps"], g["eps"])
            ortho = ortho.reshape(-1)
            for r, p in enumerate(m.pieces):
                if p is not None:
                    back[r].append(ortho[p.start : p.start + p.numel])
        mine = [0] * world
        for m in active:
            piece = m.pieces[me]
            mine[m.owner] += piece.numel if piece is not None else 0
        returned = all_to_all_pieces(_cat(back, device), mine, self.group, self.stats)

        # 3. the element-wise update of this rank's pieces, in torch's order and operations
        read = [0] * world
        for m in active:
            piece = m.pieces[me]
            if piece is None:
                continue
            g = hyper[id(m.master)]
            lr = float(g["lr"])
            o = returned[m.owner][read[m.owner] : read[m.owner] + piece.numel]
            read[m.owner] += piece.numel
            w = m.master.detach()[piece.shard_offset : piece.shard_offset + piece.numel]
            w.mul_(1 - lr * g["weight_decay"])
            w.add_(o, alpha=-_adjust_lr(lr, g["adjust_lr_fn"], torch.Size(m.shape)))
        return loss

    def owned_flops(self, steps: int | None = None) -> list[int]:
        """Newton-Schulz FLOPs each rank runs per step (:func:`~zeroshard.sharding.owner_assignment.ns_flops`)."""
        steps = steps if steps is not None else self.defaults["ns_steps"]
        out = [0] * self.world_size
        for m in self.matrices:
            out[m.owner] += ns_flops(m.shape, steps)
        return out


def _cat(chunks: list[list[torch.Tensor]], device: torch.device) -> list[torch.Tensor]:
    return [torch.cat(c) if c else torch.empty(0, dtype=torch.bfloat16, device=device) for c in chunks]
