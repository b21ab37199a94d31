"""Simulated editor sessions: real held-out code files replayed as an editor would.

Each simulated user opens a held-out file, places the cursor at a line in it, and asks for
a completion with the code before the cursor as prefix and the code after the line as
suffix. The true continuation is the rest of that line (and the next lines). The user
reports `view`, then accepts when the suggestion matches the truth (fully, or partly by
line or by word) and dismisses otherwise; a few seconds later it sends `edit` with the
text it kept. Empty suggestions are not shown, so they get no event.

Each editor keeps its own record of every call (`SimStats.calls`): the completion id it was
served, the `event_id` it chose for each event (sent again, with the same id, after a call that
got no answer, a 429 or a 5xx), and the HTTP status or why there was none. `flywheel soak`
compares that client-side view with what reached SQL.

Same-file sessions (`simulate.same_file`): each simulated editor walks down one file
(`learner.judge.file_walks`), asking at successive cursors a few lines apart, one request after
the other, and completes each line before moving on, so the next request's prefix carries what
became of the previous suggestion: what the sink's implicit feedback reads (feedback/implicit.py).
With `simulate.explicit_events` off the editors send no events at all, as Continue, llama.vscode
and Ollama clients do.

The user's judgement and the events it sends for it (`learner.judge.judge` and `editor_events`)
are pure: the learner's held-out replay uses the same ones; this module only puts them on the wire.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pydantic import Field, SecretStr

from feedback.core.config import FlywheelSettings, Section
from feedback.core.server_timing import breakdown, parse_header
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
    event_retries: int = Field(default=2, ge=0, le=10)
    """How many times an event is sent again after a call that got no answer, a 429 or a 5xx; it keeps
    its `event_id`, so the server stores it once however many copies arrive."""
    same_file: bool = False
    """Each editor walks down one file, requesting at successive cursors in order (see the module
    docstring); `requests` counts the completions of all walks together."""
    walk_sites: int = Field(default=8, ge=2)
    """Requests per walk down a file (same_file)."""
    explicit_events: bool = True
    """Send view, select, dismiss and edit events. False: send none, as editors without an events API do."""
    seed: int = 0
    corpus: str | None = None
    """Folder of source files whose held-out split is replayed. Empty: the standard library."""


class SimulateSettings(FlywheelSettings):
    """The `[simulate]` section on top of the shared settings (`flywheel simulate` adds `[serve]`,
    to find the API and an editor token when the section names none)."""

    simulate: SimulateSection = SimulateSection()


@dataclass(frozen=True)
class Call:
    """One HTTP call as the editor saw it."""

    kind: str  # "completion" | "event"
    id: str  # the completion id it was served ("" without an answer), or the event's own event_id
    status: int | None  # the HTTP status; None when no answer came (timeout, connection error)
    failure: str | None  # why it is not a 200 (failure_reason), None for a 200
    started: float  # time.time() when the call began
    ended: float
    version: str = ""  # completions: the version that answered (system_fingerprint)


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
    stages: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    """Answered completions as (latency ms, the API's Server-Timing stages: serving/http/timing.py)."""
    calls: list[Call] = field(default_factory=list)  # every call, in the order they ended

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

    def stage_summary(self, slowest: float = 0.05) -> dict[str, dict[str, dict[str, float]]]:
        """Where the answered completions' time went, by stage: over all of them, and over the
        slowest `slowest` share (at least one), the requests behind the p99."""
        timed = [(ms, t) for ms, t in self.stages if t]
        if not timed:
            return {}
        tail = sorted(timed, key=lambda x: x[0])[-max(1, round(len(timed) * slowest)) :]
        return {
            "all": breakdown([t for _, t in timed], [ms for ms, _ in timed]),
            "slowest": breakdown([t for _, t in tail], [ms for ms, _ in tail]),
        }

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
    (an `edit` names the completion only). The body carries a fresh `event_id`: a retry sends the
    same body, and the server stores the event once."""
    body: dict = {"type": e.type, "completion_id": completion_id, "event_id": str(uuid.uuid4())}
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
    stop: Callable[[], bool] | None = None,
    requests: int | None = None,
    walks: Sequence[Sequence[Site]] | None = None,
) -> SimStats:
    """Replay `sites` as `cfg.users` editors at about `cfg.rate` requests/s in all, over the real HTTP API.

    A call that times out (`cfg.timeout_s`), cannot connect, or gets an error status is counted in
    `stats.failures` with its reason and the session goes on, as an editor would: a slow or
    restarting replica costs that suggestion, not the run. An event is sent again (same
    `event_id`) up to `cfg.event_retries` times when it got no answer, a 429 or a 5xx.

    `requests`: how many completions to ask for, going round `sites` (default: one per site);
    0 means no limit, until `deadline` or `stop`. `deadline` (time.monotonic()) or `stop()`
    returning True: start no request after it; the planned ones left are counted as skipped.

    `walks` (same-file sessions) replaces `sites`: each walk is one editor's sites in one file,
    requested in order, each after the previous one's answer and events; `requests` then counts
    walks (default: each once), and `cfg.users` walks run at once."""
    import httpx

    users, rate, edit_delay_s, timeout_s = cfg.users, cfg.rate, cfg.edit_delay_s, cfg.timeout_s
    units = [[site] for site in sites] if walks is None else [list(w) for w in walks if w]
    total = len(units) if requests is None else requests
    stats = SimStats()
    rng = random.Random(cfg.seed)
    pending: set[asyncio.Task] = set()  # requests in flight and edits still to send
    async with httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s
    ) as client:

        async def post(kind: str, path: str, body: dict) -> tuple[httpx.Response | None, Call]:
            """The response when it is a 200 (else None, the failure counted), and the call's record."""
            t0 = time.time()
            r, reason = None, None
            try:
                r = await client.post(path, json=body)
            except httpx.HTTPError as e:
                reason = failure_reason(e)
            else:
                if r.status_code != 200:
                    reason = failure_reason(status=r.status_code)
            ident, version = body.get("event_id", ""), ""
            if kind == "completion" and reason is None:
                answer = r.json()
                ident, version = answer["id"], answer.get("system_fingerprint") or "?"
            call = Call(kind, ident, r.status_code if r is not None else None, reason, t0, time.time(), version)
            stats.calls.append(call)
            if reason is not None:
                stats.failures[f"{kind}: {reason}"] += 1
                return None, call
            return r, call

        async def event(body: dict, query: str = "") -> None:
            for attempt in range(cfg.event_retries + 1):
                t0 = time.monotonic()
                r, call = await post("event", f"/v1/events{query}", body)
                if r is not None:
                    stats.events += 1
                    return
                if call.status is not None and call.status != 429 and call.status < 500:
                    return  # refused for what it is: sending it again changes nothing
                if attempt < cfg.event_retries:  # a second or two apart, counted from when the call began
                    await asyncio.sleep(max(0.0, min(1.0 + attempt, timeout_s) - (time.monotonic() - t0)))

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
            r, _ = await post("completion", "/v1/completions", req)
            if r is None:
                progress(stats)
                return
            body = r.json()
            cid, text = body["id"], body["choices"][0]["text"]
            version = body.get("system_fingerprint") or "?"
            elapsed_ms = (time.perf_counter() - t0) * 1000
            stats.latency_ms.setdefault(version, []).append(elapsed_ms)
            stats.stages.append((elapsed_ms, parse_header(r.headers.get("server-timing", ""))))
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
                if not cfg.explicit_events:
                    continue
                body, query = event_body(e, cid, elapsed_ms)
                if e.type == "edit":  # the kept text is known a little after the accept
                    spawn(later_edit(body))
                else:
                    await event(body, query)
            progress(stats)

        async def unit(sites_in_order: list[Site], user: str) -> None:
            for site in sites_in_order:
                if time_is_up():
                    stats.skipped += 1
                    continue
                await one(site, user)

        def spawn(coro) -> asyncio.Task:
            task = asyncio.create_task(coro)
            pending.add(task)
            task.add_done_callback(pending.discard)
            return task

        def time_is_up() -> bool:
            return (deadline is not None and time.monotonic() >= deadline) or (stop is not None and stop())

        sem = asyncio.Semaphore(users)
        interval = 1.0 / rate if rate > 0 else 0.0
        started = time.monotonic()
        for i in itertools.count() if total == 0 else range(total):
            await asyncio.sleep(max(0.0, started + i * interval - time.monotonic()))
            await sem.acquire()
            if time_is_up():
                sem.release()
                stats.skipped += sum(len(units[j % len(units)]) for j in range(i, total)) if total else 0
                break
            # A walk is one user in one file; single sites share a few users between them.
            user = f"sim-user-{i % max(1, users * 4)}" if walks is None else f"sim-walk-{i}"
            spawn(unit(units[i % len(units)], user)).add_done_callback(lambda _: sem.release())
        while pending:
            await asyncio.gather(*pending)
    return stats
