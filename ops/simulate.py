"""Simulated editor sessions: real held-out code files replayed as an editor would.

Each simulated user opens a held-out file, places the cursor at a line in it, and asks for
a completion with the code before the cursor as prefix and the code after the line as
suffix. The true continuation is the rest of that line (and the next lines). The user
reports `view`, then accepts when the suggestion matches the truth (fully, or partly by
line or by word) and dismisses otherwise; a few seconds later it sends `edit` with the
text it kept. Empty suggestions are not shown, so they get no event.

The user's judgement and the events it sends for it (`learner.judge.judge` and `editor_events`)
are pure: the learner's held-out replay uses the same ones; this module only puts them on the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pydantic import Field, SecretStr

from feedback.core.config import FlywheelSettings, Section
from feedback.core.stats import percentile
from feedback.reward import Event
from learner.judge import Site, editor_events, judge


class SimulateSection(Section):
    url: str = ""
    """The API to call. Empty: this machine's `flywheel serve` (serve.host and serve.port)."""
    token: SecretStr = SecretStr("")
    """Editor token to send. Empty: the first of serve.auth_tokens / serve.auth_tokens_file."""
    requests: int = Field(default=100, ge=1)
    """Completions to request in all."""
    users: int = Field(default=4, ge=1)
    """Simulated editors working at once."""
    rate: float = Field(default=2.0, gt=0)
    """Requests per second, over all users."""
    edit_delay_s: float = Field(default=2.0, ge=0)
    """Seconds between accepting a suggestion and reporting the text kept (`edit`)."""
    max_tokens: int = Field(default=32, ge=1)
    timeout_s: float = Field(default=30.0, gt=0)
    """How long an editor waits for one call; a slower answer counts as a failed request (with its
    reason) and the session goes on."""
    seed: int = 0
    corpus: str | None = None
    """Folder of source files whose held-out split is replayed. Empty: the standard library."""


class SimulateSettings(FlywheelSettings):
    """The `[simulate]` section on top of the shared settings (`flywheel simulate` adds `[serve]`,
    to find the API and an editor token when the section names none)."""

    simulate: SimulateSection = SimulateSection()


@dataclass
class SimStats:
    requests: int = 0
    shown: int = 0
    accepted: int = 0
    accepted_chars: int = 0
    events: int = 0
    skipped: int = 0  # sites not requested because the deadline passed
    failures: Counter = field(default_factory=Counter)  # "completion: timeout", "event: HTTP 503", ... -> count
    by_version: dict[str, dict[str, int]] = field(default_factory=dict)
    latency_ms: dict[str, list[float]] = field(default_factory=dict)  # answered completions, per served version

    @property
    def errors(self) -> int:
        """Failed calls of any kind (completions and events); the loop went on after each."""
        return sum(self.failures.values())

    @property
    def failed_completions(self) -> int:
        return sum(n for k, n in self.failures.items() if k.startswith("completion"))

    @property
    def accept_rate(self) -> float:
        return self.accepted / self.shown if self.shown else 0.0

    @property
    def suggestion_rate(self) -> float:
        answered = self.requests - self.failed_completions
        return self.shown / answered if answered > 0 else 0.0

    def failure_line(self) -> str:
        """ "3 completion: timeout, 1 event: HTTP 503", most frequent first; "none" when nothing failed."""
        return ", ".join(f"{n} {k}" for k, n in self.failures.most_common()) or "none"

    def latency_summary(self) -> dict[str, dict[str, float]]:
        """Per version: answered requests, p50 and p99 completion latency in ms (nearest rank)."""
        return {
            v: {"n": len(xs), "p50_ms": percentile(xs, 0.50, empty=0.0), "p99_ms": percentile(xs, 0.99, empty=0.0)}
            for v, xs in sorted(self.latency_ms.items())
            if xs
        }


def failure_reason(exc: BaseException | None = None, status: int | None = None) -> str:
    """What went wrong with one call, as an editor would see it: a timeout, a refused or dropped
    connection, or the HTTP status."""
    import httpx

    if status is not None:
        return f"HTTP {status}"
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    if isinstance(exc, httpx.TransportError):
        return f"connection error ({type(exc).__name__})"
    return f"{type(exc).__name__}"


def event_body(e: Event, completion_id: str, elapsed_ms: float) -> tuple[dict, str]:
    """(JSON body, query string) of the POST /v1/events call that reports `e` about choice 0
    (an `edit` names the completion only)."""
    body: dict = {"type": e.type, "completion_id": completion_id}
    if e.type != "edit":
        body["choice_index"] = 0
    if e.type == "view":
        body |= {"view_id": uuid.uuid4().hex, "elapsed": int(elapsed_ms)}
    elif e.type == "select":
        body["accepted_chars"] = e.accepted_chars
        return body, f"?select_kind={e.select_kind}"
    elif e.type == "edit":
        body["kept_text"] = e.kept_text
    return body, ""


async def run_sessions(
    url: str,
    token: str,
    sites: Sequence[Site],
    cfg: SimulateSection,
    *,
    progress=lambda stats: None,
    deadline: float | None = None,
    until: Callable[[], bool] | None = None,
) -> SimStats:
    """Replay `sites` as `cfg.users` editors at about `cfg.rate` requests/s in all, over the real HTTP API.

    A call that times out (`cfg.timeout_s`), cannot connect, or gets an error status is counted in
    `stats.failures` with its reason and the session goes on, as an editor would: a slow or
    restarting replica costs that suggestion, not the run. `deadline` (time.monotonic()): start no
    request after it; the sites left are counted as skipped. `until`: checked about once a second;
    once it returns True, no request starts either (the run ends early)."""
    import httpx

    users, rate, edit_delay_s, timeout_s = cfg.users, cfg.rate, cfg.edit_delay_s, cfg.timeout_s
    stats = SimStats()
    rng = random.Random(cfg.seed)
    pending_edits: list[asyncio.Task] = []
    async with httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s
    ) as client:

        async def post(kind: str, path: str, body: dict) -> httpx.Response | None:
            """The response when it is a 200; else None, with the failure counted."""
            try:
                r = await client.post(path, json=body)
            except httpx.HTTPError as e:
                stats.failures[f"{kind}: {failure_reason(e)}"] += 1
                return None
            if r.status_code != 200:
                stats.failures[f"{kind}: {failure_reason(status=r.status_code)}"] += 1
                return None
            return r

        async def event(body: dict, query: str = "") -> None:
            if await post("event", f"/v1/events{query}", body) is not None:
                stats.events += 1

        async def later_edit(body: dict) -> None:
            await asyncio.sleep(edit_delay_s)
            await event(body)

        async def one(site: Site, user: str) -> None:
            stats.requests += 1
            req = {
                "language": site.language,
                "segments": {"prefix": site.prefix, "suffix": site.suffix, "filepath": site.path},
                "user": user,
                "seed": rng.randrange(2**31),
            }
            t0 = time.perf_counter()
            r = await post("completion", "/v1/completions", req)
            if r is None:
                progress(stats)
                return
            body = r.json()
            cid, text = body["id"], body["choices"][0]["text"]
            version = body.get("system_fingerprint") or "?"
            elapsed_ms = (time.perf_counter() - t0) * 1000
            stats.latency_ms.setdefault(version, []).append(elapsed_ms)
            per = stats.by_version.setdefault(version, {"requests": 0, "shown": 0, "accepted": 0, "accepted_chars": 0})
            per["requests"] += 1
            verdict = judge(text, site.truth)
            if verdict.type == "none":
                progress(stats)
                return
            stats.shown += 1
            per["shown"] += 1
            for e in editor_events(verdict):
                if e.type == "select":
                    stats.accepted += 1
                    stats.accepted_chars += e.accepted_chars
                    per["accepted"] += 1
                    per["accepted_chars"] += e.accepted_chars
                body, query = event_body(e, cid, elapsed_ms)
                if e.type == "edit":  # the kept text is known a little after the accept
                    pending_edits.append(asyncio.create_task(later_edit(body)))
                else:
                    await event(body, query)
            progress(stats)

        sem = asyncio.Semaphore(users)
        interval = 1.0 / rate if rate > 0 else 0.0
        ended = asyncio.Event()

        async def watch() -> None:
            while not ended.is_set():
                if until is not None and until():
                    ended.set()
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ended.wait(), 1.0)

        async def paced(i: int, site: Site) -> None:
            with contextlib.suppress(TimeoutError):  # its slot, unless the run ends first
                await asyncio.wait_for(ended.wait(), i * interval)
            async with sem:
                if ended.is_set() or (deadline is not None and time.monotonic() >= deadline):
                    stats.skipped += 1
                    return
                await one(site, f"sim-user-{i % max(1, users * 4)}")

        watcher = asyncio.create_task(watch())
        await asyncio.gather(*(paced(i, s) for i, s in enumerate(sites)))
        ended.set()
        await watcher
        await asyncio.gather(*pending_edits)
    return stats
