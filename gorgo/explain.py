"""`gorgo explain`: each replica's cost terms for one request, and why the winner won.

With ``--router`` it asks a running `gorgo extproc` (its live RTTs, queues and prefix index);
otherwise it builds the fleet's state from the fleet file alone, pricing each replica's RTT at its
region's configured link RTT, as a what-if.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.request
from pathlib import Path

from gorgo.core.explain import Explanation, explain
from gorgo.core.features import RequestError, extract_features
from gorgo.core.fleet import load_fleet
from gorgo.core.router import Router


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fleet", help="fleet YAML (offline what-if)")
    p.add_argument("--router", help="URL of a running router's HTTP port, e.g. http://127.0.0.1:9100")
    p.add_argument("--token-file", help="admin token file for --router (or env GORGO_ADMIN_TOKEN)")
    p.add_argument("--body", default="-", help="request JSON body file (default stdin)")
    p.add_argument("--path", default="/v1/chat/completions", help="request path")
    p.add_argument("--header", action="append", default=[], help="request header K:V")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _headers(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        k, _, v = pair.partition(":")
        out[k.strip().lower()] = v.strip()
    return out


def offline(fleet: str, path: str, headers: dict[str, str], body: bytes) -> Explanation:
    spec = load_fleet(fleet)
    router = Router(spec)
    rtt = {r.name: r.rtt_ms for r in spec.regions}
    for i, replica in enumerate(spec.replicas):
        router.state.observe_rtt(i, rtt[replica.region])
    return explain(router, extract_features(path, headers, body, router.state.tok), 0.0)


def live(url: str, token: str, path: str, headers: dict[str, str], body: bytes) -> dict:
    payload = json.dumps({"path": path, "headers": headers, "body": body.decode()}).encode()
    req = urllib.request.Request(
        url.rstrip("/") + "/admin/explain", data=payload, method="POST",
        headers={"authorization": f"Bearer {token}", "content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def main(args: argparse.Namespace) -> int:
    body = sys.stdin.buffer.read() if args.body == "-" else Path(args.body).read_bytes()
    headers = _headers(args.header)
    try:
        if args.router:
            token = os.environ.get("GORGO_ADMIN_TOKEN", "")
            if args.token_file:
                token = Path(args.token_file).read_text().strip()
            result = live(args.router, token, args.path, headers, body)
            print(json.dumps(result, indent=2))
            return 0
        if not args.fleet:
            print("gorgo explain: give --fleet or --router", file=sys.stderr)
            return 2
        exp = offline(args.fleet, args.path, headers, body)
    except RequestError as err:
        print(json.dumps(err.to_body()), file=sys.stderr)
        return 1
    print(json.dumps(exp.to_dict(), indent=2) if args.json else exp.table())
    return 0
