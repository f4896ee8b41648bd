"""Rewards from served models: a reward model behind HTTP (OpenRLHF's remote RM protocol, or vLLM's
/classify) and an LLM judge behind an OpenAI-compatible /chat/completions endpoint.

Requests go out from one asyncio loop on a thread of the worker's own (httpx), so scoring one engine
call's groups overlaps the engine's next call. Samples are batched across groups up to `batch_size`
per request, at most `concurrency` requests in flight. A request that times out, gets a 5xx or 429,
loses its connection or gets an unusable answer (not JSON, the wrong count, a non-finite number) is
retried `retries` times with exponential back-off; after that its samples score 0 and are counted
as reward errors. When more than `max_error_rate` of the last `error_window` requests failed,
scoring raises RewardServerError (the run stops, naming the endpoint)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import threading
import time
from dataclasses import dataclass, field

from tidal.config import JudgeRewardConfig, RewardFunctionConfig, ServedRewardConfig
from tidal.rewards.failures import FailureWindow, RewardFailingError

log = logging.getLogger(__name__)


class RewardServerError(RewardFailingError):
    """A served reward failed too often: the run stops (one line, naming the endpoint)."""


class UnusableAnswer(ValueError):
    """The server answered, but not with what the protocol says (retried like a 5xx)."""


class Refused(ValueError):
    """The server refused the request for good (a 4xx other than 429): not retried."""


@dataclass(frozen=True)
class Row:
    """One sample to score: the prompt as the policy saw it, its completion, the reference answer."""

    prompt: str
    completion: str
    answer: str


@dataclass
class ServedStats:
    """Counts since the last `take`: requests, retries, failed requests (after retries), samples sent,
    seconds spent in requests (summed over concurrent ones)."""

    requests: int = 0
    retries: int = 0
    failed: int = 0
    samples: int = 0
    seconds: float = 0.0

    def take(self) -> dict[str, float]:
        out = {
            "reward_server_requests": float(self.requests),
            "reward_server_retries": float(self.retries),
            "reward_server_failed_requests": float(self.failed),
            "reward_server_samples": float(self.samples),
            "reward_server_seconds": self.seconds,
        }
        self.requests = self.retries = self.failed = self.samples = 0
        self.seconds = 0.0
        return out


# --- the protocols: pure functions from rows to a request body, and from an answer to scores ---


def openrlhf_body(rows: list[Row]) -> dict:
    """OpenRLHF's remote reward model: `query` is prompt + completion (what the policy produced, in
    full), `prompts` the prompts, `labels` the reference answers."""
    return {"query": [r.prompt + r.completion for r in rows], "prompts": [r.prompt for r in rows], "labels": [r.answer for r in rows]}


def openrlhf_scores(answer: object, count: int) -> list[float]:
    if not isinstance(answer, dict) or "rewards" not in answer:
        raise UnusableAnswer(f"expected a JSON object with 'rewards', got {_short(answer)}")
    return finite_list(answer["rewards"], count)


def classify_body(rows: list[Row], model: str) -> dict:
    return {"model": model, "input": [r.prompt + r.completion for r in rows]}


def classify_scores(answer: object, count: int) -> list[float]:
    """vLLM's /classify: each input's `probs`; the reward is the last one (a one-label reward model's
    score, or a binary classifier's positive class)."""
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list):
        raise UnusableAnswer(f"expected a JSON object with 'data', got {_short(answer)}")
    if len(data) != count:
        raise UnusableAnswer(f"{len(data)} results for {count} inputs")
    try:
        ordered = sorted(data, key=lambda d: d["index"])
        return finite_list([d["probs"][-1] for d in ordered], count)
    except (KeyError, IndexError, TypeError) as err:
        raise UnusableAnswer(f"a result without index or probs ({err})") from None


def finite_list(values: object, count: int) -> list[float]:
    if not isinstance(values, list):
        raise UnusableAnswer(f"expected a list of {count} numbers, got {_short(values)}")
    if len(values) != count:
        raise UnusableAnswer(f"{len(values)} scores for {count} samples")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise UnusableAnswer(f"score {v!r} is not a finite number")
        out.append(float(v))
    return out


def judge_body(row: Row, cfg: JudgeRewardConfig, seed: int | None) -> dict:
    """One chat completion request: the rubric with the sample filled in, `samples` replies."""
    body = {
        "model": cfg.model,
        "messages": [{"role": "user", "content": cfg.prompt_template.format(prompt=row.prompt, completion=row.completion, answer=row.answer)}],
        "temperature": 0.0 if seed is not None else cfg.temperature,
        "max_tokens": cfg.max_tokens,
        "n": cfg.samples,
    }
    if seed is not None:
        body["seed"] = seed
    return body


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


def judge_score(text: str, how: str, field_name: str = "score") -> float:
    """A judge reply as a score. number: the last number in it; yes_no: the first yes (1) or no (0);
    json: the field of the (first) JSON object in it, true/false as 1/0. UnusableAnswer otherwise."""
    if how == "number":
        found = _NUMBER.findall(text)
        if not found:
            raise UnusableAnswer(f"no number in the judge's reply {_short(text)}")
        return float(found[-1])
    if how == "yes_no":
        found = _YES_NO.search(text)
        if not found:
            raise UnusableAnswer(f"neither yes nor no in the judge's reply {_short(text)}")
        return 1.0 if found.group(1).lower() == "yes" else 0.0
    start, end = text.find("{"), text.rfind("}")
    try:
        verdict = json.loads(text[start : end + 1]) if start >= 0 else None
    except json.JSONDecodeError:
        verdict = None
    if not isinstance(verdict, dict) or field_name not in verdict:
        raise UnusableAnswer(f"no JSON object with {field_name!r} in the judge's reply {_short(text)}")
    value = verdict[field_name]
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    raise UnusableAnswer(f"the judge's {field_name!r} is {value!r}, not a number")


def judge_scores(answer: object, cfg: JudgeRewardConfig) -> float:
    """The mean score over the reply's choices (`samples` of them)."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or len(choices) != cfg.samples:
        raise UnusableAnswer(f"expected {cfg.samples} choice(s), got {_short(answer)}")
    try:
        texts = [c["message"]["content"] for c in choices]
    except (KeyError, TypeError):
        raise UnusableAnswer(f"a choice without message.content: {_short(answer)}") from None
    scores = [judge_score(t or "", cfg.score, cfg.score_field) for t in texts]
    return sum(scores) / len(scores)


def _short(value: object, limit: int = 120) -> str:
    text = value if isinstance(value, str) else repr(value)
    return repr(text[:limit] + "...") if len(text) > limit else repr(text)


def backoff_seconds(first: float, attempt: int) -> float:
    """The wait before retry `attempt` (1, 2, ...): `first`, doubled each time."""
    return first * 2 ** (attempt - 1)


def endpoint_url(cfg: ServedRewardConfig, served_urls: dict[str, str] | None = None) -> str:
    """The url requests go to: the entry's (with the protocol's path), or the one of the server
    `tidal run` started for it (`served_urls`: RunDir.reward_server_urls)."""
    if cfg.type == "reward_model" and cfg.serve is not None:
        urls = served_urls or {}
        if cfg.label not in urls:
            raise RewardServerError(f"reward {cfg.label!r}: serve is set but no reward server was started for it (run it with `tidal run`)")
        return urls[cfg.label]
    base = cfg.url.rstrip("/")
    if cfg.type == "judge":
        return base + "/chat/completions"
    if cfg.protocol == "vllm_classify":
        return base + "/classify"
    return cfg.url


class RewardUnreachableError(ValueError):
    """A served reward's url takes no connection before the run starts (one line, naming it)."""


def connect_address(url: str) -> tuple[str, int]:
    """(host, port) a url's requests connect to: the port it names, else its scheme's."""
    from urllib.parse import urlparse

    parsed = urlparse(url)
    return parsed.hostname or "127.0.0.1", parsed.port or (443 if parsed.scheme == "https" else 80)


def unreachable_rewards(functions: list[RewardFunctionConfig], timeout: float = 5.0) -> list[str]:
    """One line per reward_model / judge entry with a url that takes no TCP connection (refused, no such
    host, no answer within `timeout`): without this check the run would start, and every sample would
    score 0 after its retries. Entries `tidal run` serves itself have no url yet; a url reached through
    a proxy is not checked (a direct connection says nothing about it)."""
    import socket
    import urllib.request

    lines = []
    for f in functions:
        if f.type == "function" or f.url is None:
            continue
        host, port = connect_address(f.url)
        scheme = f.url.split(":", 1)[0]
        if urllib.request.getproxies().get(scheme) and not urllib.request.proxy_bypass(host):
            continue
        try:
            with socket.create_connection((host, port), timeout=timeout):
                continue
        except OSError as err:
            lines.append(f"cannot reach reward {f.label!r} at {f.url} (reward.functions[{f.label}].url): {err}; is its server running?")
    return lines


def check_reward_urls(functions: list[RewardFunctionConfig], timeout: float = 5.0) -> None:
    """The launcher's check before start, beside the MLflow and NATS urls: RewardUnreachableError naming the first unreachable reward."""
    lines = unreachable_rewards(functions, timeout)
    if lines:
        raise RewardUnreachableError(lines[0])


@dataclass
class ServedReward:
    """One reward.functions entry of type reward_model or judge, scored over HTTP."""

    cfg: ServedRewardConfig
    url: str
    seed: int | None = None  # rollout.deterministic: the judge's seed
    stats: ServedStats = field(default_factory=ServedStats)
    last_error: str | None = None
    client: object = None  # httpx.AsyncClient, made on the loop
    window: FailureWindow | None = None

    def __post_init__(self) -> None:
        self.window = FailureWindow(self.cfg.error_window, self.cfg.max_error_rate)
        self.semaphore: asyncio.Semaphore | None = None

    def headers(self) -> dict[str, str]:
        name = self.cfg.api_key_env
        if name is None:
            return {}
        key = os.environ.get(name)
        if not key:
            raise RewardServerError(f"reward {self.cfg.label!r}: api_key_env names {name}, which is not set (or empty) in the environment")
        return {"Authorization": f"Bearer {key}"}

    async def score(self, rows: list[Row]) -> list[float | None]:
        """A score per row; None where its request failed after the retries."""
        import httpx

        if self.client is None:
            limits = httpx.Limits(max_connections=self.cfg.concurrency, max_keepalive_connections=self.cfg.concurrency)
            self.client = httpx.AsyncClient(timeout=self.cfg.timeout_seconds, limits=limits, headers=self.headers())
            self.semaphore = asyncio.Semaphore(self.cfg.concurrency)
        if self.cfg.type == "judge":
            batches = [[r] for r in rows]
        else:
            size = self.cfg.batch_size
            batches = [rows[i : i + size] for i in range(0, len(rows), size)]
        results = await asyncio.gather(*(self._request(b) for b in batches))
        return [s for scores in results for s in scores]

    def _body_and_parser(self, rows: list[Row]):
        c = self.cfg
        if c.type == "judge":
            return judge_body(rows[0], c, self.seed), lambda answer: [judge_scores(answer, c)]
        if c.protocol == "vllm_classify":
            return classify_body(rows, c.model), lambda answer: classify_scores(answer, len(rows))
        return openrlhf_body(rows), lambda answer: openrlhf_scores(answer, len(rows))

    async def _request(self, rows: list[Row]) -> list[float | None]:
        import httpx

        body, parse = self._body_and_parser(rows)
        async with self.semaphore:
            self.stats.requests += 1
            self.stats.samples += len(rows)
            reason = ""
            for attempt in range(self.cfg.retries + 1):
                if attempt:
                    self.stats.retries += 1
                    await asyncio.sleep(backoff_seconds(self.cfg.backoff, attempt))
                t0 = time.perf_counter()
                try:
                    response = await self.client.post(self.url, json=body)
                    if response.status_code == 429 or response.status_code >= 500:
                        raise UnusableAnswer(f"HTTP {response.status_code}")
                    if response.status_code >= 400:
                        raise Refused(f"HTTP {response.status_code}: {_short(response.text)}")
                    try:
                        answer = response.json()
                    except ValueError:
                        raise UnusableAnswer(f"not JSON: {_short(response.text)}") from None
                    scores = parse(answer)
                    self.window.record(False)
                    return scores
                except httpx.TimeoutException:
                    reason = f"no answer within {self.cfg.timeout_seconds:g}s"
                except httpx.TransportError as err:  # refused, reset, closed mid-answer
                    reason = f"connection failed ({type(err).__name__}: {err or 'no detail'})"
                except UnusableAnswer as err:
                    reason = str(err)
                except Refused as err:
                    reason = str(err)
                    break
                finally:
                    self.stats.seconds += time.perf_counter() - t0
            self.stats.failed += 1
            self.window.record(True)
            self.last_error = reason
            log.warning(
                "reward %s: a request of %d sample(s) to %s failed after %d attempt(s): %s (scored 0)",
                self.cfg.label,
                len(rows),
                self.url,
                attempt + 1,
                reason,
            )
            return [None] * len(rows)

    def check_error_rate(self) -> None:
        if self.window.too_many():
            raise RewardServerError(
                f"reward server {self.url} ({self.cfg.label}): {self.window.failures} of the last {len(self.window.outcomes)} requests failed "
                f"after {self.cfg.retries} retries, over max_error_rate {self.cfg.max_error_rate:g} of {self.cfg.error_window}; last: {self.last_error}"
            )

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()


class BackgroundLoop:
    """An asyncio loop on a daemon thread: the served rewards' requests run there, whatever thread asks."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="served-rewards", daemon=True)
        self.thread.start()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self, closing=None) -> None:
        if closing is not None:
            self.run(closing)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()


class ServedRewards:
    """Every served entry of reward.functions, scored together on one background loop."""

    def __init__(self, entries: list[ServedReward]):
        self.entries = entries
        self.loop = BackgroundLoop() if entries else None

    @classmethod
    def from_config(cls, functions: list[RewardFunctionConfig], seed: int | None = None, served_urls: dict[str, str] | None = None) -> ServedRewards:
        served = [f for f in functions if f.type != "function"]
        return cls([ServedReward(f, endpoint_url(f, served_urls), seed if f.type == "judge" else None) for f in served])

    def score(self, rows: list[Row]) -> dict[str, list[float | None]]:
        """reward label -> a score per row (None: failed, to score 0 and count). Raises
        RewardServerError when an endpoint fails more than its max_error_rate."""
        if not self.entries or not rows:
            return {}

        async def all_entries():
            return await asyncio.gather(*(e.score(rows) for e in self.entries))

        results = self.loop.run(all_entries())
        for e in self.entries:
            e.check_error_rate()
        return {e.cfg.label: scores for e, scores in zip(self.entries, results)}

    def last_errors(self) -> dict[str, str]:
        """reward label -> why its last failed request failed (the url named), for the ones that failed."""
        return {e.cfg.label: f"{e.last_error} ({e.url})" for e in self.entries if e.last_error is not None}

    def take_stats(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for e in self.entries:
            for k, v in e.stats.take().items():
                total[k] = total.get(k, 0.0) + v
        return total

    def close(self) -> None:
        if self.loop is None:
            return

        async def close_clients():
            await asyncio.gather(*(e.aclose() for e in self.entries))

        self.loop.close(close_clients())
        self.loop = None
