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


def test_haproxy_front_is_the_shipped_config():
    cfg = ours_config(41234, "/models/tiny", 1, engine_placement="ingress")
    assert cfg["http_options"]["port"] == 41234 and cfg["proxy_location"] != "Disabled" and direct_ingress_in(cfg)
    assert AppSettings.model_validate(cfg["applications"][0]["args"]).ingress.listen is None


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
