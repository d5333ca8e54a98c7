"""load/bench_tiers.py's server config: the app's own settings accept it, with the two tenants' tiers and the small
engine slot count that makes requests wait inside vLLM; fair shares on except in the flat variant."""

from load.bench_tiers import FAIR_SHARE, KEYS, TIERS, config
from serve_app.settings import AppSettings
from serve_app.tenants import engine_priority


def test_each_variant_is_a_valid_config_with_its_tiers():
    for name, priorities in TIERS.items():
        cfg = config(8123, "/models/tiny", priorities, 2, FAIR_SHARE[name])
        settings = AppSettings.model_validate(cfg["applications"][0]["args"])
        (model,) = settings.models
        assert model.engine_kwargs["max_num_seqs"] == 2
        assert {e.tenant for e in settings.ingress.api_keys} == set(KEYS)
        dev, ci = (engine_priority(settings.ingress, t, None) for t in ("dev", "ci"))
        assert (dev < ci) if name == "tiered" else (dev == ci)  # vLLM runs lower values first
        assert settings.ingress.fair_share is (name != "flat")  # flat: first come, first served within the tier
