"""Where an engine thread's time goes, phase by phase: a running sum of wall seconds per phase.

Served speed is decided as much by the host's work around a model step as by the step itself
(scheduling, building the step's input tensors, sampling, turning tokens into outputs and
handing them to the server's event loop, and waiting for work). :class:`StepPhases` is one
clock the engine thread carries through an iteration: each :meth:`StepPhases.lap` charges the
seconds since the previous lap to one phase. The engine core charges its own phases
(``schedule``, ``inputs``, ``forward``, ``sample``, ``postprocess``), the worker's engine loop
the ones around them (``commands``, ``outputs``, ``publish``, ``idle``); the worker exports the
sums as ``tandem:engine_thread_seconds_total{phase}`` so a profile is two scrapes apart.

It costs two ``perf_counter`` calls and a dict update per lap (well under a microsecond each),
so it is always on. Only the engine thread writes; readers on other threads may see a sum one
lap old, never a torn value (each sum is one float swapped in place).
"""

from __future__ import annotations

from time import perf_counter

ENGINE_PHASES = ("schedule", "inputs", "forward", "sample", "postprocess")
"""Phases of one :meth:`LLMEngine.step <services.engine.core.engine.LLMEngine.step>`:
choosing the batch, building its input tensors and attention metadata, the model's forward
pass and logits, the sampler, and appending tokens / stop checks / prefix-cache updates."""

LOOP_PHASES = ("commands", "outputs", "publish", "idle")
"""Phases of the worker's engine loop around a step: applying queued commands, text and
delivery of outputs to the server's event loop, publishing stats, and waiting for work."""


class StepPhases:
    """Wall seconds per phase, summed over the thread's life (see the module docstring)."""

    def __init__(self, phases: tuple[str, ...] = ENGINE_PHASES + LOOP_PHASES) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(phases, 0.0)
        self.steps = 0  # steps that ran a batch
        self._mark = perf_counter()

    def start(self) -> None:
        """Begin timing from now (the time since the last lap is charged to nothing)."""
        self._mark = perf_counter()

    def lap(self, phase: str) -> None:
        """Charge the seconds since the previous lap (or :meth:`start`) to ``phase``."""
        now = perf_counter()
        self.seconds[phase] += now - self._mark
        self._mark = now

    def read(self) -> tuple[dict[str, float], int]:
        """The sums and the number of steps that ran a batch (safe from any thread)."""
        return dict(self.seconds), self.steps
