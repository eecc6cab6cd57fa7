"""The offloaded host step for int8 optimizer state: ``_C.HostAdamPipeline``'s chunked walk, in Python.

The C++ pipeline (:mod:`zeroshard.offload.offload`) steps fp32 and bf16 moments; its segments carry no per-block
scales, so int8 state (uint8 codes + one fp32 absmax per block of 2048 elements, :mod:`zeroshard.optim.state_format`)
is stepped here with the same fused kernel through :func:`zeroshard.ops.adam_step` and the same copy queues, tickets
and double-buffered uploads. Chunks are ``chunk_elems`` rounded down to a multiple of 2048 (at least one block), and
start at block boundaries of the segment, so each chunk's absmax are a contiguous slice of the segment's and the
results equal one ``adam_step`` call over the whole segment bit for bit (each block is independent in the kernel).

Per segment: wait (host side) for its gradient copy; per chunk, the weights go either straight into ``param_out`` (the
host parameter shard, parameter offload) or into one of two staging buffers, whose upload into ``device_param`` is
enqueued on ``h2d`` while the next chunk steps (waiting first for the upload that last read that buffer). At the end
the caller's current stream waits (device side) for the last upload.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from zeroshard import _C
from zeroshard.ops import QUANT_BLOCK, adam_step

__all__ = ["QuantSegment", "QuantizedHostStep"]

_MAX_ELEM_BYTES = 4  # float32, the widest weight dtype


class QuantSegment(NamedTuple):
    """One flat parameter's int8 step.

    Attributes:
        seg: the ``_C.HostAdamPipeline`` segment tuple ``(master, exp_avg, exp_avg_sq, grad, grad_ticket, param_out,
            device_param, step, lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction, grad_unscale,
            grad_clip)``, its moments uint8 codes.
        exp_avg_absmax, exp_avg_sq_absmax: fp32 CPU tensors of ``ceil(numel / 2048)`` elements, updated in place.
    """

    seg: tuple
    exp_avg_absmax: torch.Tensor
    exp_avg_sq_absmax: torch.Tensor


class QuantizedHostStep:
    """Chunked int8 Adam step over host state, overlapped with the uploads.

    Args:
        d2h, h2d: the engine's ``_C.CopyQueue`` for gradients and weights.
        chunk_elems: elements per chunk (``offload_chunk_size``), rounded down to a multiple of 2048, at least 2048.
        pin: page-lock the two staging buffers (CUDA).

    The staging buffers (``chunk * 4`` bytes each, counted host memory) are allocated on first use.
    """

    def __init__(self, d2h, h2d, chunk_elems: int, pin: bool) -> None:
        self.d2h, self.h2d = d2h, h2d
        self.chunk = max(QUANT_BLOCK, chunk_elems // QUANT_BLOCK * QUANT_BLOCK)
        self.pin = pin
        self._upload: list[torch.Tensor | None] = [None, None]
        self._slot_ticket = [0, 0]

    def _staging(self, slot: int, dtype: torch.dtype, n: int) -> torch.Tensor:
        if self._upload[slot] is None:
            self._upload[slot] = _C.empty_host(self.chunk * _MAX_ELEM_BYTES, torch.uint8, self.pin)
        return self._upload[slot][: n * dtype.itemsize].view(dtype)

    def upload_buffer_bytes(self) -> int:
        """Bytes of the staging buffers allocated so far."""
        return sum(b.numel() for b in self._upload if b is not None)

    def step(self, segments: list[QuantSegment]) -> None:
        """One Adam step over every segment, in order. Every segment is checked first (``adam_step`` on empty views:
        dtypes, hyperparameters, absmax sizes by their own rule below); nothing is written if one fails.

        Raises:
            ValueError / TypeError / RuntimeError: as :func:`zeroshard.ops.adam_step`, or an absmax of the wrong size.
        """
        for i, s in enumerate(segments):
            self._check(i, s)
        self.h2d.wait_current_stream()  # compute may still read the old device weights
        k = 0  # chunk counter across segments: picks the staging buffer
        for s in segments:
            master, m, v, grad, ticket, param_out, device_param, *hyper = s.seg
            n = master.numel()
            master, m, v, grad = master.view(-1), m.view(-1), v.view(-1), grad.view(-1)
            kwargs = _hyper(hyper)
            self.d2h.synchronize(ticket)
            for c0 in range(0, n, self.chunk):
                length = min(self.chunk, n - c0)
                slot = k % 2
                k += 1
                out = None
                if device_param is not None:
                    self.h2d.synchronize(self._slot_ticket[slot])  # the upload that last read this buffer
                    out = self._staging(slot, device_param.dtype, length)
                elif param_out is not None:
                    out = param_out.view(-1).narrow(0, c0, length)
                b0, b1 = c0 // QUANT_BLOCK, -(-(c0 + length) // QUANT_BLOCK)
                adam_step(
                    master.narrow(0, c0, length),
                    grad.narrow(0, c0, length),
                    m.narrow(0, c0, length),
                    v.narrow(0, c0, length),
                    param_out=out,
                    exp_avg_absmax=s.exp_avg_absmax[b0:b1],
                    exp_avg_sq_absmax=s.exp_avg_sq_absmax[b0:b1],
                    **kwargs,
                )
                if device_param is not None:
                    self._slot_ticket[slot] = self.h2d.copy(device_param.view(-1).narrow(0, c0, length), out)
        self.h2d.current_stream_wait(self.h2d.last_ticket())

    @staticmethod
    def _check(i: int, s: QuantSegment) -> None:
        master, m, v, grad, _, param_out, _, *hyper = s.seg
        blocks = -(-master.numel() // QUANT_BLOCK)
        for name, t in (("exp_avg_absmax", s.exp_avg_absmax), ("exp_avg_sq_absmax", s.exp_avg_sq_absmax)):
            if t.numel() != blocks:
                raise ValueError(
                    f"int8 offload step, segment {i}: {name} has {t.numel()} elements; {master.numel()} elements "
                    f"need ceil(n / {QUANT_BLOCK}) = {blocks}"
                )
        for name, t in (("exp_avg", m), ("exp_avg_sq", v), ("grad", grad)):
            if t.numel() != master.numel():
                raise ValueError(
                    f"int8 offload step, segment {i}: {name} has {t.numel()} elements, master {master.numel()}"
                )
        empty = lambda t: t.reshape(-1)[:0]  # noqa: E731
        adam_step(
            empty(master), empty(grad), empty(m), empty(v),
            param_out=None if param_out is None else empty(param_out),
            exp_avg_absmax=s.exp_avg_absmax[:0], exp_avg_sq_absmax=s.exp_avg_sq_absmax[:0],
            **_hyper(hyper),
        )  # fmt: skip


def _hyper(h: list) -> dict:
    step, lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction, grad_unscale, grad_clip = h
    return dict(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                adamw_mode=adamw_mode, bias_correction=bias_correction, grad_unscale=grad_unscale,
                grad_clip=grad_clip)  # fmt: skip
