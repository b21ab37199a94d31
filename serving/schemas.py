"""HTTP request and response bodies: OpenAI's completions API, Tabby's, and events.

`POST /v1/completions` takes either shape: a body with `segments` (or `language` and no
`prompt`) is Tabby's, anything else OpenAI's. The response is a superset both clients
read: OpenAI's `text_completion` object, whose `id` and `choices[].index/.text` are all
Tabby needs.

Every request body is a `RequestBody` (feedback/core/web.py): its text must be valid Unicode
and its numbers finite, or it is refused with 422 naming the field. Fields that Flywheel
receives (Tabby's declarations, snippets, clipboard) are bounded in count and size, so they cost
at most a bounded parse; the declarations and snippets go into the prompt as other files.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from feedback.core.web import RequestBody
from feedback.schemas import CompletionId, NonNegInt32

MAX_SNIPPETS = 16
"""Most declarations, and most snippets of each kind, a Tabby request may carry (Tabby's own
clients send a handful)."""
SNIPPET_CHARS = 10_000
"""Longest declaration or snippet body, and longest clipboard, in characters."""
STOP_CHARS = 64
"""Longest stop string."""


class Strict(RequestBody):
    model_config = ConfigDict(extra="ignore")  # clients send fields we don't use; never fail on them


# --- OpenAI ------------------------------------------------------------------------------------


class OpenAICompletionRequest(Strict):
    """OpenAI `POST /v1/completions`. With `suffix`, the prompt is a fill-in-the-middle prefix."""

    model: str | None = Field(default=None, max_length=128)
    prompt: str | list[str]
    suffix: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: int = Field(default=1, ge=1)
    stop: str | list[str] | None = None
    logprobs: int | None = Field(default=None, ge=0, le=5)
    user: str | None = Field(default=None, max_length=256)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stream: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and len(v) != 1:
            raise ValueError("exactly one prompt per request is supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> str | list[str] | None:
        # How many: serve.max_stop_strings, checked by the route, which knows the settings.
        stops = [v] if isinstance(v, str) else v or []
        if any(not s or len(s) > STOP_CHARS for s in stops):
            raise ValueError(f"each stop string must be non-empty and at most {STOP_CHARS} characters")
        return v

    @property
    def prompt_text(self) -> str:
        return self.prompt[0] if isinstance(self.prompt, list) else self.prompt

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


# --- Tabby -------------------------------------------------------------------------------------


class Snippet(Strict):
    filepath: str = Field(default="", max_length=1024)
    body: str = Field(default="", max_length=SNIPPET_CHARS)
    score: float | None = None


class Declaration(Strict):
    filepath: str = Field(default="", max_length=1024)
    body: str = Field(default="", max_length=SNIPPET_CHARS)


class Segments(Strict):
    prefix: str
    suffix: str | None = None
    filepath: str | None = Field(default=None, max_length=1024)
    git_url: str | None = Field(default=None, max_length=1024)
    declarations: list[Declaration] | None = Field(default=None, max_length=MAX_SNIPPETS)
    relevant_snippets_from_changed_files: list[Snippet] | None = Field(default=None, max_length=MAX_SNIPPETS)
    relevant_snippets_from_recently_opened_files: list[Snippet] | None = Field(default=None, max_length=MAX_SNIPPETS)
    clipboard: str | None = Field(default=None, max_length=SNIPPET_CHARS)


class TabbyCompletionRequest(Strict):
    """Tabby `POST /v1/completions`."""

    language: str | None = Field(default=None, max_length=64)
    segments: Segments
    user: str | None = Field(default=None, max_length=256)
    temperature: float | None = Field(default=None, ge=0, le=2)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    mode: Literal["standard", "next_edit_suggestion"] | None = None


CompletionRequest = OpenAICompletionRequest | TabbyCompletionRequest


# --- llama.cpp server's /infill ---------------------------------------------------------------


MAX_EXTRA_CHUNKS = 64
"""Most `input_extra` chunks an /infill request may carry (llama.vscode and llama.vim send up to 16)."""


class InfillChunk(Strict):
    filename: str = Field(default="", max_length=1024)
    text: str = Field(default="", max_length=SNIPPET_CHARS)


class InfillRequest(Strict):
    """llama.cpp server's `POST /infill`, as llama.vscode and llama.vim send it. The prefix is
    `input_prefix` + `prompt` (llama.cpp puts `prompt` after the middle token: the start of the
    middle, the current line up to the cursor). `input_extra`: chunks of other files, the most
    recent last. Sampling fields Flywheel has no use for (`top_k`, `samplers`, `cache_prompt`,
    `t_max_prompt_ms`, `id_slot`, `n_indent`) are accepted and ignored."""

    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[InfillChunk] = Field(default_factory=list, max_length=MAX_EXTRA_CHUNKS)
    prompt: str = ""
    n_predict: int = Field(default=-1, ge=-1, description="-1: up to serve.max_tokens_limit; 0: a warm-up")
    n_cmpl: int = Field(default=1, ge=1, description="completions to return (at most serve.max_n)")
    temperature: float = Field(default=0.2, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = Field(default=None, ge=-1, le=2**63 - 1, description="-1: random")
    stop: list[str] = []
    stream: bool = False
    t_max_predict_ms: int | None = Field(
        default=None, ge=0, le=600_000, description="stop after this long once every completion has a new line"
    )
    model: str | None = Field(default=None, max_length=128)

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: list[str]) -> list[str]:
        if any(not s or len(s) > STOP_CHARS for s in v):
            raise ValueError(f"each stop string must be non-empty and at most {STOP_CHARS} characters")
        return v


# --- Ollama's /api/generate --------------------------------------------------------------------


class OllamaOptions(Strict):
    """The `options` of an Ollama request that map to sampling; the others are accepted and ignored."""

    num_predict: int | None = Field(default=None, ge=-2, description="-1, -2: up to serve.max_tokens_limit")
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: list[str] | None = None
    seed: int | None = Field(default=None, ge=-1, le=2**63 - 1, description="-1: random")

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: list[str] | None) -> list[str] | None:
        if any(not s or len(s) > STOP_CHARS for s in v or ()):
            raise ValueError(f"each stop string must be non-empty and at most {STOP_CHARS} characters")
        return v


class OllamaGenerateRequest(Strict):
    """Ollama's `POST /api/generate`, as Twinny and Continue's Ollama provider send it. With a
    `suffix`, `prompt` is the prefix; without one, a prompt the client rendered in a FIM template
    is read back, and any other prompt is continued. `raw`, `keep_alive`, `system`, `template`,
    `context`, `format` are accepted and ignored: Flywheel always prompts the model its own way."""

    model: str = Field(max_length=128)
    prompt: str = ""
    suffix: str | None = None
    raw: bool = False
    stream: bool = True
    options: OllamaOptions = OllamaOptions()


class OllamaShowRequest(Strict):
    """Ollama's `POST /api/show`: the model by `model` (or `name`, as older clients send it)."""

    model: str | None = Field(default=None, max_length=128)
    name: str | None = Field(default=None, max_length=128)


# --- the response both shapes get ------------------------------------------------------------


class LogProbs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class Choice(BaseModel):
    index: int
    text: str
    logprobs: LogProbs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None
    system_fingerprint: str | None = Field(
        default=None, description="the model version that produced the completion, as `v<N>`"
    )


# --- events ------------------------------------------------------------------------------------


class EventRequest(Strict):
    """Tabby `POST /v1/events` (`type` view | select | dismiss), plus Flywheel's extensions:
    `edit` with the `kept_text`, word-level partial accepts (`select_kind=word` with
    `accepted_chars`), and a client `event_id` for idempotent retries."""

    type: Literal["view", "select", "dismiss", "edit"]
    completion_id: CompletionId
    choice_index: int = Field(default=0, ge=0, le=64)
    view_id: str | None = Field(default=None, max_length=128)
    elapsed: NonNegInt32 | None = Field(default=None, description="milliseconds since the completion was shown")
    select_kind: Literal["full", "line", "word"] | None = None
    accepted_chars: NonNegInt32 | None = None
    kept_text: str | None = Field(default=None, max_length=100_000)
    event_id: uuid.UUID | None = None


class EventAccepted(BaseModel):
    event_id: uuid.UUID
    status: Literal["accepted"] = "accepted"


class EventBatchRequest(BaseModel):
    """`POST /v1/events/batch`: several events in one request (at most serve.limits.events_per_batch),
    each an `EventRequest`. Each item is checked on its own (its Unicode too) and answered on its
    own, so one bad event does not refuse the others."""

    model_config = ConfigDict(extra="ignore")
    events: list[Any] = Field(description="the events, each in the shape of `POST /v1/events`")


class EventResult(BaseModel):
    """What became of one event of a batch, in the batch's order.

    accepted: queued for Kafka under `event_id` (resending it with that id is stored once);
    rejected: invalid (`error` names the field), do not resend as is;
    rate_limited: over the token's event rate, resend after Retry-After;
    unavailable: the server's buffer for Kafka is full, resend later."""

    index: int
    status: Literal["accepted", "rejected", "rate_limited", "unavailable"]
    event_id: uuid.UUID | None = None
    error: str | None = None


class EventBatchAccepted(BaseModel):
    accepted: int
    rejected: int
    rate_limited: int
    unavailable: int
    results: list[EventResult]
