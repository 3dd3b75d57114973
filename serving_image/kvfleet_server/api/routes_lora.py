"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's runtime LoRA API; mounted only when
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is true, as vLLM does). The work runs on the engine thread between
two steps (``AsyncEngine.call``): tensor-parallel ranks load their shards in step with it."""

from __future__ import annotations

import os

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from ..model.lora_checkpoint import LoRAError
from .errors import APIError
from .protocol import ErrorResponse, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

router = APIRouter()
ERRORS = {400: {"model": ErrorResponse}, 404: {"model": ErrorResponse}}


def runtime_lora_updating() -> bool:
    """vLLM's switch: ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` set to 1 / true."""
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true")


async def _on_engine(request: Request, fn):
    state = request.app.state.kv
    engine = state.require_engine()
    try:
        return await engine.call(fn)
    except LoRAError as exc:
        raise APIError(exc.status, str(exc), param=exc.param) from None


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=ERRORS)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request):
    """Load the PEFT adapter at ``lora_path`` as model ``lora_name``: 400 for a bad adapter or a name in
    use, 404 for a missing path."""
    llm = request.app.state.kv.llm
    if not body.lora_name or not body.lora_path:
        raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.", param="lora_name")
    if body.lora_name in request.app.state.kv.settings.served_model_names:
        raise APIError(400, f"lora_name {body.lora_name!r} is the base model's name", param="lora_name")
    await _on_engine(request, lambda: llm.add_lora(body.lora_name, body.lora_path))
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=ERRORS)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request):
    """Unload adapter ``lora_name`` (404 when unknown); requests already queued finish with it."""
    llm = request.app.state.kv.llm
    await _on_engine(request, lambda: llm.remove_lora(body.lora_name))
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
