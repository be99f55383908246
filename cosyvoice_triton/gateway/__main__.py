"""``python -m cosyvoice_triton.gateway --triton-grpc 127.0.0.1:8001 --port 8080`` (``--help`` for the limits)."""

from __future__ import annotations

import logging
import sys

from .app import create_app
from .config import from_args
from .connections import serve
from .middleware import RequestIdFilter


def main(argv: list[str] | None = None) -> int:
    config = from_args(argv)
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [%(request_id)s] %(name)s: %(message)s"))
    logging.basicConfig(level=config.log_level.upper(), handlers=[handler], force=True)
    keys = f"{len(config.api_keys)} API key(s)" if config.api_keys else "no API keys (open)"
    logging.getLogger(__name__).info("gateway on %s:%d -> triton %s; %s", config.host, config.port,
                                     config.triton_grpc, keys)
    # uvicorn's access log is replaced by the middleware's (which carries the request id)
    serve(create_app(config), config, access_log=False, log_config=None, log_level=config.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
