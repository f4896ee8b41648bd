"""A stand-in for the Kubernetes API server (none can run here), spoken to by the real ``kubernetes`` client over
HTTP: it serves CRDs and fixed objects (cluster-scoped custom objects, a pod), creates namespaced objects, refusing
unknown fields as the real one does when the request asks for strict field validation (``fieldValidation=Strict``):
custom objects against their CRD, built-in kinds (a Deployment) against the Kubernetes schema of
kubernetes-validate; and deletes what it created. With ``refuse_duplicates`` a second object of the same name is
refused (409 AlreadyExists), as the real one does."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from kubernetes import client as k8s

from tests.crd_schema import schema_errors

CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/"
BUILT_IN_GROUPS = {"apps", "networking.k8s.io"}
"""Kinds the API server knows without a CRD; their schema is Kubernetes' own (kubernetes-validate's copy)."""


def built_in_errors(body: dict) -> list[str]:
    """Every schema error of a built-in object, as the strict decoder reports unknown fields (one line each)."""
    import kubernetes_validate

    from tidal.kube.cluster import KUBERNETES_VERSION

    try:
        kubernetes_validate.validate(body, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as err:
        return [f"{'.'.join(str(p) for p in err.path)}: {err.message}"]
    return []


class StandInApi:
    def __init__(self, crds: list[dict] = (), cluster_objects: dict[str, dict] | None = None, refuse_duplicates: bool = False):
        self.crds = {crd["metadata"]["name"]: crd for crd in crds}
        self.cluster_objects = dict(cluster_objects or {})  # "/apis/<group>/<version>/<plural>/<name>" -> object
        self.created: list[tuple[str, dict, dict]] = []  # (path, query, body) of each object created
        self.deleted: list[str] = []  # the path of each object deleted
        self.refuse_duplicates = refuse_duplicates
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> StandInApi:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def api_client(self) -> k8s.ApiClient:
        config = k8s.Configuration(host=f"http://127.0.0.1:{self._server.server_address[1]}")
        return k8s.ApiClient(config)

    def crd_for_plural(self, group: str, plural: str) -> dict | None:
        return self.crds.get(f"{plural}.{group}")

    def live_objects(self) -> dict[str, dict]:
        """``<collection path>/<name>`` of every object created and not deleted since."""
        objects = {f"{path}/{body['metadata']['name']}": body for path, _, body in self.created}
        return {path: body for path, body in objects.items() if path not in self.deleted}

    def _handler(self):
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _not_found(self) -> None:
                self._reply(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404})

            def _refuse(self, code: int, reason: str, message: str) -> None:
                self._reply(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "message": message, "code": code})

            def do_GET(self):
                path = urlparse(self.path).path
                found = api.crds.get(path.removeprefix(CRD_PATH)) if path.startswith(CRD_PATH) else api.cluster_objects.get(path)
                self._reply(200, found) if found is not None else self._not_found()

            def do_DELETE(self):
                path = urlparse(self.path).path
                live = api.live_objects()
                if path not in live:
                    self._not_found()
                    return
                api.deleted.append(path)
                self._reply(200, {"kind": "Status", "apiVersion": "v1", "status": "Success"})

            def do_POST(self):
                url = urlparse(self.path)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                _, _, group, _version, _, _namespace, plural = url.path.split("/")
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                crd = api.crd_for_plural(group, plural)
                unknown = [e for e in schema_errors(body, crd) if e.endswith("unknown field")] if crd else []
                if group in BUILT_IN_GROUPS:
                    unknown = built_in_errors(body)
                if unknown and query.get("fieldValidation") == "Strict":
                    self._refuse(400, "BadRequest", "strict decoding error: " + ", ".join(unknown))
                    return
                if api.refuse_duplicates and f"{url.path}/{body['metadata']['name']}" in api.live_objects():
                    self._refuse(409, "AlreadyExists", f"{plural} {body['metadata']['name']!r} already exists")
                    return
                api.created.append((url.path, query, body))
                self._reply(201, body)

        return Handler
