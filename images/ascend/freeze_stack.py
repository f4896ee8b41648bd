"""Prints `name==version` for the accelerator stack installed in this environment, as pip constraints:
installing Tidal under them adds its own dependencies and replaces none of these."""

from importlib.metadata import PackageNotFoundError, version

STACK = ("torch", "torch-npu", "torchvision", "torchaudio", "vllm", "vllm-ascend", "transformers", "numpy", "triton-ascend")


def installed_stack() -> list[str]:
    lines = []
    for name in STACK:
        try:
            lines.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            pass
    return lines


if __name__ == "__main__":
    print("\n".join(installed_stack()))
