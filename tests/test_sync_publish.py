"""What sync mode's trainer publishes: on the HF engine, which generates with the learner's own weights,
versions without the arrival check's probe (no engine loads them); every other trainer with it."""

from tidal.data import load_dataset
from tidal.demo.warm_start import prepare_base_model
from tidal.roles import build_learner, trainer_weight_store
from tidal.rundir import RunDir
from tidal.trainer.boundary import publish_weights
from tidal.weights import readable_manifest


def test_only_a_store_whose_versions_engines_load_carries_the_arrival_probe(tiny_config, tmp_path):
    base = prepare_base_model(tiny_config, load_dataset(tiny_config.data, tiny_config.seed))
    learner, _ = build_learner(tiny_config, str(base))
    for loaded, name in ((True, "loaded"), (False, "shared")):
        store = trainer_weight_store(tiny_config, RunDir(tmp_path / name), str(base), learner, loaded_by_engines=loaded)
        publish_weights(store, 1, learner)
        manifest = readable_manifest(store.path(1))
        assert ("probe" in manifest) is loaded, name  # the probe's forward ran only where an engine will check it
        assert (store.probe is not None) is loaded, name
