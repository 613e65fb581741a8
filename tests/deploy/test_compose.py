"""docker-compose.yaml, the project image and the drop-in configs, checked without a Docker engine.

No container runs here, so everything a container would trip over is checked statically: every
gorgo command parses with the CLI's own parsers, every Envoy config passes `envoy --mode validate`
and is a fresh render, the services agree on each other's names and ports, the collector's
pipelines are wired, published ports do not clash, mounted files exist, and the doc snippets are
the tested files.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from gorgo.cli import COMMANDS
from gorgo.cli import main as gorgo_main
from gorgo.core.contract import CLUSTER_HEADER, CONTROL_HEADERS
from gorgo.core.fleet import load_fleet
from gorgo.envoy_config import EXTPROC_CLUSTER, OTLP_CLUSTER, PICKER_CLUSTER, render_bootstrap
from gorgo.harness.envoy_proc import envoy_binary
from gorgo.sim.view import offset_addresses, view_doc
from tuner.main import parse_config
from tuner.receiver import MAX_MESSAGE_BYTES

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yaml"
PROJECT_IMAGE = "gorgo-router:local"
ENVOY_MAIN = "deploy/envoy.compose.yaml"
ENVOY_GPU = "deploy/envoy.gpu.yaml"
DROPIN = "deploy/envoy.dropin.yaml"
# Each rendered Envoy config and the `gorgo envoy-config` arguments it is rendered with (the same
# command lines are shown in docs/docker.md).
RENDERS: dict[str, list[str]] = {
    ENVOY_MAIN: ["envoy-config", "deploy/fleet.compose.yaml", "--listen", "0.0.0.0:10000",
                 "--extproc", "extproc:50051", "--otlp", "otel-collector:4317",
                 "--admin", "127.0.0.1:9901"],
    ENVOY_GPU: ["envoy-config", "deploy/fleet.gpu.yaml", "--listen", "0.0.0.0:10000",
                "--extproc", "extproc-gpu:50051", "--otlp", "otel-collector:4319",
                "--admin", "127.0.0.1:9901"],
}
# Profile multi: a proxy per region. Each other region's view of the compose fleet (written by
# `gorgo sim view` with these port offsets) and its Envoy config, rendered like the main one.
VIEWS = {"eu-frankfurt": 100, "ap-seoul": 200}
for _region in VIEWS:
    RENDERS[f"deploy/envoy.compose.{_region}.yaml"] = [
        "envoy-config", f"deploy/fleet.compose.{_region}.yaml", "--listen", "0.0.0.0:10000",
        "--extproc", f"extproc-{_region}:50051", "--otlp", "otel-collector:4317",
        "--admin", "127.0.0.1:9901"]
SIM_SERVICES = ("sim-us-east", "sim-eu-frankfurt", "sim-ap-seoul")
OTLP_TOKEN_FILE = "/run/gorgo/otlp-token"
CORE_SERVICES = {"envoy", "extproc", "tuner", "otel-collector", "jaeger", "prometheus", "grafana",
                 "loadgen", "admin-token", "nats", *SIM_SERVICES}
GPU_SERVICES = {"sglang", "vllm", "extproc-gpu", "tuner-gpu", "envoy-gpu", "loadgen-gpu"}
MULTI_SERVICES = {f"{kind}-{g}" for kind in ("extproc", "envoy", "loadgen") for g in VIEWS}
MULTI_ENVOYS = [f"envoy-{region}" for region in VIEWS]
PROFILES = {**{n: ["gpu"] for n in GPU_SERVICES}, **{n: ["multi"] for n in MULTI_SERVICES}}
_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def _interpolate(value: Any) -> Any:
    """Compose's ${VAR:-default} with nothing set in the environment: every default applies."""
    if isinstance(value, str):
        return _VAR.sub(lambda m: m.group(2) or "", value)
    if isinstance(value, list):
        return [_interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: _interpolate(v) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return _interpolate(yaml.safe_load(COMPOSE.read_text()))


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def _is_project(svc: dict[str, Any]) -> bool:
    return svc.get("image") == PROJECT_IMAGE


def _gorgo(svc: dict[str, Any]) -> tuple[tuple[str, ...], argparse.Namespace]:
    """The CLI words and the parsed arguments of a service that runs the gorgo entry point."""
    argv = [str(a) for a in svc["command"]]
    words = next((tuple(argv[:n]) for n in (2, 1) if tuple(argv[:n]) in COMMANDS), None)
    assert words is not None, f"`gorgo {' '.join(argv[:2])}` is not a gorgo command"
    module = importlib.import_module(COMMANDS[words][0])
    parser = argparse.ArgumentParser(prog=f"gorgo {' '.join(words)}")
    module.add_arguments(parser)
    try:
        return words, parser.parse_args(argv[len(words):])
    except SystemExit:
        pytest.fail(f"`gorgo {' '.join(argv)}` does not parse")


def _gorgo_services(services: dict[str, dict[str, Any]], *words: str) -> dict[str, Any]:
    out = {}
    for name, svc in services.items():
        if _is_project(svc) and "entrypoint" not in svc:
            found, args = _gorgo(svc)
            if found == words:
                out[name] = args
    return out


def _mounts(svc: dict[str, Any]) -> dict[str, str]:
    """Container path -> source (a ./repo path or a named volume)."""
    out = {}
    for v in svc.get("volumes", []):
        source, target = v.split(":")[:2]
        out[target] = source
    return out


def _repo_file(svc: dict[str, Any], container_path: str) -> Path:
    source = _mounts(svc)[container_path]
    assert source.startswith("./"), f"{container_path} is not mounted from the repository"
    return REPO / source


def _published(svc: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(host ip, host port, container port) of each published port (short syntax)."""
    out = []
    for p in svc.get("ports", []):
        parts = str(p).split(":")
        ip = parts[0] if len(parts) == 3 else "0.0.0.0"
        out.append((ip, int(parts[-2]), int(parts[-1])))
    return out


def _hostport(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host, int(port)


def _health_url(svc: dict[str, Any]) -> str:
    """The URL a service's healthcheck fetches."""
    code = svc["healthcheck"]["test"][-1]
    match = re.search(r"http://[^'\"]+", code)
    assert match, code
    return match.group(0)


def _validate(path: Path) -> None:
    out = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), "--base-id", "4343"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "deprecated" not in (out.stdout + out.stderr).lower()


def _clusters(boot: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in boot["static_resources"]["clusters"]}


def _cluster_address(cluster: dict[str, Any]) -> tuple[str, int]:
    sa = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"][
        "socket_address"]
    return sa["address"], sa["port_value"]


def _hcm(boot: dict[str, Any]) -> dict[str, Any]:
    return boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]


# --- the compose file -----------------------------------------------------------------------------


def test_compose_has_every_service_and_the_profiles(services: dict[str, Any]) -> None:
    assert set(services) == CORE_SERVICES | GPU_SERVICES | MULTI_SERVICES
    for name, svc in services.items():
        profiles = svc.get("profiles", [])
        assert profiles == PROFILES.get(name, []), name
        for dep in svc.get("depends_on", []):
            assert dep in services, f"{name} depends on unknown {dep}"
            assert PROFILES.get(dep, profiles) == profiles, (
                f"{name} would pull the {PROFILES[dep][0]} profile's {dep} into its own")


def test_every_gorgo_command_parses_with_the_cli(services: dict[str, Any]) -> None:
    ran = {name for name, svc in services.items() if _is_project(svc) and "entrypoint" not in svc}
    assert ran == (CORE_SERVICES | GPU_SERVICES | MULTI_SERVICES) - {
        "envoy", "envoy-gpu", *MULTI_ENVOYS, "otel-collector", "jaeger", "prometheus", "grafana",
        "sglang", "vllm", "admin-token", "nats"}
    for name in sorted(ran):
        svc = services[name]
        assert svc["build"] == {"context": ".", "target": "router"}, name  # no matplotlib
        _gorgo(svc)
    assert set(_gorgo_services(services, "sim", "fleet")) == set(SIM_SERVICES)
    assert set(_gorgo_services(services, "extproc")) == {
        "extproc", "extproc-gpu", *(f"extproc-{g}" for g in VIEWS)}
    assert set(_gorgo_services(services, "tuner")) == {"tuner", "tuner-gpu"}
    assert set(_gorgo_services(services, "replay")) == {
        "loadgen", "loadgen-gpu", *(f"loadgen-{g}" for g in VIEWS)}


def test_each_region_runs_in_its_own_container(services: dict[str, Any]) -> None:
    sims = _gorgo_services(services, "sim", "fleet")
    spec = None
    served: list[str] = []
    for name, args in sims.items():
        fleet = _repo_file(services[name], args.fleet)
        assert fleet == REPO / "deploy" / "fleet.compose.yaml"
        spec = load_fleet(fleet)
        assert args.bind == "0.0.0.0" and len(args.region) == 1
        served += args.region
        ports = {r.port for r in spec.replicas if r.region in args.region}
        # Every replica of this region is addressed by this service's name (what Envoy dials).
        assert {r.host for r in spec.replicas if r.region in args.region} == {name}
        health = _health_url(services[name])
        assert urlsplit(health).port in ports
        # One more link per other proxy region: the mounted views, on this service's name too.
        views = [_repo_file(services[name], v) for v in args.view]
        assert views == [REPO / f"deploy/fleet.compose.{g}.yaml" for g in VIEWS]
        for view in map(load_fleet, views):
            assert {r.host for r in view.replicas if r.region in args.region} == {name}
    assert spec is not None
    assert sorted(served) == sorted(spec.region_names)
    assert len({a.seed for a in sims.values()}) == len(sims)  # independent link jitter


@pytest.mark.parametrize("region", sorted(VIEWS))
def test_each_proxy_region_view_is_fresh(region: str) -> None:
    """The multi profile's views are what `gorgo sim view` writes (the command in the header):
    the fleet's replicas under the same names, each port moved by the view's offset, and the
    regions' RTTs from that proxy region."""
    path = REPO / f"deploy/fleet.compose.{region}.yaml"
    doc = yaml.safe_load((REPO / "deploy" / "fleet.compose.yaml").read_text())
    fresh = view_doc(doc, region, offset_addresses(doc, VIEWS[region]))
    assert yaml.safe_load(path.read_text()) == fresh, f"{path.name} is stale: re-run its header"
    command = (f"gorgo sim view deploy/fleet.compose.yaml --region {region} "
               f"--port-offset {VIEWS[region]}")
    assert command in path.read_text() and command in (REPO / "docs" / "docker.md").read_text()
    view, fleet = load_fleet(path), load_fleet(REPO / "deploy" / "fleet.compose.yaml")
    assert view.proxy_region == region
    assert [r.name for r in view.replicas] == [r.name for r in fleet.replicas]


def test_the_simulated_fleets_routers_share_their_bookings(services: dict[str, Any]) -> None:
    """Every router of the simulated fleet (us-east's and the multi profile's) names the compose
    NATS server and one subject, and starts after it."""
    nats = services["nats"]
    assert nats["image"].startswith("nats:2.") and "ports" not in nats  # compose network only
    cmd = nats["command"]
    port = int(cmd[cmd.index("-p") + 1])
    subjects = set()
    for name, args in _gorgo_services(services, "extproc").items():
        if name == "extproc-gpu":
            continue
        sharing = load_fleet(_repo_file(services[name], args.fleet)).sharing
        assert sharing is not None, name
        url = urlsplit(sharing.nats)
        assert (url.hostname, url.port) == ("nats", port), name
        assert services[name]["depends_on"]["nats"] == {"condition": "service_started"}
        subjects.add(sharing.subject)
    assert len(subjects) == 1


def test_admin_token_is_generated_once_into_a_volume(services: dict[str, Any],
                                                     tmp_path: Path) -> None:
    svc = services["admin-token"]
    assert svc["entrypoint"] == ["python", "-c"] and svc["restart"] == "no"
    script = svc["command"][0]
    token_path = "/run/gorgo/admin-token"
    assert _mounts(svc)["/run/gorgo"] == "gorgo-secrets"
    code = script.replace("/run/gorgo/", f"{tmp_path}/")
    exec(compile(code, "admin-token", "exec"), {})
    target, otlp = tmp_path / "admin-token", tmp_path / "otlp-token"
    token, otlp_token = target.read_text(), otlp.read_text()
    assert re.fullmatch(r"[0-9a-f]{64}", token)
    # The collector reads it through ${file:}, as YAML: the prefix keeps it a string.
    assert re.fullmatch(r"gorgo-otlp-[0-9a-f]{64}", otlp_token)
    assert isinstance(yaml.safe_load(otlp_token), str)
    for path in (target, otlp):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    exec(compile(code, "admin-token", "exec"), {})
    # A restart keeps the tokens the router, the tuner and the collector already loaded.
    assert (target.read_text(), otlp.read_text()) == (token, otlp_token)
    for name, args in _gorgo_services(services, "extproc").items():
        assert args.admin_token_file == token_path
        assert _mounts(services[name])["/run/gorgo"] == "gorgo-secrets"
        assert services[name]["depends_on"]["admin-token"] == {
            "condition": "service_completed_successfully"}


def test_published_host_ports_do_not_clash(services: dict[str, Any]) -> None:
    seen: dict[int, list[tuple[str, str]]] = {}
    for name, svc in services.items():
        for ip, host_port, _ in _published(svc):
            for other_ip, other in seen.get(host_port, []):
                assert ip != other_ip and "0.0.0.0" not in (ip, other_ip), (
                    f"{name} and {other} both publish port {host_port}")
            seen.setdefault(host_port, []).append((ip, name))
    assert 16686 in seen and 10000 in seen  # Jaeger UI and the Envoy listener
    # Admin and metrics endpoints stay on the host's loopback.
    for name, svc in services.items():
        for ip, _, container_port in _published(svc):
            if container_port in (50052, 9102, 9901):
                assert ip == "127.0.0.1", f"{name} publishes {container_port} beyond loopback"


def test_every_mounted_file_exists_and_volumes_are_declared(compose: dict[str, Any]) -> None:
    volumes = set(compose["volumes"])
    used = set()
    for name, svc in compose["services"].items():
        for target, source in _mounts(svc).items():
            if source.startswith(("./", "/")):
                assert (REPO / source).is_file(), f"{name} mounts missing {source}"
            else:
                assert source in volumes, f"{name} mounts undeclared volume {source}"
                used.add(source)
            assert target.startswith("/"), target
    assert used == volumes


# --- Envoy ------------------------------------------------------------------------------------


# Runs `envoy --version`.
@pytest.mark.envoy
def test_envoy_image_matches_the_tested_envoy(services: dict[str, Any]) -> None:
    out = subprocess.run([envoy_binary(), "--version"], capture_output=True, text=True,
                         timeout=30).stdout
    tested = re.search(r"/(\d+)\.(\d+)\.\d+/", out)
    assert tested, out
    for name in ("envoy", "envoy-gpu", *MULTI_ENVOYS):
        image = services[name]["image"]
        m = re.fullmatch(r"envoyproxy/envoy:v(\d+)\.(\d+)(?:\.\d+|-latest)", image)
        assert m and m.groups() == tested.groups(), f"{name}: {image} vs tested {out.strip()}"


# Runs `envoy --mode validate`.
@pytest.mark.envoy
@pytest.mark.parametrize("path", sorted(RENDERS))
def test_rendered_envoy_config_validates_and_is_fresh(path: str, tmp_path: Path) -> None:
    args = list(RENDERS[path])
    args[1] = str(REPO / args[1])
    out = tmp_path / "fresh.yaml"
    assert gorgo_main([*args, "-o", str(out)]) == 0
    assert (REPO / path).read_text() == out.read_text(), (
        f"{path} is stale: re-render it with the command in docs/docker.md")
    _validate(REPO / path)


def test_docker_docs_show_the_render_commands() -> None:
    doc = (REPO / "docs" / "docker.md").read_text()
    for path, args in RENDERS.items():
        assert f"gorgo {' '.join(args)} -o {path}" in doc, path


@pytest.mark.parametrize("envoy_name", ["envoy", "envoy-gpu", *MULTI_ENVOYS])
def test_envoy_service_matches_its_config_and_peers(services: dict[str, Any],
                                                    envoy_name: str) -> None:
    svc = services[envoy_name]
    cmd = svc["command"]
    config = _repo_file(svc, cmd[cmd.index("-c") + 1])
    rel = str(config.relative_to(REPO))
    assert rel in RENDERS
    boot = yaml.safe_load(config.read_text())
    listen = boot["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]
    admin = boot["admin"]["address"]["socket_address"]["port_value"]
    assert {c for _, _, c in _published(svc)} == {listen}  # its admin: no other container's
    assert boot["admin"]["address"]["socket_address"]["address"] == "127.0.0.1" and admin
    clusters = _clusters(boot)
    # ext_proc: the extproc service that serves this config's fleet, on its gRPC port.
    host, port = _cluster_address(clusters[EXTPROC_CLUSTER])
    extproc = _gorgo_services(services, "extproc")[host]
    assert extproc.host == "0.0.0.0" and extproc.port == port
    fleet_file = _repo_file(services[host], extproc.fleet)
    assert fleet_file == REPO / RENDERS[rel][1]
    assert host in svc["depends_on"]
    # Replicas: STRICT_DNS clusters on compose service names.
    spec = load_fleet(fleet_file)
    for r in spec.replicas:
        c = clusters[r.cluster]
        assert c["type"] == "STRICT_DNS" and _cluster_address(c) == (r.host, r.port)
        assert r.host in services
    # Spans: to a receiver of the collector.
    host, port = _cluster_address(clusters[OTLP_CLUSTER])
    assert host == "otel-collector" and port in _collector_ports()


# --- collector, tuner ---------------------------------------------------------------------------


def _collector() -> dict[str, Any]:
    return yaml.safe_load((REPO / "deploy" / "otel-collector.yaml").read_text())


def _collector_ports() -> set[int]:
    return {_hostport(r["protocols"]["grpc"]["endpoint"])[1]
            for r in _collector()["receivers"].values()}


def test_collector_exports_stay_under_the_tuners_message_limit() -> None:
    """Envoy's span tags carry client headers (a 50 KB user-agent, a 51 KB span): each attribute
    is cut and a batch bounded, so no client makes an export the tuner refuses whole."""
    cfg = _collector()
    (group,) = cfg["processors"]["transform/bound"]["trace_statements"]
    (statement,) = group["statements"]
    cut = int(re.fullmatch(r"truncate_all\(attributes, (\d+)\)", statement).group(1))
    batch = cfg["processors"]["batch"]
    assert batch["send_batch_size"] == batch["send_batch_max_size"] > 0
    attributes = 64  # an Envoy request span has about 40: the contract's tags and Envoy's own
    assert batch["send_batch_max_size"] * attributes * (cut + 64) < MAX_MESSAGE_BYTES
    for name, pipeline in cfg["service"]["pipelines"].items():
        if name.startswith("traces"):
            assert pipeline["processors"][-2:] == ["transform/bound", "batch"], name


def test_collector_config_is_wired(services: dict[str, Any]) -> None:
    svc = services["otel-collector"]
    config_arg = next(a for a in svc["command"] if a.startswith("--config="))
    assert _repo_file(svc, config_arg.split("=", 1)[1]) == REPO / "deploy" / "otel-collector.yaml"
    cfg = _collector()
    used: dict[str, set[str]] = {"receivers": set(), "processors": set(), "exporters": set()}
    for name, pipe in cfg["service"]["pipelines"].items():
        assert name.split("/")[0] in ("traces", "logs")
        for kind in used:
            for component in pipe[kind]:
                assert component in cfg[kind], f"pipeline {name}: no {kind[:-1]} {component}"
                used[kind].add(component)
    for kind, names in used.items():
        assert names == set(cfg[kind]), f"unused {kind}: {set(cfg[kind]) - names}"
    for r in cfg["receivers"].values():
        assert _hostport(r["protocols"]["grpc"]["endpoint"])[0] == "0.0.0.0"
    targets = {}
    for name, exp in cfg["exporters"].items():
        assert name.split("/")[0] == "otlp_grpc"
        host, port = _hostport(exp["endpoint"])
        assert host in services and exp["tls"] == {"insecure": True}
        targets[name] = (host, port)
    tuners = _gorgo_services(services, "tuner")
    for pipeline, tuner in (("traces", "tuner"), ("traces/gpu", "tuner-gpu")):
        sent_to = {targets[e] for e in cfg["service"]["pipelines"][pipeline]["exporters"]}
        tuner_cfg = yaml.safe_load(_repo_file(services[tuner], tuners[tuner].config).read_text())
        assert sent_to == {("jaeger", 4317), (tuner, _hostport(tuner_cfg["listen"])[1])}
        # the TTFT access log: from the same receiver, to the tuner alone (Jaeger takes no logs)
        logs = cfg["service"]["pipelines"][pipeline.replace("traces", "logs")]
        assert logs["receivers"] == cfg["service"]["pipelines"][pipeline]["receivers"]
        assert {targets[e] for e in logs["exporters"]} == {
            (tuner, _hostport(tuner_cfg["listen"])[1])}
    jaeger = services["jaeger"]["command"]
    assert "receivers.otlp.protocols.grpc.endpoint=0.0.0.0:4317" in jaeger


def test_each_pipeline_serves_one_envoy() -> None:
    """The GPU Envoy's spans go to their own receiver: they never reach the simulated fleet's
    tuner, whose weights they say nothing about."""
    cfg = _collector()
    port_of = {name: _hostport(r["protocols"]["grpc"]["endpoint"])[1]
               for name, r in cfg["receivers"].items()}
    main = [ENVOY_MAIN, *(f"deploy/envoy.compose.{g}.yaml" for g in VIEWS)]
    for path, pipeline in [*((p, "traces") for p in main), (ENVOY_GPU, "traces/gpu")]:
        boot = yaml.safe_load((REPO / path).read_text())
        _, port = _cluster_address(_clusters(boot)[OTLP_CLUSTER])
        (receiver,) = cfg["service"]["pipelines"][pipeline]["receivers"]
        assert port_of[receiver] == port
        # its TTFT access log goes to the same receiver, which has a logs pipeline
        hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        otel_logs = [a["typed_config"]["grpc_service"]["envoy_grpc"]
                     ["cluster_name"] for a in hcm["typed_config"].get("access_log", ())
                     if a["name"] == "envoy.access_loggers.open_telemetry"]
        assert otel_logs == [OTLP_CLUSTER]
        assert cfg["service"]["pipelines"][pipeline.replace("traces", "logs")]["receivers"] == [
            receiver]


def test_tuner_configs_parse_and_reach_their_router(services: dict[str, Any],
                                                    tmp_path: Path) -> None:
    extprocs = _gorgo_services(services, "extproc")
    for name, args in _gorgo_services(services, "tuner").items():
        svc = services[name]
        raw = yaml.safe_load(_repo_file(svc, args.config).read_text())
        (router,) = raw["routers"]
        url = urlsplit(router["url"])
        target = extprocs[url.hostname]
        assert url.port == target.metrics_port and target.metrics_host == "0.0.0.0"
        assert router["token_file"] == target.admin_token_file
        assert Path(raw["state_file"]).parent.as_posix() in _mounts(svc)
        assert services[name]["depends_on"][url.hostname] == {"condition": "service_healthy"}
        # Spans count only with the token the collector sends (see the test below).
        assert raw["token_file"] == OTLP_TOKEN_FILE
        assert _mounts(svc)[str(Path(OTLP_TOKEN_FILE).parent)] == "gorgo-secrets"
        token = tmp_path / f"{name}-token"
        token.write_text("t" * 32)
        local = {**raw, "routers": [{**router, "token_file": str(token)}],
                 "token_file": str(token), "state_file": str(tmp_path / f"{name}-state.json")}
        cfg = parse_config(local, tmp_path)
        assert _hostport(cfg.listen) == ("0.0.0.0", 4317)
        assert cfg.status_listen is not None and _hostport(cfg.status_listen)[1] in {
            c for _, _, c in _published(svc)}


def test_collector_sends_the_tuners_token(services: dict[str, Any]) -> None:
    """Every exporter to a tuner carries the tuner's bearer token, read from the secrets volume
    the admin-token service fills before the collector starts."""
    svc = services["otel-collector"]
    assert _mounts(svc)[str(Path(OTLP_TOKEN_FILE).parent)] == "gorgo-secrets"
    assert svc["depends_on"]["admin-token"] == {"condition": "service_completed_successfully"}
    cfg = _collector()
    tuners = set(_gorgo_services(services, "tuner"))
    to_tuner = {n: e for n, e in cfg["exporters"].items()
                if urlsplit("//" + e["endpoint"]).hostname in tuners}
    assert {urlsplit("//" + e["endpoint"]).hostname for e in to_tuner.values()} == tuners
    for name, exporter in to_tuner.items():
        assert exporter["headers"] == {"authorization": f"Bearer ${{file:{OTLP_TOKEN_FILE}}}"}, name


def test_load_generators_target_their_envoy(services: dict[str, Any]) -> None:
    for name, args in _gorgo_services(services, "replay").items():
        url = urlsplit(args.url)
        envoy = services[url.hostname]
        boot = yaml.safe_load(_repo_file(envoy, "/etc/envoy/envoy.yaml").read_text())
        listen = boot["static_resources"]["listeners"][0]["address"]["socket_address"]
        assert url.port == listen["port_value"]
        assert Path(args.out).parent.as_posix() in _mounts(services[name])
        assert url.hostname in services[name]["depends_on"]


# --- the GPU profile --------------------------------------------------------------------------


def test_gpu_profile_engines_match_their_fleet_file(services: dict[str, Any]) -> None:
    spec = load_fleet(REPO / "deploy" / "fleet.gpu.yaml")
    assert sorted(r.engine for r in spec.replicas) == ["sglang", "vllm"]
    for r in spec.replicas:
        svc = services[r.host]
        assert svc["image"].split("/")[0] in ("lmsysorg", "vllm")
        cmd = [str(a) for a in svc["command"]]
        assert cmd[cmd.index("--port") + 1] == str(r.port)
        assert cmd[cmd.index("--host") + 1] == "0.0.0.0"
        if r.engine == "sglang":
            assert "--enable-metrics" in cmd  # SGLang serves /metrics only with it
        for url in (r.health_url, r.metrics_url):
            assert (urlsplit(url).hostname, urlsplit(url).port) == (r.host, r.port)
        assert urlsplit(r.health_url).path == "/health"
        assert urlsplit(_health_url(svc)).path == "/health"
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia"
        assert cmd[cmd.index("--served-model-name") + 1] == "gorgo-model"
    assert _gorgo_services(services, "replay")["loadgen-gpu"].model == "gorgo-model"
    assert services["sglang"]["deploy"] != services["vllm"]["deploy"]  # one GPU each


# --- the project image ------------------------------------------------------------------------


def _stages(lines: list[str]) -> dict[str, list[str]]:
    """The Dockerfile's build stages by name, each with its lines from its FROM on."""
    stages: dict[str, list[str]] = {}
    for ln in lines:
        if ln.startswith("FROM "):
            words = ln.split()
            assert len(words) == 4 and words[2] == "AS", f"unnamed stage: {ln}"
            stages[words[3]] = []
        stages[list(stages)[-1]].append(ln)
    return stages


def test_dockerfile_builds_the_cli_image() -> None:
    text = (REPO / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    stages = _stages(lines)
    # router last: a plain `docker build .` gives the router image
    assert list(stages) == ["base", "sim", "router"]
    assert stages["base"][0] == "FROM python:3.11-slim AS base"
    assert stages["sim"][0] == "FROM base AS sim"
    assert stages["router"][0] == "FROM base AS router"
    assert 'ENTRYPOINT ["gorgo"]' in stages["base"]
    for name in ("sim", "router"):
        users = [ln.split()[1] for ln in stages[name] if ln.startswith("USER ")]
        assert users and users[-1] not in ("root", "0"), name
    installs = {name: [ln for ln in body if "pip install" in ln] for name, body in stages.items()}
    assert installs == {
        "base": [],
        "sim": ["RUN pip install '.[sim]' && rm -rf /src"],  # + matplotlib, for the bench plots
        "router": ["RUN pip install . && rm -rf /src"],  # runtime dependencies only
    }
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r"^sim = \[", pyproject, re.M), "the [sim] extra the sim target installs"
    include = re.search(r"include = \[([^\]]*)\]", pyproject)
    assert include
    packages = [p.strip().strip('"').rstrip("*") for p in include.group(1).split(",")]
    copies = [ln for ln in stages["base"] if ln.startswith("COPY ")]
    assert copies == ["COPY pyproject.toml README.md ./", *(f"COPY {p} ./{p}" for p in packages)]
    # The sim target carries the shipped traces, and points gorgo at them.
    assert "COPY data/traces /opt/gorgo/traces" in stages["sim"]
    assert "ENV GORGO_TRACES=/opt/gorgo/traces" in stages["sim"]
    assert not [ln for ln in stages["router"] if ln.startswith("COPY ")]
    ignored = (REPO / ".dockerignore").read_text().split()
    assert not set(packages) & set(ignored)
    assert {".venv", ".git", "tests"} <= set(ignored)


def test_entry_point_runs_outside_an_editable_install() -> None:
    """The image installs the package normally, so no editable-install .pth hook has imported
    importlib submodules (or anything else) before the `gorgo` entry point runs."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import gorgo.cli as cli; "
            "sys.exit(cli.main(['--version']) or cli.main(['sim']))")
    out = subprocess.run([sys.executable, "-S", "-c", code, str(REPO)], capture_output=True,
                         text=True, timeout=30, cwd=REPO)
    assert out.returncode == 0 and out.stdout.startswith("gorgo "), out.stderr[-500:]
    assert "sim fleet" in out.stdout


# --- drop-in configs and docs -----------------------------------------------------------------


# Runs `envoy --mode validate`.
@pytest.mark.envoy
def test_dropin_envoy_validates_and_agrees_with_the_renderer() -> None:
    _validate(REPO / DROPIN)
    boot = yaml.safe_load((REPO / DROPIN).read_text())
    ref = render_bootstrap(load_fleet(REPO / "envoy" / "fleet.example.yaml"), picker=True)
    hcm, ref_hcm = _hcm(boot), _hcm(ref)
    ext, ref_ext = hcm["http_filters"][0], ref_hcm["http_filters"][0]
    assert [f["name"] for f in hcm["http_filters"]] == [
        "envoy.filters.http.ext_proc", "envoy.filters.http.buffer", "envoy.filters.http.router"]
    assert hcm["http_filters"][1] == ref_hcm["http_filters"][1]  # the body limit, router down
    for key in ("processing_mode", "failure_mode_allow", "metadata_options", "message_timeout",
                "forward_rules"):
        assert ext["typed_config"][key] == ref_ext["typed_config"][key], key
    assert hcm["use_remote_address"] is True and "internal_address_config" not in hcm
    for key in ("request_timeout", "stream_idle_timeout", "early_header_mutation_extensions"):
        assert hcm[key] == ref_hcm[key], key
    assert hcm["route_config"]["internal_only_headers"] == list(CONTROL_HEADERS)
    # The 431 and the codec's 400: the router's own 413 and the upstream bodies are the fleet's.
    assert hcm["local_reply_config"]["mappers"] == ref_hcm["local_reply_config"]["mappers"][-2:]
    # Off by default, on where a route asks: a codec error is answered before any route.
    assert ext["disabled"] is ref_ext["disabled"] is True
    *routes, not_found = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert [r["route"].get("cluster", r["route"].get("cluster_header")) for r in routes] == [
        PICKER_CLUSTER, PICKER_CLUSTER, CLUSTER_HEADER, CLUSTER_HEADER, "llm-a"]
    *ref_routes, ref_not_found = ref_hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert not_found == ref_not_found  # every other path: Envoy's 404, the router not asked
    ref_by_match = {json.dumps(r["match"].get("headers")): r for r in ref_routes}
    for r in routes:  # the matches and the request and idle bounds of every route: the renderer's
        ref_route = ref_by_match[json.dumps(r["match"].get("headers"))]
        assert r["match"]["safe_regex"] == ref_route["match"]["safe_regex"]
        assert {k: r["route"][k] for k in ("timeout", "idle_timeout")} == {
            k: ref_route["route"][k] for k in ("timeout", "idle_timeout")}
        assert r["typed_per_filter_config"] == ref_route["typed_per_filter_config"]
    clusters, ref_clusters = _clusters(boot), _clusters(ref)
    for key in ("type", "lb_policy", "original_dst_lb_config", "circuit_breakers",
                "preconnect_policy"):
        assert clusters[PICKER_CLUSTER][key] == ref_clusters[PICKER_CLUSTER][key], key
    # The replica clusters keep connections ahead of the requests as rendered ones do.
    for name in ("llm-a", "llm-b"):
        assert clusters[name]["preconnect_policy"] == ref_clusters["use-0"]["preconnect_policy"]
    assert (clusters[EXTPROC_CLUSTER]["typed_extension_protocol_options"]
            == ref_clusters[EXTPROC_CLUSTER]["typed_extension_protocol_options"])  # HTTP/2


def test_dropin_without_its_picker_routes_still_loads() -> None:
    """The routes marked "endpoint-picker mode only" can be deleted: the router-on anchor the
    other routes use sat on the first of them (an undefined alias without them)."""
    text = (REPO / DROPIN).read_text()
    cut = re.sub(r"( *)# gorgo \(endpoint-picker mode only\).*?(?=\1# gorgo: the replica cluster)",
                 "", text, flags=re.S)
    assert cut != text
    routes = _hcm(yaml.safe_load(cut))["route_config"]["virtual_hosts"][0]["routes"]
    assert all("typed_per_filter_config" in r for r in routes)


_SNIPPET = re.compile(r"<!-- snippet: (\S+) -->\n```\w*\n(.*?)```", re.S)


def _contains_block(text: str, block: str) -> bool:
    """``block`` appears in ``text`` as consecutive lines, up to a common indentation."""
    lines = text.splitlines()
    want = textwrap.dedent(block).splitlines()
    return any(textwrap.dedent("\n".join(lines[i:i + len(want)])).splitlines() == want
               for i in range(len(lines) - len(want) + 1))


@pytest.mark.parametrize("doc", ["integrate.md", "docker.md"])
def test_doc_snippets_are_the_tested_files(doc: str) -> None:
    text = (REPO / "docs" / doc).read_text()
    snippets = _SNIPPET.findall(text)
    assert snippets
    for path, block in snippets:
        assert _contains_block((REPO / path).read_text(), block), f"{doc}: stale {path} snippet"


def test_integration_guide_references_the_picker_e2e_test() -> None:
    text = (REPO / "docs" / "integrate.md").read_text()
    assert "tests/extproc/test_picker_e2e.py" in text
    assert (REPO / "tests" / "extproc" / "test_picker_e2e.py").is_file()
