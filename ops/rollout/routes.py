"""Ops HTTP endpoints for rollouts: the same functions as `flywheel rollout`, behind ops tokens.

    GET  /ops/rollouts                     status: the active (else latest) rollout, its recent steps, the pools
    POST /ops/rollouts                     start a rollout of a version
    POST /ops/rollouts/{id}/pause          stop advancing (traffic stays)
    POST /ops/rollouts/{id}/resume         advance again
    POST /ops/rollouts/{id}/promote        make the candidate stable now
    POST /ops/rollouts/{id}/abort          every user back to stable

Every route needs an ops token (feedback.core.auth.OpsToken, read from `app.state.tokens`:
401 without one, 403 for an editor token). Ids and versions are bounded by their SQL columns
and bodies are `RequestBody`s (valid Unicode, finite numbers): anything else is a 422. The
database comes from the dependency `engine_for`; by default the app's `app.state.database_url`,
through `db.shared_engine` (one pool per URL for the life of the process). Routes are plain `def`: SQL blocks, so FastAPI
runs them in its thread pool.

No `from __future__ import annotations` here: FastAPI must see the route annotations, and
`EngineDep` is local to `router()`.
"""

import hashlib
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request
from pydantic import Field, ValidationError
from sqlalchemy.engine import Engine

from feedback import db
from feedback.core.auth import OpsToken
from feedback.core.web import RequestBody
from feedback.schemas import INT32_MAX, INT64_MAX, NonNegInt32
from ops.rollout import commands, rows
from ops.rollout.settings import RolloutSection


def app_engine(request: Request) -> Engine:
    """The engine for the app's `database_url` (503 when the API was started without one)."""
    url = getattr(request.app.state, "database_url", None)
    if not url:
        raise HTTPException(503, "rollout endpoints need the database: the API was started without a database URL")
    return db.shared_engine(url)


RolloutId = Annotated[int, Path(ge=0, le=INT64_MAX, description="a rollout id")]


class RolloutCreate(RequestBody):
    """Start a rollout; unset fields take the [rollout] defaults."""

    version: NonNegInt32
    weights: list[float] | None = Field(default=None, max_length=100)
    interval_s: float | None = Field(default=None, le=365 * 86400)
    min_samples: int | None = Field(default=None, le=INT32_MAX)
    alpha: float | None = None
    max_holds: int | None = Field(default=None, le=INT32_MAX)
    require_reward: bool | None = None
    promote_rule: str | None = Field(
        default=None,
        max_length=16,
        description="non_inferior (the default), expected_loss or no_harm: what the last step needs",
    )
    thresholds: dict[str, float] | None = Field(default=None, max_length=16)
    mode: str | None = Field(default=None, max_length=16)
    stable: NonNegInt32 | None = Field(
        default=None, description="the version to compare with (default: the current stable)"
    )
    force: bool = Field(default=False, description="roll out a version that failed the gate, or was rolled out before")


class OperatorAction(RequestBody):
    reason: str | None = Field(default=None, max_length=500)


def who(token: str) -> str:
    """An operator's name in the audit trail: which ops token, never the token itself."""
    return f"api:ops-token:{hashlib.sha256(token.encode()).hexdigest()[:8]}"


def router(
    engine_for: Callable[..., Engine] = app_engine,
    defaults: Callable[[], RolloutSection] = RolloutSection,
) -> APIRouter:
    """The /ops/rollouts routes. `engine_for` is a FastAPI dependency returning the database engine;
    `defaults()` gives the policy a started rollout gets where the request leaves it unset."""
    api = APIRouter(prefix="/ops/rollouts", tags=["ops"])
    EngineDep = Annotated[Engine, Depends(engine_for)]

    @api.get("")
    def rollouts_status(
        token: OpsToken,
        engine: EngineDep,
        rollout_id: Annotated[int | None, Query(alias="id", ge=0, le=INT64_MAX)] = None,
        limit: Annotated[int, Query(ge=1, le=500)] = 20,
    ) -> dict[str, Any]:
        """The active rollout (else the latest, or `?id=`), its recent steps, recent rollouts, and the serving pools."""
        return _call(lambda: rows.status(engine, rollout_id=rollout_id, limit=limit).as_dict())

    @api.post("", status_code=201)
    def start(body: RolloutCreate, token: OpsToken, engine: EngineDep) -> dict[str, Any]:
        """Start a rollout of `version` (refused for unknown or gate-failed versions, or while another runs)."""
        section = _section(defaults(), body)
        by = who(token)
        return _call(
            lambda: commands.start_rollout(
                engine, body.version, section=section, force=body.force, stable=body.stable, by=by
            ).as_dict()
        )

    for name, fn in (
        ("pause", commands.pause),
        ("resume", commands.resume),
        ("promote", commands.promote),
        ("abort", commands.abort),
    ):
        _operator_route(api, name, fn, EngineDep)
    return api


def _operator_route(api: APIRouter, name: str, fn, EngineDep) -> None:
    def action(
        rollout_id: RolloutId, token: OpsToken, engine: EngineDep, body: OperatorAction | None = None
    ) -> dict[str, Any]:
        return _call(lambda: fn(engine, rollout_id, by=who(token), reason=body.reason if body else None).as_dict())

    action.__name__ = f"rollout_{name}"
    action.__doc__ = (fn.__doc__ or name).strip().splitlines()[0]
    api.post("/{rollout_id}/" + name)(action)


def _section(defaults: RolloutSection, body: RolloutCreate) -> RolloutSection:
    data = defaults.model_dump()
    for key in ("weights", "interval_s", "min_samples", "alpha", "max_holds", "require_reward", "promote_rule", "mode"):
        if getattr(body, key) is not None:
            data[key] = getattr(body, key)
    if body.thresholds:
        data["thresholds"] = data["thresholds"] | body.thresholds
    try:
        return RolloutSection.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        raise HTTPException(422, f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}") from None


def _call(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except rows.RolloutError as e:
        raise HTTPException(e.status, str(e)) from None
