"""The rendered Envoy config goes through envoy-data-plane's typed classes strictly: a wrong field,
type, enum value, oneof or Any payload fails at render time with the field's path, no Envoy run."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from gorgo import envoy_config
from gorgo.cli import main as gorgo_main
from gorgo.core.fleet import load_fleet
from gorgo.envoy_config import render_bootstrap
from gorgo.envoy_typed import EnvoyConfigError, check_bootstrap, check_discovery_file, to_typed

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "envoy" / "fleet.example.yaml"
# Every hand-written or rendered Envoy bootstrap the project ships.
SHIPPED = ("envoy/envoy.example.yaml", "deploy/envoy.compose.yaml", "deploy/envoy.gpu.yaml",
           "deploy/envoy.dropin.yaml")
HCM = "static_resources.listeners[0].filter_chains[0].filters[0].typed_config"


@pytest.fixture(scope="module")
def boot() -> dict[str, Any]:
    return render_bootstrap(load_fleet(EXAMPLE), otlp="127.0.0.1:4317", picker=True,
                            body_mode="full-duplex")


def _broken(boot: dict[str, Any], edit) -> str:
    b = copy.deepcopy(boot)
    edit(b)
    with pytest.raises(EnvoyConfigError) as info:
        check_bootstrap(b)
    return str(info.value)


def _hcm(b: dict[str, Any]) -> dict[str, Any]:
    return b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


@pytest.mark.parametrize("path", SHIPPED)
def test_every_shipped_bootstrap_converts(path: str) -> None:
    typed = check_bootstrap(yaml.safe_load((REPO / path).read_text()))
    assert typed.static_resources.clusters


def test_rendered_bootstrap_converts_with_its_typed_payloads(boot: dict[str, Any]) -> None:
    typed = check_bootstrap(boot)
    names = [c.name for c in typed.static_resources.clusters]
    assert names == [c["name"] for c in boot["static_resources"]["clusters"]]
    # The filters' Any payloads were packed from their typed classes, so they unpack again.
    hcm = typed.static_resources.listeners[0].filter_chains[0].filters[0].typed_config.unpack()
    assert type(hcm).__name__ == "HttpConnectionManager"
    ext_proc = hcm.http_filters[0].typed_config.unpack()
    assert ext_proc.failure_mode_allow is True


def test_unknown_field_names_its_path(boot: dict[str, Any]) -> None:
    msg = _broken(boot, lambda b: b["static_resources"]["clusters"][2].update(
        connect_timeot="1s"))
    assert msg == "static_resources.clusters[2].connect_timeot: unknown field (in Cluster)"


def test_wrong_types_name_their_path(boot: dict[str, Any]) -> None:
    cases = {
        "static_resources.clusters[0].connect_timeout": 5,  # a Duration is "5s"
        "static_resources.clusters[0].name": 7,
        "static_resources.clusters[0].circuit_breakers.thresholds[0].max_connections": "many",
        "static_resources.clusters[0].type": "STRIKT_DNS",
        "static_resources.clusters[0].load_assignment.endpoints": {"lb_endpoints": []},
    }
    for where, value in cases.items():
        def edit(b: dict[str, Any], where: str = where, value: Any = value) -> None:
            *parents, leaf = where.split(".")
            node: Any = b
            for p in parents:
                name, _, idx = p.partition("[")
                node = node[name] if not idx else node[name][int(idx.rstrip("]"))]
            node[leaf] = value

        assert _broken(boot, edit).startswith(f"{where}: "), where


def test_any_payloads_are_checked_too(boot: dict[str, Any]) -> None:
    msg = _broken(boot, lambda b: _hcm(b)["http_filters"][0]["typed_config"].update(
        message_timout="1s"))
    assert msg.startswith(f"{HCM}.http_filters[0].typed_config.message_timout: unknown field")
    msg = _broken(boot, lambda b: _hcm(b).update({"@type": _hcm(b)["@type"] + "X"}))
    assert msg.startswith(f"{HCM}.@type: unknown type")
    msg = _broken(boot, lambda b: _hcm(b).pop("@type"))
    assert msg.startswith(f"{HCM}.@type: required")


def test_two_members_of_a_oneof_fail(boot: dict[str, Any]) -> None:
    msg = _broken(boot, lambda b: b["static_resources"]["clusters"][0].update(
        cluster_type={"name": "envoy.clusters.dynamic_forward_proxy"}))
    assert msg.startswith("static_resources.clusters[0].cluster_type: 'type' is already set")


def test_a_discovery_file_checks_each_resource(boot: dict[str, Any]) -> None:
    clusters = boot["static_resources"]["clusters"][:2]
    url = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
    doc = {"resources": [{"@type": url, **c} for c in clusters]}
    assert len(check_discovery_file(doc).resources) == 2
    doc["resources"][1]["lb_polcy"] = "ROUND_ROBIN"
    with pytest.raises(EnvoyConfigError, match=r"^resources\[1\]\.lb_polcy: unknown field"):
        check_discovery_file(doc)
    with pytest.raises(EnvoyConfigError, match=r"^f\.yaml\.name: expected a string"):
        to_typed("envoy.config.cluster.v3.Cluster", {"name": 1}, "f.yaml")


def test_envoy_config_exits_2_with_the_path(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str],
                                            tmp_path: Path) -> None:
    real = envoy_config.render_bootstrap

    def typo(*args: Any, **kwargs: Any) -> dict[str, Any]:
        b = real(*args, **kwargs)
        b["static_resources"]["clusters"][2]["connect_timeot"] = b["static_resources"][
            "clusters"][2].pop("connect_timeout")
        return b

    monkeypatch.setattr(envoy_config, "render_bootstrap", typo)
    out = tmp_path / "envoy.yaml"
    assert gorgo_main(["envoy-config", str(EXAMPLE), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["gorgo envoy-config: static_resources.clusters[2].connect_timeot: "
                   "unknown field (in Cluster)"]
    assert not out.exists()  # nothing half-written
