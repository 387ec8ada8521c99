"""The worker-side brain of the tap, engine-agnostic.

A runner adapter owns one `TapController`; it describes each step as a `StepLayout`
and calls `before_forward` / `after_forward`. The controller loads probe sets into the
layer taps' static buffers, turns the step's raw scores into events, publishes them and,
in capture mode, saves residual rows for extraction.

Threads: `load`, `before_forward` and `after_forward` run on the engine thread;
everything that reads scores (bookkeeping, capture files, publishing) runs on the
`ScoreTransfer` thread, in step order, so the engine never waits for the device.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable

import numpy as np

from probes.artifact import ProbeArtifact, ProbeFormatError, ProbeMismatchError, ServedModel, check_probe_set, load_probe
from engine_worker.bookkeeping import ProbeTable, ScoreBook, StepLayout
from engine_worker.score_transfer import ScoreTransfer, StagedStep
from engine_worker.tap import LayerTap, ProbeSlot

log = logging.getLogger("probex.controller")


class ProbeSetRejected(ValueError):
    """A probe set that cannot be served by this worker; the old set stays loaded."""


class TapController:
    def __init__(
        self,
        taps: dict[int, LayerTap],
        served: ServedModel,
        publish: Callable[[dict], None] | None = None,
        capture_dir: str | None = None,
        threaded: bool = True,
    ) -> None:
        if not taps:
            raise ValueError("TapController needs at least one tapped layer")
        self.taps = dict(sorted(taps.items()))
        self.served = served
        self.publish = publish
        self.capture_dir = Path(capture_dir) if capture_dir else None
        self.table = ProbeTable(version=0, slots=())
        self.probes: list[ProbeArtifact] = []
        self.book = ScoreBook()
        self.steps = 0
        self._capture_requests: dict[str, dict[int, np.ndarray]] = {}
        self._capture_plan: list[tuple[str, int, int]] = []  # (req, first position, count) in capture order
        self.transfer = ScoreTransfer({layer: tap.scores for layer, tap in self.taps.items()},
                                      self._consume_step, threaded=threaded)

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
        log.info("probex: loaded probe set v%d: %s", self.table.version, ", ".join(self.table.names) or "(empty)")
        return self.table

    def listing(self) -> dict:
        return {
            "version": self.table.version,
            "tapped_layers": sorted(self.taps),
            "slots_per_layer": {str(l): t.capacity for l, t in self.taps.items()},
            "capture": self.capture_dir is not None,
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

    # -- per step ----------------------------------------------------------------------------

    def before_forward(self, layout: StepLayout, capture_req_ids: set[str] | frozenset = frozenset()) -> None:
        self._capture_plan = []
        if self.capture_dir is None or not capture_req_ids:
            return
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

    def after_forward(self, layout: StepLayout, finished: set[str] | list[str] = ()) -> None:
        """Hand the step to the transfer thread; returns without waiting for the device."""
        self.steps += 1
        captured = None
        if self._capture_plan:
            # Capture is an offline extraction mode: a synchronous read is fine there.
            captured = {layer: tap.capture.cpu().numpy() for layer, tap in self.taps.items()}
        context = (layout, self.table, list(finished), self._capture_plan, captured)
        self.transfer.submit(layout.num_rows, context)

    def after_idle_step(self, finished: set[str] | list[str]) -> None:
        """A step that ran no forward still ends requests; their bookkeeping must be released."""
        self.transfer.submit(0, (StepLayout.empty(), self.table, list(finished), [], None))

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every submitted step has been processed and published."""
        return self.transfer.flush(timeout)

    def _consume_step(self, step: StagedStep) -> None:
        layout, table, finished, capture_plan, captured = step.context
        raw = self.book.gather(table, step.rows, step.scores())
        events = self.book.record_step(layout, table, raw)
        if captured is not None:
            self._collect_capture(layout, events, capture_plan, captured)
        events.finished = self.book.finish(finished)
        for req_id in finished:
            self._capture_requests.pop(req_id, None)
        if events and self.publish is not None:
            self.publish(
                {
                    "v": table.version,
                    "probes": table.describe(),
                    "prompt": events.prompt,
                    "tokens": events.tokens,
                    "finished": events.finished,
                }
            )

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
