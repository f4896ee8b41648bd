"""Which KFP backends run the compiled pipeline: the floor, what each release does with the executor-config fields
Tidal's IR uses, and the backend's version as its API reports it.

Each task's Kubernetes settings (kfp-kubernetes' ``KubernetesExecutorConfig``) are parsed twice by the backend,
each time against the proto its release was built with (``tests/data/kfp_protos/``):

- by the API server's workflow compiler, when the run is created, for the task's pod labels and annotations
  (``backend/src/v2/compiler/argocompiler/container.go``). It parses strictly in every release: up to 2.5.x it
  ignores the error and the task's pods get **no labels** (so no NetworkPolicy admission to NATS or MLflow, no
  Kueue queue); from 2.14.0 the error fails the run's creation;
- by the driver, before the task's pod exists (``backend/src/v2/cmd/driver/main.go``): strictly up to 2.4.0 (the
  task fails), dropping what it does not know from 2.4.1 on.

So the compiled IR carries only fields the floor's proto knows: :func:`strip_above_floor` removes the later ones
at compile time, and :data:`NOT_CARRIED` says why the pipeline does not need them.
"""

from __future__ import annotations

import json
import re
from typing import Any

BACKEND_FLOOR = (2, 5, 0)
"""The oldest KFP backend the compiled pipeline runs on (Kubeflow 1.10 ships 2.5.0)."""

DRIVER_STRICT_THROUGH = (2, 4, 0)
"""The last release whose driver refuses an executor-config field it does not know (``jsonpb.UnmarshalString``);
2.4.1 on parse with ``util.UnmarshalString`` (unknown fields dropped)."""

COMPILER_FAILS_FROM = (2, 14, 0)
"""The first release whose workflow compiler fails the run on an unknown executor-config field; before it, the
compiler ignores the error and leaves the task's pod metadata (labels, annotations) unset."""

PIPELINE_STORE_FROM = (2, 14, 0)
"""The first release whose ``/apis/v2beta1/healthz`` answer has ``pipeline_store`` (a lower bound for a backend
that reports no version)."""

FIELD_SINCE = {
    "activeDeadlineSeconds": (2, 0, 0),
    "configMapAsEnv": (2, 0, 0),
    "configMapAsEnv[].configMapName": (2, 0, 0),
    "configMapAsEnv[].keyToEnv": (2, 0, 0),
    "configMapAsEnv[].configMapNameParameter": (2, 5, 0),
    "configMapAsEnv[].optional": (2, 15, 0),
    "configMapAsVolume": (2, 0, 0),
    "configMapAsVolume[].configMapName": (2, 0, 0),
    "configMapAsVolume[].mountPath": (2, 0, 0),
    "configMapAsVolume[].optional": (2, 0, 0),
    "configMapAsVolume[].configMapNameParameter": (2, 5, 0),
    "emptyDirMounts": (2, 0, 0),
    "fieldPathAsEnv": (2, 0, 0),
    "nodeSelector": (2, 0, 0),
    "podMetadata": (2, 0, 0),
    "pvcMount": (2, 0, 0),
    "pvcMount[].constant": (2, 0, 0),
    "pvcMount[].mountPath": (2, 0, 0),
    "pvcMount[].pvcNameParameter": (2, 5, 0),
    "secretAsEnv": (2, 0, 0),
    "secretAsEnv[].secretName": (2, 0, 0),
    "secretAsEnv[].keyToEnv": (2, 0, 0),
    "secretAsEnv[].secretNameParameter": (2, 5, 0),
    "secretAsEnv[].optional": (2, 15, 0),
    "secretAsVolume": (2, 0, 0),
    "secretAsVolume[].secretName": (2, 0, 0),
    "secretAsVolume[].mountPath": (2, 0, 0),
    "secretAsVolume[].optional": (2, 0, 0),
    "secretAsVolume[].secretNameParameter": (2, 5, 0),
    "securityContext": (2, 16, 0),
    "tolerations": (2, 0, 0),
}
"""Each executor-config field (a path of JSON names) kfp-kubernetes may write for Tidal: the first KFP backend
whose proto knows it."""

NOT_CARRIED = {
    "configMapAsEnv[].optional": "Tidal's ConfigMap keys are all required",
    "secretAsEnv[].optional": "the platform's Secrets hold every key, empty where unset, and Tidal treats empty as unset",
    "securityContext": "the images run as USER 1000, and every step refuses to run as root in a KFP pod",
}
"""The fields later than the floor, which the compiled IR leaves out, and why the pipeline does not need them."""

NAME_PARAMETER_FALLBACK = {
    "configMapAsEnv[].configMapNameParameter": "configMapName",
    "configMapAsVolume[].configMapNameParameter": "configMapName",
    "pvcMount[].pvcNameParameter": "constant",
    "secretAsEnv[].secretNameParameter": "secretName",
    "secretAsVolume[].secretNameParameter": "secretName",
}
"""Fields the floor knows and older releases do not: each has an older field, set too, naming the same object."""


class BackendTooOld(ValueError):
    """The KFP backend is below :data:`BACKEND_FLOOR`, or cannot read the compiled pipeline; one line."""


def parse_version(text: str) -> tuple[int, int, int] | None:
    """``"2.5.0"``, ``"v2.14.3"``, ``"2.15.0-rc.1"`` → a tuple; None for anything else (``"unknown"``, a commit)."""
    match = re.fullmatch(r"v?(\d+)\.(\d+)(?:\.(\d+))?(?:[-+.].*)?", text.strip())
    return None if match is None else (int(match[1]), int(match[2]), int(match[3] or 0))


def dotted(version: tuple[int, ...]) -> str:
    return ".".join(str(part) for part in version)


def platform_executors(pipeline_documents: list[dict]) -> dict[str, dict]:
    """Each task's executor config of a compiled pipeline (its platform document's ``executors``)."""
    platform = next((d for d in pipeline_documents[1:] if "platforms" in d), {})
    return platform.get("platforms", {}).get("kubernetes", {}).get("deploymentSpec", {}).get("executors", {})


def executor_config_fields(pipeline_documents: list[dict]) -> set[str]:
    """The executor-config field paths (JSON names, ``[]`` for list items; map keys not included) the compiled IR uses."""
    found: set[str] = set()
    for config in platform_executors(pipeline_documents).values():
        for name, value in config.items():
            found.add(name)
            for item in value if isinstance(value, list) else []:
                found.update(f"{name}[].{child}" for child in (item if isinstance(item, dict) else {}))
    return found


def since(field: str) -> tuple[int, int, int]:
    """The first release that knows ``field`` (a list item's field without a rule of its own: its list's); a field
    Tidal has no rule for counts as unknown to every release."""
    return FIELD_SINCE.get(field, FIELD_SINCE.get(field.split("[]")[0], (99, 0, 0)))


def strip_above_floor(pipeline_documents: list[dict]) -> None:
    """Remove, in place, the executor-config fields the floor's proto does not know (:data:`NOT_CARRIED`)."""
    for config in platform_executors(pipeline_documents).values():
        for field in NOT_CARRIED:
            name, _, child = field.partition("[].")
            if not child:
                config.pop(name, None)
            for item in config.get(name, []) if child else []:
                item.pop(child, None)


def unknown_to(version: tuple[int, int, int], fields: set[str]) -> set[str]:
    """Which of ``fields`` a release's proto does not know."""
    return {f for f in fields if version < since(f)}


def consequence(version: tuple[int, int, int], unknown: set[str]) -> str | None:
    """What a release does with a pipeline whose executor configs carry ``unknown`` fields; None when there are none."""
    if not unknown:
        return None
    if version <= DRIVER_STRICT_THROUGH:
        return "its driver refuses them: every task fails before its pod starts"
    if version >= COMPILER_FAILS_FROM:
        return "its API server refuses them: the run is not created"
    return "its API server then sets no pod labels: no NetworkPolicy admission to NATS or MLflow, no Kueue queue"


def check_backend(version_text: str, pipeline_documents: list[dict]) -> list[str]:
    """Raise :class:`BackendTooOld` (one line) below the floor or where the release cannot read the pipeline; else
    notes (a version that is not a release)."""
    version = parse_version(version_text)
    if version is None:
        return [f"the KFP backend reports version {version_text!r}, not a release: Tidal needs {dotted(BACKEND_FLOOR)} or later"]
    unknown = unknown_to(version, executor_config_fields(pipeline_documents))
    effect = consequence(version, unknown)
    if version < BACKEND_FLOOR:
        why = f": it does not know executor-config fields the pipeline uses ({', '.join(sorted(unknown))}) and {effect}" if effect else ""
        raise BackendTooOld(
            f"KFP backend {dotted(version)} is below Tidal's floor {dotted(BACKEND_FLOOR)} (Kubeflow 1.10){why}; "
            f"upgrade the KFP backend to {dotted(BACKEND_FLOOR)} or later"
        )
    if effect:
        raise BackendTooOld(
            f"KFP backend {dotted(version)} does not know executor-config fields the pipeline uses ({', '.join(sorted(unknown))}): {effect}"
        )
    return []


def healthz(client: Any) -> dict:
    """The KFP API's ``/apis/v2beta1/healthz`` answer as JSON (kfp's client model keeps only ``multi_user``)."""
    response = client._healthz_api.healthz_service_get_healthz(_preload_content=False)
    body = response.data.decode() if isinstance(response.data, bytes) else str(response.data)
    try:
        payload = json.loads(body or "{}")
    except json.JSONDecodeError:
        return {}
    return payload if isinstance(payload, dict) else {}


def version_of(payload: dict, stated: str | None = None) -> tuple[str, list[str]]:
    """The version to check a backend at, from its healthz answer, and notes on how it was found.

    ``tag_name`` is the release only where the API server's image was built with it: KFP's own release images
    from 2.4.0 to 2.15.x report ``"unknown"``. Then ``stated`` (``tidal submit --backend-version``) is used, or
    :data:`PIPELINE_STORE_FROM` where the answer has ``pipeline_store``; else the version stays unknown."""
    tag = str(payload.get("tag_name") or "unknown")
    if parse_version(tag) is not None:
        return tag, []
    if stated:
        return stated, [f"the KFP backend reports version {tag!r}: checked as {stated} (--backend-version)"]
    if "pipeline_store" in payload:
        floor = dotted(PIPELINE_STORE_FROM)
        return floor, [f"the KFP backend reports version {tag!r}; its healthz has pipeline_store, so it is {floor} or later"]
    return tag, [
        f"the KFP backend reports version {tag!r} (KFP's release images before 2.16 do) and no pipeline_store, so it is "
        f"older than {dotted(PIPELINE_STORE_FROM)}: Tidal needs {dotted(BACKEND_FLOOR)} or later (on 2.4.0 every task fails "
        "at its driver); pass --backend-version to check it"
    ]
