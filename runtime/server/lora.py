"""LoRA adapters over HTTP, as vLLM serves them: an adapter's name is a request's `model`, /v1/models lists the
adapters, and POST /v1/load_lora_adapter and /v1/unload_lora_adapter change them (behind the API key).

Loading reads and checks the adapter on the engine thread (runtime/lora/manager.py), so a bad one answers 400
naming it and nothing of it stays; requests already running with an unloaded adapter finish with it.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from runtime.lora.request import LoRARequest
from runtime.server.errors import APIError

router = APIRouter()


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def parse_lora_modules(specs: list[str] | None) -> list[tuple[str, str]]:
    """`--lora-modules name=path ...` as (name, path) pairs; ValueError for a malformed one."""
    pairs = []
    for spec in specs or ():
        name, sep, path = spec.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--lora-modules {spec!r}: write each adapter as NAME=PATH")
        pairs.append((name.strip(), path.strip()))
    return pairs


async def add_adapter(state, name: str, path: str) -> LoRARequest:
    """Check and load an adapter under `name` (ValueError naming it when it does not fit)."""
    if name == state.model_name or name in state.loras:
        raise APIError(400, f"the LoRA adapter {name!r} is already loaded; unload it first, or choose another name",
                       param="lora_name", code="lora_exists")
    lora = LoRARequest(name, state.next_lora_id(), path)
    await state.engine.call(lambda: state.engine.engine.add_lora(lora))
    state.loras[name] = lora
    return lora


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> JSONResponse:
    state = request.app.state.server
    await add_adapter(state, body.lora_name, body.lora_path)
    return JSONResponse({"status": "ok", "message": f"Success: LoRA adapter '{body.lora_name}' added successfully."})


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> JSONResponse:
    state = request.app.state.server
    lora = state.loras.pop(body.lora_name, None)
    if lora is None:
        raise APIError(404, f"the LoRA adapter {body.lora_name!r} is not loaded", param="lora_name",
                       code="lora_not_found")
    await state.engine.call(lambda: state.engine.engine.remove_lora(lora.lora_int_id))
    return JSONResponse({"status": "ok", "message": f"Success: LoRA adapter '{body.lora_name}' removed successfully."})
