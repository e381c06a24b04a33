"""The OpenAI-compatible HTTP API behind `dflash-mlx serve` (flags in `cli/serve.py`).

Built on FastAPI + uvicorn, not on `mlx_lm.server`: that server's handler is wired to its
own generation machinery (batch generator, LRU prompt cache, mlx-lm's `stream_generate`),
so taking our generator would mean copying most of it. FastAPI gives validated requests
(pydantic) and streaming on a maintained ASGI stack, and leaves us only the OpenAI response
shapes to write. Its parts, each depending only on those listed before it:

- `schemas`: the request models and the bounds on their fields;
- `shapes`: OpenAI's response, chunk, logprobs and error shapes;
- `guards`: who may call and how much a request may send (Host, API key, body size);
- `worker`: the thread that runs the generations, batched, and its queue;
- `routes`: the handlers, from a request's body to its reply;
- `page`: the chat page's static files (`static/`), which call the API;
- `connections`: connection-level guards under uvicorn (request deadlines, the connection
  limit, floods logged once);
- `app`: the FastAPI app with its middleware, and the uvicorn server that runs it.
"""

from .app import create_app, run
from .guards import CLIENT_GONE, Policy
from .schemas import PROMPT_CHARS_PER_TOKEN
from .shapes import NO_LOGPROB, logprob_entries
from .worker import Job, Worker

__all__ = [
    "CLIENT_GONE",
    "NO_LOGPROB",
    "PROMPT_CHARS_PER_TOKEN",
    "Job",
    "Policy",
    "Worker",
    "create_app",
    "logprob_entries",
    "run",
]
