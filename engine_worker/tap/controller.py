"""The worker-side brain of the tap, engine-agnostic.

A runner adapter owns one `TapController`; it describes each step as a `StepLayout`
and calls `before_forward` / `after_forward`. The controller loads probe sets into the
layer taps' static buffers, turns the step's raw scores into events, publishes them and,
in capture mode, saves residual rows for extraction.

Threads: `load`, `before_forward` and `after_forward` run on the engine thread;
everything that reads scores (bookkeeping, capture files, publishing) runs, in step order,
once the step's copies have landed, so the engine never waits for the device: on the
`ScoreTransfer` thread, or (the engine consumer, the default on one GPU) on the engine
thread where it finds them landed.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from probes.artifact import ProbeArtifact, ProbeFormatError, ProbeMismatchError, ServedModel, check_probe_set, load_probe
from probes.steering import SteeringVector, check_vector_set, load_vector
from engine_worker.scores.bookkeeping import (ProbeTable, ScoreBook, StepLayout, gather_scores, lost_message, paused_message,
                                       step_message, swapped_message)
from engine_worker.tap.ring_copies import RingTransfer
from engine_worker.scores.ring import RingPublisher
from engine_worker.tap.cuda_driver import LARGE_STEP_ROWS, ScoreTransfer, StagedStep
from engine_worker.step_timing import ENV_STEP_TIMING, StepTimer, step_timing_enabled, step_timing_min_rows
from engine_worker.tap.steer import LayerSteer, RowValues
from engine_worker.steering import SteerRequest, raw_threshold, window_rows
from engine_worker.tap.layer import LayerTap, ProbeSlot
from engine_worker.tap.config import (ENV_COPY_STREAM, ENV_SCORE_CONSUMER, hook_spin_s, prompt_scores_mid_forward,
                                      scores_ahead_of_tokens)

log = logging.getLogger("probex.controller")


class ProbeSetRejected(ValueError):
    """A probe set that cannot be served by this worker; the old set stays loaded."""


class VectorSetRejected(ValueError):
    """A steering-vector set that cannot be served by this worker; the old set stays loaded."""


@dataclass(frozen=True)
class VectorSlot:
    name: str
    layer: int
    slot: int
    digest: str


@dataclass(frozen=True)
class _ResolvedSteer:
    layer: int
    slot: int
    gate_column: int | None
    raw_threshold: float


class TapController:
    def __init__(
        self,
        taps: dict[int, LayerTap],
        served: ServedModel,
        publish: Callable[[dict], None] | None = None,
        capture_dir: str | None = None,
        threaded: bool = True,
        steers: dict[int, LayerSteer] | None = None,
        consumer: str = "thread",
        ring: RingPublisher | None = None,
    ) -> None:
        """`consumer`: who consumes each step's scores once its copies land ("thread" or
        "engine", see score_transfer.py), unless PROBEX_SCORE_CONSUMER says otherwise. The
        runner adapter picks it: "engine" only where it calls `consume_scores_through` and
        `consume_landed_scores` around the engine's read of a step's sampled tokens.
        `ring`: hand each step to the score formatter's process through this shared-memory
        ring instead (ring_transfer.py): nobody in the engine process consumes, and control
        messages go through the ring too (`publish` is then the ring's)."""
        if not taps:
            raise ValueError("TapController needs at least one tapped layer")
        self.taps = dict(sorted(taps.items()))
        self.steers = dict(sorted((steers or {}).items()))
        self.vectors: list[SteeringVector] = []
        self.vector_slots: dict[str, VectorSlot] = {}
        self.vector_version = 0
        self._steer_warned: set[tuple[str, str]] = set()
        self.served = served
        self.publish = ring.publish if ring is not None else publish
        self.capture_dir = Path(capture_dir) if capture_dir else None
        self.table = ProbeTable(version=0, slots=())
        self.paused = False  # the tap switched off at run time (`set_paused`)
        self.pause_changes = 0  # how many times it was switched: orders the API servers' view of it
        self._capture_skipped: set[str] = set()  # capture requests that ran while paused: never written
        self.probes: list[ProbeArtifact] = []
        self.book = ScoreBook()
        self.steps = 0
        # Time the runner adapters spend in ProbeX code on the engine thread (layout, buffer
        # staging, hand-off), summed: what the tap adds to the host side of every step.
        self.engine_thread_s = 0.0
        self.layout_s = 0.0  # the part of it spent reading the step's layout from the runner
        self.token_reads = TokenReads()  # engine consumer: vLLM's wait for each step's tokens after its scores
        self.consume_parts = ConsumeParts()  # where each step's consume goes (`_consume_step`)
        self._capture_requests: dict[str, dict[int, np.ndarray]] = {}
        self._capture_plan: list[tuple[str, int, int]] = []  # (req, first position, count) in capture order
        self._captures_in_step = False  # the step about to run has capture requests (`before_forward`)
        self._hook_spin_s = hook_spin_s()  # PROBEX_HOOK_SPIN_US, a diagnostic; 0 otherwise
        self.scores_ahead_of_tokens = scores_ahead_of_tokens()  # PROBEX_SCORES_AHEAD_OF_TOKENS=0: a diagnostic
        # PROBEX_PROMPT_SCORES_MID_FORWARD (on unless "0"): see `open_mid_forward_copies`.
        self.prompt_scores_mid_forward = prompt_scores_mid_forward()
        self._mid_forward_open = False  # a reserved step's forward is being enqueued
        # PROBEX_STEP_TIMING=1, a diagnostic: the device span of every prompt-sized forward
        # (step_timing.py); the runner adapters time the forwards, `step_timings` reads them.
        device = next(iter(self.taps.values())).scores.device
        self.step_timer = StepTimer(device, step_timing_min_rows()) if step_timing_enabled() else None
        sources = {layer: tap.scores for layer, tap in self.taps.items()}
        self._ring = ring
        if ring is not None:
            self.transfer = RingTransfer(sources, ring, self._ring_message)
        else:
            self.transfer = ScoreTransfer(sources, self._consume_step, threaded=threaded,
                                          copy_stream=os.environ.get(ENV_COPY_STREAM, "same"),
                                          consumer=os.environ.get(ENV_SCORE_CONSUMER, "").strip().lower() or consumer)

    # -- probe sets ------------------------------------------------------------------------

    def validate(self, probe_dirs: list[str]) -> list[ProbeArtifact]:
        try:
            probes = [load_probe(d, self.served) for d in probe_dirs]
            check_probe_set(probes)
        except (ProbeFormatError, ProbeMismatchError) as exc:
            raise ProbeSetRejected(str(exc)) from None
        per_layer: dict[int, int] = {}
        for probe in probes:
            if probe.layer not in self.taps:
                raise ProbeSetRejected(
                    f"{probe.source}: probe {probe.name!r} reads layer {probe.layer}, but this worker taps only"
                    f" layers {sorted(self.taps)} (fixed at startup; restart the worker with that layer tapped)"
                )
            per_layer[probe.layer] = per_layer.get(probe.layer, 0) + 1
        for layer, count in per_layer.items():
            if count > self.taps[layer].capacity:
                raise ProbeSetRejected(
                    f"{count} probes at layer {layer} exceed the {self.taps[layer].capacity} slots fixed at startup"
                )
        return probes

    def load(self, probe_dirs: list[str]) -> ProbeTable:
        """Validate, then copy into the static buffers. On any error nothing changes."""
        probes = self.validate(probe_dirs)
        slots: list[ProbeSlot] = []
        for layer, tap in self.taps.items():
            here = [p for p in probes if p.layer == layer]
            weights = np.stack([p.weight for p in here]) if here else np.zeros((0, tap.hidden_size), np.float32)
            tap.load(weights, np.asarray([p.bias for p in here], dtype=np.float32))
            slots += [ProbeSlot(p.name, layer, i, p.read.value, p.slope, p.intercept) for i, p in enumerate(here)]
        self.probes = probes
        self.table = ProbeTable(version=self.table.version + 1, slots=tuple(slots))
        self._announce(swapped_message("probes", self.table.version, list(probe_dirs)))
        log.info("probex: loaded probe set v%d: %s", self.table.version, ", ".join(self.table.names) or "(empty)")
        return self.table

    def set_paused(self, paused: bool) -> None:
        """Switch the tap off (or on again) without a restart: its kernels return at once and no
        step's scores are copied, booked or sent (requests that end are still announced), so a
        paused worker serves as plain vLLM does but for the kernels' empty launches (what
        `probex bench engine`'s `tap-toggle` set-up compares the tap against within one
        start). Steps already handed over are still consumed. Refused where steering is
        configured (its gates read the tap's scores in the graph) and while a capture is being
        written; capture requests made while paused are refused by the API server, and one
        that runs while paused anyway (sent before) is never written, not written in part.
        Called between engine steps on the engine thread, so the flags' fill is queued on the
        stream the next forward runs on."""
        if self.steers:
            raise ValueError("the tap cannot be paused on a worker that steers: steering gates read its scores")
        if paused and self._capture_requests:
            raise ValueError("a capture is being written; pause the tap once it has finished")
        for tap in self.taps.values():
            tap.set_paused(paused)
        self.paused = bool(paused)
        self.pause_changes += 1
        self._announce(paused_message(self.paused, self.pause_changes))
        log.info("probex: tap %s", "paused" if self.paused else "running")

    def _announce(self, message: dict) -> None:
        """A control message to every API server process (delivery.py), from a delivering rank:
        the one that took the request knows already, any others learn it here."""
        if self.publish is not None:
            self.publish(message)

    def step_timings(self, after: int = -1) -> dict:
        """The timed forwards numbered above `after` (PROBEX_STEP_TIMING=1; step_timing.py)."""
        if self.step_timer is None:
            raise ValueError(f"forwards are not timed on this worker: start it with {ENV_STEP_TIMING}=1")
        return self.step_timer.records(after)

    def listing(self) -> dict:
        return {
            "version": self.table.version,
            "paused": self.paused,
            "tapped_layers": sorted(self.taps),
            "slots_per_layer": {str(l): t.capacity for l, t in self.taps.items()},
            "capture": self.capture_dir is not None,
            "transfer": {**self.transfer.describe(), "scores_ahead_of_tokens": self.scores_ahead_of_tokens,
                         "prompt_scores_mid_forward": self.prompt_scores_mid_forward,
                         "consume_parts": self.consume_parts.as_dict()},
            "engine_thread": {"steps": self.steps, "hook_s": self.engine_thread_s, "layout_s": self.layout_s,
                              "token_reads": self.token_reads.as_dict()},
            "step_timing": None if self.step_timer is None else {"min_rows": self.step_timer.min_rows,
                                                                 "recorded": self.step_timer.recorded},
            "probes": [
                {
                    "name": p.name,
                    "layer": p.layer,
                    "read": p.read.value,
                    "calibration": {"slope": p.slope, "intercept": p.intercept},
                    "source": str(p.source) if p.source else None,
                }
                for p in self.probes
            ],
        }

    # -- steering vectors ------------------------------------------------------------------------

    def validate_vectors(self, vector_dirs: list[str]) -> list[SteeringVector]:
        try:
            vectors = [load_vector(d, self.served) for d in vector_dirs]
            check_vector_set(vectors)
        except (ProbeFormatError, ProbeMismatchError) as exc:
            raise VectorSetRejected(str(exc)) from None
        per_layer: dict[int, int] = {}
        for vector in vectors:
            if vector.layer not in self.steers:
                raise VectorSetRejected(
                    f"{vector.source}: steering vector {vector.name!r} is for layer {vector.layer}, but this worker"
                    f" steers only layers {sorted(self.steers)} (fixed at startup; restart with --steer-layer"
                    f" {vector.layer})"
                )
            per_layer[vector.layer] = per_layer.get(vector.layer, 0) + 1
        for layer, count in per_layer.items():
            if count > self.steers[layer].capacity:
                raise VectorSetRejected(f"{count} steering vectors at layer {layer} exceed the"
                                        f" {self.steers[layer].capacity} slots fixed at startup")
        return vectors

    def load_vectors(self, vector_dirs: list[str]) -> dict:
        """Validate, then copy into the vector tables in place. On any error nothing changes."""
        vectors = self.validate_vectors(vector_dirs)
        slots: dict[str, VectorSlot] = {}
        for layer, steer in self.steers.items():
            here = [v for v in vectors if v.layer == layer]
            table = np.stack([v.vector for v in here]) if here else np.zeros((0, steer.hidden_size), np.float32)
            steer.load(table)
            slots.update({v.name: VectorSlot(v.name, layer, i, v.digest) for i, v in enumerate(here)})
        self.vectors, self.vector_slots = vectors, slots
        self.vector_version += 1
        self._announce(swapped_message("steering", self.vector_version))
        log.info("probex: loaded steering vectors v%d: %s", self.vector_version, ", ".join(slots) or "(empty)")
        return self.steering_listing()

    def steering_listing(self) -> dict:
        return {
            "version": self.vector_version,
            "steer_layers": sorted(self.steers),
            "slots_per_layer": {str(l): s.capacity for l, s in self.steers.items()},
            "gate_layers": {str(l): s.gate_layers for l, s in self.steers.items()},
            "vectors": [
                {"name": v.name, "layer": v.layer, "digest": v.digest, "norm": float(np.linalg.norm(v.vector)),
                 "source": str(v.source) if v.source else None}
                for v in self.vectors
            ],
        }

    def _resolve_steer(self, req_id: str, request: SteerRequest) -> _ResolvedSteer | None:
        """Where this request's vector and gate live now; None (and a warning, once) if they do not.

        The middleware refuses requests naming unknown vectors or gates; this covers a
        swap that removed one while the request was running: it then runs unsteered.
        """
        vector = self.vector_slots.get(request.vector)
        if vector is None:
            return self._steer_warning(req_id, f"steering vector {request.vector!r} is not loaded")
        if request.gate is None:
            return _ResolvedSteer(vector.layer, vector.slot, None, 0.0)
        slot = next((s for s in self.table.slots if s.name == request.gate), None)
        if slot is None:
            return self._steer_warning(req_id, f"gate probe {request.gate!r} is not loaded")
        column = self.steers[vector.layer].gate_column(slot.layer, slot.slot)
        if column is None:
            return self._steer_warning(req_id, f"gate probe {request.gate!r} (layer {slot.layer}) is not readable"
                                               f" at steering layer {vector.layer}")
        try:
            threshold = raw_threshold(request.threshold, slot.slope, slot.intercept)
        except ValueError as exc:
            return self._steer_warning(req_id, f"gate probe {request.gate!r}: {exc}")
        return _ResolvedSteer(vector.layer, vector.slot, column, threshold)

    def _steer_warning(self, req_id: str, problem: str) -> None:
        if (req_id, problem) not in self._steer_warned:
            self._steer_warned.add((req_id, problem))
            log.warning("probex: request %s runs unsteered: %s", req_id, problem)
        return None

    def steering_rows(self, layout: StepLayout, steering: Mapping[str, SteerRequest]) -> dict[int, RowValues]:
        """Per steered layer, this step's per-row values (only layers with a steered row appear)."""
        out: dict[int, RowValues] = {}
        if not steering:
            return out
        starts = layout.row_starts
        for i, req_id in enumerate(layout.req_ids):
            request = steering.get(req_id)
            if request is None or request.alpha == 0.0:
                continue
            resolved = self._resolve_steer(req_id, request)
            if resolved is None:
                continue
            rows = window_rows(request.window, int(starts[i]), int(layout.num_computed[i]),
                               int(layout.num_scheduled[i]), int(layout.num_prompt[i]))
            values = out.get(resolved.layer)
            if values is None:
                values = out[resolved.layer] = RowValues(self.steers[resolved.layer].max_rows)
            values.set(rows, request.alpha, resolved.slot, resolved.gate_column, resolved.raw_threshold)
        return out

    # -- per step ----------------------------------------------------------------------------

    @property
    def needs_layout_before_forward(self) -> bool:
        """Steering and capture rows are staged before the forward; probe scores need the
        layout only afterwards, so adapters can build it off the pre-launch path."""
        return bool(self.steers) or self.capture_dir is not None

    def before_forward(self, layout: StepLayout, capture_req_ids: set[str] | frozenset = frozenset(),
                       steering: Mapping[str, SteerRequest] | None = None) -> None:
        if self.steers:
            rows = self.steering_rows(layout, steering or {})
            for layer, steer in self.steers.items():
                steer.stage_rows(rows.get(layer), layout.num_rows)
        self._capture_plan = []
        self._captures_in_step = False
        if self.capture_dir is None or not capture_req_ids:
            return
        if self.paused:  # nothing is captured while paused, and what began then is never written
            self._capture_skipped.update(capture_req_ids)
            return
        if self._capture_skipped:
            capture_req_ids = {r for r in capture_req_ids if r not in self._capture_skipped}
        self._captures_in_step = bool(capture_req_ids)
        rows: list[int] = []
        capacity = next(iter(self.taps.values())).capture_index.shape[0]
        for i, req_id in enumerate(layout.req_ids):
            if req_id not in capture_req_ids:
                continue
            first, stop, first_pos = layout.prompt_rows(i)
            count = min(stop - first, capacity - len(rows))
            if count <= 0:
                continue
            rows.extend(range(first, first + count))
            self._capture_plan.append((req_id, first_pos, count))
        index = np.asarray(rows, dtype=np.int64)
        for tap in self.taps.values():
            tap.set_capture_rows(index)

    def open_mid_forward_copies(self, rows: int) -> None:
        """On the engine thread, before the forward of a real step of `rows` rows carrying a
        prompt chunk (some request has more than one row; the adapter tells) is enqueued:
        set a staging buffer aside so each tapped layer's rows are copied out as soon as the
        forward has written them (`layer_scores_final`, which the model's hooks call), not
        behind the whole forward. The step's consume (layout, gather, publish: 0.2 ms on the
        GPU hosts) then waits only for the last tapped layer and overlaps the forward's
        remaining layers instead of sitting between the forward and the step's first token.
        Decode steps keep the copies behind the forward: their graphs replay whole, with no
        point mid-forward where the host runs. The adapter calls `close_mid_forward_copies`
        once the forward is enqueued."""
        # Not for a step of capture requests on a device: through the score ring such a step is
        # copied at once behind its forward (on the CPU every copy is made at once anyway).
        host_copied = self._ring is not None and self._captures_in_step and not self.transfer.synchronous
        if self.prompt_scores_mid_forward and self.reads_scores and not host_copied:
            self._mid_forward_open = self.transfer.reserve_step(rows)

    def layer_scores_final(self, layer: int) -> None:
        """Called from the model's forward, on the engine thread, once `layer`'s tap op is
        enqueued (where the next decoder layer's attention runs from Python): copy its rows out
        now if a step is open for it. Cheap when none is: a decode step, a dummy run or a
        CUDA-graph capture never opens one."""
        if self._mid_forward_open:  # inside the forward: the adapters' hook time does not hold it
            started = time.perf_counter()
            self.transfer.copy_layer_now(layer)
            self.engine_thread_s += time.perf_counter() - started

    def close_mid_forward_copies(self, launched: bool = True) -> None:
        """The step's forward is enqueued (`launched`) and its `after_forward` comes next; or
        it failed (not `launched`), and the buffer set aside goes back."""
        if self._mid_forward_open:
            self._mid_forward_open = False
            if not launched:
                self.transfer.release_reservation()

    def before_forward_launch(self) -> None:
        """Before any forward is enqueued (real or dummy): with side-stream copies, the forward
        must not overwrite the score buffers before the last copy out of them has run."""
        self.transfer.before_next_forward()

    @property
    def consumes_on_engine_thread(self) -> bool:
        """The engine thread consumes the scores: the runner adapter calls
        `consume_scores_through` (before) and `consume_landed_scores` (after) where the
        engine reads a step's sampled tokens."""
        return self.transfer.consumer == "engine" and self.reads_scores

    def consume_landed_scores(self) -> None:
        started = time.perf_counter()
        self.transfer.consume_landed()
        self.engine_thread_s += time.perf_counter() - started

    def scores_step_mark(self) -> int:
        """The latest step handed to the transfer: what `consume_scores_through` waits for."""
        return self.transfer.submitted_steps

    def consume_scores_through(self, mark: int) -> None:
        """Consume the steps up to `mark` (`scores_step_mark`), waiting for their copies; the
        wait (GIL released, in place of vLLM's own wait for the tokens) is not counted as
        engine-thread time."""
        started, waited = time.perf_counter(), self.transfer.device_wait_s
        self.transfer.consume_through(mark)
        self.engine_thread_s += time.perf_counter() - started - (self.transfer.device_wait_s - waited)

    def tokens_read(self, wait_s: float) -> None:
        """vLLM read a step's sampled tokens `wait_s` after its scores were consumed (engine
        consumer): booked by the size of the step consumed last."""
        self.token_reads.add(wait_s, self.transfer.last_consumed_rows > LARGE_STEP_ROWS)

    @property
    def delivers(self) -> bool:
        """False on a tensor-parallel rank other than the delivering one (which is also the only
        one that captures): its scores equal that rank's, so copying them to the host would be
        work for nobody."""
        return self.publish is not None or self.capture_dir is not None

    @property
    def reads_scores(self) -> bool:
        """Steps' scores are copied out and consumed: a delivering rank whose tap is not paused."""
        return self.delivers and not self.paused

    def after_forward(self, layout: StepLayout | Callable[[], StepLayout], finished: set[str] | list[str] = (),
                      num_rows: int | None = None) -> None:
        """Stage the step's score copies and hand it to its consumer; returns without waiting
        for the device.

        `layout` may be a function that builds it, with the step's `num_rows`: it is then
        called by the consumer once the copies have landed, keeping the hook to the copies
        and the hand-off. It must read only values the engine does not change afterwards
        (the runner's per-step arrays, or snapshots of shared ones).
        """
        self.steps += 1
        if (self._steer_warned or self._capture_skipped) and finished:
            self.forget(finished)
        if not self.reads_scores:
            self.transfer.release_reservation()  # paused since the step was opened: nothing to copy
            if self.paused:
                self._announce_finished(finished)
            return
        captured = None
        if self._capture_plan:
            # Capture is an offline extraction mode: a synchronous read is fine there.
            captured = {layer: tap.capture.cpu().numpy() for layer, tap in self.taps.items()}
        if num_rows is None:
            if not isinstance(layout, StepLayout):
                raise TypeError("after_forward: a layout handed over as a function needs the step's num_rows")
            num_rows = layout.num_rows
        context = (layout, self.table, list(finished), self._capture_plan, captured)
        if self._ring is not None:
            # A step of capture requests keeps its books here (when is a captured prompt
            # complete?): its scores are copied synchronously, as the captured rows just were.
            self.transfer.submit(num_rows, context, host_copy=self._captures_in_step)
        else:
            self.transfer.submit(num_rows, context)
        if self._hook_spin_s:
            spin_until = time.perf_counter() + self._hook_spin_s
            while time.perf_counter() < spin_until:
                pass

    def forget(self, finished: set[str] | list[str]) -> None:
        for req_id in finished:
            for key in [k for k in self._steer_warned if k[0] == req_id]:
                self._steer_warned.discard(key)
            self._capture_skipped.discard(req_id)

    def after_idle_step(self, finished: set[str] | list[str]) -> None:
        """A step that ran no forward still ends requests; their bookkeeping must be released."""
        if self._steer_warned or self._capture_skipped:
            self.forget(finished)
        self._announce_finished(finished)

    def _announce_finished(self, finished: set[str] | list[str]) -> None:
        """A step of no rows that only ends requests (their books on both sides are released),
        on a delivering rank; paused or not."""
        if finished and self.delivers:
            self.transfer.submit(0, (StepLayout.empty(), self.table, list(finished), [], None))

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every submitted step has been processed and published."""
        return self.transfer.flush(timeout)

    def _consume_step(self, step: StagedStep) -> None:
        """On the scores' consumer (engine or transfer thread): the step's raw block goes out
        as it is (`step_message`); the API server keeps the books. Only capture mode keeps
        books here too, to know when a captured prompt is complete."""
        layout, table, finished, capture_plan, captured = step.context
        published = False
        # A prompt-sized step's consume is on its first token's way: its thread's CPU time beside
        # its wall time tells a slow consume (cold caches, a slow core) from one kept waiting
        # (for the GIL, or descheduled). Not for every step: the clock is a system call.
        began_on_cpu = time.thread_time() if step.rows > LARGE_STEP_ROWS else None
        try:
            began = time.perf_counter()
            if not isinstance(layout, StepLayout):
                layout = self._build_layout(layout, step.rows)
            laid_out = time.perf_counter()
            raw = gather_scores(table, step.rows, step.scores())
            gathered = time.perf_counter()
            capture_failure = None
            if self.capture_dir is not None:
                capture_failure = self._book_capture(layout, table, raw, finished, capture_plan, captured)
            if self.publish is not None and (layout.req_ids or finished):
                # Read in this order: the engine thread sets `paused` before counting the change.
                pause = (self.pause_changes, self.paused)
                building = time.perf_counter()  # capture's work, if any, is not a part
                message = step_message(table, layout, raw, list(finished), pause)
                built = time.perf_counter()
                self.publish(message)
                sent = time.perf_counter()
                on_cpu = time.thread_time() - began_on_cpu if began_on_cpu is not None else None
                self.consume_parts.add(step.rows, laid_out - began, gathered - laid_out, built - building,
                                       sent - built, cpu_s=on_cpu)
            published = True
            if capture_failure is not None:
                raise capture_failure
        except Exception:
            # The step's scores could not be placed or sent. The API servers hear of it, so the
            # step's requests stop waiting for scores, those that ended with it end, and it
            # counts as a consume error.
            if self.publish is not None and not published:
                requests = layout.req_ids if isinstance(layout, StepLayout) else []
                self.publish(lost_message(list(requests), list(finished)))
            raise

    def _book_capture(self, layout: StepLayout, table: ProbeTable, raw: np.ndarray, finished: list[str],
                      capture_plan, captured) -> Exception | None:
        """Capture mode, before the step goes out: a captured request's files are written by the
        time its response ends. A capture that fails costs no scores: its error is returned."""
        failure = None
        try:
            events = self.book.record_step(layout, table, raw)
            if captured is not None:
                self._collect_capture(layout, events, capture_plan, captured)
        except Exception as exc:
            failure = exc
        self.book.finish(finished)
        for req_id in finished:
            self._capture_requests.pop(req_id, None)
        return failure

    def _ring_message(self, rows: int, context, scores: dict[int, np.ndarray] | None) -> dict | None:
        """The ring's consumer-less counterpart of `_consume_step`, on the engine thread at the
        step's submit: its message without the scores (the formatter gathers the columns from
        the slot, `slots` saying which of each layer's buffer columns is which probe), or None
        where it has nothing to say. `scores`: the host rows where they were copied
        synchronously (capture mode keeps its books with them here)."""
        layout, table, finished, capture_plan, captured = context
        try:
            if not isinstance(layout, StepLayout):
                layout = self._build_layout(layout, rows)
            if self.capture_dir is not None:
                # The steps of capture requests come with their scores (`host_copy`; on the CPU
                # every step does) and are booked; the others only end requests here: a captured
                # prompt's rows are all in steps of capture requests.
                booked = scores is not None
                raw = (gather_scores(table, rows, scores) if booked
                       else np.zeros((0, len(table.slots)), dtype=np.float32))
                capture_failure = self._book_capture(layout if booked else StepLayout.empty(), table, raw, finished,
                                                     capture_plan, captured)
                if capture_failure is not None:
                    log.error("probex: capturing a step's rows failed: %r", capture_failure)
            if not (layout.req_ids or finished):
                return None
            message = step_message(table, layout, None, list(finished), (self.pause_changes, self.paused))
            message["rows"] = rows
            message["slots"] = table.buffer_slots()
            return message
        except Exception:
            # The step's scores cannot be placed: the API servers hear of it, so its requests
            # stop waiting for scores and those that ended with it end.
            log.exception("probex: describing a step's scores failed")
            self.transfer.message_errors += 1
            requests = layout.req_ids if isinstance(layout, StepLayout) else []
            return lost_message(list(requests), list(finished))

    @staticmethod
    def _build_layout(build: Callable[[], StepLayout], rows: int) -> StepLayout:
        """A layout handed over as a function, built here, off the engine thread; one that
        disagrees with the rows copied cannot place the step's scores."""
        layout = build()
        if layout.num_rows != rows:
            raise ValueError(f"the step's layout has {layout.num_rows} rows, {rows} were copied")
        return layout

    def _collect_capture(self, layout: StepLayout, events, capture_plan, captured: dict[int, np.ndarray]) -> None:
        prompt_len = dict(zip(layout.req_ids, layout.num_prompt.tolist()))
        offset = 0
        for req_id, first_pos, count in capture_plan:
            store = self._capture_requests.get(req_id)
            if store is None:
                store = self._capture_requests[req_id] = {
                    layer: np.full((prompt_len[req_id], tap.hidden_size), np.nan, np.float32)
                    for layer, tap in self.taps.items()
                }
            for layer, rows in captured.items():
                store[layer][first_pos : first_pos + count] = rows[offset : offset + count]
            offset += count
        for summary in events.prompt:
            store = self._capture_requests.pop(summary["req"], None)
            if store is not None:
                self._write_capture(summary["req"], store)

    def _write_capture(self, req_id: str, store: dict[int, np.ndarray]) -> None:
        from safetensors.numpy import save_file

        self.capture_dir.mkdir(parents=True, exist_ok=True)
        final = self.capture_dir / f"{req_id}.safetensors"
        partial = final.with_suffix(".partial")
        save_file({f"layer_{layer}": rows for layer, rows in store.items()}, str(partial))
        os.replace(partial, final)


# A read of the tokens this soon after the scores' consume found them ready: the device had
# finished sampling before the consume did, so the consume held the step's output back.
TOKENS_READY_S = 50e-6


class ConsumeParts:
    """Where a published step's consume goes, on whichever thread consumes: the layout built
    (where the runner adapter left that to the consumer), the scores gathered into probe
    columns, the message built, and its publishing (encoding and the socket's send). Split
    apart for steps of more than LARGE_STEP_ROWS rows (prefill chunks, on a first token's way),
    with, for those, the consuming thread's CPU time. Sums and counts; readers take
    differences between snapshots."""

    PARTS = ("layout", "gather", "message", "publish")

    def __init__(self) -> None:
        self.count = self.large_count = 0
        self.sums = dict.fromkeys(self.PARTS, 0.0)
        self.large_sums = dict.fromkeys(self.PARTS, 0.0)
        # The consuming thread's CPU time over the same span (capture's work, if any, included),
        # prefill-sized steps only.
        self.large_cpu_s = 0.0

    def add(self, rows: int, *seconds: float, cpu_s: float | None = None) -> None:
        self.count += 1
        for part, value in zip(self.PARTS, seconds):
            self.sums[part] += value
        if rows > LARGE_STEP_ROWS:
            self.large_count += 1
            for part, value in zip(self.PARTS, seconds):
                self.large_sums[part] += value
            self.large_cpu_s += cpu_s or 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {"count": self.count, "large_count": self.large_count,
                **{f"{part}_s": value for part, value in self.sums.items()},
                **{f"large_{part}_s": value for part, value in self.large_sums.items()},
                "large_cpu_s": self.large_cpu_s}


class TokenReads:
    """How long vLLM waited for each step's sampled tokens after the engine consumer had booked
    and sent that step's scores (`scores_with_sampled_tokens`). The consume runs while the device
    samples; where the tokens were ready by its end (`ready`: read within TOKENS_READY_S), the
    consume was on the step's way out, and on a first token's way for a prefill (`large`:
    steps of more than LARGE_STEP_ROWS rows). Sums and counts; readers take differences."""

    def __init__(self) -> None:
        self.count = self.ready = self.large_count = self.large_ready = 0
        self.wait_s = self.large_wait_s = 0.0

    def add(self, wait_s: float, large: bool) -> None:
        ready = wait_s < TOKENS_READY_S
        self.count += 1
        self.wait_s += wait_s
        self.ready += ready
        if large:
            self.large_count += 1
            self.large_wait_s += wait_s
            self.large_ready += ready

    def as_dict(self) -> dict[str, float | int]:
        return {"count": self.count, "wait_s": self.wait_s, "ready": self.ready, "large_count": self.large_count,
                "large_wait_s": self.large_wait_s, "large_ready": self.large_ready}
