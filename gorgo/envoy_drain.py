"""`gorgo envoy-drain`: let a local Envoy finish its requests before it is stopped.

Envoy exits at once on SIGTERM, cutting every request it carries, and a Kubernetes pod's
containers all get SIGTERM together. So the gateway pod (deploy/kubernetes/sidecar.yaml) runs
this as the router container's preStop hook: it starts Envoy's graceful drain (listeners stay
open, but every connection is told to close after its request: HTTP/1 ``Connection: close``,
HTTP/2 GOAWAY, so clients move to the pods still serving), waits until Envoy holds no request
(after ``--min-s``, the time the pod's removal from the Service takes to reach the clients) or
``--timeout-s`` passed, then writes ``--done-file``. Envoy's own preStop hook waits for that file,
so Envoy gets its SIGTERM only once drained; the router's comes after this hook, so it routes
every request the drain lets finish.

Exit 0: drained; 1: timed out with requests still open (the hook's failure shows in the pod's
events); 2: Envoy's admin cannot be reached (then Envoy is gone or the address is wrong). The
done file is written in every case, so Envoy's hook never waits past this one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from gorgo.errors import UserError

POLL_S = 0.5


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--admin", default="127.0.0.1:9901", metavar="HOST:PORT",
                   help="Envoy's admin address (default %(default)s)")
    p.add_argument("--min-s", type=float, default=5.0,
                   help="wait at least this long, for the pod's removal from its Service to "
                        "reach the clients (default %(default)s)")
    p.add_argument("--timeout-s", type=float, default=300.0,
                   help="stop waiting after this long, requests still open or not; keep it "
                        "under the pod's terminationGracePeriodSeconds (default %(default)s)")
    p.add_argument("--done-file", type=Path, default=None,
                   help="written when this command ends, for Envoy's own preStop hook to wait on")


def _admin(base: str, path: str, method: str = "GET") -> bytes:
    req = urllib.request.Request(base + path, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.read()
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise UserError(f"cannot reach Envoy's admin at {base}{path}: {reason}") from None


def open_requests(base: str) -> int:
    """Requests Envoy's listeners carry now: every HTTP connection manager's
    ``downstream_rq_active`` but the admin's own."""
    data = json.loads(_admin(base, "/stats?format=json&filter=downstream_rq_active$"))
    return sum(int(s.get("value", 0)) for s in data.get("stats", ())
               if isinstance(s, dict) and str(s.get("name", "")).startswith("http.")
               and not str(s.get("name", "")).startswith("http.admin."))


def main(args: argparse.Namespace) -> int:
    base = args.admin if "://" in args.admin else f"http://{args.admin}"
    base = base.rstrip("/")
    t0 = time.monotonic()
    try:  # whatever happens, the done file: Envoy's own hook waits on it
        if not (0 <= args.min_s <= args.timeout_s):
            raise UserError("need 0 <= --min-s <= --timeout-s")
        _admin(base, "/drain_listeners?graceful", "POST")
        while True:
            waited = time.monotonic() - t0
            left = open_requests(base)
            if left == 0 and waited >= args.min_s:
                print(f"envoy drained after {waited:.1f} s", file=sys.stderr)
                return 0
            if waited >= args.timeout_s:
                print(f"envoy still carries {left} requests after {waited:.1f} s: stopping it "
                      "anyway", file=sys.stderr)
                return 1
            time.sleep(POLL_S)
    finally:
        if args.done_file is not None:
            args.done_file.parent.mkdir(parents=True, exist_ok=True)
            args.done_file.touch()
