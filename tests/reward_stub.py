"""`python -m tests.reward_stub [--faults F,F,...] [--always KIND] [--delay S] [--record PATH] [--api-key-env NAME]`:
a real HTTP reward server the tests control (standard library, one thread per request). It scores
with exact_match (so a run against it learns what the built-in reward teaches) and speaks:

    POST /rm                    OpenRLHF's remote RM: {"query", "prompts", "labels"} -> {"rewards"}
    POST /v1/classify           vLLM's /classify: {"model", "input"} -> {"data": [{"index", "probs"}]},
                                each input's score its length mod 7, the results in reverse order
    POST /v1/chat/completions   an OpenAI-compatible judge: "yes"/"no" per choice (n of them)

`--faults`: the first requests each misbehave once, in this order: slow (answers after 3 s), 500,
drop (closes the connection without an answer), garbage (200 with a non-JSON body), count (one
reward too few), nan (a NaN reward), 401 (refuses). `--always KIND`: every request does.
`--delay S`: every answer waits S seconds. It prints its port on the first line of stdout."""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tidal.rewards import exact_match

SLOW_SECONDS = 3.0


def judge_verdict(content: str) -> str:
    answer = re.search(r"Reference answer:\n(.*?)\n", content).group(1)
    graded = re.search(r"Answer to grade:\n(.*?)\n\nIs the answer", content, re.S).group(1)
    return "yes" if exact_match(graded, answer) else "no"


class Stub:
    def __init__(self, faults: list[str], always: str | None, delay: float, record: str | None, api_key_env: str | None):
        self.faults, self.always, self.delay, self.record = faults, always, delay, record
        self.key = os.environ.get(api_key_env) if api_key_env else None
        self.lock = threading.Lock()

    def next_fault(self) -> str | None:
        with self.lock:
            if self.always:
                return self.always
            return self.faults.pop(0) if self.faults else None

    def log(self, entry: dict) -> None:
        if self.record:
            with self.lock, open(self.record, "a") as f:
                f.write(json.dumps(entry) + "\n")


def handler_for(stub: Stub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def reply(self, code: int, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            fault = stub.next_fault()
            stub.log({"path": self.path, "body": body, "fault": fault, "authorization": self.headers.get("Authorization")})
            if stub.key is not None and self.headers.get("Authorization") != f"Bearer {stub.key}":
                return self.reply(401, b'{"error": "bad key"}')
            time.sleep(stub.delay)
            if fault == "slow":
                time.sleep(SLOW_SECONDS)
            elif fault in ("500", "401"):
                return self.reply(int(fault), b'{"error": "injected"}')
            elif fault == "drop":
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return None
            elif fault == "garbage":
                return self.reply(200, b"<html>not json</html>")
            if self.path == "/rm":
                rewards = [exact_match(q[len(p) :], label) for q, p, label in zip(body["query"], body["prompts"], body["labels"])]
                if fault == "count":
                    rewards = rewards[:-1]
                if fault == "nan":
                    rewards[0] = float("nan")
                return self.reply(200, json.dumps({"rewards": rewards}).encode())
            if self.path == "/v1/classify":
                data = [{"index": i, "label": None, "probs": [float(len(text) % 7)], "num_classes": 1} for i, text in enumerate(body["input"])]
                return self.reply(200, json.dumps({"data": data[::-1], "model": body["model"]}).encode())
            if self.path == "/v1/chat/completions":
                verdict = judge_verdict(body["messages"][0]["content"])
                choices = [{"index": i, "message": {"role": "assistant", "content": f"The answer is correct: {verdict}."}} for i in range(body["n"])]
                return self.reply(200, json.dumps({"choices": choices, "model": body["model"]}).encode())
            return self.reply(404, b'{"error": "no such path"}')

    return Handler


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--faults", default="")
    p.add_argument("--always", default=None)
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--record", default=None)
    p.add_argument("--api-key-env", default=None)
    args = p.parse_args(argv)
    stub = Stub([f for f in args.faults.split(",") if f], args.always, args.delay, args.record, args.api_key_env)
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler_for(stub))
    server.daemon_threads = True
    print(server.server_address[1], flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
