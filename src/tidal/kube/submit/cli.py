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
    compile_parser.add_argument(
        "--check-backend",
        default=None,
        metavar="VERSION",
        help="refuse (exit 2) if a KFP backend of this version (e.g. 2.5.0) cannot run the compiled pipeline",
    )
    add_profile_arguments(compile_parser)
    compile_parser.set_defaults(func=compile_command)

    submit_parser = subparsers.add_parser(
        "submit",
        help="submit a run to Kubeflow Pipelines (and, with --wait, gate CI on its outcome)",
        description="Compile the pipeline and start a run on a KFP server. The endpoint comes from --host "
        "or KFP_HOST; credentials from KFP_TOKEN or KF_PIPELINES_SA_TOKEN_PATH; the profile "
        "namespace from KFP_NAMESPACE (see docs/kubernetes.md). With --wait, follow the run to its end and "
        "check --require on its final metrics, read from its MLflow run.",
        epilog="Exit status: 0 submitted (with --wait: the run SUCCEEDED and met every requirement); 1 the run "
        "failed, was cancelled, missed a requirement, outlived --timeout, or could not be followed; 2 nothing "
        "was submitted (a bad option or config, the KFP API unreachable or refusing).",
    )
    submit_parser.add_argument("config", help="Tidal config YAML; its text is the run's config_yaml parameter")
    submit_parser.add_argument("--host", default=None, help="KFP API endpoint (default: $KFP_HOST)")
    submit_parser.add_argument("--experiment", default="tidal", help="KFP experiment (default: tidal)")
    submit_parser.add_argument("--run-name", default=None, help="display name of the run")
    submit_parser.add_argument(
        "--param", "-p", action="append", default=[], metavar="NAME=VALUE", help="set a pipeline parameter, e.g. -p rounds=8 (repeatable)"
    )
    add_profile_arguments(submit_parser)
    gate = submit_parser.add_argument_group("CI gate")
    gate.add_argument("--wait", action="store_true", help="follow the run until it ends, printing each state it enters")
    gate.add_argument("--timeout", type=float, default=None, metavar="SECONDS", help="with --wait: stop waiting after this long (the run goes on)")
    gate.add_argument(
        "--require",
        action="append",
        default=[],
        metavar="EXPR",
        help="with --wait: a final metric must satisfy METRIC OP NUMBER, OP one of >= <= > < == != (e.g. eval/accuracy>=0.6; repeatable)",
    )
    gate.add_argument(
        "--tracking-uri",
        default=None,
        help="with --wait: the MLflow server the run logs to, where its final metrics are read (default: $MLFLOW_TRACKING_URI)",
    )
    gate.add_argument("--poll-seconds", type=float, default=None, help="with --wait: how often to ask for the run's state (default: 15)")
    gate.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="write the outcome as JSON")
    gate.add_argument(
        "--summary", default=None, metavar="PATH", help="write the outcome as Markdown (default: appended to $GITHUB_STEP_SUMMARY when set)"
    )
    submit_parser.add_argument(
        "--backend-version",
        default=None,
        metavar="VERSION",
        help="the KFP backend's release (e.g. 2.5.0), checked against Tidal's floor when its API reports none "
        "(KFP's release images before 2.16 report 'unknown')",
    )
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
    from tidal.kube.pipeline.definition import compile_pipeline

    path = compile_pipeline(args.output, accelerator=args.accelerator, image=args.image, queue_name=args.queue_name)
    print(f"wrote {path}")
    if args.check_backend is not None:
        import yaml

        from tidal.kube.submit.backend import BackendTooOld, check_backend, parse_version

        if parse_version(args.check_backend) is None:
            print(f"tidal compile: --check-backend {args.check_backend!r} is not a KFP release (like 2.5.0)", file=sys.stderr)
            return 2
        try:
            notes = check_backend(args.check_backend, list(yaml.safe_load_all(path.read_text())))
        except BackendTooOld as err:
            print(f"tidal compile: {err}", file=sys.stderr)
            return 2
        for note in notes:
            print(f"note: {note}")
    return 0


def submit_command(args: argparse.Namespace) -> int:
    require_kube_extra()
    from tidal.kube.submit.client import SubmitError, follow_submitted, kfp_host, parse_params, submit_run, submitted_only, write_outcome

    try:
        params = parse_params(args.param)
        options = gate_options(args, params)
        run = submit_run(
            args.config,
            host=args.host,
            experiment=args.experiment,
            params=params,
            accelerator=args.accelerator,
            image=args.image,
            queue_name=args.queue_name,
            run_name=args.run_name,
            backend_version=args.backend_version,
        )
    except SubmitError as err:
        print(f"tidal submit: {err}", file=sys.stderr)
        return 2
    print(run.url, flush=True)
    if options is None:
        write_outcome(submitted_only(run), args.json_path, args.summary)
        return 0
    outcome = follow_submitted(run, kfp_host(args.host), options, say=lambda line: print(line, flush=True))
    for check in outcome.checks:
        print(check.describe(), flush=True)
    for note in outcome.notes:
        print(f"note: {note}", flush=True)
    write_outcome(outcome, args.json_path, args.summary)
    if not outcome.ok:
        print(f"tidal submit: {outcome.failure()}", file=sys.stderr)
        return 1
    print(f"tidal submit: run {run.run_id} {outcome.state}" + (f"; {len(outcome.checks)} requirement(s) met" if outcome.checks else ""))
    return 0


def gate_options(args: argparse.Namespace, params: dict):
    """The ``--wait`` options, checked before anything is submitted; None without ``--wait``."""
    import os

    from tidal.kube.submit.client import POLL_SECONDS, GateOptions, SubmitError
    from tidal.kube.submit.gate import RequirementError, parse_requirement

    if not args.wait:
        given = [
            name
            for name, value in (("--require", args.require or None), ("--timeout", args.timeout), ("--poll-seconds", args.poll_seconds))
            if value is not None
        ]
        if given:
            raise SubmitError(f"{', '.join(given)} need(s) --wait (the run is followed to its end only with --wait)")
        return None
    try:
        requirements = [parse_requirement(text) for text in args.require]
    except RequirementError as err:
        raise SubmitError(str(err)) from None
    for name, value in (("--timeout", args.timeout), ("--poll-seconds", args.poll_seconds)):
        if value is not None and not value > 0:
            raise SubmitError(f"{name} must be a positive number of seconds, got {value:g}")
    tracking_uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    if requirements and not tracking_uri:
        raise SubmitError("--require reads the run's final metrics from its MLflow run: pass --tracking-uri URI or set MLFLOW_TRACKING_URI")
    return GateOptions(requirements, tracking_uri, args.timeout, args.poll_seconds or POLL_SECONDS, str(params.get("mlflow_ui_url", "")))


def run_via_kfp_local(config_path: str, run_dir: str, overrides: list[str]) -> int:
    """``tidal run --via kfp-local``: the whole pipeline with kfp.local's SubprocessRunner."""
    require_kube_extra()
    from tidal.kube.submit.kfp_local import KfpLocalError, run_pipeline_locally

    try:
        run_pipeline_locally(config_path, run_dir, overrides)
    except KfpLocalError as err:
        print(f"tidal run --via kfp-local: {err}", file=sys.stderr)
        return 1
    return 0
