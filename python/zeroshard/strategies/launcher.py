"""The spawn/fork launcher for ZeroStrategy: Lightning's ``_MultiProcessingLauncher`` with a stage-3-safe hand-back.

At the end of ``fit``/``validate``/``test``/``predict`` Lightning's launcher calls ``lightning_module.state_dict()`` on
every rank and saves it on rank 0 only, for the main process to load. At ZeRO stage 3 that state dict holds
:class:`~zeroshard.sharding.sharded_param.ShardedParameter` placeholders, and saving (pickling) one gathers its unit, a
collective that only rank 0 would join, after the other ranks have returned. Here every rank first takes part in
:meth:`~zeroshard.engine.engine.ZeroEngine.full_state_dict` (one unit at a time, into CPU copies on rank 0), and rank 0
hands over plain tensors. Stages 1-2 (whole parameters) and runs without an engine keep Lightning's behaviour.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.trainer.states import TrainerFn


class ZeroMultiProcessingLauncher(_MultiProcessingLauncher):
    """``start_method="spawn"``/``"fork"`` (``ddp_spawn``, ``ddp_notebook``) for :class:`zeroshard.ZeroStrategy`."""

    def _collect_rank_zero_results(self, trainer, results: Any) -> _WorkerOutput | None:
        engine = getattr(self._strategy, "engine", None)
        if engine is None or engine.sharded is None:
            return super()._collect_rank_zero_results(trainer, results)
        checkpoint_callback = trainer.checkpoint_callback
        best_model_path = getattr(checkpoint_callback, "best_model_path", None) if checkpoint_callback else None
        state_dict = engine.full_state_dict()  # collective: every rank, before rank 0 goes on alone
        if self._strategy.local_rank != 0:
            return None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:  # as Lightning: a temporary file the main process loads
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, self.get_extra_results(trainer))
