"""The worker-side brain of the tap, engine-agnostic.

An engine adapter owns one `TapController` and describes each step to it as a `StepView`
(engine_worker/step.py, where the calls an adapter makes are listed). The controller loads
probe sets and steering vectors into the layers' static buffers, stages per-row steering
values before a forward and, after it, hands the step's score rows to the score formatter's
process through the shared-memory score ring (ring_copies.py): the device copies the rows
into the ring and says when they have landed; nothing in the engine process waits for them,
gathers or sends them. In capture mode it also saves residual rows for extraction.

Everything here runs on the engine thread, between steps or around a forward.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np

from probes.artifact import ProbeArtifact, ProbeFormatError, ProbeMismatchError, ServedModel, check_probe_set, load_probe
from probes.steering import SteeringVector, check_vector_set, load_vector
from engine_worker.scores.bookkeeping import (ProbeTable, ScoreBook, gather_scores, lost_message, paused_message,
                                              step_message, swapped_message)
from engine_worker.scores.ring import RingPublisher
from engine_worker.step import DeferredStep, StepView
from engine_worker.steering import SteerRequest, raw_threshold, window_rows
from engine_worker.tap.layer import LayerTap, ProbeSlot
from engine_worker.tap.ring_copies import RingTransfer
from engine_worker.tap.steer import LayerSteer, RowValues

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
        ring: RingPublisher | None = None,
        capture_dir: str | None = None,
        steers: dict[int, LayerSteer] | None = None,
        driver=None,
    ) -> None:
        """`ring`: where this rank's steps and control messages go (the score formatter reads
        it); None on a tensor-parallel rank that does not deliver (its scores equal the
        delivering rank's). `driver`: the device calls of the ring's copies (tests pass a
        recording stand-in; made from the CUDA driver on a GPU)."""
        if not taps:
            raise ValueError("TapController needs at least one tapped layer")
        if capture_dir and ring is None:
            raise ValueError("capture mode needs the score ring: only the delivering rank captures")
        self.taps = dict(sorted(taps.items()))
        self.steers = dict(sorted((steers or {}).items()))
        self.vectors: list[SteeringVector] = []
        self.vector_slots: dict[str, VectorSlot] = {}
        self.vector_version = 0
        self._steer_warned: set[tuple[str, str]] = set()
        self.served = served
        self.publish = ring.publish if ring is not None else None
        self.capture_dir = Path(capture_dir) if capture_dir else None
        self.table = ProbeTable(version=0, slots=())
        self.paused = False  # the tap switched off at run time (`set_paused`)
        self.pause_changes = 0  # how many times it was switched: orders the API servers' view of it
        self._capture_skipped: set[str] = set()  # capture requests that ran while paused: never written
        self.probes: list[ProbeArtifact] = []
        self.book = ScoreBook()
        self.steps = 0
        self._capture_requests: dict[str, dict[int, np.ndarray]] = {}
        self._capture_plan: list[tuple[str, int, int]] = []  # (req, first position, count) in capture order
        self._captures_in_step = False  # the step about to run has capture requests (`before_forward`)
        self._mid_forward_open = False  # a reserved step's forward is being enqueued
        sources = {layer: tap.scores for layer, tap in self.taps.items()}
        self.transfer = RingTransfer(sources, ring, self._ring_message, driver=driver) if ring is not None else None

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
        `python -m bench.engine`'s `tap-toggle` set-up compares the tap against within one
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
        """A control message to every API server process (through the ring and the score
        formatter), from a delivering rank:
        the one that took the request knows already, any others learn it here."""
        if self.publish is not None:
            self.publish(message)

    def listing(self) -> dict:
        return {
            "version": self.table.version,
            "paused": self.paused,
            "tapped_layers": sorted(self.taps),
            "slots_per_layer": {str(l): t.capacity for l, t in self.taps.items()},
            "capture": self.capture_dir is not None,
            "transfer": None if self.transfer is None else self.transfer.describe(),
            "steps": self.steps,
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

    def steering_rows(self, view: StepView, steering: Mapping[str, SteerRequest]) -> dict[int, RowValues]:
        """Per steered layer, this step's per-row values (only layers with a steered row appear)."""
        out: dict[int, RowValues] = {}
        if not steering:
            return out
        starts = view.row_starts
        for i, req_id in enumerate(view.req_ids):
            request = steering.get(req_id)
            if request is None or request.alpha == 0.0:
                continue
            resolved = self._resolve_steer(req_id, request)
            if resolved is None:
                continue
            rows = window_rows(request.window, int(starts[i]), int(view.num_computed[i]),
                               int(view.num_scheduled[i]), int(view.num_prompt[i]))
            values = out.get(resolved.layer)
            if values is None:
                values = out[resolved.layer] = RowValues(self.steers[resolved.layer].max_rows)
            values.set(rows, request.alpha, resolved.slot, resolved.gate_column, resolved.raw_threshold)
        return out

    # -- per step ----------------------------------------------------------------------------

    @property
    def needs_view_before_forward(self) -> bool:
        """Steering and capture rows are staged before the forward; probe scores need the
        step's view only afterwards, so adapters can build it off the launch path."""
        return bool(self.steers) or self.capture_dir is not None

    def before_forward(self, view: StepView, capture_req_ids: set[str] | frozenset = frozenset(),
                       steering: Mapping[str, SteerRequest] | None = None) -> None:
        if self.steers:
            rows = self.steering_rows(view, steering or {})
            for layer, steer in self.steers.items():
                steer.stage_rows(rows.get(layer), view.num_rows)
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
        for i, req_id in enumerate(view.req_ids):
            if req_id not in capture_req_ids:
                continue
            first, stop, first_pos = view.prompt_rows(i)
            count = min(stop - first, capacity - len(rows))
            if count <= 0:
                continue
            rows.extend(range(first, first + count))
            self._capture_plan.append((req_id, first_pos, count))
        index = np.asarray(rows, dtype=np.int64)
        for tap in self.taps.values():
            tap.set_capture_rows(index)

    def open_mid_forward_copies(self, rows: int) -> None:
        """Before the forward of a step of `rows` rows carrying a prompt chunk is enqueued:
        take the step's ring entry now, so each tapped layer's rows are copied out as soon as
        the forward has written them (`layer_scores_final`, which the model's hooks call),
        not behind the whole forward: the prompt's scores then land while the forward's
        remaining layers run. Decode steps replay whole CUDA graphs, with no point
        mid-forward where the host runs: their copies go behind the forward. The adapter
        calls `close_mid_forward_copies` once the forward is enqueued."""
        # A step of capture requests on a device is copied at once behind its forward (on the
        # CPU every copy is made at once anyway).
        host_copied = self._captures_in_step and not self.transfer.synchronous if self.transfer else False
        if self.reads_scores and not host_copied:
            self._mid_forward_open = self.transfer.reserve_step(rows)

    def layer_scores_final(self, layer: int) -> None:
        """Called from the model's forward once `layer`'s tap op is enqueued: copy its rows out
        now if a step is open for it. Cheap when none is: a decode step, a dummy run or a
        CUDA-graph capture never opens one."""
        if self._mid_forward_open:
            self.transfer.copy_layer_now(layer)

    def close_mid_forward_copies(self, launched: bool = True) -> None:
        """The step's forward is enqueued (`launched`) and its `after_forward` comes next; or
        it failed (not `launched`), and the entry set aside goes back."""
        if self._mid_forward_open:
            self._mid_forward_open = False
            if not launched:
                self.transfer.release_reservation()

    @property
    def delivers(self) -> bool:
        """False on a tensor-parallel rank other than the delivering one (which is also the only
        one that captures): its scores equal that rank's, so copying them would be work for
        nobody."""
        return self.transfer is not None

    @property
    def reads_scores(self) -> bool:
        """Steps' scores are copied out: a delivering rank whose tap is not paused."""
        return self.delivers and not self.paused

    def after_forward(self, step: StepView | DeferredStep) -> None:
        """Hand the step's score rows to the ring; returns without waiting for the device. A
        `DeferredStep`'s view is built here too, once its copies are enqueued."""
        self.steps += 1
        finished = list(step.finished)
        if (self._steer_warned or self._capture_skipped) and finished:
            self.forget(finished)
        if not self.reads_scores:
            if self.transfer is not None:
                self.transfer.release_reservation()  # paused since the step was opened: nothing to copy
            if self.paused:
                self._announce_finished(finished)
            return
        captured = None
        if self._capture_plan:
            # Capture is an offline extraction mode: a synchronous read is fine there.
            captured = {layer: tap.capture.cpu().numpy() for layer, tap in self.taps.items()}
        rows = step.rows if isinstance(step, DeferredStep) else step.num_rows
        context = (step, self.table, finished, self._capture_plan, captured)
        # A step of capture requests keeps its books here (when is a captured prompt
        # complete?): its scores are copied synchronously, as the captured rows just were.
        self.transfer.submit(rows, context, host_copy=self._captures_in_step)

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
            self.transfer.submit(0, (StepView.empty(finished), self.table, list(finished), [], None))

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until the score formatter has taken every step handed over (tests, shutdown)."""
        return True if self.transfer is None else self.transfer.flush(timeout)

    def _book_capture(self, view: StepView, table: ProbeTable, raw: np.ndarray, finished: list[str],
                      capture_plan, captured) -> Exception | None:
        """Capture mode, before the step goes out: a captured request's files are written by the
        time its response ends. A capture that fails costs no scores: its error is returned."""
        failure = None
        try:
            events = self.book.record_step(view, table, raw)
            if captured is not None:
                self._collect_capture(view, events, capture_plan, captured)
        except Exception as exc:
            failure = exc
        self.book.finish(finished)
        for req_id in finished:
            self._capture_requests.pop(req_id, None)
        return failure

    def _ring_message(self, rows: int, context, scores: dict[int, np.ndarray] | None) -> dict | None:
        """The step's message without the scores, built at its submit (the formatter gathers
        the columns from the ring slot, `slots` saying which of each layer's buffer columns is
        which probe), or None where it has nothing to say. `scores`: the host rows where they
        were copied synchronously (capture mode keeps its books with them here)."""
        step, table, finished, capture_plan, captured = context
        view = None
        try:
            view = step.view() if isinstance(step, DeferredStep) else step
            if self.capture_dir is not None:
                # The steps of capture requests come with their scores (`host_copy`; on the CPU
                # every step does) and are booked; the others only end requests here: a captured
                # prompt's rows are all in steps of capture requests.
                booked = scores is not None
                raw = (gather_scores(table, rows, scores) if booked
                       else np.zeros((0, len(table.slots)), dtype=np.float32))
                capture_failure = self._book_capture(view if booked else StepView.empty(), table, raw, finished,
                                                     capture_plan, captured)
                if capture_failure is not None:
                    log.error("probex: capturing a step's rows failed: %r", capture_failure)
            if not (view.req_ids or finished):
                return None
            message = step_message(table, view, None, list(finished), (self.pause_changes, self.paused))
            message["rows"] = rows
            message["slots"] = table.buffer_slots()
            return message
        except Exception:
            # The step's scores cannot be placed: the API servers hear of it, so its requests
            # stop waiting for scores and those that ended with it end.
            log.exception("probex: describing a step's scores failed")
            self.transfer.message_errors += 1
            requests = view.req_ids if view is not None else []
            return lost_message(list(requests), list(finished))

    def _collect_capture(self, view: StepView, events, capture_plan, captured: dict[int, np.ndarray]) -> None:
        prompt_len = dict(zip(view.req_ids, view.num_prompt.tolist()))
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
