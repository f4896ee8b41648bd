"""Compile Tidal's looping pipeline: ``python pipelines/tidal_pipeline.py OUTPUT [nvidia|ascend|cpu]``."""

import sys

from tidal.kube.pipeline.definition import build_pipeline, compile_pipeline  # noqa: F401

if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    print(compile_pipeline(sys.argv[1], accelerator=sys.argv[2] if len(sys.argv) == 3 else "nvidia"))
