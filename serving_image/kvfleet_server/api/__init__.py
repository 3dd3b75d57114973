"""HTTP layer of kvfleet-server: OpenAI-compatible FastAPI app over the engine thread."""

from .app import build_app
from .state import ServerSettings, ServerState

__all__ = ["build_app", "ServerSettings", "ServerState"]
