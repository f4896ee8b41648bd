"""The Dockerfiles cannot be built here; check what they promise: pins, non-root, tidal[kube]."""

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ["cuda", "ascend", "cpu"]


def torch_pin() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in deps if d.startswith("torch==")]
    return pin.split("==")[1]


@pytest.mark.parametrize("image", IMAGES)
def test_dockerfile_pins_torch_runs_non_root_and_installs_tidal(image):
    text = (ROOT / "images" / image / "Dockerfile").read_text()
    assert f"ARG TORCH_VERSION={torch_pin()}" in text
    assert re.search(r"^USER 1000:1000$", text, re.M), "images must run as a non-root user"
    assert '"/opt/tidal[kube]"' in text
    assert "COPY examples /opt/tidal/examples" in text  # the pipeline's default config_path


def test_every_profile_image_has_a_dockerfile():
    from tidal.kube.cluster import PROFILES

    names = {profile.image.rsplit("/", 1)[1].split(":")[0] for profile in PROFILES.values()}
    assert names == {f"tidal-{image}" for image in IMAGES}
