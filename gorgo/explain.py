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
import urllib.error
import urllib.request
from pathlib import Path

from gorgo.core.explain import Explanation, explain
from gorgo.core.features import RequestError, extract_features
from gorgo.core.fleet import FleetSpec, load_fleet
from gorgo.core.router import Router
from gorgo.errors import UserError, header_pair, url_arg

TOKEN_ENV = "GORGO_ADMIN_TOKEN"  # as extproc.admin reads it (not imported: it pulls in aiohttp)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fleet", help="fleet YAML (offline what-if)")
    p.add_argument("--router", type=url_arg,
                   help="URL of a running router's HTTP port, e.g. http://127.0.0.1:50052")
    p.add_argument("--token-file", help="admin token file for --router (or env GORGO_ADMIN_TOKEN)")
    p.add_argument("--body", default="-", help="request JSON body file (default stdin)")
    p.add_argument("--path", default="/v1/chat/completions", help="request path")
    p.add_argument("--header", action="append", type=header_pair, default=[],
                   help="request header K:V")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def offline(fleet: str | FleetSpec, path: str, headers: dict[str, str],
            body: bytes) -> Explanation:
    spec = load_fleet(fleet) if isinstance(fleet, str) else fleet
    router = Router(spec)
    rtt = {r.name: r.rtt_ms for r in spec.regions}
    for i, replica in enumerate(spec.replicas):
        router.state.observe_rtt(i, rtt[replica.region])
    f = extract_features(path, headers, body, router.state.tok, policies=router.policies,
                         limits=router.spec.limits)
    return explain(router, f, 0.0)


def live(url: str, token: str, path: str, headers: dict[str, str], body: bytes) -> dict:
    """The router's explanation; UserError if it cannot be reached or refuses the call."""
    payload = json.dumps({"path": path, "headers": headers, "body": body.decode()}).encode()
    req = urllib.request.Request(
        url.rstrip("/") + "/admin/explain", data=payload, method="POST",
        headers={"authorization": f"Bearer {token}", "content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raise UserError(f"{url} answered {exc.code}: {_error_message(exc)}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        reason = getattr(reason, "strerror", None) or reason
        raise UserError(f"cannot reach the router at {url}: {reason}; is `gorgo extproc` "
                        "running there (its --metrics-port)?") from None


def _error_message(exc: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(exc.read())["error"]["message"])
    except (OSError, ValueError, KeyError, TypeError):
        return exc.reason or "error"


def _token(token_file: str | None) -> str:
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as exc:
            raise UserError(f"{token_file}: cannot read the admin token: {exc.strerror}") from None
    else:
        token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise UserError(f"--router needs the router's admin token: give --token-file FILE or set "
                        f"{TOKEN_ENV}")
    return token


def _body(name: str) -> bytes:
    if name == "-":
        return sys.stdin.buffer.read()
    try:
        return Path(name).read_bytes()
    except OSError as exc:
        raise UserError(f"--body {name}: {exc.strerror}") from None


def main(args: argparse.Namespace) -> int:
    if not args.router and not args.fleet:
        raise UserError("give --fleet FILE (what-if) or --router URL (a running router)")
    headers = {k.lower(): v for k, v in args.header}  # as the router reads them
    try:
        if args.router:
            token = _token(args.token_file)
            result = live(args.router, token, args.path, headers, _body(args.body))
            try:  # the router's answer is an Explanation's to_dict
                table = Explanation(result["policy"], result["winner"], result["reason"],
                                    result["replicas"]).table()
            except (KeyError, TypeError):  # another shape (an older router): as it came
                table = None
            print(json.dumps(result, indent=2) if args.json or table is None else table)
            return 0
        spec = load_fleet(args.fleet)  # before reading stdin: a bad file fails at once
        exp = offline(spec, args.path, headers, _body(args.body))
    except RequestError as err:  # what the router would answer, as the live path says it
        raise UserError(f"the router refuses this request ({err.status}): {err.message}"
                        ) from None
    print(json.dumps(exp.to_dict(), indent=2) if args.json else exp.table())
    return 0
