"""`tidal serve-reward MODEL_DIR --port P`: a sequence-classification reward model behind HTTP
(FastAPI + uvicorn), speaking OpenRLHF's remote reward-model protocol:

    POST /  (or /get_reward)   {"query": [...], "prompts": [...], "labels": [...]}  ->  {"rewards": [...]}

`query` is prompt + completion as text; the reward is the model's first logit (or its sigmoid,
--output sigmoid, or 1/0 by its sign, --output binary). GET /health answers once the model is loaded. `tidal run` starts one for each
reward.functions entry with `serve` (RewardServers), beside nats-server, and stops it with the run."""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import socket
import subprocess
import sys
import threading
import time
import typing
import urllib.request
from pathlib import Path

from tidal.config.reward import RewardOutput
from tidal.rewards.score_head import NoScoreHeadError, architecture_without_score_head, check_score_head
from tidal.supervise import RoleFailed

log = logging.getLogger(__name__)

MAX_RESTARTS = 3
READY_TIMEOUT_SECONDS = 300.0  # loading a large reward model takes a while


class RewardModel:
    """The model and tokenizer of MODEL_DIR, scoring texts in batches of `batch_size` (no gradients)."""

    def __init__(self, model_dir: str | Path, batch_size: int = 64, output: str = "logit", device: str = "cpu"):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        model, loading = AutoModelForSequenceClassification.from_pretrained(model_dir, output_loading_info=True)
        check_score_head(model_dir, loading["missing_keys"])
        self.model = model.to(device).eval()
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.batch_size, self.output, self.device, self.torch = batch_size, output, device, torch

    def score(self, texts: list[str]) -> list[float]:
        out: list[float] = []
        for i in range(0, len(texts), self.batch_size):
            out.extend(self._forward(texts[i : i + self.batch_size]))
        return out

    def _forward(self, texts: list[str]) -> list[float]:
        # the texts carry whatever special tokens the policy's prompts had (OpenRLHF decodes them so)
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
        with self.torch.no_grad():
            logits = self.model(**enc).logits[:, 0].float()
        if self.output == "sigmoid":
            logits = self.torch.sigmoid(logits)
        elif self.output == "binary":
            logits = (logits > 0).float()
        return [float(x) for x in logits.tolist()]


def build_app(model: RewardModel):
    from fastapi import FastAPI, HTTPException
    from pydantic import BaseModel

    class RewardRequest(BaseModel):
        query: list[str]
        prompts: list[str] | None = None
        labels: list[str] | None = None

    app = FastAPI(title="tidal reward server")

    @app.get("/health")
    def health() -> dict:
        return {"ok": True}

    def get_reward(request):
        rewards = model.score(request.query)
        if not all(math.isfinite(r) for r in rewards):
            raise HTTPException(status_code=500, detail="the model gave a non-finite reward")
        return {"rewards": rewards, "scores": rewards}

    get_reward.__annotations__ = {"request": RewardRequest, "return": dict}  # the class itself: this module's annotations are strings

    app.post("/")(get_reward)
    app.post("/get_reward")(get_reward)
    return app


def register(sub) -> None:
    p = sub.add_parser("serve-reward", help="serve a sequence-classification reward model over HTTP (OpenRLHF's remote RM protocol)")
    p.add_argument("model_dir", help="a Hugging Face directory of an AutoModelForSequenceClassification")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--batch-size", type=int, default=64, help="rows per forward pass")
    p.add_argument(
        "--output",
        choices=typing.get_args(RewardOutput),
        default="logit",
        help="the reward: the first logit, its sigmoid, or 1 when it is positive (else 0)",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch threads (CPU); default: torch's own")
    p.set_defaults(func=serve_command)


def serve_command(args: argparse.Namespace) -> int:
    import uvicorn

    from tidal.logs import setup_logging

    setup_logging()
    if not Path(args.model_dir, "config.json").is_file():
        raise FileNotFoundError(f"{args.model_dir} is not a model directory (no config.json)")
    architecture = architecture_without_score_head(args.model_dir)
    if architecture is not None:
        raise NoScoreHeadError(
            f"{args.model_dir} is a {architecture}, not a reward model: its config.json names no ForSequenceClassification architecture (no trained score head)"
        )
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model = RewardModel(args.model_dir, args.batch_size, args.output, args.device)
    log.info("serving reward model %s on http://%s:%d", args.model_dir, args.host, args.port)
    uvicorn.run(build_app(model), host=args.host, port=args.port, log_level="warning")
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


class RewardServer:
    """One `tidal serve-reward` child process on 127.0.0.1, restarted on its port when it dies."""

    def __init__(self, label: str, serve, log_file: Path, popen_options: dict | None = None, model: str | Path | None = None):
        self.label, self.serve, self.log_file = label, serve, log_file
        self.model = model or serve.model
        self.port = serve.port or free_port()
        self.options = popen_options or {}
        self.proc: subprocess.Popen | None = None
        self.restarts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/get_reward"

    def start(self) -> None:
        cmd = [sys.executable, "-m", "tidal.cli", "serve-reward", str(self.model), "--port", str(self.port)]
        cmd += ["--batch-size", str(self.serve.batch_size), "--output", self.serve.output, "--threads", str(self.serve.threads)]
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with self.log_file.open("ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, **self.options)
        deadline = time.time() + READY_TIMEOUT_SECONDS
        health = f"http://127.0.0.1:{self.port}/health"
        while not healthy(health):
            if self.proc.poll() is not None:
                raise RoleFailed(f"reward server for {self.label!r} exited with code {self.proc.returncode} while starting: see {self.log_file}")
            if time.time() > deadline:
                self.stop()
                raise RoleFailed(
                    f"reward server for {self.label!r} did not answer on port {self.port} within {READY_TIMEOUT_SECONDS:g}s: see {self.log_file}"
                )
            time.sleep(0.2)
        log.info("reward server for %s ready on %s (pid %d)", self.label, self.url, self.proc.pid)

    def check(self) -> None:
        """Restarts a server that died, on the same port (its requests meanwhile are retried)."""
        if self.proc is None or self.proc.poll() is None:
            return
        self.restarts += 1
        if self.restarts > MAX_RESTARTS:
            raise RoleFailed(f"reward server for {self.label!r} exited with code {self.proc.returncode} {self.restarts} times: see {self.log_file}")
        log.warning("reward server for %s exited with code %s; restarting it on port %d", self.label, self.proc.returncode, self.port)
        self.start()

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class RewardServers:
    """The reward servers a run's config asks `tidal run` for (reward.functions entries with `serve`)."""

    def __init__(self, cfg, logs: Path, popen_options: dict | None = None, base_model: str | Path | None = None):
        """`base_model`: the run's warm start, which the built-in reward model (`serve.model` unset) starts from."""
        self.servers = []
        for f in cfg.reward.functions:
            if f.type != "reward_model" or f.serve is None:
                continue
            model = f.serve.model
            if model is None:
                from tidal.model.base_model import prepare_reward_model

                model = prepare_reward_model(cfg, base_model)
            self.servers.append(RewardServer(f.label, f.serve, logs / f"reward-server-{f.label}.log", popen_options, model))

    def start(self) -> dict[str, str]:
        """Starts them all, waits until each answers; {reward label: url} for the roles (RunDir.save_reward_servers)."""
        try:
            for s in self.servers:
                s.start()
        except BaseException:
            self.stop()
            raise
        return {s.label: s.url for s in self.servers}

    def check(self) -> None:
        for s in self.servers:
            s.check()

    @contextlib.contextmanager
    def watched(self, every: float = 1.0):
        """Checks the servers on a thread of its own while the block runs (sync mode, where no launcher
        loop would): a server that dies is restarted; after MAX_RESTARTS the watch ends, and the
        requests that then fail stop the run through the endpoint's error rate."""
        done = threading.Event()

        def watch() -> None:
            while not done.wait(every):
                try:
                    self.check()
                except RoleFailed as err:
                    log.error("%s", err)
                    return

        thread = threading.Thread(target=watch, name="reward-servers", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            done.set()
            thread.join()

    def stop(self) -> None:
        for s in self.servers:
            s.stop()
