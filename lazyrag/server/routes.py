"""The endpoints of ``lazyrag serve``, as vLLM's ``api_server.py`` lays them out: small functions on one
``APIRouter``, each reading what it needs from ``request.app.state`` (``init_app_state`` puts it there); the
request work is ``OpenAIServing``'s (``serving.py``)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from lazyrag.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from lazyrag.server.serving import OpenAIServing
from lazyrag.version import __version__

router = APIRouter()


def _serving(request: Request) -> OpenAIServing:
    return request.app.state.serving


@router.get("/health")
async def health(request: Request):
    state = request.app.state
    problem = state.engine.health_problem()
    if problem is not None:  # e.g. a tensor-parallel rank died: a load balancer must stop sending here
        return JSONResponse({"status": "error", "error": problem, "model": state.config.model_name}, status_code=503)
    return {"status": "ok", "model": state.config.model_name, "requests_in_flight": state.in_flight.count}


@router.get("/metrics")
async def prometheus_metrics(request: Request):
    state = request.app.state
    state.metrics.in_flight.set(state.in_flight.count)
    return PlainTextResponse(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/version")
async def version():
    return {"version": __version__}


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    """vLLM's /tokenize: a prompt, or chat messages through the chat template (with lazyrag's default system
    turn when they bring none, as /v1/chat/completions renders them), as token ids."""
    return await _serving(request).tokenize(body)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    return await _serving(request).detokenize(body)


@router.get("/v1/models")
async def models(request: Request):
    return _serving(request).models()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, http: Request):
    return await _serving(http).chat(body, http)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, http: Request):
    return await _serving(http).completion(body, http)
