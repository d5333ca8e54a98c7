"""The load scripts' `--front listen` turns the shipped Serve config into one the app and Serve both accept, with
the same invariants as the shipped no-proxy config (tests/unit/test_deployments.py)."""

from __future__ import annotations

from ray.serve.schema import ServeDeploySchema

from load.bench_capacity import ours_config
from serve_app.serve_tuning import direct_ingress_in
from serve_app.settings import AppSettings


def test_listen_front_has_the_replicas_serve_the_benchmarks_port():
    cfg = ours_config(41234, "/models/tiny", 1, engine_placement="ingress", front="listen")
    ServeDeploySchema.model_validate(cfg)
    assert cfg["proxy_location"] == "Disabled" and "http_options" not in cfg and not direct_ingress_in(cfg)
    settings = AppSettings.model_validate(cfg["applications"][0]["args"])
    assert (settings.ingress.listen.host, settings.ingress.listen.port) == ("127.0.0.1", 41234)
    assert not settings.ingress.direct_ingress


def test_haproxy_front_is_the_shipped_haproxy_config():
    cfg = ours_config(41234, "/models/tiny", 1, engine_placement="ingress")
    assert cfg["http_options"]["port"] == 41234 and cfg["proxy_location"] != "Disabled" and direct_ingress_in(cfg)
    ingress = AppSettings.model_validate(cfg["applications"][0]["args"]).ingress
    assert ingress.listen is None and ingress.direct_ingress


def test_the_front_of_config_yaml_converts_both_ways_on_the_same_address():
    """config.yaml (the replicas' own port) behind Serve's HAProxy and back, as the load scripts that start from it
    do (bench_overhead, locust_capacity): a config Serve and the app accept, with the shipped HAProxy config's
    controller flags (direct ingress, the drain floor) and the same models."""
    import yaml

    from load.bench_capacity import ROOT, SHIPPED_FRONT, with_front
    from serve_app.serve_tuning import DRAIN_FLOOR, controller_env

    shipped = yaml.safe_load((ROOT / "config.yaml").read_text())
    listen = shipped["applications"][0]["args"]["ingress"]["listen"]
    behind = with_front(shipped, "haproxy")
    ServeDeploySchema.model_validate(behind)
    assert behind["http_options"] == {"host": listen["host"], "port": listen["port"]} and direct_ingress_in(behind)
    haproxy_env = controller_env(yaml.safe_load(SHIPPED_FRONT["haproxy"].read_text()))
    assert controller_env(behind)[DRAIN_FLOOR] == haproxy_env[DRAIN_FLOOR]
    args = AppSettings.model_validate(behind["applications"][0]["args"])
    assert args.ingress.direct_ingress and args.ingress.listen is None
    assert [m.id for m in args.models] == [m["id"] for m in shipped["applications"][0]["args"]["models"]]
    back = with_front(behind, "listen")
    assert back["proxy_location"] == "Disabled" and "http_options" not in back and not direct_ingress_in(back)
    assert back["applications"] == shipped["applications"]
    assert shipped == yaml.safe_load((ROOT / "config.yaml").read_text())  # the input is left as it was


def test_the_benchmarks_place_the_responses_store_as_the_shipped_config_does():
    """config.yaml's `response_store_placement` (one Ray worker fewer when `ingress`) is part of what is measured;
    `--ingress-set` overrides it for an A/B."""
    import yaml

    from load.bench_capacity import ROOT

    shipped = yaml.safe_load((ROOT / "config.yaml").read_text())["applications"][0]["args"]["ingress"]
    for front in ("listen", "haproxy"):
        cfg = ours_config(41234, "/models/tiny", 1, engine_placement="ingress", front=front)
        ingress = AppSettings.model_validate(cfg["applications"][0]["args"]).ingress
        assert ingress.response_store_placement == shipped["response_store_placement"] == "ingress"
    cfg = ours_config(41234, "/models/tiny", 1, ingress_set={"response_store_placement": "deployment"})
    assert AppSettings.model_validate(cfg["applications"][0]["args"]).ingress.response_store_placement == "deployment"


def test_the_single_process_launcher_serves_the_listen_config_without_ray():
    """`--launcher single_process` runs the README command with `--single-process`, and only on the topology that
    runs in one process (the benchmark's config must pass the server's own refusals)."""
    import argparse

    import pytest

    from load.bench_capacity import add_engine_placement_arg, add_front_arg, add_launcher_arg, check_launcher, serve_command
    from serve_app.single_process import refusals

    assert serve_command("c.yaml", "single_process")[-3:] == ["run", "c.yaml", "--single-process"]
    assert "--single-process" not in serve_command("c.yaml", "serve_app")
    ap = argparse.ArgumentParser()
    add_front_arg(ap)
    add_launcher_arg(ap)
    add_engine_placement_arg(ap)
    ok = ap.parse_args(["--launcher", "single_process", "--front", "listen", "--engine-placement", "ingress"])
    check_launcher(ap, ok)
    with pytest.raises(SystemExit):
        check_launcher(ap, ap.parse_args(["--launcher", "single_process"]))
    args = ours_config(8123, "/m", 1, engine_placement="ingress", front="listen")["applications"][0]["args"]
    assert refusals(AppSettings.model_validate(args)) == []
