"""SGLang inference fleet: the HTTP client (pinned to SGLang 0.5.17's shapes), the `SGLangEngine`, server
processes as Ray actors with sglang-router in front, and the trainer-side weight sync (tensor, NCCL, disk)."""

from rollout.sglang.client import SGLANG_VERSION, SGLangClient, SGLangError, ServerUnavailable
from rollout.sglang.engine import SGLangEngine
from rollout.sglang.server import RouterProcess, SGLangServer, ServerStartError

__all__ = ["SGLANG_VERSION", "SGLangClient", "SGLangError", "ServerUnavailable", "SGLangEngine", "SGLangServer",
           "RouterProcess", "ServerStartError"]
