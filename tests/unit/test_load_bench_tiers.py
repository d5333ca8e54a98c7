"""load/bench_tiers.py's and load/bench_shares.py's server configs: the app's own settings accept them, with the
tenants' tiers or shares and the small engine slot count that makes requests wait inside vLLM; fair shares on
except in the first-come-first-served variants."""

from load import bench_shares
from load.bench_tiers import FAIR_SHARE, KEYS, TIERS, config
from serve_app.settings import AppSettings
from serve_app.tenants import config_of, engine_priority


def test_each_variant_is_a_valid_config_with_its_tiers():
    for name, priorities in TIERS.items():
        cfg = config(8123, "/models/tiny", {t: {"priority": p} for t, p in priorities.items()}, 2, FAIR_SHARE[name])
        settings = AppSettings.model_validate(cfg["applications"][0]["args"])
        (model,) = settings.models
        assert model.engine_kwargs["max_num_seqs"] == 2
        assert {e.tenant for e in settings.ingress.api_keys} == set(KEYS)
        dev, ci = (engine_priority(settings.ingress, t, None) for t in ("dev", "ci"))
        assert (dev < ci) if name == "tiered" else (dev == ci)  # vLLM runs lower values first
        assert settings.ingress.fair_share is (name != "flat")  # flat: first come, first served within the tier


def test_each_shares_variant_gives_its_tenants_their_weights():
    for name, shares in bench_shares.SHARES.items():
        cfg = config(8123, "/models/tiny", {t: {"share": n} for t, n in shares.items()}, 2,
                     bench_shares.FAIR_SHARE[name], keys=bench_shares.KEYS)
        settings = AppSettings.model_validate(cfg["applications"][0]["args"])
        assert {e.tenant for e in settings.ingress.api_keys} == {"a", "b"}
        assert {t: config_of(settings.ingress, t).share for t in "ab"} == shares
        assert engine_priority(settings.ingress, "a", None) == engine_priority(settings.ingress, "b", None)
        assert settings.ingress.fair_share is (name != "fcfs")
    assert bench_shares.SHARES["weighted"] == {"a": 1, "b": 2}
