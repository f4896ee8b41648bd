"""A stand-in for the Kubernetes API server (none can run here), spoken to by the real ``kubernetes`` client over
HTTP: it serves CRDs and cluster-scoped custom objects, and creates namespaced custom objects, refusing unknown
fields as the real one does when the request asks for strict field validation (``fieldValidation=Strict``)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from kubernetes import client as k8s

from tests.crd_schema import schema_errors

CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/"


class StandInApi:
    def __init__(self, crds: list[dict] = (), cluster_objects: dict[str, dict] | None = None):
        self.crds = {crd["metadata"]["name"]: crd for crd in crds}
        self.cluster_objects = dict(cluster_objects or {})  # "/apis/<group>/<version>/<plural>/<name>" -> object
        self.created: list[tuple[str, dict, dict]] = []  # (path, query, body) of each object created
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

            def do_GET(self):
                path = urlparse(self.path).path
                found = api.crds.get(path.removeprefix(CRD_PATH)) if path.startswith(CRD_PATH) else api.cluster_objects.get(path)
                self._reply(200, found) if found is not None else self._not_found()

            def do_POST(self):
                url = urlparse(self.path)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                _, _, group, _version, _, _namespace, plural = url.path.split("/")
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                crd = api.crd_for_plural(group, plural)
                unknown = [e for e in schema_errors(body, crd) if e.endswith("unknown field")] if crd else []
                if unknown and query.get("fieldValidation") == "Strict":
                    message = "strict decoding error: " + ", ".join(unknown)
                    self._reply(
                        400, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "BadRequest", "message": message, "code": 400}
                    )
                    return
                api.created.append((url.path, query, body))
                self._reply(201, body)

        return Handler
