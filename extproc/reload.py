"""Fleet membership without a restart: reload the fleet file on SIGHUP or when it changes, and
apply the admin API's add, remove and drain.

Every change is a new fleet document, validated whole by the fleet schema, then taken on by
`Router.reload` (unchanged replicas keep their state) and the router's shell (`ExtProcServer.
apply_fleet`: metrics, signals, the CDS file Envoy watches). A document that fails keeps the old
fleet routing: the reason is logged, counted (``gorgo_fleet_reloads_total{result="error"}``) and
returned to an admin caller. A document's ``discover:`` entries are parsed resolved (``parse``: DNS
discovery's current answers), and a changed DNS answer comes in as a new spec of the same document
(`apply_spec`). The file is watched by polling its inode, mtime and size on the
router's loop (an atomic rename is a new inode), so no watcher dependency is needed. The file is
the source of truth: an admin change lasts until the file's document changes (a touch or a copy
of the same document is none), or a SIGHUP or the admin API reads the file again.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from extproc.telemetry import RouterMetrics, log_event
from gorgo.core.fleet import FleetError, FleetSpec, ip_literal, parse_yaml, read_fleet
from gorgo.core.membership import FleetDiff
from gorgo.core.router import Router

log = logging.getLogger("gorgo.reload")
POLL_INTERVAL_S = 1.0  # how often the fleet file's identity is checked


Stamp = tuple[int, int, int]  # a file's inode, mtime (ns) and size


def file_stamp(path: Path) -> Stamp | None:
    """The file's identity as the watch compares it (None: it cannot be read)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


class FleetReloader:
    """Owns the fleet document the router runs; ``apply`` takes a validated spec on."""

    def __init__(self, router: Router, metrics: RouterMetrics,
                 apply: Callable[[FleetSpec], FleetDiff], path: str | os.PathLike[str] | None,
                 parse: Callable[[Any, str], FleetSpec],
                 adopted: Callable[[Any, FleetSpec], None] | None = None,
                 start: tuple[Any, Stamp | None] | None = None) -> None:
        """``parse`` validates a document (resolving its ``discover:`` entries); ``adopted`` is
        told of each document taken on (DNS discovery re-resolves its names); ``start``: the
        document the router's fleet was parsed from and the file's stamp taken before it was
        read (default: the file read now), so an edit made while the router started is taken
        on at the first poll (it was read here, reported as running and never applied)."""
        self.router = router
        self.metrics = metrics
        self._apply = apply
        self._parse = parse
        self._adopted = adopted
        self.path = None if path is None else Path(path)
        if start is not None:
            self.doc, self._stamp = start
        elif self.path is not None:
            self._stamp = file_stamp(self.path)
            self.doc = read_fleet(self.path)
        else:
            self.doc, self._stamp = None, None
        # The document last read from the file: one read again the same (touched, or copied over
        # with the same content) is not a change, and the admin API's changes stand.
        self._file_doc: Any = self.doc
        self.last_error: str | None = None
        self.reloads = 0

    def status(self) -> dict[str, Any]:
        s = self.router.state
        replicas = [{
            "name": r.name, "address": r.address, "region": r.region, "cluster": r.cluster,
            "models": list(r.models), "draining": bool(s.draining[i]),
            "healthy": bool(s.healthy[i]), "inflight": int(s.inflight_reqs[i]),
            "rtt_ms": None if s.rtt_ms[i] != s.rtt_ms[i] else float(s.rtt_ms[i]),
            "rtt_samples": int(s.rtt_samples[i]), "prefix_blocks": s.prefix.blocks_held(i),
        } for i, r in enumerate(self.router.spec.replicas)]
        return {"fleet": self.router.spec.name, "file": str(self.path) if self.path else None,
                "generation": self.router.generation, "reloads": self.reloads,
                "last_error": self.last_error, "models": list(self.router.spec.models),
                "replicas": replicas}

    def _failed(self, reason: str, exc: Exception) -> None:
        self.last_error = str(exc)
        self.metrics.fleet_reloads.labels("error").inc()
        log_event(log, "fleet_reload_failed", logging.ERROR, reason=reason, error=str(exc))

    def apply_doc(self, doc: Any, reason: str) -> FleetDiff:
        """Validate and take on ``doc``; a FleetError leaves the running fleet as it was."""
        source = self.path.name if self.path is not None else "fleet"
        try:
            spec = self._parse(doc, source)
        except FleetError as exc:
            self._failed(reason, exc)
            raise
        return self.apply_spec(doc, spec, reason)

    def apply_spec(self, doc: Any, spec: FleetSpec, reason: str) -> FleetDiff:
        """Take on ``spec``, parsed from ``doc`` (a DNS answer changed: the running document
        with new answers); a FleetError leaves the running fleet as it was."""
        retried = self.router.spec.retries.enabled
        try:
            diff = self._apply(spec)
        except FleetError as exc:
            self._failed(reason, exc)
            raise
        if retried and not spec.retries.enabled:
            # Off by default once a replica is reached by a DNS name (Envoy's override-host
            # list matches IP:port): an admin add of one switched them off with nothing said.
            named = next((r.address for r in spec.replicas if not ip_literal(r.host)), None)
            log_event(log, "retries_off", logging.WARNING, reason=reason,
                      cause=f"replica address {named}" if named else "retries.enabled: false")
        self.doc, self.last_error = doc, None
        if self._adopted is not None:
            self._adopted(doc, spec)
        self.reloads += 1
        self.metrics.fleet_reloads.labels("applied" if diff.changed else "unchanged").inc()
        log_event(log, "fleet_reloaded", reason=reason, replicas=len(spec.replicas),
                  added=",".join(diff.added), removed=",".join(diff.removed),
                  generation=self.router.generation)
        return diff

    def reload_file(self, reason: str, if_changed: bool = False) -> FleetDiff | None:
        """Read the fleet file again and take it on (SIGHUP, a change, the admin API); with
        ``if_changed``, only if it reads otherwise than it last did (None: the same)."""
        if self.path is None:
            raise FleetError("fleet: this router has no fleet file to reload")
        self._stamp = file_stamp(self.path)
        try:
            doc = read_fleet(self.path)
        except FleetError as exc:
            self._failed(reason, exc)
            raise
        if if_changed and doc == self._file_doc:
            return None
        diff = self.apply_doc(doc, reason)
        self._file_doc = doc
        return diff

    def document(self) -> dict[str, Any]:
        """The document the router runs (the file with the admin changes since), as YAML text,
        and the identity of the file it last read (None: it has none)."""
        if self.doc is None:
            raise FleetError("fleet: this router has no fleet file")
        return {"document": yaml.safe_dump(self.doc, sort_keys=False),
                "file_stamp": None if self._stamp is None else list(self._stamp)}

    def adopt(self, text: str, file_stamp: Stamp | None) -> FleetDiff:
        """Take on another router's `document` (a restarted worker, its peers'): with its
        ``file_stamp``, a file this router read and the other had not yet is read again at
        the next poll, as the other will."""
        if self.doc is None:
            raise FleetError("fleet: this router has no fleet file to change")
        try:
            doc = parse_yaml(text)
        except ValueError as exc:
            raise FleetError(f"document: {exc}") from None
        diff = self.apply_doc(doc, "admin document")
        if file_stamp is not None:
            if file_stamp != self._stamp:  # the other read another file: what it held, unknown
                self._file_doc = None
            self._stamp = file_stamp
        return diff

    def poll(self) -> None:
        """Reload when the file is another file (inode: an atomic rename) or was rewritten."""
        if self.path is None:
            return
        stamp = file_stamp(self.path)
        if stamp is not None and stamp != self._stamp:
            try:
                self.reload_file("file changed", if_changed=True)
            except FleetError:  # logged and counted; the old fleet stays
                pass
            except Exception as exc:  # a bug in a reload must not end the watch: the old fleet
                self._failed("file changed", exc)  # stays, and the next change is read again
                log.exception("fleet reload raised %s", type(exc).__name__)

    # --- admin changes: each is a new document, validated whole ---------------------------------

    def _replicas(self) -> tuple[dict[str, Any], list[Any]]:
        if self.doc is None:
            raise FleetError("fleet: this router has no fleet file to change")
        doc = copy.deepcopy(self.doc)
        return doc, doc["replicas"]

    def _find(self, replicas: list[Any], name: str) -> int:
        for i, raw in enumerate(replicas):
            if isinstance(raw, dict) and raw.get("name") == name:
                return i
        if any(r.name == name for r in self.router.spec.replicas):
            raise FleetError(f"{name}: discovered from a DNS name, not listed in the fleet file: "
                             "drain or remove its discover: entry by that entry's name, or take "
                             "the pod out of the DNS answer (a pod that is not ready leaves a "
                             "headless Service's)")
        raise KeyError(name)

    def add(self, raw: Any) -> FleetDiff:
        doc, replicas = self._replicas()
        replicas.append(raw)
        return self.apply_doc(doc, "admin add")

    def remove(self, name: str) -> FleetDiff:
        doc, replicas = self._replicas()
        del replicas[self._find(replicas, name)]
        return self.apply_doc(doc, "admin remove")

    def drain(self, name: str, drain: bool) -> FleetDiff:
        doc, replicas = self._replicas()
        replicas[self._find(replicas, name)]["drain"] = drain
        return self.apply_doc(doc, "admin drain" if drain else "admin undrain")
