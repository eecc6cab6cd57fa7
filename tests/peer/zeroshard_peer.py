"""pytest plugin: run Lightning's own tests with zeroshard in place of Lightning's DDP.

Loaded with ``-p zeroshard_peer`` (``tests/peer`` on ``PYTHONPATH``) and configured by ``ZEROSHARD_PEER_STAGE``:
``ddp`` or unset (the baseline: nothing substituted) or a ZeRO stage (``1``, ``2``, ``3``).

What it substitutes, and where. Lightning turns every way a test can ask for DDP (the strings ``"ddp"``,
``"ddp_spawn"``, ``"ddp_fork"``, ``"ddp_notebook"``, ``"ddp_find_unused_parameters_true"``..., ``"auto"`` with
several CPU devices, or a ``DDPStrategy(...)`` instance) into a strategy object in one place: the connector's
``_init_strategy`` (``lightning/pytorch/trainer/connectors/accelerator_connector.py`` for the Trainer,
``lightning/fabric/connector.py`` for Fabric). Wrapping that method covers every form without touching Lightning's
test files: when it produced exactly Lightning's ``DDPStrategy`` (not a test's own subclass, which tests DDP itself),
the plugin replaces it with ``ZeroStrategy``/``ZeroFabricStrategy`` at the configured stage. The launcher's start
method is kept (popen / spawn / fork), as are accelerator, parallel devices, cluster environment, checkpoint IO,
precision plugin, process group backend and timeout; DDP-only settings (``find_unused_parameters``, ``static_graph``,
comm hooks, ...) have no meaning without ``DistributedDataParallel`` and are dropped. The connector then fills in
the rest (devices, precision, num_nodes) as it does for DDP.

The processes a test starts get the substitution too: the popen launcher re-runs ``python -m pytest ...`` per rank
with the same arguments and environment (so this plugin and the stage come along), and spawn/fork children receive
the strategy object already built.

With ``ZEROSHARD_PEER_RECORD=<file>`` it also appends one JSON line per substitution, per launch of 2+ processes and
per test outcome, from every process (every config, the baseline included), so the runner can tell a multi-process
test from one that only builds a Trainer, confirm that a stage run did use zeroshard, and read each rank's outcome.
"""

from __future__ import annotations

import functools
import json
import os
import re

STAGE_ENV = "ZEROSHARD_PEER_STAGE"
RECORD_ENV = "ZEROSHARD_PEER_RECORD"


def stage_from_env() -> int | None:
    """The ZeRO stage to substitute, or None for the DDP baseline."""
    value = os.environ.get(STAGE_ENV, "ddp").strip().lower()
    if value in ("", "ddp"):
        return None
    if value not in ("1", "2", "3"):
        raise ValueError(f"{STAGE_ENV} must be ddp, 1, 2 or 3, got {value!r}")
    return int(value)


def _record(event: str, **fields) -> None:
    path = os.environ.get(RECORD_ENV)
    if path:
        line = json.dumps({"event": event, "pid": os.getpid(), "rank": os.environ.get("LOCAL_RANK"), **fields})
        with open(path, "a") as f:  # one short append per event: whole lines even with several processes
            f.write(line + "\n")


def _common_arguments(ddp) -> dict:
    """What a DDPStrategy carries that ZeRO keeps (attributes set by DDPStrategy.__init__ in Lightning 2.6)."""
    return dict(
        accelerator=ddp._accelerator,
        parallel_devices=ddp.parallel_devices,
        cluster_environment=ddp.cluster_environment,
        checkpoint_io=ddp._checkpoint_io,
        process_group_backend=ddp._process_group_backend,
        timeout=ddp._timeout,
        start_method=ddp._start_method,
    )


def trainer_strategy(ddp, stage: int):
    """``lightning.pytorch.strategies.DDPStrategy`` -> ``zeroshard.ZeroStrategy`` at ``stage``."""
    from zeroshard import ZeroStrategy

    strategy = ZeroStrategy(stage=stage, precision_plugin=ddp._precision_plugin, **_common_arguments(ddp))
    _record("substituted", api="trainer", stage=stage, start_method=ddp._start_method, dropped=sorted(ddp._ddp_kwargs))
    return strategy


def fabric_strategy(ddp, stage: int):
    """``lightning.fabric.strategies.DDPStrategy`` -> ``zeroshard.ZeroFabricStrategy`` at ``stage``."""
    from zeroshard import ZeroFabricStrategy

    strategy = ZeroFabricStrategy(stage=stage, precision=ddp._precision, **_common_arguments(ddp))
    _record("substituted", api="fabric", stage=stage, start_method=ddp._start_method, dropped=sorted(ddp._ddp_kwargs))
    return strategy


def _wrap_init_strategy(connector_cls, ddp_cls, convert, stage: int):
    original = connector_cls._init_strategy

    @functools.wraps(original)
    def _init_strategy(self) -> None:
        original(self)
        if type(self.strategy) is ddp_cls:
            self.strategy = convert(self.strategy, stage)

    connector_cls._init_strategy = _init_strategy
    return original


def _wrap_launch(launcher_cls, api: str) -> None:
    original = launcher_cls.launch

    @functools.wraps(original)
    def launch(self, *args, **kwargs):
        processes = getattr(self, "num_processes", None) or self._strategy.num_processes
        if processes >= 2:
            _record("launch", api=api, launcher=type(self).__name__, processes=processes)
        return original(self, *args, **kwargs)

    launcher_cls.launch = launch


def substitute(stage: int) -> dict:
    """Make the Trainer's and Fabric's connectors build zeroshard instead of DDP. Returns what to restore."""
    from lightning.fabric.connector import _Connector
    from lightning.fabric.strategies import DDPStrategy as FabricDDP
    from lightning.pytorch.strategies import DDPStrategy as TrainerDDP
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    return {
        _AcceleratorConnector: _wrap_init_strategy(_AcceleratorConnector, TrainerDDP, trainer_strategy, stage),
        _Connector: _wrap_init_strategy(_Connector, FabricDDP, fabric_strategy, stage),
    }


def restore(originals: dict) -> None:
    """Undo :func:`substitute` (for the plugin's own unit test)."""
    for connector_cls, original in originals.items():
        connector_cls._init_strategy = original


def record_launches() -> None:
    from lightning.fabric.strategies.launchers import multiprocessing as fabric_mp
    from lightning.fabric.strategies.launchers import subprocess_script as fabric_script
    from lightning.pytorch.strategies.launchers import multiprocessing as trainer_mp
    from lightning.pytorch.strategies.launchers import subprocess_script as trainer_script

    _wrap_launch(trainer_mp._MultiProcessingLauncher, "trainer")
    _wrap_launch(trainer_script._SubprocessScriptLauncher, "trainer")
    _wrap_launch(fabric_mp._MultiProcessingLauncher, "fabric")
    _wrap_launch(fabric_script._SubprocessScriptLauncher, "fabric")


def error_line(message: str) -> str:
    """The line of a failure message that names the error: the last ``SomethingError: ...`` line (a spawned rank's
    own error comes last in Lightning's ``ProcessRaisedException``), else the first line. A bare ``AssertionError``
    gets the place and statement that raised it from the traceback above it."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    named = [i for i, line in enumerate(lines) if re.match(r"^[\w.]*(Error|Exception|Exit|Interrupt|Failed)\b", line)]
    if not named:
        return lines[0][:300] if lines else ""
    line = lines[named[-1]]
    if ":" not in line:
        frames = [i for i in range(named[-1]) if lines[i].startswith("File ")]
        if frames and frames[-1] + 1 < named[-1]:
            where = re.match(r'File "(?:.*/)?([^/"]+)", line (\d+)', lines[frames[-1]])
            place = f"{where[1]}:{where[2]} " if where else ""
            line += f" ({place}`{lines[frames[-1] + 1]}`)"
    return line[:300]


def pytest_configure(config) -> None:
    stage = stage_from_env()
    if stage is not None:
        substitute(stage)
    if os.environ.get(RECORD_ENV):
        record_launches()


def pytest_runtest_logreport(report) -> None:
    """With recording on: each phase's outcome, per process (the runner reads the outcome from these, not from the
    output, which the ranks of a popen-launched test share)."""
    if not os.environ.get(RECORD_ENV) or (report.when != "call" and report.outcome == "passed"):
        return
    crash = getattr(report.longrepr, "reprcrash", None)
    message = crash.message if crash is not None else str(report.longrepr or "")
    outcome = "xfailed" if hasattr(report, "wasxfail") else report.outcome
    _record("report", when=report.when, outcome=outcome, error=error_line(message) if report.failed else "")
