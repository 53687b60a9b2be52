"""What every route reads from its application: the models it answers for and its config."""

from __future__ import annotations

from fastapi import Request

from app.config import ServeConfig
from app.serve.http.clients import Models


def models(request: Request) -> Models:
    return request.app.state.models


def config(request: Request) -> ServeConfig:
    return request.app.state.config
