"""The ``tidal compile`` and ``tidal submit`` verbs, and ``tidal run --via kfp-local``.

The core CLI calls :func:`register` with its subparsers and, for
``tidal run --via kfp-local``, :func:`run_via_kfp_local`.
"""

from __future__ import annotations

import argparse
import sys

from tidal.kube.cluster import PROFILES


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``compile`` and ``submit`` to the ``tidal`` command."""
    compile_parser = subparsers.add_parser(
        "compile", help="write the Kubeflow pipeline YAML", description="Compile Tidal's KFP pipeline for one accelerator profile."
    )
    compile_parser.add_argument("--output", "-o", required=True, help="where to write the pipeline YAML")
    add_profile_arguments(compile_parser)
    compile_parser.set_defaults(func=compile_command)

    submit_parser = subparsers.add_parser(
        "submit",
        help="submit a run to Kubeflow Pipelines",
        description="Compile the pipeline and start a run on a KFP server. The endpoint comes from --host "
        "or KFP_HOST; credentials from KFP_TOKEN or KF_PIPELINES_SA_TOKEN_PATH; the profile "
        "namespace from KFP_NAMESPACE (see docs/kubernetes.md).",
    )
    submit_parser.add_argument("config", help="Tidal config YAML; its text is the run's config_yaml parameter")
    submit_parser.add_argument("--host", default=None, help="KFP API endpoint (default: $KFP_HOST)")
    submit_parser.add_argument("--experiment", default="tidal", help="KFP experiment (default: tidal)")
    submit_parser.add_argument("--run-name", default=None, help="display name of the run")
    submit_parser.add_argument(
        "--param", "-p", action="append", default=[], metavar="NAME=VALUE", help="set a pipeline parameter, e.g. -p rounds=8 (repeatable)"
    )
    add_profile_arguments(submit_parser)
    submit_parser.set_defaults(func=submit_command)


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--accelerator",
        choices=sorted(PROFILES),
        default="nvidia",
        help="accelerator profile: image, device resource, node placement (default: nvidia)",
    )
    parser.add_argument("--image", default="", help="image for every step (default: the profile's)")
    parser.add_argument(
        "--queue-name",
        default="",
        help="Kueue LocalQueue of the trainer job and of the worker and evaluation pods (label kueue.x-k8s.io/queue-name; default: none)",
    )


KUBE_EXTRA_HINT = "the Kubeflow commands need the 'kube' extra: pip install 'tidal[kube]'"


def require_kube_extra() -> None:
    """Fail with the install hint, not a traceback, when kfp or kubeflow-training is missing."""
    import importlib.util

    missing = [m for m in ("kfp", "kfp.kubernetes", "kubeflow.training", "kubeflow.trainer") if _find_spec(importlib.util, m) is None]
    if missing:
        raise SystemExit(f"tidal: {KUBE_EXTRA_HINT} (missing: {', '.join(missing)})")


def _find_spec(util, module: str):
    try:
        return util.find_spec(module)
    except ModuleNotFoundError:
        return None


def compile_command(args: argparse.Namespace) -> int:
    require_kube_extra()
    from tidal.kube.pipeline import compile_pipeline

    path = compile_pipeline(args.output, accelerator=args.accelerator, image=args.image, queue_name=args.queue_name)
    print(f"wrote {path}")
    return 0


def submit_command(args: argparse.Namespace) -> int:
    require_kube_extra()
    from tidal.kube.submit import SubmitError, parse_params, submit_run

    try:
        run = submit_run(
            args.config,
            host=args.host,
            experiment=args.experiment,
            params=parse_params(args.param),
            accelerator=args.accelerator,
            image=args.image,
            queue_name=args.queue_name,
            run_name=args.run_name,
        )
    except SubmitError as err:
        print(f"tidal submit: {err}", file=sys.stderr)
        return 2
    print(run.url)
    return 0


def run_via_kfp_local(config_path: str, run_dir: str, overrides: list[str]) -> int:
    """``tidal run --via kfp-local``: the whole pipeline with kfp.local's SubprocessRunner."""
    require_kube_extra()
    from tidal.kube.kfp_local import KfpLocalError, run_pipeline_locally

    try:
        run_pipeline_locally(config_path, run_dir, overrides)
    except KfpLocalError as err:
        print(f"tidal run --via kfp-local: {err}", file=sys.stderr)
        return 1
    return 0
